// Launcher for reshape_and_cache: checks sizes, picks the copy width.
#include "kv_cache.cuh"
#include "launchers.h"

namespace tinyvllm {
namespace {

constexpr int kCopyThreads = 128;

template <typename Vec>
void launch_copy(ptr_t key, ptr_t value, ptr_t key_cache, ptr_t value_cache, ptr_t slot_mapping,
                 int64_t num_tokens, int64_t row_bytes, int64_t key_stride_bytes,
                 int64_t value_stride_bytes, cudaStream_t stream) {
  const int64_t unit = sizeof(Vec);
  reshape_and_cache_kernel<Vec><<<static_cast<unsigned>(num_tokens), kCopyThreads, 0, stream>>>(
      reinterpret_cast<const Vec*>(key), reinterpret_cast<const Vec*>(value),
      reinterpret_cast<Vec*>(key_cache), reinterpret_cast<Vec*>(value_cache),
      reinterpret_cast<const int64_t*>(slot_mapping), static_cast<int>(row_bytes / unit),
      key_stride_bytes / unit, value_stride_bytes / unit);
  check_launch("reshape_and_cache_kernel");
}

}  // namespace

void reshape_and_cache(ptr_t key,            // [num_tokens, num_kv_heads, head_dim], row stride key_stride
                       ptr_t value,          // [num_tokens, num_kv_heads, head_dim], row stride value_stride
                       ptr_t key_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                       ptr_t value_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                       ptr_t slot_mapping,   // [num_tokens] int64
                       int64_t num_tokens, int num_kv_heads, int head_dim, int block_size,
                       int64_t key_stride, int64_t value_stride, int dtype, stream_t stream) {
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "reshape_and_cache: num_tokens=" + std::to_string(num_tokens) + " out of range");
  require(num_kv_heads > 0 && head_dim > 0 && block_size > 0,
          "reshape_and_cache: num_kv_heads, head_dim and block_size must be positive");
  if (num_tokens == 0) return;
  const int64_t elem = dtype_size(dtype);
  const int64_t row_bytes = int64_t(num_kv_heads) * head_dim * elem;
  const int64_t ks = key_stride * elem, vs = value_stride * elem;
  // A row is a byte copy: the cache holds the same dtype as key/value (checked in Python).
  const bool wide = row_bytes % 16 == 0 && ks % 16 == 0 && vs % 16 == 0 &&
                    aligned16(reinterpret_cast<void*>(key)) &&
                    aligned16(reinterpret_cast<void*>(value)) &&
                    aligned16(reinterpret_cast<void*>(key_cache)) &&
                    aligned16(reinterpret_cast<void*>(value_cache));
  const cudaStream_t s = as_stream(stream);
  if (wide) {
    launch_copy<uint4>(key, value, key_cache, value_cache, slot_mapping, num_tokens, row_bytes,
                       ks, vs, s);
  } else if (elem == 2) {
    launch_copy<uint16_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                          row_bytes, ks, vs, s);
  } else {
    launch_copy<uint32_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                          row_bytes, ks, vs, s);
  }
}

}  // namespace tinyvllm
