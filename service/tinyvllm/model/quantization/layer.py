"""`QuantLinear`: a projection over weights kept packed in `ops.quant_linear`'s layout;
`W8A8Linear`: one over 8-bit weights with 8-bit activations (`ops.w8a8_linear`); and the module
swap that puts them in place of a Llama model's float projections."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tinyvllm.model.quantization.schemes import QuantizationConfig, WeightScheme
from tinyvllm.ops._dispatch import use_kernel
from tinyvllm.ops.quant_linear import pack_factor, quant_linear
from tinyvllm.ops.quant_tiles import (QuantTiles, gemv_serves, repack, split_workspace,
                                      tile_linear, tiles_supported)
from tinyvllm.ops.w8a8_linear import (ACT_SCALE_DIVISORS, FP8_DTYPE, QMAX, QuantizedRows,
                                      input_quant_fusable, w8a8_linear)

W8A8_DTYPES = {"int-quantized": torch.int8, "float-quantized": FP8_DTYPE}
"""W8A8 layout -> the dtype of its weight (and of the quantized activations)."""

MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
"""Our projection -> its checkpoint projections, stacked along n in this order."""


class QuantLinear(nn.Module):
    """y = x[..., perm] @ dequantize(qweight, scales, zeros).T + bias (`ops.quant_linear`).

    Buffers (filled at load; their layout is `ops.quant_linear`'s):
        qweight  int32 [out_features, in_features / (32 / bits)]
        scales   [out_features, in_features / group_size] (the model's float dtype)
        zeros    [out_features, in_features / group_size] (same dtype; zero points as floats)
        perm     int64 [in_features] or None (act-order)
    bias: a float Parameter [out_features] or None, loaded like a float projection's.

    After `use_tiles` (at load, on a GPU with the kernels): the weight lives in the tile layout of
    the tensor-core decode GEMV instead (`tiles`, `tile_scales`: `ops.quant_tiles`), qweight,
    scales and zeros are None, and `fused_linear` runs the projection with the decoder's
    prologues and epilogues folded in (`ops.use_fused_decode` asks `fused_serves`).
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int,
                 bias: bool) -> None:
        super().__init__()
        pf = pack_factor(bits)
        if in_features % pf or in_features % group_size:
            raise ValueError(f"in_features {in_features}: not a multiple of {pf} and of "
                             f"group_size {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // pf,
                                                    dtype=torch.int32))
        self.register_buffer("scales", torch.empty(out_features, groups))
        self.register_buffer("zeros", torch.empty(out_features, groups))
        self.register_buffer("perm", None)
        self.register_buffer("tiles", None)
        self.register_buffer("tile_scales", None)
        self.interleaved = False
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] -> [..., out_features]."""
        if self.tiles is None:
            return quant_linear(x, self.qweight, self.scales, self.zeros, self.bits,
                                self.group_size, self.perm, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        return tile_linear(x2, self._tiles(), self.bias).view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def use_tiles(self, interleave: bool = False) -> bool:
        """Repack the weight into `ops.quant_tiles`' layout where the GEMV kernel serves it (the
        CUDA kernels on its device, `tiles_supported`); interleave: gate rows with up rows (a
        gate_up_proj, whose GEMV then writes the SwiGLU product). Returns whether it did."""
        if self.tiles is not None:
            return True
        if (use_kernel("quant_linear", self.qweight) is None
                or not tiles_supported(self.qweight, self.scales, self.zeros, self.bits,
                                       self.group_size)):
            return False
        t = repack(self.qweight, self.scales, self.zeros, self.group_size,
                   interleave and self.out_features % 16 == 0)
        self.tiles, self.tile_scales, self.interleaved = t.tiles, t.tile_scales, t.interleaved
        self.qweight = self.scales = self.zeros = None
        split_workspace(self.tiles.device)  # made (and zeroed) here, before any graph capture
        return True

    def _tiles(self) -> QuantTiles:
        return QuantTiles(self.tiles, self.tile_scales, self.out_features, self.in_features,
                          self.group_size, self.interleaved)

    def fused_serves(self, x: torch.Tensor) -> bool:
        """Whether `fused_linear` over activations like x [m, in_features] is one GEMV launch."""
        return self.tiles is not None and self.perm is None and gemv_serves(x, self._tiles())

    def fused_linear(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """`ops.fused_linear(x, weight, bias, **kwargs)` over this weight (norm_weight, eps,
        silu_mul, residual, silu_mul_out; see `ops.quant_tiles.tile_linear`); needs `use_tiles`
        and no act-order permutation."""
        if self.tiles is None or self.perm is not None:
            raise ValueError("fused_linear: needs the tile layout and no act-order permutation")
        return tile_linear(x, self._tiles(), self.bias, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, "
                f"act_order={self.perm is not None}, bias={self.bias is not None}")


class W8A8Linear(nn.Module):
    """y = w8a8_linear(x, qweight, weight_scale, input_scale) + bias (`ops.w8a8_linear`).

    Buffers (filled at load; their layout is `ops.w8a8_linear`'s):
        qweight       int8 or float8_e4m3fn [out_features, in_features]
        weight_scale  float32 [out_features]
        input_scale   float32 [] (static activation scale) or None (dynamic per token)
    bias: a float Parameter [out_features] or None, loaded like a float projection's.
    act_scale_divisor: a dynamic token scale is max|x| / this (None: QMAX of the type; the
    checkpoint's convention, `WeightScheme.act_scale`).
    No `weight` attribute: the fused float GEMV path (`ops.use_fused_decode`) stays off.
    On CUDA the op before it may quantize its input (`fused_input_quant`).
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 static_input: bool, bias: bool,
                 act_scale_divisor: Optional[float] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_scale_divisor = QMAX[dtype] if act_scale_divisor is None else act_scale_divisor
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32)
                             if static_input else None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """[..., in_features] -> [..., out_features]; or rows quantized already
        (QuantizedRows [num_tokens, in_features], as `fused_input_quant` asks for) ->
        [num_tokens, out_features]."""
        return w8a8_linear(x, self.qweight, self.weight_scale, self.input_scale, self.bias,
                           act_scale_divisor=self.act_scale_divisor)

    def fused_input_quant(self, op: str, x: torch.Tensor) -> Optional[tuple[torch.dtype, float]]:
        """(qdtype, divisor) for `op` ("rms_norm_quant" or "silu_and_mul_quant"), the op that
        makes this projection's input from x, to quantize the rows as forward would and hand
        over QuantizedRows (`ops.w8a8_linear.input_quant_fusable`: dynamic scales, on CUDA);
        None: it hands over float rows."""
        if not input_quant_fusable(op, x, self.qweight, self.input_scale):
            return None
        return self.qweight.dtype, self.act_scale_divisor

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dtype={self.qweight.dtype}, static_input={self.input_scale is not None}, "
                f"act_scale_divisor={self.act_scale_divisor}, bias={self.bias is not None}")


