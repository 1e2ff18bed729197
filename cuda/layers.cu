// Launchers for RMSNorm, SiLU-and-mul and rotary embedding: check sizes, pick the access width.
//
// Instantiations: {float32, float16, bfloat16} x {16-byte packs, single elements}; the wide form
// runs when the row length, strides and pointers allow 16-byte accesses.
#include "launchers.h"
#include "layers.cuh"

namespace tinyvllm {
namespace {

template <typename T>
constexpr int kWide = 16 / sizeof(T);

}  // namespace

void rms_norm(ptr_t out,       // [num_tokens, hidden], row stride out_stride
              ptr_t x,         // [num_tokens, hidden], row stride x_stride
              ptr_t residual,  // [num_tokens, hidden], row stride residual_stride; 0 = none
              ptr_t weight,    // [hidden]
              int64_t num_tokens, int hidden, int64_t x_stride, int64_t residual_stride,
              int64_t out_stride, float eps, int dtype, stream_t stream) {
  require(hidden > 0, "rms_norm: hidden=" + std::to_string(hidden) + " must be positive");
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "rms_norm: num_tokens=" + std::to_string(num_tokens) + " out of range");
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_FLOAT(dtype, "rms_norm", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    auto* r = reinterpret_cast<scalar_t*>(residual);
    auto* w = reinterpret_cast<const scalar_t*>(weight);
    constexpr int n = kWide<scalar_t>;
    if (can_go_wide(sizeof(scalar_t), hidden, {x_stride, residual ? residual_stride : 0, out_stride},
                    {out, x, residual, weight})) {
      rms_norm_kernel<scalar_t, n><<<unsigned(num_tokens), row_threads(hidden / n), 0, s>>>(
          o, xi, r, w, hidden, x_stride, residual_stride, out_stride, eps);
    } else {
      rms_norm_kernel<scalar_t, 1><<<unsigned(num_tokens), row_threads(hidden), 0, s>>>(
          o, xi, r, w, hidden, x_stride, residual_stride, out_stride, eps);
    }
  });
  check_launch("rms_norm_kernel");
}

void silu_and_mul(ptr_t out,  // [num_tokens, d], row stride out_stride
                  ptr_t x,    // [num_tokens, 2 * d] (gate | up), row stride x_stride
                  int64_t num_tokens, int d, int64_t x_stride, int64_t out_stride, int dtype,
                  stream_t stream) {
  require(d > 0, "silu_and_mul: d=" + std::to_string(d) + " must be positive");
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "silu_and_mul: num_tokens=" + std::to_string(num_tokens) + " out of range");
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_FLOAT(dtype, "silu_and_mul", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    constexpr int n = kWide<scalar_t>;
    const bool wide = can_go_wide(sizeof(scalar_t), d, {x_stride, out_stride}, {out, x});
    const int64_t packs = wide ? d / n : d;
    const unsigned threads = row_threads(packs);
    const dim3 grid(unsigned(num_tokens), unsigned((packs + threads - 1) / threads));
    if (wide) {
      silu_and_mul_kernel<scalar_t, n><<<grid, threads, 0, s>>>(o, xi, d, x_stride, out_stride);
    } else {
      silu_and_mul_kernel<scalar_t, 1><<<grid, threads, 0, s>>>(o, xi, d, x_stride, out_stride);
    }
  });
  check_launch("silu_and_mul_kernel");
}

