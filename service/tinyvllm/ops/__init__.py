"""The only door to the CUDA kernels (`tinyvllm._cuda`), with a pure-torch reference for each.

Every op takes torch tensors, documents shapes, and runs the CUDA kernel when its inputs live on a
CUDA device and the kernel supports them; otherwise the torch reference runs (that is the CPU
path). On CUDA an unsupported input raises rather than silently falling back.
"""

from tinyvllm.ops.attention import (AttentionMetadata, DecodePartitions, paged_attention,
                                    paged_attention_ref, rotary_paged_attention)
from tinyvllm.ops.kv_cache import KV_CACHE_LAYOUT, allocate_kv_caches, reshape_and_cache
from tinyvllm.ops.layers import (build_cos_sin_cache, rms_norm, rotary_embedding,
                                 rotary_embedding_and_cache, silu_and_mul)
from tinyvllm.ops.linear import GEMV_MAX_ROWS, fused_linear, fused_linear_supported
from tinyvllm.ops.sampling import sample, sample_ref

__all__ = [
    "AttentionMetadata", "DecodePartitions", "paged_attention", "paged_attention_ref",
    "rotary_paged_attention",
    "KV_CACHE_LAYOUT",
    "allocate_kv_caches", "reshape_and_cache", "rms_norm", "rotary_embedding",
    "rotary_embedding_and_cache", "silu_and_mul",
    "build_cos_sin_cache", "GEMV_MAX_ROWS", "fused_linear", "fused_linear_supported",
    "sample", "sample_ref",
]
