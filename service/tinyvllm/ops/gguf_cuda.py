"""CUDA path of `ops.quantized` (cuda/gguf_gemv.cuh): GGUF Q4_0 / Q4_1 / Q8_0 and Q4_K / Q5_K /
Q6_K rows read as stored.
Decode-sized batches run the GEMV (float activations, the weight dequantized in registers);
larger ones dequantize the rows and use cuBLAS."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import dtype_code, stream_handle

GEMV_MAX_ROWS = 8
"""Rows served by the GEMV (cuda/gguf_gemv.cu kGgufGemvMaxM)."""


def gguf_dequantize_cuda(kernel, qweight: torch.Tensor, qtype: int, k: int, dtype: torch.dtype,
                         rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows `rows` (int64 on the GPU; None: all) of the packed weight as dtype [num_rows, k]."""
    if rows is not None:
        rows = rows.to(device=qweight.device, dtype=torch.int64).contiguous()
    num_rows = qweight.shape[0] if rows is None else rows.shape[0]
    out = torch.empty((num_rows, k), dtype=dtype, device=qweight.device)
    kernel.gguf_dequantize(out=out.data_ptr(), qweight=qweight.data_ptr(),
                           rows=0 if rows is None else rows.data_ptr(), num_rows=num_rows, k=k,
                           qtype=qtype, dtype=dtype_code(dtype),
                           stream=stream_handle(qweight.device))
    return out


def gguf_linear_cuda(kernel, x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., k] float16 / bfloat16 @ dequantize(qweight).T + bias -> [..., n] in x's dtype."""
    n = qweight.shape[0]
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias: expected a contiguous {x.dtype} tensor, got {bias.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS:
        w = gguf_dequantize_cuda(kernel, qweight, qtype, k, x.dtype)
        return F.linear(x2, w, bias).view(*lead, n)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel.gguf_gemv(out=out.data_ptr(), x=x2.data_ptr(), qweight=qweight.data_ptr(),
                     bias=0 if bias is None else bias.data_ptr(), m=m, n=n, k=k,
                     x_stride=x2.stride(0) if m > 1 else k, out_stride=n, qtype=qtype,
                     dtype=dtype_code(x.dtype), stream=stream_handle(x.device))
    return out.view(*lead, n)
