// Weight-only quantized linear layers (W4A16 / W8A16) over the integer-group layout of
// service/tinyvllm/ops/quant_linear.py:
//
//   qweight int32 [n, k / (32 / BITS)]  unsigned BITS-bit values along k, value j of a word in
//                                       bits [j * BITS, (j + 1) * BITS)
//   scales, zeros T [n, k / group_size] w[i, c] = (q[i, c] - zeros[i, g]) * scales[i, g]
//
// quant_gemv_kernel: out[m, n] = x[m, k] . w^T (+ bias) for decode-sized m (at most M rows). Each
// warp owns kRowsPerWarp output rows and walks k in 16-byte chunks of packed weight per lane
// (32 values at 4 bits, 16 at 8), so a warp reads 512 contiguous bytes of a row per step. The
// weight is dequantized in registers, never written: per chunk (which lies in one group, since
// group_size is a multiple of 32) the lane forms dot = sum x * q and sx = sum x, and adds
// scale * (dot - zero * sx), which is sum x * (q - zero) * scale with one multiply per value.
// x is read through the read-only cache; every warp of the grid reads the same few KB.
//
// quant_dequantize_kernel: the weight as T [n, k], for batches large enough that a tensor-core
// GEMM over a dequantized copy beats the GEMV (prefill).
#pragma once

#include "common.cuh"

namespace tinyvllm {

constexpr int kQuantGemvWarps = 4;
constexpr int kQuantRowsPerWarp = 2;

// 16 bytes of packed weight as floats: BITS = 4 gives 32 values, BITS = 8 gives 16. The value
// is exact in float (at most 255); the exponent trick (0x4B000000 | v is 2^23 + v) converts it
// with one OR and one subtraction instead of an integer-to-float instruction.
template <int BITS>
__device__ __forceinline__ float quant_value(uint32_t word, int j) {
  const uint32_t v = (word >> (j * BITS)) & ((1u << BITS) - 1u);
  return __uint_as_float(0x4B000000u | v) - 8388608.0f;
}

template <typename T, int M, int BITS>
__global__ void __launch_bounds__(kQuantGemvWarps * 32)
    quant_gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                      const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
                      const T* __restrict__ zeros, const T* __restrict__ bias, int m, int n, int k,
                      int64_t x_stride, int64_t out_stride, int group_size) {
  constexpr int kPerWord = 32 / BITS;
  constexpr int kChunk = 4 * kPerWord;  // values per lane per step (one uint4 of weight)
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kQuantGemvWarps + warp) * kQuantRowsPerWarp;
  if (row0 >= n) return;
  const int words_per_row = k / kPerWord;
  const int groups = k / group_size;

  float acc[kQuantRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kQuantRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  for (int c0 = lane * kChunk; c0 < k; c0 += 32 * kChunk) {
    uint4 q[kQuantRowsPerWarp];
    float scale[kQuantRowsPerWarp], zero[kQuantRowsPerWarp];
    const int g = c0 / group_size;
#pragma unroll
    for (int r = 0; r < kQuantRowsPerWarp; ++r) {
      const int row = min(row0 + r, n - 1);  // a missing last row re-reads the one before
      q[r] = __ldg(reinterpret_cast<const uint4*>(qweight + int64_t(row) * words_per_row +
                                                  c0 / kPerWord));
      scale[r] = to_float<T>(scales[int64_t(row) * groups + g]);
      zero[r] = to_float<T>(zeros[int64_t(row) * groups + g]);
    }
    float dot[kQuantRowsPerWarp][M], sx[M];
#pragma unroll
    for (int i = 0; i < M; ++i) {
      sx[i] = 0.f;
#pragma unroll
      for (int r = 0; r < kQuantRowsPerWarp; ++r) dot[r][i] = 0.f;
    }
    // The chunk in pieces of 8 activations (one uint4 of x per row).
#pragma unroll
    for (int p = 0; p < kChunk / 8; ++p) {
      float xv[M][8];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i < m) {
          unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + i * x_stride + c0 + p * 8)), xv[i]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[i][j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) sx[i] += xv[i][j];
      }
#pragma unroll
      for (int r = 0; r < kQuantRowsPerWarp; ++r) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&q[r]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int v = p * 8 + j;  // value index within the chunk
          const float w = quant_value<BITS>(words[v / kPerWord], v % kPerWord);
#pragma unroll
          for (int i = 0; i < M; ++i) dot[r][i] = fmaf(xv[i][j], w, dot[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kQuantRowsPerWarp; ++r)
#pragma unroll
      for (int i = 0; i < M; ++i) acc[r][i] += scale[r] * (dot[r][i] - zero[r] * sx[i]);
  }

#pragma unroll
  for (int r = 0; r < kQuantRowsPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float total = warp_sum(acc[r][i]);
      const int row = row0 + r;
      if (lane == 0 && i < m && row < n) {
        const float b = bias != nullptr ? to_float<T>(bias[row]) : 0.f;
        out[i * out_stride + row] = from_float<T>(total + b);
      }
    }
  }
}

// One thread per packed word: kPerWord consecutive values of one row.
template <typename T, int BITS>
__global__ void quant_dequantize_kernel(T* __restrict__ out, const uint32_t* __restrict__ qweight,
                                        const T* __restrict__ scales, const T* __restrict__ zeros,
                                        int n, int k, int group_size) {
  constexpr int kPerWord = 32 / BITS;
  const int words_per_row = k / kPerWord;
  const int64_t word = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (word >= int64_t(n) * words_per_row) return;
  const int row = int(word / words_per_row);
  const int c0 = int(word % words_per_row) * kPerWord;
  const int64_t gi = int64_t(row) * (k / group_size) + c0 / group_size;
  const float scale = to_float<T>(scales[gi]), zero = to_float<T>(zeros[gi]);
  const uint32_t w = qweight[word];
  T values[kPerWord];
#pragma unroll
  for (int j = 0; j < kPerWord; ++j) {
    values[j] = from_float<T>((quant_value<BITS>(w, j) - zero) * scale);
  }
  T* dst = out + int64_t(row) * k + c0;
  if constexpr (kPerWord == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(values);
  } else {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(values);
  }
}

}  // namespace tinyvllm
