// The paged KV cache's element types and writing new K/V rows into it. Framework-free device code.
//
// Cache layout (per K and per V): [num_blocks, block_size, num_kv_heads, head_dim], so the
// num_kv_heads * head_dim elements of one slot are contiguous and a token is a plain row copy.
//
// FP8 cache (E4M3, `--kv-cache-dtype fp8`): one float32 scale per layer for K and one for V (read
// through device pointers so that CUDA graphs see updated values). Written: x / scale, rounded to
// nearest even and saturated to +-448 (cvt.rn.satfinite); read: stored * scale. Readers fold the
// scales into fp32 math they do anyway (K scale into the softmax scale, V scale into the output),
// so a dequantised element is the exact E4M3 value, which fp16 and bf16 both represent exactly.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "common.cuh"

namespace tinyvllm {

// Element type of an FP8 cache in templates (a distinct type, so Cache == T means "not FP8").
using fp8_e4m3 = __nv_fp8_e4m3;

template <typename Cache>
constexpr bool is_fp8_cache() {
  return std::is_same_v<Cache, fp8_e4m3>;
}

// ---- quantise (write) ---------------------------------------------------------------------------

// x / scale as E4M3 bits. Division, not a multiply by 1 / scale: bit-identical to the reference.
__device__ __forceinline__ __nv_fp8_storage_t quantize_fp8(float x, float scale) {
  return __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3);
}

// One element of T as stored in a Cache element: unchanged, or quantised with `scale`.
template <typename Cache, typename T>
__device__ __forceinline__ Cache to_cache(T x, float scale) {
  if constexpr (is_fp8_cache<Cache>()) {
    Cache c;
    c.__x = quantize_fp8(to_float<T>(x), scale);
    return c;
  } else {
    static_assert(std::is_same_v<Cache, T>, "a 16/32-bit cache holds the activation dtype");
    return x;
  }
}

// ---- dequantise (read), without the scale (see the header comment) ------------------------------

// Two E4M3 values (lo in the low byte) -> two floats; one cvt.rn.f16x2.e4m3x2 on sm_89+.
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
  return __half22float2(__half2(h));
}

// Eight E4M3 values in 8 bytes -> floats.
__device__ __forceinline__ void unpack8_fp8(const uint2& v, float (&out)[8]) {
  const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = fp8x2_to_float2(e[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Two E4M3 values -> one register of two T (exact: E4M3 values are fp16 and bf16 values).
template <typename T> __device__ __forceinline__ uint32_t fp8x2_to_pair(uint16_t v);
template <> __device__ __forceinline__ uint32_t fp8x2_to_pair<__half>(uint16_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
template <> __device__ __forceinline__ uint32_t fp8x2_to_pair<__nv_bfloat16>(uint16_t v) {
  const __nv_bfloat162 b = __float22bfloat162_rn(fp8x2_to_float2(v));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Sixteen E4M3 values (16 bytes) -> sixteen T (32 bytes, as two 16-byte vectors).
template <typename T>
__device__ __forceinline__ void fp8x16_to(const uint4& v, uint4& lo, uint4& hi) {
  const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
  lo = make_uint4(fp8x2_to_pair<T>(e[0]), fp8x2_to_pair<T>(e[1]), fp8x2_to_pair<T>(e[2]),
                  fp8x2_to_pair<T>(e[3]));
  hi = make_uint4(fp8x2_to_pair<T>(e[4]), fp8x2_to_pair<T>(e[5]), fp8x2_to_pair<T>(e[6]),
                  fp8x2_to_pair<T>(e[7]));
}

// Eight cache elements for a reader that works in floats: the vector type of one load and its
// unpacking (16 bytes of a 16-bit cache, 8 bytes of an FP8 one).
template <typename T, typename Cache>
struct CacheVec8 {
  using Vec = uint4;
  __device__ __forceinline__ static void unpack(const Vec& v, float (&out)[8]) {
    unpack8<T>(v, out);
  }
};
template <typename T>
struct CacheVec8<T, fp8_e4m3> {
  using Vec = uint2;
  __device__ __forceinline__ static void unpack(const Vec& v, float (&out)[8]) {
    unpack8_fp8(v, out);
  }
};

// ---- reshape_and_cache --------------------------------------------------------------------------

// One CTA per token; Vec is the copy unit (uint4 when every row is 16-byte aligned). Cache == T.
template <typename Vec>
__global__ void reshape_and_cache_kernel(
    const Vec* __restrict__ key,        // [num_tokens, key_stride_vec]
    const Vec* __restrict__ value,      // [num_tokens, value_stride_vec]
    Vec* __restrict__ key_cache,        // [num_slots, row_vecs]
    Vec* __restrict__ value_cache,      // [num_slots, row_vecs]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]; -1 = padding, skipped
    int row_vecs, int64_t key_stride_vec, int64_t value_stride_vec) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const Vec* k = key + token * key_stride_vec;
  const Vec* v = value + token * value_stride_vec;
  Vec* kc = key_cache + slot * row_vecs;
  Vec* vc = value_cache + slot * row_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    kc[i] = k[i];
    vc[i] = v[i];
  }
}

// N elements moved as one access.
template <typename E, int N>
struct alignas(sizeof(E) * N) ElemPack {
  E v[N];
};

// One CTA per token, N elements per thread and step (8 when rows and pointers allow): quantise
// K/V rows of T into an FP8 cache.
template <typename T, int N>
__global__ void reshape_and_cache_fp8_kernel(
    const T* __restrict__ key,                 // [num_tokens, key_stride]
    const T* __restrict__ value,               // [num_tokens, value_stride]
    __nv_fp8_storage_t* __restrict__ key_cache,    // [num_slots, row]
    __nv_fp8_storage_t* __restrict__ value_cache,  // [num_slots, row]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]; -1 = padding, skipped
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,  // [1] each
    int row, int64_t key_stride, int64_t value_stride) {
  using In = ElemPack<T, N>;
  using Out = ElemPack<__nv_fp8_storage_t, N>;
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const float ks = *k_scale, vs = *v_scale;
  const In* k = reinterpret_cast<const In*>(key + token * key_stride);
  const In* v = reinterpret_cast<const In*>(value + token * value_stride);
  Out* kc = reinterpret_cast<Out*>(key_cache + slot * row);
  Out* vc = reinterpret_cast<Out*>(value_cache + slot * row);
  for (int i = threadIdx.x; i < row / N; i += blockDim.x) {
    const In kin = k[i], vin = v[i];
    Out kout, vout;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      kout.v[e] = quantize_fp8(to_float<T>(kin.v[e]), ks);
      vout.v[e] = quantize_fp8(to_float<T>(vin.v[e]), vs);
    }
    kc[i] = kout;
    vc[i] = vout;
  }
}

}  // namespace tinyvllm
