"""Which quantized format each projection of a checkpoint is stored in, read from config.json's
`quantization_config` the way Hugging Face transformers and vLLM read it.

`quant_method` names the tool's format; each projection of the model (by its Hugging Face module
name, `model.layers.0.self_attn.q_proj`) gets a `WeightScheme` or None (stored unquantized):

    gptq                 qweight int32 [k/pf, n] packed along k, qzeros int32 [k/g, n/pf] packed
                         along n, scales [k/g, n], g_idx int32 [k]; `checkpoint_format` gptq stores
                         zero - 1 (read back + 1), gptq_v2 the zero itself
    awq (GEMM)           qweight int32 [k, n/8] and qzeros int32 [k/g, n/8] packed along n in the
                         interleaved order AWQ_ORDER, scales [k/g, n]; zero as is
    compressed-tensors   `pack-quantized`: weight_packed int32 [n, k/pf] of signed values stored
                         + 2^(bits-1), weight_scale [n, k/g], weight_zero_point (asymmetric: packed
                         along n, same offset), weight_shape, optional weight_g_idx
    auto-round           `packing_format` auto_round:auto_gptq (the gptq layout, zero - 1),
                         auto_round:auto_awq (awq), other auto_round packings (the gptq layout with
                         the zero as is); its `auto_gptq` / `auto_awq` exports are gptq / awq

W8A8 (8-bit weights and activations, `ops.w8a8_linear`), compressed-tensors as llm-compressor
writes it (`compressors/naive_quantized`): `int-quantized` (weight int8 [n, k]) or
`float-quantized` (weight float8_e4m3fn [n, k]), symmetric, with weight_scale [n, 1] (strategy
channel) or [1] (tensor) in the model's float dtype; activations dynamic per token (no tensor) or
static per tensor (input_scale [1]); dynamic scales follow compressed-tensors' convention,
max|x| / ((q_max - q_min) / 2) (`WeightScheme.act_scale`). `--quantization int8|fp8` on a float
checkpoint makes the same from its float weights at load (one scale per output channel, dynamic
per-token activations scaled by max|x| / 127 or 448, as vLLM).

Raises ValueError, naming the key and the format, for anything this loader does not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

QUANTIZE_AT_LOAD = {"int8": "int-quantized", "fp8": "float-quantized"}
"""`--quantization` values that quantize a float checkpoint at load -> the W8A8 layout made."""
METHODS = ("gptq", "awq", "compressed-tensors", "auto-round", *QUANTIZE_AT_LOAD)
"""`--quantization` values: a checkpoint's quantized format, or int8 / fp8 (QUANTIZE_AT_LOAD)."""
W8A8_LAYOUTS = ("int-quantized", "float-quantized")
"""Layouts of 8-bit weights with 8-bit activations (`ops.w8a8_linear`, W8A8Linear)."""

_ALIASES = {"auto_round": "auto-round", "autoround": "auto-round",
            "compressed_tensors": "compressed-tensors"}

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Llama projections a checkpoint may store quantized (lm_head and embeddings stay float)."""


@dataclass(frozen=True)
class WeightScheme:
    """How one projection's weight is stored in the checkpoint.

    layout: gptq, awq, pack-quantized, or a W8A8 layout (int-quantized, float-quantized; the
    tensor names and packing, see the module docstring); group_size: -1 per output channel (one
    group over all of k); zero_offset: added to the stored zero point (gptq v1: 1); sym:
    pack-quantized only, no zero-point tensor (zero 2^(bits-1)).
    """

    layout: str
    bits: int
    group_size: int
    sym: bool = True
    zero_offset: int = 0
    desc_act: bool = False
    method: str = ""
    """The checkpoint's quant_method, for error messages."""
    per_tensor: bool = False
    """W8A8: one weight_scale for the projection (strategy tensor) instead of one per channel."""
    static_input: bool = False
    """W8A8: a static per-tensor input_scale; False: activations scaled per token at run time."""
    quantize_at_load: bool = False
    """W8A8: the checkpoint holds a float weight, quantized per channel at load."""
    act_scale: str = "qmax"
    """W8A8, dynamic activations: how a token's scale follows from max|x| (`ops.w8a8_linear`
    ACT_SCALE_DIVISORS): "qmax" divides by the largest quantized magnitude (int8 127, fp8 448),
    as vLLM does (`--quantization int8|fp8`); "compressed-tensors" by that package's
    (q_max - q_min) / 2 (int8 127.5, fp8 448), the convention its checkpoints are made with."""

    @property
    def w8a8(self) -> bool:
        return self.layout in W8A8_LAYOUTS

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class QuantizationConfig:
    """The parsed `quantization_config`: `scheme_for(hf_module_name)` per projection."""

    method: str
    scheme_for: Callable[[str], Optional[WeightScheme]]


def normalize_method(name: str) -> str:
    name = name.strip().lower()
    return _ALIASES.get(name, name)


