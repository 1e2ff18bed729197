// The skinny linear layer of gemv.cuh on tensor cores, for 1 to 16 rows of x (speculative
// verification steps, small decode batches): out[m, n] = act(x)[m, :k] . weight[n, :k] + bias,
// with gemv.cuh's prologues (RMSNorm, SiLU-and-mul, a split decode's merge) and epilogues (the
// residual add in place, the SwiGLU product), over the same row-major 16-bit weight.
//
// The weight is the A operand of mma.m16n8k16 (16 weight rows, a band), x the B operand (row c of
// x is column c of B: 8 rows per mma, two mmas for up to 16 rows), so every weight value is read
// once and multiplied on tensor cores however many rows there are; at 3-16 rows the scalar GEMV
// would multiply each value once per row.
//
// A tile is 64 values of k of a band (2 KB). Lane (g, t) = (lane / 4, lane % 4) reads, per tile,
// 16 bytes of band rows g and g + 8 at k0 + 8t and at k0 + 32 + 8t (four 16-byte loads; each
// quarter of the warp reads whole 32-byte sectors). The mma's k is summed in any order, so the
// tile's four k-steps take those values as they lie: step j (0..3) uses the lane's pairs 2j' and
// 2j' + 1 of its vector at k0 + 32 (j / 2) + 8t, j' = j % 2, as a0 / a2 (row g) and a1 / a3 (row
// g + 8), and B the same columns of x: b0 / b1 = x[c][k0 + 32 (j / 2) + 8t + 4j' + {0, 1} /
// {2, 3}], i.e. x[c][k0 + 32 (j / 2) + 8t .. + 8] is one 16-byte shared load for two steps.
//
// Work split (as quant_tiles.cuh): all CTAs resident, striding over the bands; in every band, warp
// w takes the tiles [k_tiles * w / 8, k_tiles * (w + 1) / 8) and the warps add their sums through
// shared memory (one barrier per band). Each warp streams its tiles, band after band, through a
// ring of kMmaStages tiles in shared memory filled by cp.async, the first ones requested before
// the PDL wait; a lane reads back only what it copied. With SILU_MUL the band holds gate rows
// 8b .. 8b + 7 and up rows n / 2 + 8b .. + 7 (quant_tiles.cuh's interleaved band), so that a lane
// has gate and up of one output.
#pragma once

#include "common.cuh"
#include "gemv.cuh"
#include "mma.cuh"
#include "quant_tiles.cuh"

