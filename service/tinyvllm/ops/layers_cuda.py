"""CUDA RMSNorm(+residual), SiLU-and-mul (each also fused with the per-token quantization of a
W8A8 projection's input) and rotary embedding behind `ops.layers`."""

from __future__ import annotations

import math
from typing import Optional

import torch

from tinyvllm.ops._dispatch import dtype_code, stream_handle
from tinyvllm.ops.kv_cache import FP8_DTYPE, kv_scale_ptrs
from tinyvllm.ops.w8a8_linear import (MIN_ABSMAX, QMAX, QuantizedRows, quantized_output,
                                      static_scale_arg)


def rms_norm_cuda(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
    """RMSNorm, fused with the residual add when `residual` is given.

    Shape: x, residual: [num_tokens, hidden] (last dim contiguous); weight: [hidden], x's dtype.
    Returns: normed x (a new tensor), or (normed(x + residual), x + residual) where the second is
    `residual` itself, updated in place (the next layer's residual, as in vLLM). `out` is an
    optional [num_tokens, hidden] buffer with contiguous rows for the normed result.
    """
    _check_norm_inputs(x, weight, residual)
    out = _output(out, x.shape, x)
    kernel.rms_norm(
        out=out.data_ptr(), x=x.data_ptr(),
        residual=0 if residual is None else residual.data_ptr(), weight=weight.data_ptr(),
        num_tokens=x.shape[0], hidden=x.shape[-1], x_stride=x.stride(0),
        residual_stride=0 if residual is None else residual.stride(0),
        out_stride=out.stride(0), eps=eps, dtype=dtype_code(x.dtype),
        stream=stream_handle(x.device))
    return out if residual is None else (out, residual)


def silu_and_mul_cuda(kernel, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU. Shape: x [num_tokens, 2 * d] (gate | up, rows contiguous) -> [num_tokens, d].

    `out` is an optional [num_tokens, d] buffer with contiguous rows.
    """
    _check_rows("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even (gate | up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    out = _output(out, (x.shape[0], d), x)
    kernel.silu_and_mul(out=out.data_ptr(), x=x.data_ptr(), num_tokens=x.shape[0], d=d,
                        x_stride=x.stride(0), out_stride=out.stride(0),
                        dtype=dtype_code(x.dtype), stream=stream_handle(x.device))
    return out


def rms_norm_quant_cuda(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: Optional[torch.Tensor], qdtype: torch.dtype, divisor: float,
                        scale: Optional[torch.Tensor] = None):
    """`rms_norm_cuda` then `quantize_rows` of the normed rows, in one launch (the normed rows
    are never stored).

    Shape: as rms_norm_cuda. qdtype int8 / float8_e4m3fn; divisor the dynamic scale's; scale
    a static float32 scalar or None.
    Returns: QuantizedRows (q [num_tokens, hidden], scales [num_tokens, 1]), or (that, residual)
    with `residual` updated in place to x + residual.
    """
    _check_norm_inputs(x, weight, residual)
    num_tokens, hidden = x.shape
    q, scales = quantized_output(num_tokens, hidden, qdtype, x.device)
    static = static_scale_arg(scale, x.device)  # held until the launch
    kernel.rms_norm_quant(
        out=q.data_ptr(), scales=scales.data_ptr(), x=x.data_ptr(),
        residual=0 if residual is None else residual.data_ptr(), weight=weight.data_ptr(),
        static_scale=0 if static is None else static.data_ptr(), num_tokens=num_tokens,
        hidden=hidden, x_stride=x.stride(0),
        residual_stride=0 if residual is None else residual.stride(0), out_stride=hidden,
        eps=eps, qmax=QMAX[qdtype], scale_divisor=divisor, min_absmax=MIN_ABSMAX,
        dtype=dtype_code(x.dtype), qdtype=dtype_code(qdtype), stream=stream_handle(x.device))
    rows = QuantizedRows(q, scales, x.dtype)
    return rows if residual is None else (rows, residual)


def silu_and_mul_quant_cuda(kernel, x: torch.Tensor, qdtype: torch.dtype, divisor: float,
                            scale: Optional[torch.Tensor] = None) -> QuantizedRows:
    """`silu_and_mul_cuda` then `quantize_rows` of the product, in one launch (the product is
    never stored). Shape: x [num_tokens, 2 * d] (gate | up, rows contiguous) -> QuantizedRows
    (q [num_tokens, d], scales [num_tokens, 1]); qdtype, divisor, scale as rms_norm_quant_cuda."""
    _check_rows("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even (gate | up), got {x.shape[-1]}")
    num_tokens, d = x.shape[0], x.shape[-1] // 2
    q, scales = quantized_output(num_tokens, d, qdtype, x.device)
    static = static_scale_arg(scale, x.device)
    kernel.silu_and_mul_quant(
        out=q.data_ptr(), scales=scales.data_ptr(), x=x.data_ptr(),
        static_scale=0 if static is None else static.data_ptr(), num_tokens=num_tokens, d=d,
        x_stride=x.stride(0), out_stride=d, qmax=QMAX[qdtype], scale_divisor=divisor,
        min_absmax=MIN_ABSMAX, dtype=dtype_code(x.dtype), qdtype=dtype_code(qdtype),
        stream=stream_handle(x.device))
    return QuantizedRows(q, scales, x.dtype)


def rotary_embedding_cuda(kernel, positions: torch.Tensor, query: torch.Tensor,
                          key: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int):
    """Rotate q and k in place (GPT-NeoX half split).

    Shape:
        positions: [num_tokens] int64
        query: [num_tokens, num_heads * head_dim]; key: [num_tokens, num_kv_heads * head_dim]
            (each row contiguous; rows may be strided, e.g. views into a fused qkv output)
        cos_sin_cache: [max_position, head_dim] float32, contiguous, on the same device
    Returns: (query, key), the same tensors, rotated.
    """
    _check_rows("query", query, dims=(2, 3))
    _check_rows("key", key, dims=(2, 3))
    _check_rotary_tables(positions, cos_sin_cache, head_dim, query.device)
    if key.dtype != query.dtype:
        raise ValueError(f"key: dtype {key.dtype} differs from query's {query.dtype}")
    num_tokens = query.shape[0]
    kernel.rotary_embedding(
        positions=positions.data_ptr(), query=query.data_ptr(), key=key.data_ptr(),
        cos_sin_cache=cos_sin_cache.data_ptr(), num_tokens=num_tokens,
        num_heads=_row_numel(query) // head_dim, num_kv_heads=_row_numel(key) // head_dim,
        head_dim=head_dim, query_stride=query.stride(0), key_stride=key.stride(0),
        dtype=dtype_code(query.dtype), stream=stream_handle(query.device))
    return query, key


def rotary_embedding_and_cache_cuda(kernel, positions: torch.Tensor, query: torch.Tensor,
                                    key: torch.Tensor, value: torch.Tensor,
                                    cos_sin_cache: torch.Tensor, head_dim: int,
                                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                    k_scale: Optional[torch.Tensor] = None,
                                    v_scale: Optional[torch.Tensor] = None):
    """Rotary on q and k in place, then rotated k and v written to their cache slots, in one launch.

    Shape: as rotary_embedding_cuda; value like key; kv_cache KV_CACHE_LAYOUT of query's dtype or
    FP8 (quantised with k_scale / v_scale, one-element float32; None: 1.0);
    slot_mapping [num_tokens] int64 (negative: padding, not written).
    Returns: (query, key), the same tensors, rotated.
    """
    _check_rows("query", query, dims=(2, 3))
    _check_rows("key", key, dims=(2, 3))
    _check_rows("value", value, dims=(2, 3))
    _check_rotary_tables(positions, cos_sin_cache, head_dim, query.device)
    if (key.dtype != query.dtype or value.dtype != query.dtype
            or kv_cache.dtype not in (query.dtype, FP8_DTYPE)):
        raise ValueError(f"key, value, kv_cache: expected {query.dtype} (kv_cache also "
                         f"{FP8_DTYPE}), got {key.dtype}, {value.dtype}, {kv_cache.dtype}")
    num_kv_heads = _row_numel(key) // head_dim
    if (kv_cache.dim() != 5 or not kv_cache.is_contiguous()
            or kv_cache.shape[3] * kv_cache.shape[4] != num_kv_heads * head_dim
            or _row_numel(value) != _row_numel(key)):
        raise ValueError(f"kv_cache: expected a contiguous [2, num_blocks, block_size, "
                         f"{num_kv_heads}, {head_dim}] cache, got {tuple(kv_cache.shape)}")
    if (slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or slot_mapping.shape[0] != query.shape[0]):
        raise ValueError(f"slot_mapping: expected contiguous int64 [{query.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    k_scale_ptr, v_scale_ptr = kv_scale_ptrs(kv_cache, k_scale, v_scale)
    kernel.rotary_embedding_and_cache(
        positions=positions.data_ptr(), query=query.data_ptr(), key=key.data_ptr(),
        value=value.data_ptr(), key_cache=kv_cache[0].data_ptr(),
        value_cache=kv_cache[1].data_ptr(), slot_mapping=slot_mapping.data_ptr(),
        cos_sin_cache=cos_sin_cache.data_ptr(), num_tokens=query.shape[0],
        num_heads=_row_numel(query) // head_dim, num_kv_heads=num_kv_heads, head_dim=head_dim,
        query_stride=query.stride(0), key_stride=key.stride(0), value_stride=value.stride(0),
        dtype=dtype_code(query.dtype), cache_dtype=dtype_code(kv_cache.dtype),
        k_scale=k_scale_ptr, v_scale=v_scale_ptr, stream=stream_handle(query.device))
    return query, key


def _output(out: Optional[torch.Tensor], shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out: expected {like.dtype} {tuple(shape)} on {like.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    _check_rows("out", out)
    return out


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor,
                       residual: Optional[torch.Tensor]) -> None:
    """x, residual: [num_tokens, hidden] with contiguous rows, one dtype; weight: [hidden]."""
    hidden = x.shape[-1]
    _check_rows("x", x)
    if weight.dtype != x.dtype or weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [{hidden}] {x.dtype} tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual: expected {x.dtype} {tuple(x.shape)}, got "
                             f"{residual.dtype} {tuple(residual.shape)}")


def _row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


def _check_rows(name: str, t: torch.Tensor, dims: tuple[int, ...] = (2,)) -> None:
    """t is [num_tokens, ...] and each row (everything after dim 0) is one contiguous run."""
    row_ok = t.shape[0] == 0 or t[0].is_contiguous()
    if t.dim() not in dims or not row_ok:
        raise ValueError(f"{name}: expected [num_tokens, ...] ({' or '.join(map(str, dims))} "
                         f"dims) with contiguous rows, got shape {tuple(t.shape)} strides "
                         f"{t.stride()}")


def _check_rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
                         device: torch.device) -> None:
    """positions: contiguous int64; cos_sin_cache: contiguous float32 [max_position, head_dim]."""
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError(f"positions: expected contiguous int64, got {positions.dtype}")
    if (cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
            or cos_sin_cache.shape[-1] != head_dim or cos_sin_cache.device != device):
        raise ValueError(f"cos_sin_cache: expected contiguous float32 [max_position, {head_dim}] "
                         f"on {device}, got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)} on {cos_sin_cache.device}")