void rotary_embedding(ptr_t positions,      // [num_tokens] int64
                      ptr_t query,          // [num_tokens, num_heads * head_dim], row stride query_stride
                      ptr_t key,            // [num_tokens, num_kv_heads * head_dim], row stride key_stride
                      ptr_t cos_sin_cache,  // [max_position, head_dim] float32
                      int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                      int64_t query_stride, int64_t key_stride, int dtype, stream_t stream) {
  require(head_dim > 0 && head_dim % 2 == 0,
          "rotary_embedding: head_dim=" + std::to_string(head_dim) + " must be even and positive");
  require(num_heads >= 0 && num_kv_heads >= 0,
          "rotary_embedding: num_heads and num_kv_heads must not be negative");
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "rotary_embedding: num_tokens=" + std::to_string(num_tokens) + " out of range");
  if (num_tokens == 0 || num_heads + num_kv_heads == 0) return;
  const cudaStream_t s = as_stream(stream);
  const int64_t pairs = int64_t(num_heads + num_kv_heads) * head_dim / 2;
  TINYVLLM_DISPATCH_FLOAT(dtype, "rotary_embedding", {
    rotary_embedding_kernel<scalar_t><<<unsigned(num_tokens), row_threads(pairs), 0, s>>>(
        reinterpret_cast<const int64_t*>(positions), reinterpret_cast<scalar_t*>(query),
        reinterpret_cast<scalar_t*>(key), reinterpret_cast<const float*>(cos_sin_cache),
        num_heads, num_kv_heads, head_dim, query_stride, key_stride);
  });
  check_launch("rotary_embedding_kernel");
}

void rotary_embedding_and_cache(
    ptr_t positions,      // [num_tokens] int64
    ptr_t query,          // [num_tokens, num_heads * head_dim], row stride query_stride
    ptr_t key,            // [num_tokens, num_kv_heads * head_dim], row stride key_stride
    ptr_t value,          // [num_tokens, num_kv_heads * head_dim], row stride value_stride
    ptr_t key_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
    ptr_t value_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
    ptr_t slot_mapping,   // [num_tokens] int64, -1 = padding
    ptr_t cos_sin_cache,  // [max_position, head_dim] float32
    int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int64_t query_stride,
    int64_t key_stride, int64_t value_stride, int dtype, int cache_dtype,
    ptr_t k_scale,        // [1] float32, read when cache_dtype is FP8
    ptr_t v_scale,        // [1] float32, read when cache_dtype is FP8
    stream_t stream) {
  require(head_dim > 0 && head_dim % 2 == 0, "rotary_embedding_and_cache: head_dim=" +
                                                 std::to_string(head_dim) + " must be even and positive");
  require(num_heads >= 0 && num_kv_heads > 0,
          "rotary_embedding_and_cache: num_heads must not be negative, num_kv_heads positive");
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "rotary_embedding_and_cache: num_tokens=" + std::to_string(num_tokens) + " out of range");
  const bool fp8 = cache_dtype == kFloat8E4M3;
  require(cache_dtype == dtype || fp8,
          std::string("rotary_embedding_and_cache: cache_dtype must be the activation dtype or "
                      "float8_e4m3fn, got ") + dtype_name(cache_dtype));
  require(!fp8 || (k_scale != 0 && v_scale != 0),
          "rotary_embedding_and_cache: an FP8 cache needs k_scale and v_scale");
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  const int64_t pairs = int64_t(num_heads + num_kv_heads) * head_dim / 2;
  // Instantiations: {float32, float16, bfloat16} x cache {same, FP8}.
  TINYVLLM_DISPATCH_FLOAT(dtype, "rotary_embedding_and_cache", {
    auto launch = [&](auto cache_tag) {
      using Cache = decltype(cache_tag);
      launch_pdl(rotary_embedding_and_cache_kernel<scalar_t, Cache>, dim3(unsigned(num_tokens)),
              dim3(row_threads(pairs)), 0, s,
              reinterpret_cast<const int64_t*>(positions), reinterpret_cast<scalar_t*>(query),
              reinterpret_cast<scalar_t*>(key), reinterpret_cast<const scalar_t*>(value),
              reinterpret_cast<Cache*>(key_cache), reinterpret_cast<Cache*>(value_cache),
              reinterpret_cast<const int64_t*>(slot_mapping),
              reinterpret_cast<const float*>(cos_sin_cache),
              reinterpret_cast<const float*>(k_scale), reinterpret_cast<const float*>(v_scale),
              num_heads, num_kv_heads, head_dim, query_stride, key_stride, value_stride);
    };
    if (fp8) {
      launch(fp8_e4m3{});
    } else {
      launch(scalar_t{});
    }
  });
}

}  // namespace tinyvllm
