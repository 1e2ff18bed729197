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
// quant_mma_kernel: the same for W4A16 with tensor cores, m <= 8 * NT. The weight is the mma's A
// operand (16 output rows per CTA), x^T its B operand (the batch as the 8 columns of an n-tile),
// so one mma.m16n8k16 serves up to 8 rows of x and the work per weight value is the
// dequantization alone, whatever m is. The CTA's warps split k (64-value tiles) and add their
// partial sums through shared memory. Lane l loads 16 bytes of row l / 2 of a tile (a warp reads
// the tile's 16 rows x 32 bytes at once, two tiles ahead); the A fragments (rows g and g + 8,
// columns 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16-wide slice) come from the loading lanes by
// shuffles and are dequantized to T pairs with the group's scale and zero (the rounding of the
// reference's dequantize), then multiplied in fp32.
//
// quant_dequantize_kernel: the weight as T [n, k], for batches large enough that a tensor-core
// GEMM over a dequantized copy beats the GEMV (prefill).
#pragma once

#include "common.cuh"
#include "mma.cuh"

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
  zero_sums(acc);

  // The weight of the lane's next chunk is requested before this one is computed.
  auto load_chunk = [&](int c0, uint4 (&q)[kQuantRowsPerWarp]) {
#pragma unroll
    for (int r = 0; r < kQuantRowsPerWarp; ++r) {
      const int row = min(row0 + r, n - 1);  // a missing last row re-reads the one before
      q[r] = c0 < k ? __ldg(reinterpret_cast<const uint4*>(qweight + int64_t(row) * words_per_row +
                                                           c0 / kPerWord))
                    : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 ahead[kQuantRowsPerWarp];
  load_chunk(lane * kChunk, ahead);
  for (int c0 = lane * kChunk; c0 < k; c0 += 32 * kChunk) {
    uint4 q[kQuantRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kQuantRowsPerWarp; ++r) q[r] = ahead[r];
    load_chunk(c0 + 32 * kChunk, ahead);
    float scale[kQuantRowsPerWarp], zero[kQuantRowsPerWarp];
    const int g = c0 / group_size;
#pragma unroll
    for (int r = 0; r < kQuantRowsPerWarp; ++r) {
      const int row = min(row0 + r, n - 1);
      scale[r] = to_float<T>(scales[int64_t(row) * groups + g]);
      zero[r] = to_float<T>(zeros[int64_t(row) * groups + g]);
    }
    float dot[kQuantRowsPerWarp][M], sx[M];
    zero_sums(dot);
    zero_sums(sx);
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

  write_warp_rows<T, kQuantRowsPerWarp, M>(acc, lane, row0, m, n, bias, out, out_stride);
}

constexpr int kQuantMmaWarps = 4;
constexpr int kQuantMmaTileK = 64;

template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t word, int t, float scale, float zero) {
  const uint32_t pair = word >> (8 * t);
  const float lo = __uint_as_float(0x4B000000u | (pair & 0xFu)) - 8388608.0f;
  const float hi = __uint_as_float(0x4B000000u | ((pair >> 4) & 0xFu)) - 8388608.0f;
  return pack2<T>((lo - zero) * scale, (hi - zero) * scale);
}

template <typename T, int NT>
__global__ void __launch_bounds__(kQuantMmaWarps * 32)
    quant_mma_kernel(T* __restrict__ out, const T* __restrict__ x,
                     const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
                     const T* __restrict__ zeros, const T* __restrict__ bias, int m, int n, int k,
                     int64_t x_stride, int64_t out_stride, int group_size) {
  __shared__ float partial[kQuantMmaWarps][NT][4][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int words_per_row = k / 8;
  const int groups = k / group_size;
  const int tiles = k / kQuantMmaTileK;
  const int tile_begin = tiles * warp / kQuantMmaWarps;
  const int tile_end = tiles * (warp + 1) / kQuantMmaWarps;
  // Rows past n re-read row n - 1; their results are never written.
  const uint32_t* qrow =
      qweight + int64_t(min(row0 + (lane >> 1), n - 1)) * words_per_row + (lane & 1) * 4;
  const int row_a = min(row0 + g, n - 1), row_b = min(row0 + g + 8, n - 1);

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

  auto load_tile = [&](int tile) {
    return tile < tile_end ? __ldg(reinterpret_cast<const uint4*>(qrow + tile * 8))
                           : make_uint4(0, 0, 0, 0);
  };
  uint4 ahead0 = load_tile(tile_begin), ahead1 = load_tile(tile_begin + 1);
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const uint4 cur = ahead0;
    ahead0 = ahead1;
    ahead1 = load_tile(tile + 2);
    const int k0 = tile * kQuantMmaTileK;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // 32 values: one group (group_size % 32 == 0)
      const int gi = (k0 + 32 * half) / group_size;
      const float sa = to_float<T>(scales[int64_t(row_a) * groups + gi]);
      const float za = to_float<T>(zeros[int64_t(row_a) * groups + gi]);
      const float sb = to_float<T>(scales[int64_t(row_b) * groups + gi]);
      const float zb = to_float<T>(zeros[int64_t(row_b) * groups + gi]);
#pragma unroll
      for (int sub = 0; sub < 2; ++sub) {  // 16-wide slice s = 2 * half + sub: words 2s, 2s + 1
        const uint32_t lo = sub ? cur.z : cur.x, hi = sub ? cur.w : cur.y;
        const int src_a = 2 * g + half, src_b = 2 * (g + 8) + half;
        uint32_t a[4];
        a[0] = dequant_pair<T>(__shfl_sync(0xffffffffu, lo, src_a), t, sa, za);
        a[1] = dequant_pair<T>(__shfl_sync(0xffffffffu, lo, src_b), t, sb, zb);
        a[2] = dequant_pair<T>(__shfl_sync(0xffffffffu, hi, src_a), t, sa, za);
        a[3] = dequant_pair<T>(__shfl_sync(0xffffffffu, hi, src_b), t, sb, zb);
        const int kk = k0 + 16 * (2 * half + sub) + 2 * t;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int b = 8 * j + g;  // this lane's column of the n-tile: a row of x
          uint32_t b0 = 0, b1 = 0;
          if (b < m) {
            const T* xr = x + b * x_stride + kk;
            b0 = __ldg(reinterpret_cast<const uint32_t*>(xr));
            b1 = __ldg(reinterpret_cast<const uint32_t*>(xr + 8));
          }
          mma_16816<T>(acc[j], a, b0, b1);
        }
      }
    }
  }

#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) partial[warp][j][c][lane] = acc[j][c];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kQuantMmaWarps; ++w) total += partial[w][j][c][lane];
      const int row = row0 + g + (c >= 2 ? 8 : 0);  // c0, c1: row g; c2, c3: row g + 8
      const int b = 8 * j + 2 * t + (c & 1);        // columns 2t, 2t + 1
      if (row < n && b < m) {
        const float bv = bias != nullptr ? to_float<T>(bias[row]) : 0.f;
        out[b * out_stride + row] = from_float<T>(total + bv);
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
