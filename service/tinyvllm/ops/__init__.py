"""The only door to the CUDA kernels (`tinyvllm._cuda`), with a pure-torch reference for each.

Every op takes torch tensors, documents shapes, and runs the CUDA kernel when its inputs live on a
CUDA device and the kernel supports them; otherwise the torch reference runs (that is the CPU
path). On CUDA an unsupported input raises rather than silently falling back.

Which fusions run is the engine's `KernelConfig`, installed once with `configure` (the model asks
`use_fused_decode` and `kernel_config()` instead of deciding itself).
"""

from tinyvllm.ops._dispatch import CudaModuleError, configure, kernel_config
from tinyvllm.ops.attention import (AttentionMetadata, DecodePartitions, paged_attention,
                                    paged_attention_ref, rotary_paged_attention)
from tinyvllm.ops.kv_cache import KV_CACHE_LAYOUT, allocate_kv_caches, reshape_and_cache
from tinyvllm.ops.layers import (build_cos_sin_cache, rms_norm, rms_norm_quant,
                                 rotary_embedding, rotary_embedding_and_cache, silu_and_mul,
                                 silu_and_mul_quant)
from tinyvllm.ops.linear import fused_linear, fused_linear_supported, use_fused_decode
from tinyvllm.ops.sampling import sample, sample_ref

__all__ = [
    "CudaModuleError", "configure", "kernel_config",
    "AttentionMetadata", "DecodePartitions", "paged_attention", "paged_attention_ref",
    "rotary_paged_attention",
    "KV_CACHE_LAYOUT",
    "allocate_kv_caches", "reshape_and_cache", "rms_norm", "rms_norm_quant", "rotary_embedding",
    "rotary_embedding_and_cache", "silu_and_mul", "silu_and_mul_quant",
    "build_cos_sin_cache", "fused_linear", "fused_linear_supported", "use_fused_decode",
    "sample", "sample_ref",
]
