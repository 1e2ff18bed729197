"""Elementwise and normalisation ops of the Llama family, each with its torch reference; RMSNorm
and SiLU-and-mul also fused with the per-token quantization of a W8A8 projection's input."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from tinyvllm.ops._dispatch import use_kernel
from tinyvllm.ops.w8a8_linear import QuantizedRows, quant_divisor, quantize_rows_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None):
    """RMSNorm, optionally fused with the residual add that precedes it.

    Shape: x, residual: [num_tokens, hidden]; weight: [hidden].
    Returns: normed x, or (normed(x + residual), x + residual) when residual is given.
    """
    kernel = use_kernel("rms_norm", x, weight)
    if kernel is not None:
        from tinyvllm.ops.layers_cuda import rms_norm_cuda
        return rms_norm_cuda(kernel, x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed.to(x.dtype) * weight) if x.dtype != torch.float32 else normed * weight
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation. Shape: x [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]."""
    kernel = use_kernel("silu_and_mul", x)
    if kernel is not None:
        from tinyvllm.ops.layers_cuda import silu_and_mul_cuda
        return silu_and_mul_cuda(kernel, x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: Optional[torch.Tensor], qdtype: torch.dtype,
                   divisor: Optional[float] = None, scale: Optional[torch.Tensor] = None):
    """`rms_norm` then `quantize_rows` of its output, in one kernel on CUDA that writes only the
    8-bit rows and their scales (the values and scales of the two ops, bit for bit).

    Args:
        x, weight, eps, residual: as `rms_norm` (the residual is updated in place on CUDA).
        qdtype: torch.int8 or torch.float8_e4m3fn, the W8A8 weight's type.
        divisor, scale: as `quantize_rows` (dynamic scale max|row| / divisor, None: QMAX;
            or the static float32 scalar `scale`).
    Shape: x, residual [num_tokens, hidden]; weight [hidden].
    Returns: QuantizedRows of normed x, or (QuantizedRows of normed(x + residual), x + residual)
        when residual is given.
    """
    divisor = quant_divisor(qdtype, divisor)
    _check_norm_shapes(x, weight, residual)
    kernel = use_kernel("rms_norm_quant", x, weight)
    if kernel is not None:
        from tinyvllm.ops.layers_cuda import rms_norm_quant_cuda
        return rms_norm_quant_cuda(kernel, x, weight, eps, residual, qdtype, divisor, scale)
    return rms_norm_quant_ref(x, weight, eps, residual, qdtype, divisor, scale)


def rms_norm_quant_ref(x, weight, eps, residual, qdtype, divisor=None, scale=None):
    out = rms_norm_ref(x, weight, eps, residual)
    normed = out if residual is None else out[0]
    rows = QuantizedRows(*quantize_rows_ref(normed, qdtype, scale, divisor), x.dtype)
    return rows if residual is None else (rows, out[1])


def silu_and_mul_quant(x: torch.Tensor, qdtype: torch.dtype, divisor: Optional[float] = None,
                       scale: Optional[torch.Tensor] = None) -> QuantizedRows:
    """`silu_and_mul` then `quantize_rows` of its output, in one kernel on CUDA that writes only
    the 8-bit rows and their scales (the values and scales of the two ops, bit for bit).

    Args: qdtype, divisor, scale: as `rms_norm_quant`.
    Shape: x [num_tokens, 2 * d] (gate | up) -> QuantizedRows [num_tokens, d].
    """
    divisor = quant_divisor(qdtype, divisor)
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [num_tokens, 2 * d] (gate | up), got {tuple(x.shape)}")
    kernel = use_kernel("silu_and_mul_quant", x)
    if kernel is not None:
        from tinyvllm.ops.layers_cuda import silu_and_mul_quant_cuda
        return silu_and_mul_quant_cuda(kernel, x, qdtype, divisor, scale)
    return silu_and_mul_quant_ref(x, qdtype, divisor, scale)


def silu_and_mul_quant_ref(x, qdtype, divisor=None, scale=None) -> QuantizedRows:
    return QuantizedRows(*quantize_rows_ref(silu_and_mul_ref(x), qdtype, scale, divisor),
                         x.dtype)


