// Per-token activation quantization for the W8A8 GEMMs (ops/w8a8_linear.py `quantize_rows`):
// each row of x to int8 or fp8 e4m3 with one float32 scale, in one pass over x instead of the
// reference's chain of torch ops (float copy, abs, amax, scale, divide, clamp, cast), each of
// which reads and writes the whole activation in float32. The same quantization fused into the
// op that makes the row (ops/layers.py `rms_norm_quant`, `silu_and_mul_quant`): the 16-bit row
// stays in registers and only the 8-bit values and the scale are written. Framework-free device
// code.
//
// The arithmetic is the reference's, so the quantized values and scales are bit-identical:
//   dynamic: scale = max(max|x_row|, min_absmax) / scale_divisor  (an IEEE float32 division;
//            scale_divisor is the checkpoint's convention: QMAX, or compressed-tensors'
//            (q_max - q_min) / 2, 127.5 for int8)
//   static:  scale = *static_scale
//   int8: q = clamp(x / scale, qmin, qmax) (an IEEE division, compressed-tensors' arithmetic),
//         rounded half to even;
//   fp8:  q = clamp(x * (1 / scale), qmin, qmax) (the reciprocal rounded once per row, then an
//         IEEE product, as vLLM's FP8 kernels compute it: a division per element made the fused
//         SwiGLU's quantization compute-bound, twice the time of SwiGLU alone), converted
//         round-to-nearest-even.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"
#include "layers.cuh"  // Pack, kRowThreads

