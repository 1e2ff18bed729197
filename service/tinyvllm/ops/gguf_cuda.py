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

NORM_STAGE_MAX_VALUES = 8192
"""Most values of x (k times the launch's rows, rounded up to 1, 2, 4 or 8) the GEMV's CTAs
stage for its RMSNorm prologue; above, the norm runs as its own op first. Every CTA stages all
of x before its first block: at 8 rows of k = 4,096 (64 KB in two passes), qkv + norm took
56.4 us against 37.7 for the ops apart, where at 1-2 rows of 4,096 or 8 of SmolLM2's 576 the
fused launch is 1.0-2.2x faster (cuda/NOTES.md, "GGUF GEMV with the decoder's fusions")."""


def stages_norm(m: int, k: int) -> bool:
    """Whether the GEMV takes the RMSNorm of m rows of k values itself (NORM_STAGE_MAX_VALUES)."""
    rows = 1 if m <= 1 else 2 if m == 2 else 4 if m <= 4 else 8
    return rows * k <= NORM_STAGE_MAX_VALUES


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
                     bias: Optional[torch.Tensor] = None, *,
                     norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                     residual: Optional[torch.Tensor] = None,
                     silu_mul_out: bool = False) -> torch.Tensor:
    """x [..., k] float16 / bfloat16 @ dequantize(qweight).T + bias -> [..., n] in x's dtype.

    With `ops.fused_linear`'s fusions (x [m, k], m <= GEMV_MAX_ROWS: one GEMV launch, the
    norm a launch of its own above NORM_STAGE_MAX_VALUES): rmsnorm(x) * norm_weight in place of
    x; `residual` [m, n] += the product, in place (and returned); silu_mul_out: silu(gate) * up
    [m, n / 2] of the first and second halves of the rows.
    """
    from tinyvllm.ops.linear import _check_params, _output

    n = qweight.shape[0]
    fused = norm_weight is not None or residual is not None or silu_mul_out
    _check_params(x.dtype, x.device, n, k, bias=bias, norm_weight=norm_weight)
    if x.shape[-1] != k or (fused and (x.dim() != 2 or x.shape[0] > GEMV_MAX_ROWS)):
        raise ValueError(f"x: expected [..., {k}] ([m, {k}] with m <= {GEMV_MAX_ROWS} for the "
                         f"fused GEMV), got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS:
        w = gguf_dequantize_cuda(kernel, qweight, qtype, k, x.dtype)
        return F.linear(x2, w, bias).view(*lead, n)
    if norm_weight is not None and not stages_norm(m, k):
        from tinyvllm.ops.layers import rms_norm

        x2, norm_weight = rms_norm(x2, norm_weight, eps), None
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    n_out = n // 2 if silu_mul_out else n
    out = _output(m, n_out, x.dtype, x.device, residual, None)
    out_stride = out.stride(0) if m > 1 else n_out
    kernel.gguf_gemv(out=out.data_ptr(), x=x2.data_ptr(), qweight=qweight.data_ptr(),
                     bias=0 if bias is None else bias.data_ptr(),
                     residual=0 if residual is None else residual.data_ptr(),
                     norm_weight=0 if norm_weight is None else norm_weight.data_ptr(), m=m, n=n,
                     k=k, x_stride=x2.stride(0) if m > 1 else k, out_stride=out_stride,
                     residual_stride=out_stride, eps=eps,
                     prologue=1 if norm_weight is not None else 0,
                     silu_mul_out=int(silu_mul_out), qtype=qtype, dtype=dtype_code(x.dtype),
                     stream=stream_handle(x.device))
    return out if fused else out.view(*lead, n)
