"""The paged KV cache: its one layout, allocation, and writing new K/V into it."""

from __future__ import annotations

import torch

from tinyvllm.ops._dispatch import stream_handle, use_kernel

KV_CACHE_LAYOUT = "[2, num_blocks, block_size, num_kv_heads, head_dim]"
"""Per layer: index 0 holds keys, 1 values. A token's slot is block_id * block_size + offset."""

PADDING_SLOT = -1
"""A slot_mapping entry that marks a padded token: its K/V are not written."""


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One tensor per layer with layout KV_CACHE_LAYOUT."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its slot of the paged cache, in place.

    Shape:
        key, value: [num_tokens, num_kv_heads, head_dim]
        kv_cache: KV_CACHE_LAYOUT
        slot_mapping: [num_tokens] int64; PADDING_SLOT entries are skipped.
    """
    kernel = use_kernel(key, value, kv_cache, slot_mapping)
    if kernel is not None and hasattr(kernel, "reshape_and_cache"):
        _reshape_and_cache_cuda(kernel, key, value, kv_cache, slot_mapping)
        return
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping)


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _reshape_and_cache_cuda(kernel, key, value, kv_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value)):
        if t.shape != key.shape or t.stride(-1) != 1 or t.stride(-2) != head_dim:
            raise ValueError(f"{name}: expected [num_tokens, num_kv_heads, head_dim] with contiguous "
                             f"rows, got shape {tuple(t.shape)} strides {t.stride()}")
    if not kv_cache.is_contiguous() or kv_cache.dtype != key.dtype or value.dtype != key.dtype:
        raise ValueError(f"kv_cache: expected a contiguous cache of key's dtype {key.dtype}, got "
                         f"{kv_cache.dtype} (value {value.dtype})")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping: expected contiguous int64, got {slot_mapping.dtype}")
    kernel.reshape_and_cache(
        key.data_ptr(), value.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim, kv_cache.shape[2],
        key.stride(0), value.stride(0), _dtype_code(key.dtype), stream_handle(key.device))


def _dtype_code(dtype: torch.dtype) -> int:
    """The element-type code the CUDA launchers take (0 fp32, 1 fp16, 2 bf16)."""
    return {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