def parse_quantization_config(config: dict, forced: Optional[str] = None,
                              model: str = "model") -> Optional[QuantizationConfig]:
    """The checkpoint's quantization (None: an unquantized checkpoint, not forced).

    forced: `--quantization`; must name the checkpoint's own method, or be int8 / fp8 on a float
        checkpoint (every projection quantized at load, `QUANTIZE_AT_LOAD`).

    Raises:
        ValueError: an unknown or unsupported method, key or value (named), or a forced method
            that the checkpoint does not have.
    """
    quant = config.get("quantization_config")
    method = normalize_method(str((quant or {}).get("quant_method")
                                  or (quant or {}).get("quant_type") or "unknown"))
    if forced is not None and normalize_method(forced) in QUANTIZE_AT_LOAD:
        if quant:
            raise ValueError(f"--quantization {forced} quantizes a float checkpoint at load; "
                             f"{model} is already a {method!r} checkpoint (config.json "
                             "quantization_config)")
        return quantize_at_load(normalize_method(forced))
    if not quant:
        if forced is not None:
            raise ValueError(f"--quantization {forced}: {model} has no quantization_config in "
                             "config.json (--quantization int8 or fp8 quantizes a float "
                             "checkpoint at load)")
        return None
    if forced is not None and normalize_method(forced) != method:
        raise ValueError(f"--quantization {forced}: {model} is a {method!r} checkpoint "
                         "(config.json quantization_config.quant_method)")
    parsers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors,
               "auto-round": _auto_round}
    if method not in parsers:
        raise ValueError(f"{model}: {method!r} quantized checkpoints (config.json "
                         f"quantization_config) are not supported; supported: "
                         f"{', '.join(METHODS)}")
    return QuantizationConfig(method, parsers[method](quant, f"{model}: {method}"))


def quantize_at_load(method: str) -> QuantizationConfig:
    """Every projection W8A8 (`method` int8 or fp8), its float weight quantized at load."""
    scheme = WeightScheme(QUANTIZE_AT_LOAD[method], 8, -1, method=f"--quantization {method}",
                          quantize_at_load=True)
    return QuantizationConfig(method, _everywhere(scheme))


def _bits(value: Any, where: str, allowed: tuple[int, ...] = (4, 8)) -> int:
    if value not in allowed:
        raise ValueError(f"{where}: bits {value} is not supported (supported: "
                         f"{', '.join(map(str, allowed))})")
    return int(value)


def _group_size(value: Any, where: str) -> int:
    if value is None:
        return -1
    if not isinstance(value, int) or (value <= 0 and value != -1):
        raise ValueError(f"{where}: group_size {value!r} is not a positive size or -1")
    return value


def _everywhere(scheme: Optional[WeightScheme],
                skip: Callable[[str], bool] = lambda name: False
                ) -> Callable[[str], Optional[WeightScheme]]:
    return lambda name: None if skip(name) else scheme


def _gptq(quant: dict, where: str) -> Callable[[str], Optional[WeightScheme]]:
    if quant.get("lm_head"):
        raise ValueError(f"{where}: a quantized lm_head (lm_head: true) is not supported")
    if quant.get("dynamic"):
        raise ValueError(f"{where}: per-module overrides (dynamic) are not supported")
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    scheme = WeightScheme("gptq", _bits(quant.get("bits"), where),
                          _group_size(quant.get("group_size", 128), where),
                          sym=bool(quant.get("sym", True)), zero_offset=int(fmt == "gptq"),
                          desc_act=bool(quant.get("desc_act", False)), method="gptq")
    only = quant.get("modules_in_block_to_quantize")
    if not only:
        return _everywhere(scheme)
    names = {n for group in only for n in ([group] if isinstance(group, str) else group)}
    return _everywhere(scheme, lambda name: not any(name.endswith("." + n) for n in names))


def _awq(quant: dict, where: str) -> Callable[[str], Optional[WeightScheme]]:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}: version {version!r} is not supported (gemm)")
    if not quant.get("zero_point", True):
        raise ValueError(f"{where}: zero_point false is not supported")
    scheme = WeightScheme("awq", _bits(quant.get("bits", quant.get("w_bit")), where, (4,)),
                          _group_size(quant.get("group_size", quant.get("q_group_size", 128)),
                                      where), sym=False, method="awq")
    skip = quant.get("modules_to_not_convert") or []
    return _everywhere(scheme, lambda name: any(s in name for s in skip))


