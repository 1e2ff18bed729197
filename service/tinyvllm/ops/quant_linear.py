"""Linear layers over integer-quantized weights with group scales (W4A16 / W8A16).

Every weight-only checkpoint format (GPTQ, AWQ, compressed-tensors `pack-quantized`, AutoRound's
exports) is repacked once at load into this one layout, which the CUDA kernel (cuda/quant_gemv.cuh)
and the torch reference both read:

    qweight  int32 [n, k // (32 // bits)]   bits 4 or 8; unsigned values along k, little-endian in
                                            each word (value j of a word in bits j*bits ...)
    scales   [n, k // group_size]           the activations' float dtype
    zeros    [n, k // group_size]           the same dtype: the zero point as a float, so that
                                            w[i, c] = (q[i, c] - zeros[i, g]) * scales[i, g],
                                            g = c // group_size (symmetric formats: 2^(bits-1))
    perm     int64 [k] or None              act-order (GPTQ desc_act): the weight's columns were
                                            sorted by group at load, so x is read as x[:, perm]

    y = x[..., perm] @ w.T + bias

A per-channel format is group_size = k. `quant_linear` runs the CUDA kernel where it serves the
inputs and the reference otherwise (the CPU path dequantizes per call). On a GPU with the kernels,
most 4-bit weights go one step further at load: `QuantLinear.use_tiles` repacks them into the
tensor-core GEMV's layout (ops/quant_tiles.py) and frees this one.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import use_kernel

BITS = (4, 8)


def pack_factor(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits: expected one of {BITS}, got {bits}")
    return 32 // bits


def check_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 group_size: int, perm: Optional[torch.Tensor] = None) -> tuple[int, int]:
    """(n, k) of a weight in the layout above; raises ValueError naming what does not fit."""
    pf = pack_factor(bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight: expected an int32 [n, k / {pf}] tensor, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * pf
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: expected a positive divisor of k={k}, got {group_size}")
    want = (n, k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != want or not t.is_floating_point():
            raise ValueError(f"{name}: expected a float {want} tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if perm is not None and (perm.dtype != torch.int64 or tuple(perm.shape) != (k,)):
        raise ValueError(f"perm: expected an int64 ({k},) tensor, got {perm.dtype} "
                         f"{tuple(perm.shape)}")
    return n, k


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [n, k / (32 / bits)] -> the unsigned values, int32 [n, k]."""
    pf = pack_factor(bits)
    shifts = torch.arange(pf, device=qweight.device, dtype=torch.int32) * bits
    values = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(qweight.shape[0], -1)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack`: unsigned values int [n, k] -> int32 [n, k / (32 / bits)]."""
    pf = pack_factor(bits)
    n, k = values.shape
    if k % pf:
        raise ValueError(f"values: k={k} is not a multiple of {pf}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"values: expected {bits}-bit unsigned values")
    v = values.to(torch.int64).reshape(n, k // pf, pf)
    shifts = torch.arange(pf, device=values.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """The weight [n, k] in the scales' dtype (columns in the stored, possibly permuted, order)."""
    n, k = check_layout(qweight, scales, zeros, bits, group_size)
    q = unpack(qweight, bits).view(n, k // group_size, group_size).to(torch.float32)
    w = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.reshape(n, k).to(scales.dtype)


def quant_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, bits: int, group_size: int,
                     perm: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x[..., perm] @ dequantize(...).T + bias in torch; [..., k] -> [..., n] in x's dtype."""
    check_layout(qweight, scales, zeros, bits, group_size, perm)
    if perm is not None:
        x = x.index_select(-1, perm)
    w = dequantize(qweight, scales, zeros, bits, group_size).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, bits: int, group_size: int,
                 perm: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`quant_linear_ref`, through the CUDA kernels where they serve (float16 / bfloat16 on a GPU,
    k and group_size multiples of 32): the one entry point of the model's quantized layers.

    On CUDA, batches of up to `quant_linear_cuda.GEMV_MAX_ROWS` rows run the GEMV, which reads the
    packed weight once and dequantizes in registers; larger batches dequantize the weight into a
    scratch tensor for cuBLAS (prefill is compute-bound; dequantizing is one pass over n * k).
    """
    n, k = check_layout(qweight, scales, zeros, bits, group_size, perm)
    mod = use_kernel("quant_linear", x, qweight, scales, zeros)
    if mod is not None:
        from tinyvllm.ops.quant_linear_cuda import quant_gemv_supported, quant_linear_cuda

        if quant_gemv_supported(x, k, group_size):
            return quant_linear_cuda(mod, x, qweight, scales, zeros, bits, group_size, perm, bias)
    return quant_linear_ref(x, qweight, scales, zeros, bits, group_size, perm, bias)