namespace tinyvllm {

__device__ __forceinline__ float block_max(float x, float* scratch /* [32] */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) / 32;
  x = lane < num_warps ? scratch[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// A clamped value in the quantized type's storage byte.
template <bool kInt8>
__device__ __forceinline__ uint8_t quantize_value(float v) {
  if constexpr (kInt8) {
    return static_cast<uint8_t>(static_cast<int8_t>(rintf(v)));  // rintf: half to even
  } else {
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

template <typename T, int N>
__device__ __forceinline__ float pack_absmax(const Pack<T, N> a, float amax) {
#pragma unroll
  for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(to_float(a.v[j])));
  return amax;
}

template <bool kInt8, typename T, int N>
__device__ __forceinline__ Pack<uint8_t, N> quantize_pack(const Pack<T, N> a, float scale,
                                                          float inv_scale, float qmin, float qmax) {
  Pack<uint8_t, N> q;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float v = kInt8 ? __fdiv_rn(to_float(a.v[j]), scale) : __fmul_rn(to_float(a.v[j]), inv_scale);
    v = v < qmin ? qmin : (v > qmax ? qmax : v);  // as torch.clamp: NaN stays NaN
    q.v[j] = quantize_value<kInt8>(v);
  }
  return q;
}

// A row's dynamic scale from its threads' max|y|.
__device__ __forceinline__ float dynamic_scale(float amax, float min_absmax, float scale_divisor,
                                               float* scratch /* [32] */) {
  return __fdiv_rn(fmaxf(block_max(amax, scratch), min_absmax), scale_divisor);
}

// How a row is quantized, as the launchers check it (quantize_rows_kernel's arguments of the
// same names; the fused kernels take it whole).
struct RowQuant {
  const float* static_scale;  // [1] or null (dynamic: max(max|row|, min_absmax) / scale_divisor)
  float scale_divisor, qmin, qmax, min_absmax;
};

// One CTA per row; N elements per access (16 bytes of x when N = 16 / sizeof(T)).
template <typename T, bool kInt8, int N>
__global__ void __launch_bounds__(kRowThreads) quantize_rows_kernel(
    uint8_t* __restrict__ out,                // [num_tokens, out_stride] int8 / e4m3 bytes
    float* __restrict__ scales,               // [num_tokens]
    const T* __restrict__ x,                  // [num_tokens, x_stride]
    const float* __restrict__ static_scale,   // [1] or null (dynamic)
    int k, int64_t x_stride, int64_t out_stride, float scale_divisor, float qmin, float qmax,
    float min_absmax) {
  using V = Pack<T, N>;
  using Q = Pack<uint8_t, N>;
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const V* xr = reinterpret_cast<const V*>(x + row * x_stride);
  Q* orow = reinterpret_cast<Q*>(out + row * out_stride);
  const int num_packs = k / N;
  float scale;
  if (static_scale != nullptr) {
    scale = *static_scale;
  } else {
    float amax = 0.f;
    for (int i = threadIdx.x; i < num_packs; i += blockDim.x) amax = pack_absmax(xr[i], amax);
    scale = dynamic_scale(amax, min_absmax, scale_divisor, scratch);
  }
  if (threadIdx.x == 0) scales[row] = scale;
  const float inv_scale = __frcp_rn(scale);
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    orow[i] = quantize_pack<kInt8>(xr[i], scale, inv_scale, qmin, qmax);
  }
}

// Packs per thread that the fused kernels keep in registers between computing a row and
// quantizing it: with 256 threads of 16-byte packs, rms_norm_quant holds a row of 8192 16-bit
// values (16 registers a thread), and with 512 threads silu_and_mul_quant one of 16384. Packs past
// these are computed again for each pass instead: longer rows, and past 4 elements a thread in
// the single-element form (rows of no multiple of 16 bytes; ptxas gives those kernels 32
// registers, and 8 held elements spilled).
constexpr int kNormHeldPacks = 4;
constexpr int kSiluHeldPacks = 4;
constexpr int kSingleHeldPacks = 4;

// silu_and_mul_quant's CTA: 512 threads at most 64 registers each, so that two CTAs (two rows)
// share an SM and one loads while the other reduces its max. With rms_norm's 256 threads holding
// 8 packs (103 registers) two CTAs of half the size fitted, and the kernel took 1.8x the time of
// silu_and_mul (H100, the 8B prefill-heavy profile). Any CTA size gives the same values: a row's
// max does not depend on the order it is taken in.
constexpr int kSiluQuantThreads = 512;

constexpr int held_packs(int wide_held, int n) { return n == 1 ? kSingleHeldPacks : wide_held; }

// Quantizes a row that the CTA has computed and not stored (RMSNorm's or SwiGLU's output),
// as quantize_rows_kernel would from the stored row: this thread's pack i = threadIdx.x +
// p * blockDim.x is held[p] for p < kHeld, and value(i) (the same arithmetic again) past them.
template <bool kInt8, typename T, int N, int kHeld, typename Value>
__device__ __forceinline__ void quantize_held_row(
    Pack<uint8_t, N>* __restrict__ orow,  // [num_packs]
    float* __restrict__ scale_out,        // [1]
    const Pack<T, N> (&held)[kHeld], const Value& value, int num_packs, const RowQuant& rq,
    float* scratch /* [32] */) {
  const int first_unheld = threadIdx.x + kHeld * blockDim.x;
  float scale;
  if (rq.static_scale != nullptr) {
    scale = *rq.static_scale;
  } else {
    float amax = 0.f;
#pragma unroll
    for (int p = 0; p < kHeld; ++p) {
      const int i = threadIdx.x + p * blockDim.x;
      if (i < num_packs) amax = pack_absmax(held[p], amax);
    }
    for (int i = first_unheld; i < num_packs; i += blockDim.x) amax = pack_absmax(value(i), amax);
    scale = dynamic_scale(amax, rq.min_absmax, rq.scale_divisor, scratch);
  }
  if (threadIdx.x == 0) *scale_out = scale;
  const float inv_scale = __frcp_rn(scale);
#pragma unroll
  for (int p = 0; p < kHeld; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    if (i < num_packs) orow[i] = quantize_pack<kInt8>(held[p], scale, inv_scale, rq.qmin,
                                                          rq.qmax);
  }
  for (int i = first_unheld; i < num_packs; i += blockDim.x) {
    orow[i] = quantize_pack<kInt8>(value(i), scale, inv_scale, rq.qmin, rq.qmax);
  }
}

// rms_norm_kernel (layers.cuh) then quantize_rows_kernel, with the normalised row kept in
// registers: one CTA per token, launched with rms_norm's CTA size (row_threads) and access width,
// so that the sum of squares, and with it every value, is rms_norm's. With a residual:
// residual <- x + residual, q <- quantize(norm(residual) * weight).
template <typename T, bool kInt8, int N>
__global__ void __launch_bounds__(kRowThreads) rms_norm_quant_kernel(
    uint8_t* __restrict__ out,       // [num_tokens, out_stride] int8 / e4m3 bytes
    float* __restrict__ scales,      // [num_tokens]
    const T* __restrict__ x,         // [num_tokens, x_stride]
    T* __restrict__ residual,        // [num_tokens, residual_stride] or null
    const T* __restrict__ weight,    // [hidden]
    RowQuant rq, int hidden, int64_t x_stride, int64_t residual_stride, int64_t out_stride,
    float eps) {
  using V = Pack<T, N>;
  // Two scratch arrays: the max may not overwrite the sum's partials while a warp reads them.
  __shared__ float sum_scratch[32], max_scratch[32];
  const int64_t row = blockIdx.x;
  const V* xr = reinterpret_cast<const V*>(x + row * x_stride);
  V* rr = residual ? reinterpret_cast<V*>(residual + row * residual_stride) : nullptr;
  const int num_packs = hidden / N;
  constexpr int kHeld = held_packs(kNormHeldPacks, N);
  V held[kHeld];  // x + residual, then the normalised values
  float sum_sq = 0.f;  // in rms_norm_kernel's order: this thread's packs in ascending i
#pragma unroll
  for (int p = 0; p < kHeld; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    if (i < num_packs) {
      held[p] = add_residual(xr, rr, i);
      sum_sq = add_squares(held[p], sum_sq);
    }
  }
  for (int i = threadIdx.x + kHeld * blockDim.x; i < num_packs; i += blockDim.x) {
    sum_sq = add_squares(add_residual(xr, rr, i), sum_sq);
  }
  const float inv_rms = row_inv_rms(sum_sq, hidden, eps, sum_scratch);
  const V* src = rr ? rr : xr;  // this thread wrote its own packs of rr above
  const V* wr = reinterpret_cast<const V*>(weight);
#pragma unroll
  for (int p = 0; p < kHeld; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    if (i < num_packs) held[p] = rms_normed(held[p], wr[i], inv_rms);
  }
  const auto normed = [&](int i) { return rms_normed(src[i], wr[i], inv_rms); };
  quantize_held_row<kInt8>(reinterpret_cast<Pack<uint8_t, N>*>(out + row * out_stride),
                           scales + row, held, normed, num_packs, rq, max_scratch);
}

// silu_and_mul_kernel (layers.cuh) then quantize_rows_kernel, the product kept in registers: one
// CTA per token, x = [gate | up].
template <typename T, bool kInt8, int N>
__global__ void __launch_bounds__(kSiluQuantThreads, 2) silu_and_mul_quant_kernel(
    uint8_t* __restrict__ out,  // [num_tokens, out_stride] int8 / e4m3 bytes, d columns used
    float* __restrict__ scales, // [num_tokens]
    const T* __restrict__ x,    // [num_tokens, x_stride], 2 * d columns used
    RowQuant rq, int d, int64_t x_stride, int64_t out_stride) {
  using V = Pack<T, N>;
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(x + row * x_stride);
  const V* up = reinterpret_cast<const V*>(x + row * x_stride + d);
  const int num_packs = d / N;
  constexpr int kHeld = held_packs(kSiluHeldPacks, N);
  V held[kHeld];
#pragma unroll
  for (int p = 0; p < kHeld; ++p) {
    const int i = threadIdx.x + p * blockDim.x;
    if (i < num_packs) held[p] = silu_mul(gate[i], up[i]);
  }
  const auto product = [&](int i) { return silu_mul(gate[i], up[i]); };
  quantize_held_row<kInt8>(reinterpret_cast<Pack<uint8_t, N>*>(out + row * out_stride),
                           scales + row, held, product, num_packs, rq, scratch);
}

// The int8 GEMM's epilogue (ops/w8a8_linear.py `_int8_gemm`): out = dtype(float(acc) * x_scale
// * weight_scale (+ bias)), each product and the sum rounded in float32 in that order (no FMA),
// as the reference's torch ops round them, in one pass over the int32 sums. Grid (rows, column
// blocks); 4 columns per thread.
template <typename T>
__global__ void __launch_bounds__(kRowThreads) rescale_int32_kernel(
    T* __restrict__ out,                 // [m, out_stride]
    const int32_t* __restrict__ acc,     // [m, acc_stride]
    const float* __restrict__ x_scale,   // [m]
    const float* __restrict__ w_scale,   // [n]
    const T* __restrict__ bias,          // [n] or null
    int n, int64_t acc_stride, int64_t out_stride) {
  const int64_t row = blockIdx.x;
  const float xs = x_scale[row];
  const int32_t* a = acc + row * acc_stride;
  T* o = out + row * out_stride;
  for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * 4; c < n;
       c += gridDim.y * blockDim.x * 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (c + j >= n) break;
      float v = __fmul_rn(__fmul_rn(__int2float_rn(a[c + j]), xs), w_scale[c + j]);
      if (bias != nullptr) v = __fadd_rn(v, to_float(bias[c + j]));
      o[c + j] = from_float<T>(v);
    }
  }
}

}  // namespace tinyvllm
