"""Reading one projection's checkpoint tensors in each layout (`schemes.py`).

Every weight-only reader returns an `Unpacked`, the format-neutral parts of `ops.quant_linear`'s
layout before act-order sorting and packing: the unsigned integer weight [n, k] with its columns
in the checkpoint's order, scales and zero points [n, k / group_size] as float32 (w = (q - zero) *
scale), and the checkpoint's g_idx [k] (None: column c is in group c // group_size).
`read_w8a8` returns a `W8A8Weight`, `ops.w8a8_linear`'s layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tinyvllm.model.quantization.schemes import WeightScheme
from tinyvllm.ops.quant_linear import pack_factor
from tinyvllm.ops.w8a8_linear import FP8_DTYPE

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ GEMM packing: value i of a word (bits 4i..4i+3) is column AWQ_ORDER[i] of its 8."""

TENSORS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "pack-quantized": (("weight_packed", "weight_scale"),
                       ("weight_zero_point", "weight_shape", "weight_g_idx")),
    "int-quantized": (("weight", "weight_scale"), ("input_scale",)),
    "float-quantized": (("weight", "weight_scale"), ("input_scale",)),
}
"""Per layout: (required, optional) tensor names of a projection (`<module>.<name>`)."""


@dataclass
class Unpacked:
    values: torch.Tensor   # [n, k] int32, unsigned
    scales: torch.Tensor   # [n, k / group_size] float32
    zeros: torch.Tensor    # [n, k / group_size] float32
    g_idx: Optional[torch.Tensor]  # [k] int64