def _check_norm_shapes(x: torch.Tensor, weight: torch.Tensor,
                       residual: Optional[torch.Tensor]) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: expected [num_tokens, hidden], got {tuple(x.shape)}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight: expected [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: expected {tuple(x.shape)}, got {tuple(residual.shape)}")


def build_cos_sin_cache(head_dim: int, max_position: int, base: float,
                        rope_scaling: Optional[dict], device=None) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of the rotary angles in the first half, sin in the second.

    Supports Llama 3 rope scaling (`rope_type: llama3`) and linear scaling.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    inv_freq = _scale_inv_freq(inv_freq, rope_scaling)
    t = torch.arange(max_position, dtype=torch.float64)
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "linear":
        t = t / float(rope_scaling["factor"])
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


def _scale_inv_freq(inv_freq: torch.Tensor, rope_scaling: Optional[dict]) -> torch.Tensor:
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default", "linear"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r}")
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling.get("low_freq_factor", 1.0))
    high = float(rope_scaling.get("high_freq_factor", 4.0))
    old_len = float(rope_scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int):
    """Rotate q and k (GPT-NeoX / HF Llama half-split style).

    Shape:
        positions: [num_tokens] int64
        query: [num_tokens, num_heads * head_dim]; key: [num_tokens, num_kv_heads * head_dim]
        cos_sin_cache: [max_position, head_dim] float32
    Returns: (query, key) rotated, same shapes (in place on CUDA).
    """
    kernel = use_kernel("rotary_embedding", positions, query, key)
    if kernel is not None:
        from tinyvllm.ops.layers_cuda import rotary_embedding_cuda
        return rotary_embedding_cuda(kernel, positions, query, key, cos_sin_cache, head_dim)
    return rotary_embedding_ref(positions, query, key, cos_sin_cache, head_dim)


def rotary_embedding_ref(positions, query, key, cos_sin_cache, head_dim):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [t, d/2] each
    cos = torch.cat([cos, cos], -1).unsqueeze(1)
    sin = torch.cat([sin, sin], -1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, head_dim).float()
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x * cos + rotated * sin).view(shape)

    return rotate(query).to(query.dtype), rotate(key).to(key.dtype)


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
                               kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               k_scale: Optional[torch.Tensor] = None,
                               v_scale: Optional[torch.Tensor] = None):
    """`rotary_embedding` then `reshape_and_cache` of the rotated key and value (one launch on CUDA).

    Shape:
        positions, slot_mapping: [num_tokens] int64 (negative slots: padding, not written)
        query: [num_tokens, num_heads * head_dim]; key, value: [num_tokens, num_kv_heads * head_dim]
            (rows may be strided views into a fused qkv output)
        kv_cache: KV_CACHE_LAYOUT, query's dtype or FP8 (then K/V are quantised with the scales)
        k_scale, v_scale: one-element float32 tensors (None: 1.0), read only for an FP8 cache
    Returns: (query, key) rotated (in place on CUDA).
    """
    kernel = use_kernel("rotary_embedding_and_cache", positions, query, key, value,
                        kv_cache, slot_mapping)
    if kernel is not None:
        from tinyvllm.ops.layers_cuda import rotary_embedding_and_cache_cuda
        return rotary_embedding_and_cache_cuda(kernel, positions, query, key, value,
                                               cos_sin_cache, head_dim, kv_cache, slot_mapping,
                                               k_scale, v_scale)
    return rotary_embedding_and_cache_ref(positions, query, key, value, cos_sin_cache, head_dim,
                                          kv_cache, slot_mapping, k_scale, v_scale)


def rotary_embedding_and_cache_ref(positions, query, key, value, cos_sin_cache, head_dim,
                                   kv_cache, slot_mapping, k_scale=None, v_scale=None):
    from tinyvllm.ops.kv_cache import reshape_and_cache_ref
    query, key = rotary_embedding_ref(positions, query, key, cos_sin_cache, head_dim)
    num_tokens, num_kv_heads = key.shape[0], kv_cache.shape[3]
    reshape_and_cache_ref(key.reshape(num_tokens, num_kv_heads, head_dim),
                          value.reshape(num_tokens, num_kv_heads, head_dim), kv_cache,
                          slot_mapping, k_scale, v_scale)
    return query, key