def use_tiles(net: nn.Module) -> int:
    """Every QuantLinear of `net` into the tile layout where the GEMV kernel serves it (gate_up
    projections interleaved); returns how many were repacked. Call once all weights are in."""
    count = 0
    for name, module in net.named_modules():
        if isinstance(module, QuantLinear):
            count += module.use_tiles(interleave=name.endswith("gate_up_proj"))
    return count


def _new_linear(old: nn.Linear, scheme: WeightScheme) -> nn.Module:
    k, n, bias = old.in_features, old.out_features, old.bias is not None
    if scheme.w8a8:
        dtype = W8A8_DTYPES[scheme.layout]
        return W8A8Linear(k, n, dtype, scheme.static_input, bias,
                          ACT_SCALE_DIVISORS[scheme.act_scale][dtype])
    return QuantLinear(k, n, scheme.bits, scheme.group_for(k), bias)


def projection_schemes(quant: QuantizationConfig, layer_prefix: str, merged: str
                       ) -> Optional[WeightScheme]:
    """The one scheme of a merged projection's checkpoint parts (None: all float).

    Raises:
        ValueError: parts stored differently (one quantized, one not, or other bits/groups).
    """
    parent = "self_attn" if merged in ("qkv_proj", "o_proj") else "mlp"
    names = [f"{layer_prefix}.{parent}.{part}" for part in MERGED[merged]]
    schemes = {quant.scheme_for(name) for name in names}
    if len(schemes) > 1:
        raise ValueError(f"{quant.method}: {', '.join(names)} are stored differently "
                         f"({schemes}); the merged {merged} needs one scheme")
    return schemes.pop()


def swap_in_quant_linears(net: nn.Module, quant: QuantizationConfig) -> dict[str, WeightScheme]:
    """Replace each projection of `net` (built on the meta device) whose checkpoint parts are
    quantized by a QuantLinear (or a W8A8Linear) of the same shape; returns {our module name:
    scheme}.

    Raises:
        ValueError: a scheme that does not fit a projection (group size not dividing k, ...),
            naming the module.
    """
    swapped: dict[str, WeightScheme] = {}
    for i, layer in enumerate(net.model.layers):
        prefix = f"model.layers.{i}"
        for parent_name, merged in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                    ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
            scheme = projection_schemes(quant, prefix, merged)
            if scheme is None:
                continue
            parent = getattr(layer, parent_name)
            old: nn.Linear = getattr(parent, merged)
            name = f"{prefix}.{parent_name}.{merged}"
            try:
                new = _new_linear(old, scheme)
            except ValueError as e:
                raise ValueError(f"{name}: {e} ({scheme.method}, {scheme.bits}-bit)") from None
            setattr(parent, merged, new)
            swapped[name] = scheme
    return swapped
