"""The paged KV cache: its one layout, its element types (optionally FP8), allocation, and writing
new K/V into it.

A cache of another float type than the model's (`--kv-cache-dtype float32 | float16 | bfloat16`)
stores K/V rounded to nearest even and reads them back converted to the queries' dtype.

FP8 cache (`--kv-cache-dtype fp8`): elements are `torch.float8_e4m3fn` in the same layout, with a
float32 scale per layer for keys and one for values (vLLM's `k_scale` / `v_scale`): the stored value
is `x / scale` saturated to +-FP8_E4M3_MAX, the value read back is `stored * scale`. The scales are
one-element device tensors (the kernels read them through a pointer, so CUDA graphs see updates).
With a 16/32-bit cache the scales are ignored.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from tinyvllm.ops._dispatch import dtype_code, stream_handle, use_kernel

KV_CACHE_LAYOUT = "[2, num_blocks, block_size, num_kv_heads, head_dim]"
"""Per layer: index 0 holds keys, 1 values. A token's slot is block_id * block_size + offset."""

PADDING_SLOT = -1
"""A slot_mapping entry that marks a padded token: its K/V are not written."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
"""Largest finite E4M3 magnitude: quantised values saturate here (E4M3 'fn' has no infinity)."""

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8")

CPU_KERNEL_KV_DTYPES = (torch.float32, torch.float16)
"""Caches the CPU kernels (tinyvllm._cpu) read and write in place; others take the torch path."""

_NAMED_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "fp8": FP8_DTYPE}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype,
                           fused_cpu_step: bool = False) -> torch.dtype:
    """`CacheConfig.kv_cache_dtype` -> the cache's torch dtype.

    "auto" is the model's dtype, except under the fused packed CPU step (`fused_cpu_step`:
    float32 activations over packed GGUF weights), where it is float16, llama.cpp's default
    cache type: decode attention there is bound by reading the cache, and half the bytes per
    token read in half the time (and hold twice the tokens).

    Raises:
        ValueError: a name other than KV_CACHE_DTYPES, named.
    """
    if name == "auto":
        return torch.float16 if fused_cpu_step and model_dtype == torch.float32 else model_dtype
    if name in _NAMED_DTYPES:
        return _NAMED_DTYPES[name]
    raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {name!r}")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """torch.float16 -> "float16": the name the CPU kernels take."""
    return str(dtype).removeprefix("torch.")


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One tensor per layer with layout KV_CACHE_LAYOUT; `dtype` is the cache's (FP8_DTYPE or the
    model's)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


# ---- FP8 quantisation (the reference every kernel matches) --------------------------------------

def quantize_kv(x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """x / scale, saturated to +-FP8_E4M3_MAX, rounded to nearest even E4M3. Same shape as x."""
    xf = x.float() if scale is None else x.float() / scale
    return xf.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: Optional[torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """Cache elements -> `dtype`: stored * scale for an FP8 cache, a plain cast otherwise."""
    if x.dtype != FP8_DTYPE:
        return x.to(dtype)
    xf = x.float() if scale is None else x.float() * scale
    return xf.to(dtype)


# ---- writing K/V --------------------------------------------------------------------------------

def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None) -> None:
    """Write each token's K/V into its slot of the paged cache, in place (quantised if FP8).

    Shape:
        key, value: [num_tokens, num_kv_heads, head_dim]
        kv_cache: KV_CACHE_LAYOUT, key's dtype or FP8_DTYPE
        slot_mapping: [num_tokens] int64; PADDING_SLOT entries are skipped.
        k_scale, v_scale: one-element float32 tensors on kv_cache's device (None: 1.0); FP8 only.
    """
    kernel = use_kernel("reshape_and_cache", key, value, kv_cache, slot_mapping)
    if kernel is not None:
        _reshape_and_cache_cuda(kernel, key, value, kv_cache, slot_mapping, k_scale, v_scale)
        return
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                          v_scale: Optional[torch.Tensor] = None) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if kv_cache.dtype == FP8_DTYPE:
        # index_copy_ has no float8 kernel: copy the bytes.
        flat = flat.view(torch.uint8)
        key = quantize_kv(key, k_scale).view(torch.uint8)
        value = quantize_kv(value, v_scale).view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def _reshape_and_cache_cuda(kernel, key, value, kv_cache, slot_mapping, k_scale, v_scale) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value)):
        if t.shape != key.shape or t.stride(-1) != 1 or t.stride(-2) != head_dim:
            raise ValueError(f"{name}: expected [num_tokens, num_kv_heads, head_dim] with contiguous "
                             f"rows, got shape {tuple(t.shape)} strides {t.stride()}")
    if (not kv_cache.is_contiguous() or value.dtype != key.dtype
            or kv_cache.dtype not in (key.dtype, FP8_DTYPE)):
        raise ValueError(f"kv_cache: expected a contiguous cache of key's dtype {key.dtype} or "
                         f"{FP8_DTYPE}, got {kv_cache.dtype} (value {value.dtype})")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping: expected contiguous int64, got {slot_mapping.dtype}")
    k_ptr, v_ptr = kv_scale_ptrs(kv_cache, k_scale, v_scale)
    kernel.reshape_and_cache(
        key=key.data_ptr(), value=value.data_ptr(), key_cache=kv_cache[0].data_ptr(),
        value_cache=kv_cache[1].data_ptr(), slot_mapping=slot_mapping.data_ptr(),
        num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=kv_cache.shape[2], key_stride=key.stride(0), value_stride=value.stride(0),
        dtype=dtype_code(key.dtype), cache_dtype=dtype_code(kv_cache.dtype), k_scale=k_ptr,
        v_scale=v_ptr, stream=stream_handle(key.device))


# ---- helpers shared by the CUDA wrappers -------------------------------------------------------

def kv_scale_ptrs(kv_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                  v_scale: Optional[torch.Tensor]) -> tuple[int, int]:
    """Device pointers of the K and V scales for a kernel; (0, 0) unless the cache is FP8.

    Raises:
        ValueError: a scale that is not a one-element float32 tensor on the cache's device.
    """
    if kv_cache.dtype != FP8_DTYPE:
        return 0, 0
    ptrs = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            scale = _unit_scale(kv_cache.device)
        if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != kv_cache.device:
            raise ValueError(f"{name}: expected a one-element float32 tensor on "
                             f"{kv_cache.device}, got {scale.dtype} {tuple(scale.shape)} on "
                             f"{scale.device}")
        ptrs.append(scale.data_ptr())
    return ptrs[0], ptrs[1]


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A persistent 1.0 for calls that pass no scale (created once per device, outside graphs)."""
    return torch.ones((), dtype=torch.float32, device=device)
