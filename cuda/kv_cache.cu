// Launcher for reshape_and_cache: checks sizes, picks the copy width or the FP8 quantiser.
//
// Instantiations: byte copies {uint4, uint32, uint16} (cache dtype == activation dtype), and
// FP8 quantisers {float32, float16, bfloat16} x {8 elements per access, 1 (odd rows)}.
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

void copy_rows(ptr_t key, ptr_t value, ptr_t key_cache, ptr_t value_cache, ptr_t slot_mapping,
               int64_t num_tokens, int64_t row, int64_t key_stride, int64_t value_stride,
               int dtype, cudaStream_t s) {
  const int64_t elem = dtype_size(dtype);
  const int64_t row_bytes = row * elem;
  const int64_t ks = key_stride * elem, vs = value_stride * elem;
  const bool wide = row_bytes % 16 == 0 && ks % 16 == 0 && vs % 16 == 0 &&
                    aligned16(reinterpret_cast<void*>(key)) &&
                    aligned16(reinterpret_cast<void*>(value)) &&
                    aligned16(reinterpret_cast<void*>(key_cache)) &&
                    aligned16(reinterpret_cast<void*>(value_cache));
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

template <typename T, int N>
void launch_fp8(ptr_t key, ptr_t value, ptr_t key_cache, ptr_t value_cache, ptr_t slot_mapping,
                ptr_t k_scale, ptr_t v_scale, int64_t num_tokens, int64_t row,
                int64_t key_stride, int64_t value_stride, cudaStream_t stream) {
  reshape_and_cache_fp8_kernel<T, N>
      <<<static_cast<unsigned>(num_tokens), kCopyThreads, 0, stream>>>(
          reinterpret_cast<const T*>(key), reinterpret_cast<const T*>(value),
          reinterpret_cast<__nv_fp8_storage_t*>(key_cache),
          reinterpret_cast<__nv_fp8_storage_t*>(value_cache),
          reinterpret_cast<const int64_t*>(slot_mapping), reinterpret_cast<const float*>(k_scale),
          reinterpret_cast<const float*>(v_scale), static_cast<int>(row), key_stride,
          value_stride);
  check_launch("reshape_and_cache_fp8_kernel");
}

bool aligned(ptr_t p, int64_t bytes) { return p % bytes == 0; }

void quantize_rows(ptr_t key, ptr_t value, ptr_t key_cache, ptr_t value_cache,
                   ptr_t slot_mapping, ptr_t k_scale, ptr_t v_scale, int64_t num_tokens,
                   int64_t row, int64_t key_stride, int64_t value_stride, int dtype,
                   cudaStream_t s) {
  constexpr int kWide = 8;
  const int64_t in_bytes = kWide * dtype_size(dtype);
  const bool wide = row % kWide == 0 && key_stride % kWide == 0 && value_stride % kWide == 0 &&
                    aligned(key, in_bytes) && aligned(value, in_bytes) &&
                    aligned(key_cache, kWide) && aligned(value_cache, kWide);
  TINYVLLM_DISPATCH_FLOAT(dtype, "reshape_and_cache", {
    if (wide) {
      launch_fp8<scalar_t, kWide>(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                  v_scale, num_tokens, row, key_stride, value_stride, s);
    } else {
      launch_fp8<scalar_t, 1>(key, value, key_cache, value_cache, slot_mapping, k_scale,
                              v_scale, num_tokens, row, key_stride, value_stride, s);
    }
  });
}

}  // namespace

void reshape_and_cache(ptr_t key,            // [num_tokens, num_kv_heads, head_dim], row stride key_stride
                       ptr_t value,          // [num_tokens, num_kv_heads, head_dim], row stride value_stride
                       ptr_t key_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
                       ptr_t value_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                       ptr_t slot_mapping,   // [num_tokens] int64
                       int64_t num_tokens, int num_kv_heads, int head_dim, int block_size,
                       int64_t key_stride, int64_t value_stride, int dtype, int cache_dtype,
                       ptr_t k_scale,        // [1] float32, read when cache_dtype is FP8
                       ptr_t v_scale,        // [1] float32, read when cache_dtype is FP8
                       stream_t stream) {
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "reshape_and_cache: num_tokens=" + std::to_string(num_tokens) + " out of range");
  require(num_kv_heads > 0 && head_dim > 0 && block_size > 0,
          "reshape_and_cache: num_kv_heads, head_dim and block_size must be positive");
  require(cache_dtype == dtype || cache_dtype == kFloat8E4M3,
          std::string("reshape_and_cache: cache_dtype must be the activation dtype or "
                      "float8_e4m3fn, got ") + dtype_name(cache_dtype));
  require(cache_dtype != kFloat8E4M3 || (k_scale != 0 && v_scale != 0),
          "reshape_and_cache: an FP8 cache needs k_scale and v_scale");
  if (num_tokens == 0) return;
  const int64_t row = int64_t(num_kv_heads) * head_dim;
  const cudaStream_t s = as_stream(stream);
  if (cache_dtype == kFloat8E4M3) {
    quantize_rows(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
                  row, key_stride, value_stride, dtype, s);
  } else {
    copy_rows(key, value, key_cache, value_cache, slot_mapping, num_tokens, row, key_stride,
              value_stride, dtype, s);
  }
}

}  // namespace tinyvllm
