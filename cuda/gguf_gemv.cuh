// Decode GEMV over GGUF block formats read as the file stores them (Q4_0, Q4_1, Q8_0): rows of
// k / 32 blocks, one row per output feature (ops/quantized.py's layout; ggml-common.h):
//
//   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles   w = (q - 8) * d
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes      w = q * d + m
//   Q8_0  34 bytes: fp16 d, 32 int8               w = q * d
//
// Nibble order: byte j holds element j (low nibble) and element j + 16 (high nibble).
//
// gguf_gemv_kernel: out[m, n] = x[m, k] . w^T (+ bias) for decode-sized m (at most M rows). Each
// warp owns kGgufRowsPerWarp rows and each lane one block of each per step, so a warp reads 32
// consecutive blocks of a row (576 / 640 / 1088 contiguous bytes) per step; blocks are only 2- or
// 4-byte aligned, so a lane reads its block in 16- or 32-bit words. Per block the lane forms
// dot = sum x * q and sx = sum x and adds d * (dot - 8 sx) (Q4_0), d * dot + m * sx (Q4_1) or
// d * dot (Q8_0). The activations are not quantized (unlike the CPU kernels): the result is the
// float product with the dequantized weight, up to summation order.
//
// gguf_dequantize_kernel: rows of the weight as T (prefill-sized batches, embedding lookups).
#pragma once

#include "common.cuh"

namespace tinyvllm {

constexpr int kGgufGemvWarps = 4;
constexpr int kGgufRowsPerWarp = 2;

enum GgufType : int { kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ8_0 = 8 };

template <int QT> struct GgufBlock;

template <> struct GgufBlock<kGgufQ4_0> {
  static constexpr int kBytes = 18;
  uint32_t qs[4];
  float d, m;
  __device__ __forceinline__ void load(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    d = __half2float(__ushort_as_half(__ldg(h)));
    m = -8.f * d;
#pragma unroll
    for (int i = 0; i < 4; ++i) qs[i] = uint32_t(__ldg(h + 1 + 2 * i)) | (uint32_t(__ldg(h + 2 + 2 * i)) << 16);
  }
  __device__ __forceinline__ float q(int j) const {  // element j of 32, as a float
    const uint32_t byte = (qs[(j & 15) >> 2] >> (8 * (j & 3))) & 0xFFu;
    return float(j < 16 ? byte & 0xFu : byte >> 4);
  }
  // Element j dequantized with gguf-py's arithmetic (d * (q - 8)), for the exact dequantize.
  __device__ __forceinline__ float value(int j) const { return d * (q(j) - 8.f); }
};

template <> struct GgufBlock<kGgufQ4_1> {
  static constexpr int kBytes = 20;
  uint32_t qs[4];
  float d, m;
  __device__ __forceinline__ void load(const uint8_t* p) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
    const uint32_t dm = __ldg(w);
    d = __half2float(__ushort_as_half(uint16_t(dm & 0xFFFFu)));
    m = __half2float(__ushort_as_half(uint16_t(dm >> 16)));
#pragma unroll
    for (int i = 0; i < 4; ++i) qs[i] = __ldg(w + 1 + i);
  }
  __device__ __forceinline__ float q(int j) const {
    const uint32_t byte = (qs[(j & 15) >> 2] >> (8 * (j & 3))) & 0xFFu;
    return float(j < 16 ? byte & 0xFu : byte >> 4);
  }
  __device__ __forceinline__ float value(int j) const { return __fadd_rn(__fmul_rn(d, q(j)), m); }
};

template <> struct GgufBlock<kGgufQ8_0> {
  static constexpr int kBytes = 34;
  uint32_t qs[8];
  float d, m;
  __device__ __forceinline__ void load(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    d = __half2float(__ushort_as_half(__ldg(h)));
    m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) qs[i] = uint32_t(__ldg(h + 1 + 2 * i)) | (uint32_t(__ldg(h + 2 + 2 * i)) << 16);
  }
  __device__ __forceinline__ float q(int j) const {
    return float(int8_t((qs[j >> 2] >> (8 * (j & 3))) & 0xFFu));
  }
  __device__ __forceinline__ float value(int j) const { return d * q(j); }
};

template <typename T, int M, int QT>
__global__ void __launch_bounds__(kGgufGemvWarps * 32)
    gguf_gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                     const uint8_t* __restrict__ qweight, const T* __restrict__ bias, int m, int n,
                     int k, int64_t x_stride, int64_t out_stride) {
  using Block = GgufBlock<QT>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kGgufGemvWarps + warp) * kGgufRowsPerWarp;
  if (row0 >= n) return;
  const int blocks = k / 32;
  const int64_t row_bytes = int64_t(blocks) * Block::kBytes;

  float acc[kGgufRowsPerWarp][M];
#pragma unroll
  for (int r = 0; r < kGgufRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  for (int blk = lane; blk < blocks; blk += 32) {
    Block w[kGgufRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kGgufRowsPerWarp; ++r) {
      const int row = min(row0 + r, n - 1);
      w[r].load(qweight + row * row_bytes + int64_t(blk) * Block::kBytes);
    }
    float dot[kGgufRowsPerWarp][M], sx[M];
#pragma unroll
    for (int i = 0; i < M; ++i) {
      sx[i] = 0.f;
#pragma unroll
      for (int r = 0; r < kGgufRowsPerWarp; ++r) dot[r][i] = 0.f;
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // 8 activations at a time
      float xv[M][8];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i < m) {
          unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + i * x_stride + blk * 32 + p * 8)),
                     xv[i]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[i][j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) sx[i] += xv[i][j];
      }
#pragma unroll
      for (int r = 0; r < kGgufRowsPerWarp; ++r) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float q = w[r].q(p * 8 + j);
#pragma unroll
          for (int i = 0; i < M; ++i) dot[r][i] = fmaf(xv[i][j], q, dot[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGgufRowsPerWarp; ++r)
#pragma unroll
      for (int i = 0; i < M; ++i) acc[r][i] += w[r].d * dot[r][i] + w[r].m * sx[i];
  }

#pragma unroll
  for (int r = 0; r < kGgufRowsPerWarp; ++r) {
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

// One thread per block: rows `rows` (null: 0 .. num_rows - 1) of the weight as T [num_rows, k].
template <typename T, int QT>
__global__ void gguf_dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ qweight,
                                       const int64_t* __restrict__ rows, int num_rows, int k) {
  using Block = GgufBlock<QT>;
  const int blocks = k / 32;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(num_rows) * blocks) return;
  const int r = int(idx / blocks), blk = int(idx % blocks);
  const int64_t src_row = rows != nullptr ? rows[r] : r;
  Block b;
  b.load(qweight + src_row * blocks * Block::kBytes + int64_t(blk) * Block::kBytes);
  T* dst = out + int64_t(r) * k + blk * 32;
#pragma unroll
  for (int j = 0; j < 32; ++j) dst[j] = from_float<T>(b.value(j));
}

}  // namespace tinyvllm
