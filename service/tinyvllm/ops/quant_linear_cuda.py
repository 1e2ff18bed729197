"""CUDA path of `ops.quant_linear` (cuda/quant_gemv.cuh): the GEMV for decode-sized batches, a
dequantized copy and cuBLAS for larger ones."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import dtype_code, stream_handle

METHODS = {"auto": 0, "simt": 1, "mma": 2}
"""cuda/quant_gemv.cu's `method`: auto takes tensor cores from three rows where they fit."""


def gemv_max_rows(bits: int, k: int) -> int:
    """Rows the GEMV serves (cuda/quant_gemv.cu): 16 on tensor cores (4 bits, k % 64 == 0), else
    8; larger batches dequantize and use cuBLAS."""
    return 16 if bits == 4 and k % 64 == 0 else 8


def quant_gemv_supported(x: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether the CUDA kernels serve this weight shape (else the torch reference runs)."""
    return (x.dtype in (torch.float16, torch.bfloat16) and k % 32 == 0 and group_size % 32 == 0)


def quant_dequantize_cuda(kernel, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The weight as scales.dtype [n, k] (columns in stored order), made on the GPU."""
    n, k = qweight.shape[0], qweight.shape[1] * (32 // bits)
    out = torch.empty((n, k), dtype=scales.dtype, device=qweight.device)
    kernel.quant_dequantize(out=out.data_ptr(), qweight=qweight.data_ptr(),
                            scales=scales.data_ptr(), zeros=zeros.data_ptr(), n=n, k=k, bits=bits,
                            group_size=group_size, dtype=dtype_code(scales.dtype),
                            stream=stream_handle(qweight.device))
    return out


def quant_linear_cuda(kernel, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, bits: int, group_size: int,
                      perm: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None, *,
                      method: str = "auto") -> torch.Tensor:
    """[..., k] float16 / bfloat16 -> [..., n]; scales, zeros and bias in x's dtype.

    Args:
        method: the GEMV kernel, "auto", "simt" or "mma" (`METHODS`; for tests and benchmarks).
    """
    n, k = qweight.shape[0], qweight.shape[1] * (32 // bits)
    for name, t in (("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous {x.dtype} tensor, got {t.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    m = x2.shape[0]
    if m > gemv_max_rows(bits, k):
        w = quant_dequantize_cuda(kernel, qweight, scales, zeros, bits, group_size)
        return F.linear(x2, w, bias).view(*lead, n)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel.quant_gemv(out=out.data_ptr(), x=x2.data_ptr(), qweight=qweight.data_ptr(),
                      scales=scales.data_ptr(), zeros=zeros.data_ptr(),
                      bias=0 if bias is None else bias.data_ptr(), m=m, n=n, k=k,
                      x_stride=x2.stride(0) if m > 1 else k, out_stride=n, bits=bits,
                      group_size=group_size, method=METHODS[method], dtype=dtype_code(x.dtype),
                      stream=stream_handle(x.device))
    return out.view(*lead, n)
