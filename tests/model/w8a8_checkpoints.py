"""Tiny W8A8 Llama checkpoints as llm-compressor writes them (compressed-tensors
`int-quantized` / `float-quantized`), made with the compressed-tensors package itself: its
`calculate_qparams` for the weight scales (round-to-nearest, as llm-compressor's minmax observer)
and the static input scales (from the float model's activations on a calibration text), its
Int / FloatQuantizationCompressor for the stored tensors. Beside it, the same model saved in
float with the dequantized weights (q * weight_scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.model.quant_checkpoints import PROJ_INPUT, tiny_llama, write_config
from tests.model.test_hf_loader import _save

CALIBRATION_IDS = list(range(5, 60))


@dataclass(frozen=True)
class W8A8Spec:
    kind: str = "int"         # int (INT8, int-quantized) or float (FP8 e4m3, float-quantized)
    weights: str = "channel"  # channel or tensor
    dynamic: bool = True      # activations: dynamic per token, or static per tensor

    @property
    def format(self) -> str:
        return f"{self.kind}-quantized"


def scheme_dict(spec: W8A8Spec) -> dict:
    """The config_groups entry llm-compressor writes (its W8A8 / FP8 / FP8_DYNAMIC presets)."""
    weights = {"num_bits": 8, "type": spec.kind, "symmetric": True, "dynamic": False,
               "strategy": spec.weights, "group_size": None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": spec.kind, "symmetric": True, "dynamic": spec.dynamic,
            "strategy": "token" if spec.dynamic else "tensor", "group_size": None,
            "observer": None if spec.dynamic else "minmax"}
    return {"targets": ["Linear"], "weights": weights, "input_activations": acts,
            "output_activations": None}


def quantization_config(spec: W8A8Spec) -> dict:
    return {"quant_method": "compressed-tensors", "format": spec.format,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": scheme_dict(spec)}}


def _input_absmax(hf_model) -> dict[str, float]:
    """max |x| of each projection's input over the calibration text, by module name."""
    seen: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, name=name: seen.__setitem__(name, args[0].abs().max().item()))
        for name, m in hf_model.named_modules() if name.rsplit(".", 1)[-1] in PROJ_INPUT]
    with torch.no_grad():
        hf_model(torch.tensor([CALIBRATION_IDS]))
    for h in hooks:
        h.remove()
    return seen


def make_w8a8_checkpoints(root: Path, spec: W8A8Spec, seed: int = 0
                          ) -> tuple[Path, Path, dict[str, dict[str, torch.Tensor]]]:
    """(W8A8 dir, float dir with the dequantized weights, {projection: its stored tensors})."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(seed)
    scheme = QuantizationScheme(**scheme_dict(spec))
    compressor = BaseCompressor.get_value_from_registry(spec.format)
    ref_dir, quant_dir = root / "float", root / spec.format
    ref_dir.mkdir(parents=True)
    hf_model = tiny_llama().eval()
    _save(hf_model, ref_dir)
    absmax = _input_absmax(hf_model)
    (file,) = ref_dir.glob("*.safetensors")
    tensors = load_file(str(file))
    stored: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if module.rsplit(".", 1)[-1] not in PROJ_INPUT or leaf != "weight":
            out[name] = tensors[name]
            continue
        w = tensors[name]
        dims = (1,) if spec.weights == "channel" else (0, 1)
        lo, hi = w.amin(dim=dims, keepdim=True), w.amax(dim=dims, keepdim=True)
        if spec.weights == "tensor":
            lo, hi = lo.reshape(1), hi.reshape(1)
        scale, _ = calculate_qparams(lo, hi, scheme.weights)
        state = {"weight": w, "weight_scale": scale.to(torch.bfloat16)}  # a bf16 model's scales
        if not spec.dynamic:
            a = torch.tensor([absmax[module]])
            state["input_scale"] = calculate_qparams(-a, a, scheme.input_activations)[0].to(
                torch.bfloat16)
        parts = stored[module] = compressor.compress(state, scheme)
        out.update({f"{module}.{k}": v for k, v in parts.items()})
        tensors[name] = parts["weight"].float() * parts["weight_scale"].float()
    save_file(tensors, str(file))
    quant_dir.mkdir()
    for f in ref_dir.iterdir():
        if f.suffix != ".safetensors":
            (quant_dir / f.name).write_bytes(f.read_bytes())
    save_file(out, str(quant_dir / "model.safetensors"))
    write_config(quant_dir, quantization_config(spec))
    return quant_dir, ref_dir, stored
