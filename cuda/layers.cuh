// Elementwise and normalisation kernels of the Llama family. Framework-free device code.
//
// Each kernel reproduces the rounding points of its torch reference in ops/layers.py (the residual
// sum, the normalised value and SiLU are rounded to the activation dtype before the next product),
// so fp16 / bf16 outputs match the reference to the last bit or one rounding step.
#pragma once

#include <algorithm>
#include <initializer_list>

#include "common.cuh"
#include "kv_cache.cuh"

namespace tinyvllm {

// N elements of T moved as one access (16 bytes when N = 16 / sizeof(T)).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

constexpr int kRowThreads = 256;

// The CTA size of a one-CTA-per-row kernel over `packs` accesses per row: a warp multiple, at most
// max_threads (kRowThreads unless the kernel says otherwise). A row's sum of squares depends on it
// (each thread sums its own packs first), so rms_norm_quant launches exactly as many threads as
// rms_norm.
inline unsigned row_threads(int64_t packs, int64_t max_threads = kRowThreads) {
  return static_cast<unsigned>(
      std::min<int64_t>(max_threads, std::max<int64_t>(32, (packs + 31) / 32 * 32)));
}

// Whether rows of n elements of `elem` bytes can move as 16-byte packs: n and every row stride
// (in elements) multiples of 16 / elem, every non-null pointer 16-byte aligned.
inline bool can_go_wide(int elem, int64_t n, std::initializer_list<int64_t> strides,
                        std::initializer_list<std::uintptr_t> ptrs) {
  const int64_t per16 = 16 / elem;
  if (n % per16 != 0) return false;
  for (int64_t s : strides) if (s % per16 != 0) return false;
  for (std::uintptr_t p : ptrs) if (p && !aligned16(reinterpret_cast<void*>(p))) return false;
  return true;
}

__device__ __forceinline__ float block_sum(float x, float* scratch /* [32] */) {
  x = warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) / 32;
  x = lane < num_warps ? scratch[lane] : 0.f;
  return warp_sum(x);
}

// The rounding points of RMSNorm (+ residual) and SwiGLU, one pack at a time: the rms_norm and
// silu_and_mul kernels and their quantizing twins (quant_act.cuh) compute through these, so the
// fused kernels' values are the unfused ones bit for bit.

// x[i] + residual[i] rounded to T and stored back into residual[i]; x[i] without a residual.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> add_residual(const Pack<T, N>* x, Pack<T, N>* residual,
                                                   int i) {
  Pack<T, N> a = x[i];
  if (residual) {
    const Pack<T, N> r = residual[i];
#pragma unroll
    for (int j = 0; j < N; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(r.v[j]));
    residual[i] = a;
  }
  return a;
}

template <typename T, int N>
__device__ __forceinline__ float add_squares(const Pack<T, N> a, float sum_sq) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float f = to_float(a.v[j]);
    sum_sq = fmaf(f, f, sum_sq);
  }
  return sum_sq;
}

// T(T(a * inv_rms) * w), as rms_norm_ref rounds the normalised value before the weight.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> rms_normed(const Pack<T, N> a, const Pack<T, N> w,
                                                 float inv_rms) {
  Pack<T, N> o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    o.v[j] = from_float<T>(round_to<T>(to_float(a.v[j]) * inv_rms) * to_float(w.v[j]));
  }
  return o;
}

// T(T(silu(gate)) * up).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> silu_mul(const Pack<T, N> gate, const Pack<T, N> up) {
  Pack<T, N> o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float g = to_float(gate.v[j]);
    const float silu = round_to<T>(g / (1.f + __expf(-g)));
    o.v[j] = from_float<T>(silu * to_float(up.v[j]));
  }
  return o;
}

// 1 / rms of a row from its threads' sums of squares (each summed in pack order).
__device__ __forceinline__ float row_inv_rms(float sum_sq, int hidden, float eps,
                                             float* scratch /* [32] */) {
  return rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
}

// One CTA per token. With a residual: residual <- x + residual, out <- norm(residual) * weight.
template <typename T, int N>
__global__ void __launch_bounds__(kRowThreads) rms_norm_kernel(
    T* __restrict__ out,             // [num_tokens, out_stride]
    const T* __restrict__ x,         // [num_tokens, x_stride]
    T* __restrict__ residual,        // [num_tokens, residual_stride] or null
    const T* __restrict__ weight,    // [hidden]
    int hidden, int64_t x_stride, int64_t residual_stride, int64_t out_stride, float eps) {
  using V = Pack<T, N>;
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const V* xr = reinterpret_cast<const V*>(x + row * x_stride);
  V* rr = residual ? reinterpret_cast<V*>(residual + row * residual_stride) : nullptr;
  const int num_packs = hidden / N;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    sum_sq = add_squares(add_residual(xr, rr, i), sum_sq);
  }
  const float inv_rms = row_inv_rms(sum_sq, hidden, eps, scratch);
  const V* src = rr ? rr : xr;  // this thread wrote its own packs of rr above
  const V* wr = reinterpret_cast<const V*>(weight);
  V* orow = reinterpret_cast<V*>(out + row * out_stride);
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    orow[i] = rms_normed(src[i], wr[i], inv_rms);
  }
}