class Reader:
    """Checks and reads one projection's tensors; errors name the tensor and the format."""

    def __init__(self, module: str, scheme: WeightScheme, tensors: dict[str, torch.Tensor],
                 n: int, k: int) -> None:
        self.module, self.scheme, self.tensors, self.n, self.k = module, scheme, tensors, n, k
        self.group = scheme.group_for(k)
        self.where = f"{scheme.method} ({scheme.layout}, {scheme.bits}-bit)"
        if k % self.group:
            raise ValueError(f"{module}: group_size {scheme.group_size} does not divide "
                             f"in_features {k} ({self.where})")
        required, optional = TENSORS[scheme.layout]
        unknown = sorted(set(tensors) - set(required) - set(optional))
        if unknown:  # e.g. a float `weight` where config.json says quantized
            raise ValueError(f"{module}.{unknown[0]}: unexpected tensor for {self.where}, "
                             f"which stores {', '.join(required)}")
        missing = [t for t in required if t not in tensors]
        if missing:
            raise ValueError(f"{module}.{missing[0]}: missing from the checkpoint ({self.where} "
                             f"stores {', '.join(required)})")

    def get(self, name: str, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None
            ) -> torch.Tensor:
        t = self.tensors[name]
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
            want = f"{dtype} " if dtype is not None else ""
            raise ValueError(f"{self.module}.{name}: expected {want}{shape}, got {t.dtype} "
                             f"{tuple(t.shape)} ({self.where}, in_features {self.k}, "
                             f"out_features {self.n}, group_size {self.group})")
        return t

    def scales(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.get(name, shape)
        if not t.is_floating_point():
            raise ValueError(f"{self.module}.{name}: expected float scales, got {t.dtype} "
                             f"({self.where})")
        return t.float()

    def g_idx(self, name: str) -> Optional[torch.Tensor]:
        if name not in self.tensors:
            if self.scheme.desc_act:
                raise ValueError(f"{self.module}.{name}: missing; desc_act (act-order) needs "
                                 f"it ({self.where})")
            return None
        g = self.get(name, (self.k,)).to(torch.int64)
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= self.k // self.group):
            raise ValueError(f"{self.module}.{name}: group index out of [0, "
                             f"{self.k // self.group}) ({self.where})")
        return g


def unpack_along(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned values, the words' dimension `dim` spread little-endian: value j
    of a word is bits j*bits.. of it; the dimension grows by 32 // bits."""
    pf = pack_factor(bits)
    shifts = torch.arange(pf, dtype=torch.int32) * bits
    w = words.to(torch.int32).movedim(dim, -1)
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*w.shape[:-1], -1).movedim(-1, dim)


def read(reader: Reader) -> Unpacked:
    return {"gptq": _gptq, "awq": _awq, "pack-quantized": _pack_quantized}[
        reader.scheme.layout](reader)


def _gptq(r: Reader) -> Unpacked:
    bits, pf, groups = r.scheme.bits, pack_factor(r.scheme.bits), r.k // r.group
    if r.k % pf or r.n % pf:
        raise ValueError(f"{r.module}: in_features {r.k} and out_features {r.n} must be "
                         f"multiples of {pf} ({r.where})")
    values = unpack_along(r.get("qweight", (r.k // pf, r.n), torch.int32), bits, 0)
    zeros = unpack_along(r.get("qzeros", (groups, r.n // pf), torch.int32), bits, 1)
    zeros = zeros.float() + r.scheme.zero_offset
    return Unpacked(values.t(), r.scales("scales", (groups, r.n)).t(), zeros.t(),
                    r.g_idx("g_idx"))


def _awq(r: Reader) -> Unpacked:
    bits, pf, groups = r.scheme.bits, pack_factor(r.scheme.bits), r.k // r.group
    if r.n % pf:
        raise ValueError(f"{r.module}: out_features {r.n} must be a multiple of {pf} "
                         f"({r.where})")
    # Value i of a word holds column AWQ_ORDER[i] of the word's 8: invert that.
    order = torch.argsort(torch.tensor(AWQ_ORDER))

    def columns(words: torch.Tensor) -> torch.Tensor:
        v = unpack_along(words, bits, 1)
        return v.view(v.shape[0], -1, pf)[:, :, order].reshape(v.shape[0], -1)

    values = columns(r.get("qweight", (r.k, r.n // pf), torch.int32))
    zeros = columns(r.get("qzeros", (groups, r.n // pf), torch.int32)).float()
    return Unpacked(values.t(), r.scales("scales", (groups, r.n)).t(), zeros.t(), None)


def _pack_quantized(r: Reader) -> Unpacked:
    bits, pf, groups = r.scheme.bits, pack_factor(r.scheme.bits), r.k // r.group
    if r.k % pf:
        raise ValueError(f"{r.module}: in_features {r.k} must be a multiple of {pf} "
                         f"({r.where})")
    if "weight_shape" in r.tensors:
        shape = [int(d) for d in r.tensors["weight_shape"].reshape(-1).tolist()]
        if shape != [r.n, r.k]:
            raise ValueError(f"{r.module}.weight_shape: {shape}, expected {[r.n, r.k]} "
                             f"({r.where})")
    values = unpack_along(r.get("weight_packed", (r.n, r.k // pf), torch.int32), bits, 1)
    offset = 1 << (bits - 1)  # values are signed, stored + offset
    if r.scheme.sym:
        if "weight_zero_point" in r.tensors and bool(r.tensors["weight_zero_point"].any()):
            raise ValueError(f"{r.module}.weight_zero_point: nonzero in a symmetric scheme "
                             f"({r.where})")
        zeros = torch.full((r.n, groups), float(offset))
    else:
        zeros = _ct_zero_point(r, groups).float() + offset
    return Unpacked(values, r.scales("weight_scale", (r.n, groups)), zeros,
                    r.g_idx("weight_g_idx"))


def _ct_zero_point(r: Reader, groups: int) -> torch.Tensor:
    """Signed zero points [n, groups]: packed along n (int32 [ceil(n * bits / 32), groups],
    signed + 2^(bits-1) like the weight) or, as some writers leave them, unpacked."""
    if "weight_zero_point" not in r.tensors:
        raise ValueError(f"{r.module}.weight_zero_point: missing; an asymmetric scheme needs it "
                         f"({r.where})")
    zp = r.tensors["weight_zero_point"]
    if zp.dtype == torch.int32 and zp.dim() == 2 and zp.shape[0] * pack_factor(r.scheme.bits) \
            == r.n:
        zp = r.get("weight_zero_point", (r.n // pack_factor(r.scheme.bits), groups))
        return unpack_along(zp, r.scheme.bits, 0) - (1 << (r.scheme.bits - 1))
    return r.get("weight_zero_point", (r.n, groups)).to(torch.int32)


# --- W8A8 -----------------------------------------------------------------------------------------

W8A8_WEIGHT_DTYPES = {"int-quantized": torch.int8, "float-quantized": FP8_DTYPE}


@dataclass
class W8A8Weight:
    qweight: torch.Tensor                # [n, k] int8 or float8_e4m3fn
    weight_scale: torch.Tensor           # [n] float32
    input_scale: Optional[torch.Tensor]  # [] float32, or None (dynamic per token)


def read_w8a8(r: Reader) -> W8A8Weight:
    """compressed-tensors `int-quantized` / `float-quantized` (compressors/naive_quantized): the
    weight as is, weight_scale [n, 1] (channel) or [1] (tensor), input_scale [1] if static."""
    s = r.scheme
    qweight = r.get("weight", (r.n, r.k), W8A8_WEIGHT_DTYPES[s.layout])
    shapes = [(1,), ()] if s.per_tensor else [(r.n, 1), (r.n,)]
    weight_scale = _w8a8_scale(r, "weight_scale", shapes).reshape(-1).expand(r.n)
    if not s.static_input:
        if "input_scale" in r.tensors:
            raise ValueError(f"{r.module}.input_scale: unexpected tensor; config.json says the "
                             f"activations are quantized dynamically ({r.where})")
        return W8A8Weight(qweight, weight_scale.contiguous(), None)
    if "input_scale" not in r.tensors:
        raise ValueError(f"{r.module}.input_scale: missing; static activation quantization "
                         f"(dynamic: false) needs it ({r.where})")
    input_scale = _w8a8_scale(r, "input_scale", [(1,), ()]).reshape(())
    if float(input_scale) <= 0:
        raise ValueError(f"{r.module}.input_scale: {float(input_scale)}, expected a positive "
                         f"scale ({r.where})")
    return W8A8Weight(qweight, weight_scale.contiguous(), input_scale)


def _w8a8_scale(r: Reader, name: str, shapes: list[tuple[int, ...]]) -> torch.Tensor:
    t = r.tensors[name]
    if tuple(t.shape) not in shapes or not t.is_floating_point():
        raise ValueError(f"{r.module}.{name}: expected float scales of shape {shapes[0]}, got "
                         f"{t.dtype} {tuple(t.shape)} ({r.where}, out_features {r.n})")
    t = t.float()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{r.module}.{name}: non-finite scales ({r.where})")
    return t