namespace tinyvllm {

constexpr int kMmaStages = 4;  // tiles in flight per warp

template <typename T, int M, int P, bool SILU_MUL>
__global__ void __launch_bounds__(kTileWarps * 32) gemv_mma_kernel(
    T* out,                             // [m, out_stride]: n columns (SILU_MUL: n / 2)
    const T* __restrict__ x,            // [m, x_stride]: k columns (2k for kGemvSiluMul)
    const T* __restrict__ weight,       // [n, k], rows contiguous
    const T* __restrict__ bias,         // [n] or null
    const T* residual,                  // [m, residual_stride] or null; may be `out` itself
    const T* __restrict__ norm_weight,  // [k] (kGemvRmsNorm)
    int m, int n, int k, int64_t x_stride, int64_t out_stride, int64_t residual_stride, float eps,
    const DecodePartitions parts) {     // kGemvMergeSplits: k = num_heads * head_dim
  constexpr int NT = (M + 7) / 8;  // mmas per k-step (8 columns each)
  // Launches of more than M rows (gemv's mma 2): CTA row blockIdx.y takes rows M y .. M y + M - 1,
  // computed exactly as a launch of those rows alone would.
  const int64_t row0 = int64_t(blockIdx.y) * M;
  x += row0 * x_stride;
  out += row0 * out_stride;
  if (residual != nullptr) residual += row0 * residual_stride;
  m = min(m - int(row0), M);
  // Dynamic shared memory: act [M][k / 8] (x after the prologue); per warp a ring of kMmaStages
  // tiles, each [4 vectors][32 lanes] of 16 bytes.
  extern __shared__ uint4 act[];
  __shared__ float inv_rms[M];
  __shared__ float partial[2][kTileWarps][NT * 4][32];  // double-buffered: one barrier per band
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int k8 = k / 8, k_tiles = k / kTileK;
  uint4* ring = act + M * k8 + warp * kMmaStages * 4 * 32;
  const int bands = (n + kTileRows - 1) / kTileRows;
  const int my_bands = int(blockIdx.x) < bands ? (bands - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int tile_begin = k_tiles * warp / kTileWarps, tile_end = k_tiles * (warp + 1) / kTileWarps;
  const int per_band = tile_end - tile_begin;
  const int total = per_band * my_bands;  // this warp's tiles, flattened over its bands

  // The lane's two rows of the band being issued (clamped to row 0 past n: zero-filled).
  const T* row_lo = weight;
  const T* row_hi = weight;
  int bytes_lo = 0, bytes_hi = 0;
  auto point_at = [&](int band) {
    const int r0 = tile_row(band, g, n, SILU_MUL), r1 = tile_row(band, g + 8, n, SILU_MUL);
    bytes_lo = r0 < n ? 16 : 0;
    bytes_hi = r1 < n ? 16 : 0;
    row_lo = weight + int64_t(r0 < n ? r0 : 0) * k + 8 * t;
    row_hi = weight + int64_t(r1 < n ? r1 : 0) * k + 8 * t;
  };
  int next_band = blockIdx.x, next_tile = tile_begin;
  if (total > 0) point_at(next_band);
  const uint64_t policy = l2_evict_first_policy();
  // Item i of the warp's stream goes to ring slot i % kMmaStages; one commit group per item,
  // empty past the end, so that after wait_group<kMmaStages - 1> item i has landed.
  auto issue = [&](int i) {
    if (i < total) {
      uint4* slot = ring + (unsigned(i) % kMmaStages) * 128 + lane;
      const int64_t k0 = int64_t(next_tile) * kTileK;
      cp_async16(slot, row_lo + k0, bytes_lo, policy);
      cp_async16(slot + 32, row_lo + k0 + 32, bytes_lo, policy);
      cp_async16(slot + 64, row_hi + k0, bytes_hi, policy);
      cp_async16(slot + 96, row_hi + k0 + 32, bytes_hi, policy);
      if (++next_tile == tile_end) {
        next_tile = tile_begin;
        next_band += gridDim.x;
        if (next_band < bands) point_at(next_band);
      }
    }
    cp_async_commit();
  };
  // The weights do not depend on the previous kernel: request them before waiting on it.
#pragma unroll
  for (int i = 0; i < kMmaStages - 1; ++i) issue(i);
  wait_for_previous_grid();

  gemv_stage_input<T, M, P>(act, k8, x, x_stride, norm_weight, inv_rms, m, eps, parts);
  __syncthreads();
  allow_next_grid();

  // Column g (+ 8) of B is row g (+ 8) of x; lanes past the M staged rows read row 0 (their
  // columns are never written).
  const uint4* xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int c = g + 8 * nt;
    xrow[nt] = act + (c < M ? c : 0) * k8 + t;
  }
  float acc[NT][4] = {};

  for (int bi = 0, i = 0; bi < my_bands; ++bi) {
    for (int tile = tile_begin; tile < tile_end; ++tile, ++i) {
      issue(i + kMmaStages - 1);  // into the slot item i - 1 left (already used)
      cp_async_wait<kMmaStages - 1>();
      const uint4* slot = ring + (unsigned(i) % kMmaStages) * 128 + lane;
      const uint4 lo[2] = {slot[0], slot[32]}, hi[2] = {slot[64], slot[96]};
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // k0 + 32h + 8t .. + 8: two k-steps
        uint4 b[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) b[nt] = xrow[nt][tile * (kTileK / 8) + 4 * h];
        const uint32_t a0[4] = {lo[h].x, hi[h].x, lo[h].y, hi[h].y};
        const uint32_t a1[4] = {lo[h].z, hi[h].z, lo[h].w, hi[h].w};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          mma_16816<T>(acc[nt], a0, b[nt].x, b[nt].y);
          mma_16816<T>(acc[nt], a1, b[nt].z, b[nt].w);
        }
      }
    }
    // The end of band bi: the warps' sums meet in shared memory, one warp writes the outputs.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        partial[bi & 1][warp][nt * 4 + c][lane] = acc[nt][c];
        acc[nt][c] = 0.f;
      }
    __syncthreads();
    if (warp == bi % kTileWarps) {
      const int band = blockIdx.x + bi * gridDim.x;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (8 * nt >= m) break;
        float y[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          y[c] = 0.f;
#pragma unroll
          for (int w = 0; w < kTileWarps; ++w) y[c] += partial[bi & 1][w][nt * 4 + c][lane];
        }
        quant_tile_epilogue<T, SILU_MUL>(
            y, band, g, t, out + 8 * nt * out_stride, bias,
            residual ? residual + 8 * nt * residual_stride : nullptr, m - 8 * nt, n, out_stride,
            residual_stride, SILU_MUL);
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel
}

}  // namespace tinyvllm