def _auto_round(quant: dict, where: str) -> Callable[[str], Optional[WeightScheme]]:
    packing = str(quant.get("packing_format") or "auto_round:auto_gptq")
    if "llm_compressor" in packing or "fp8" in packing or "mx" in packing:
        raise ValueError(f"{where}: packing_format {packing!r} is not supported")

    def scheme(args: dict, name: str) -> Optional[WeightScheme]:
        bits = args.get("bits", quant.get("bits"))
        if bits is not None and bits >= 16:
            return None  # left in float
        w = f"{where} ({name})" if name else where
        if str(args.get("data_type", quant.get("data_type", "int"))) != "int":
            raise ValueError(f"{w}: data_type {args.get('data_type', quant.get('data_type'))!r}"
                             " is not supported (int)")
        if int(args.get("act_bits", quant.get("act_bits", 16))) < 16:
            raise ValueError(f"{w}: act_bits below 16 (activation quantization) is not "
                             "supported")
        group = _group_size(args.get("group_size", quant.get("group_size", 128)), w)
        if "awq" in packing:
            return WeightScheme("awq", _bits(bits, w, (4,)), group, sym=False,
                                method="auto-round")
        return WeightScheme("gptq", _bits(bits, w), group,
                            sym=bool(args.get("sym", quant.get("sym", True))),
                            zero_offset=int("gptq" in packing and "gptqmodel" not in packing),
                            method="auto-round")

    default = scheme({}, "")
    extra = quant.get("extra_config") or {}
    overrides = {name: scheme(args, name) for name, args in extra.items()}
    return lambda name: overrides.get(name, default)


def _ct_match(name: str, target: str) -> bool:
    """compressed-tensors' target matching for a Linear module: its class name, the exact module
    name, or `re:<pattern>` matched at the start of the name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in ("Linear", name)


def _compressed_tensors(quant: dict, where: str) -> Callable[[str], Optional[WeightScheme]]:
    top_format = quant.get("format")
    groups = []
    for group_name, group in (quant.get("config_groups") or {}).items():
        w = f"{where} config_groups.{group_name}"
        groups.append((group.get("targets") or [], _ct_scheme(group, group.get("format")
                                                             or top_format, w)))
    ignore = quant.get("ignore") or []

    def scheme_for(name: str) -> Optional[WeightScheme]:
        if any(_ct_match(name, t) for t in ignore):
            return None
        for targets, scheme in groups:
            if any(_ct_match(name, t) for t in targets):
                return scheme
        return None
    return scheme_for


def _ct_scheme(group: dict, fmt: Optional[str], where: str) -> Optional[WeightScheme]:
    weights = group.get("weights")
    if not weights:
        return None
    if group.get("input_activations"):
        return _ct_w8a8(weights, group["input_activations"], fmt, where)
    if fmt != "pack-quantized":
        raise ValueError(f"{where}: format {fmt!r} is not supported for weight-only "
                         "quantization (pack-quantized)")
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise ValueError(f"{where}: weights of type {weights.get('type')!r} / dynamic "
                         f"{weights.get('dynamic')} are not supported (static int)")
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = _group_size(weights.get("group_size"), where)
    elif strategy == "channel":
        group_size = -1
    else:
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported "
                         "(group, channel)")
    return WeightScheme("pack-quantized", _bits(weights.get("num_bits"), where), group_size,
                        sym=bool(weights.get("symmetric", True)), method="compressed-tensors")


_CT_W8A8_TYPES = {"int-quantized": "int", "float-quantized": "float"}


def _ct_w8a8(weights: dict, acts: dict, fmt: Optional[str], where: str) -> WeightScheme:
    """compressed-tensors W8A8: symmetric 8-bit weights (channel or tensor scales) and
    activations of the same type, dynamic per token or static per tensor. `naive-quantized`
    (the generic compressor, whose tensors int- / float-quantized alias) is read by the weight
    type."""
    if fmt == "naive-quantized":
        fmt = {"int": "int-quantized", "float": "float-quantized"}.get(weights.get("type", "int"))
    if fmt not in _CT_W8A8_TYPES:
        raise ValueError(f"{where}: format {fmt!r} with input_activations is not supported "
                         f"(W8A8: {', '.join(_CT_W8A8_TYPES)})")
    kind = _CT_W8A8_TYPES[fmt]
    for name, args in (("weights", weights), ("input_activations", acts)):
        if args.get("num_bits") != 8 or args.get("type", "int") != kind:
            raise ValueError(f"{where}: {name} of {args.get('num_bits')}-bit type "
                             f"{args.get('type', 'int')!r} are not supported in format {fmt!r} "
                             f"(8-bit {kind})")
        if not args.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric {name} (symmetric: false) are not supported "
                             "for W8A8")
    if weights.get("dynamic") or weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"{where}: weights of strategy {weights.get('strategy')!r} / dynamic "
                         f"{weights.get('dynamic')} are not supported for W8A8 (static channel "
                         "or tensor)")
    dynamic, strategy = acts.get("dynamic"), acts.get("strategy")
    if not ((dynamic is True and strategy == "token")
            or (dynamic is False and strategy == "tensor")):
        raise ValueError(f"{where}: input_activations of strategy {strategy!r} / dynamic "
                         f"{dynamic!r} are not supported (dynamic token, or static tensor)")
    return WeightScheme(fmt, 8, -1, method="compressed-tensors",
                        per_tensor=weights["strategy"] == "tensor", static_input=not dynamic,
                        act_scale="compressed-tensors")