// out = silu(gate) * up with x = [gate | up]. Grid (num_tokens, column blocks).
template <typename T, int N>
__global__ void __launch_bounds__(kRowThreads) silu_and_mul_kernel(
    T* __restrict__ out,      // [num_tokens, out_stride], d columns used
    const T* __restrict__ x,  // [num_tokens, x_stride], 2 * d columns used
    int d, int64_t x_stride, int64_t out_stride) {
  using V = Pack<T, N>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(x + row * x_stride);
  const V* up = reinterpret_cast<const V*>(x + row * x_stride + d);
  V* orow = reinterpret_cast<V*>(out + row * out_stride);
  const int num_packs = d / N;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < num_packs; i += gridDim.y * blockDim.x) {
    orow[i] = silu_mul(gate[i], up[i]);
  }
}

// Rotates query and key in place (GPT-NeoX half split). One CTA per token.
template <typename T>
__global__ void __launch_bounds__(kRowThreads) rotary_embedding_kernel(
    const int64_t* __restrict__ positions,   // [num_tokens]
    T* __restrict__ query,                   // [num_tokens, query_stride], num_heads * head_dim used
    T* __restrict__ key,                     // [num_tokens, key_stride], num_kv_heads * head_dim used
    const float* __restrict__ cos_sin_cache, // [max_position, head_dim]: cos | sin halves
    int num_heads, int num_kv_heads, int head_dim, int64_t query_stride, int64_t key_stride) {
  const int64_t token = blockIdx.x;
  const int half = head_dim / 2;
  const float* cos = cos_sin_cache + positions[token] * head_dim;
  const float* sin = cos + half;
  const int num_pairs = (num_heads + num_kv_heads) * half;
  for (int idx = threadIdx.x; idx < num_pairs; idx += blockDim.x) {
    const int head = idx / half, i = idx % half;
    T* x = head < num_heads ? query + token * query_stride + head * head_dim
                            : key + token * key_stride + (head - num_heads) * head_dim;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float c = cos[i], s = sin[i];
    x[i] = from_float<T>(x1 * c - x2 * s);
    x[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}

// Rotary on query and key in place, fused with writing this token's rotated K and its V into the
// paged cache (one launch instead of rotary + reshape_and_cache). One CTA per token; a negative
// slot (padding) rotates but writes no cache row. Cache is T, or fp8_e4m3 (quantised with the
// scales, as reshape_and_cache does; see kv_cache.cuh).
template <typename T, typename Cache>
__global__ void __launch_bounds__(kRowThreads) rotary_embedding_and_cache_kernel(
    const int64_t* __restrict__ positions,   // [num_tokens]
    T* __restrict__ query,                   // [num_tokens, query_stride]
    T* __restrict__ key,                     // [num_tokens, key_stride]
    const T* __restrict__ value,             // [num_tokens, value_stride]
    Cache* __restrict__ key_cache,           // [num_slots, num_kv_heads * head_dim]
    Cache* __restrict__ value_cache,         // [num_slots, num_kv_heads * head_dim]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    const float* __restrict__ cos_sin_cache, // [max_position, head_dim]: cos | sin halves
    const float* __restrict__ k_scale,       // [1], FP8 cache only
    const float* __restrict__ v_scale,       // [1], FP8 cache only
    int num_heads, int num_kv_heads, int head_dim, int64_t query_stride, int64_t key_stride,
    int64_t value_stride) {
  wait_for_previous_grid();  // q, k, v come from the qkv projection (PDL launch)
  allow_next_grid();
  float ks = 1.f, vs = 1.f;
  if constexpr (is_fp8_cache<Cache>()) {
    ks = *k_scale;
    vs = *v_scale;
  }
  const int64_t token = blockIdx.x;
  const int half = head_dim / 2;
  const float* cos = cos_sin_cache + positions[token] * head_dim;
  const float* sin = cos + half;
  const int64_t slot = slot_mapping[token];
  const int row = num_kv_heads * head_dim;
  Cache* kc = slot >= 0 ? key_cache + slot * row : nullptr;
  const int num_pairs = (num_heads + num_kv_heads) * half;
  for (int idx = threadIdx.x; idx < num_pairs; idx += blockDim.x) {
    const int head = idx / half, i = idx % half;
    const bool is_q = head < num_heads;
    T* x = is_q ? query + token * query_stride + head * head_dim
                : key + token * key_stride + (head - num_heads) * head_dim;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float c = cos[i], s = sin[i];
    const T y1 = from_float<T>(x1 * c - x2 * s), y2 = from_float<T>(x2 * c + x1 * s);
    x[i] = y1;
    x[i + half] = y2;
    if (!is_q && kc != nullptr) {
      Cache* k = kc + (head - num_heads) * head_dim;
      k[i] = to_cache<Cache>(y1, ks);
      k[i + half] = to_cache<Cache>(y2, ks);
    }
  }
  if (slot < 0) return;
  const T* v = value + token * value_stride;
  Cache* vc = value_cache + slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) vc[i] = to_cache<Cache>(v[i], vs);
}

}  // namespace tinyvllm
