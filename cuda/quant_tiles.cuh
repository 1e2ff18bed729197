// W4A16 decode GEMV on tensor cores over the tile layout of service/tinyvllm/ops/quant_tiles.py,
// made once at load from the integer-group layout (quant_gemv.cuh) when the zero points are
// integers and group_size is k or a power of two of at least 64:
//
//   tiles        uint4 [bands][k / 64][32 lanes]  band b: 16 weight rows; tile: 64 values of k
//   tile_scales  uint2 [bands][groups][8]         per group, lane row g's word (.x) and row
//                                                 g + 8's (.y): scale | (magic + zero) << 16,
//                                                 both as T bits
//
// One 16-byte word per lane per tile holds exactly that lane's A fragments of the tile's four
// mma.m16n8k16 (one 32-bit word each): lane (g, t) = (lane / 4, lane % 4), word j (k0 + 16j ..
// + 16) has nibbles 0, 4, 2, 6 = row g at k0 + 16j + 4t + 0, 1, 2, 3 and nibbles 1, 5, 3, 7 the
// same columns of row g + 8. `(word >> 4i) & 0x000F000F | magic` (i = 0..3, one shift and one
// lop3) is then fragment register a_i as the pair (magic + q), magic = 128 (bf16) or 1024 (fp16)
// so that the nibble lands in the mantissa exactly. The mma multiplies by x (B: column c = row c
// of x, so 8 rows of x per mma; b0 / b1 = x at k0 + 16j + 4t + {0, 1} / {2, 3}, one 8-byte
// shared-memory load). Up to 16 rows of x take two n-tiles: the same A fragments go to two mmas,
// so the weight is read once for all the rows. Sums are in fp32; the zero point is applied once
// per group:
// sum x (q - zero) = sum x (magic + q) - (magic + zero) sum x, with sum x of the same tiles
// taken from per-tile sums of x made at staging. fp16's magic (1024) costs too much precision
// over long groups, so there the pair (magic, magic) is subtracted first (exact) and the mma sums
// x q. The dequantized weight is never rounded: the result is sum_g scale_g sum x (q - zero) in
// fp32, which the tests hold to the reference's dequantize-then-matmul.
//
// Work split: CTAs are all resident and stride over the bands (CTA c: bands c, c + grid, ...); in
// every band, warp w takes the tiles [k_tiles * w / 8, k_tiles * (w + 1) / 8), and the warps add
// their sums through shared memory (one barrier per band, double-buffered). Where one CTA of 8
// warps fills the SM's shared memory (16 rows of x at k = 4096), a CTA runs two such groups of 8
// warps over alternate bands, sharing one staged copy of x (group barriers: named barriers, two
// a band over one buffer). Each warp streams its
// tiles, band after band, in chunks of kTileStages tiles through a ring of R chunks in shared
// memory: one cp.async commit group per chunk (a lane's 16 bytes of each tile, and one scale word
// of the chunk per lane), copied R chunks ahead of its multiply, the first R before the PDL wait
// (R = 3 at one row of x where shared memory allows, else 2). A chunk's slots, sources and x are
// offsets from one base each, so the ring's bookkeeping is per chunk, not per tile. Where groups of
// 128 sit at fixed positions of every chunk (each warp's slice a multiple of the chunk: every
// Llama-3-8B shape), the kernel's G instantiation scales each group with no per-tile check, into
// two accumulators in turn so that a group's scaling overlaps the next group's mmas, with x's sums
// taken per group. Each warp stages (with the prologue: plain, RMSNorm, SwiGLU) and sums only the
// slice of x it multiplies, so after the PDL wait no barrier holds the warps back but RMSNorm's
// one for the row scale. The projections of a decoder layer fold their neighbours in as gemv.cuh
// does: the residual add (out = residual + round(y), in place) and, over an interleaved layout
// (band b: gate rows 8b .. 8b + 7 as rows 0-7, up rows n / 2 + 8b .. as rows 8-15), gate_up
// writing silu(gate) * up (the lane holds gate and up of one output in c0 / c2).
#pragma once

#include "common.cuh"
#include "gemv.cuh"
#include "mma.cuh"

namespace tinyvllm {

constexpr int kTileK = 64;       // k values per tile (four mma k-steps)
constexpr int kTileRows = 16;    // weight rows per band (the mma's M)
constexpr int kTileWarps = kGemvWarps;  // each takes one slice of k in every band
constexpr int kTileStages = 4;   // tiles per chunk: a warp's ring holds R (2 or 3) chunks

// A nibble q ORed into the mantissa of kValue gives kValue + q exactly: (128 | q) as bf16,
// (1024 | q) as fp16.
template <typename T> struct TileMagic;
template <> struct TileMagic<__nv_bfloat16> {
  static constexpr uint32_t kPair = 0x43004300u;
  static constexpr float kValue = 128.f;
  static constexpr bool kSubtract = false;
};
template <> struct TileMagic<__half> {
  static constexpr uint32_t kPair = 0x64006400u;
  static constexpr float kValue = 1024.f;
  static constexpr bool kSubtract = true;
};

// 8-byte global -> shared copy (cp.async's .cg form takes 16 bytes only).
__device__ __forceinline__ void cp_async8(void* dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, 8, %2;\n" ::"r"(
                   smem_addr(dst)), "l"(src), "l"(policy));
}

// (a & 0x000F000F) | magic in one lop3.
__device__ __forceinline__ uint32_t nibble_pair(uint32_t a, uint32_t magic) {
  return and_or(a, 0x000F000Fu, magic);
}

// Logical weight row of row r (0..15) of band b.
__device__ __forceinline__ int tile_row(int band, int r, int n, bool interleaved) {
  if (!interleaved) return band * kTileRows + r;
  return r < 8 ? band * 8 + r : n / 2 + band * 8 + r - 8;
}

// A group's scale and magic + zero of one row, from its tile_scales word (two T values).
template <typename T>
__device__ __forceinline__ void tile_scale(uint32_t word, float& scale, float& zero) {
  const uint16_t lo = uint16_t(word & 0xFFFFu), hi = uint16_t(word >> 16);
  scale = to_float<T>(*reinterpret_cast<const T*>(&lo));
  zero = to_float<T>(*reinterpret_cast<const T*>(&hi));
}

// The outputs of one band from the lane's four sums (rows g, g + 8 x columns 2t, 2t + 1):
// bias, then the residual add (in place) or, interleaved with SILU_MUL, silu(gate) * up of
// output 8 * band + g (gate in rows 0-7, up in rows 8-15), rounded as the unfused ops round.
template <typename T, bool SILU_MUL>
__device__ __forceinline__ void quant_tile_epilogue(const float (&y)[4], int band, int g, int t,
                                                    T* out, const T* bias, const T* residual,
                                                    int m, int n, int64_t out_stride,
                                                    int64_t residual_stride, bool interleaved) {
  if constexpr (SILU_MUL) {
    const int o = band * 8 + g;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 2 * t + c;
      if (col < m) {
        const float gate = round_to<T>(y[c] + (bias ? to_float(bias[o]) : 0.f));
        const float up = round_to<T>(y[c + 2] + (bias ? to_float(bias[n / 2 + o]) : 0.f));
        out[col * out_stride + o] = from_float<T>(round_to<T>(gate / (1.f + __expf(-gate))) * up);
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = g + (c >= 2 ? 8 : 0), col = 2 * t + (c & 1);
      const int row = tile_row(band, r, n, interleaved);
      if (col < m && row < n) {
        float v = y[c] + (bias ? to_float(bias[row]) : 0.f);
        if (residual) v = to_float(residual[col * residual_stride + row]) + round_to<T>(v);
        out[col * out_stride + row] = from_float<T>(v);
      }
    }
  }
}

// Columns of x's per-tile sums for M rows: 8 per n-tile.
template <int M> constexpr int kTileSumCols = M > 8 ? 16 : 8;
// 16-byte vectors of padding after each staged row of x (M > 1): lane (g, t) reads B from row g
// at 8t bytes past the tile's k0, and rows 32 bytes off their 128-byte alignment put the 16 lanes
// of each half-warp's 8-byte loads on distinct banks (unpadded, rows g, g + 1, .. share them).
template <int M> constexpr int kTileRowPad = M > 1 ? 2 : 0;

// Rows of the norm weight a lane holds in registers from before the PDL wait (vectors v0 + lane,
// v0 + lane + 32, ... of its warp's slice); further ones are read when they are used.
constexpr int kTileHeldNormVectors = 4;

// The barrier of band group bg's kTileWarps warps: __syncthreads for one group, else named
// barrier 1 + bg.
template <int BG>
__device__ __forceinline__ void tile_group_sync(int bg) {
  if constexpr (BG == 1) {
    __syncthreads();
  } else if (bg == 0) {
    named_barrier_sync<1>(kTileWarps * 32);
  } else {
    named_barrier_sync<2>(kTileWarps * 32);
  }
}

// The warp's slice of x (vectors [v0, v1) of its group's rows of the M staged rows; rows at or
// past m are zero) into act with prologue P, by the warp alone: every warp multiplies only its
// own slice of k, so staging needs no barrier but RMSNorm's, whose row scale sums the warps'
// slices (ss: [kTileWarps][M] shared floats). With BG band groups, warp kw of group bg stages
// slice kw of rows [bg M / BG, (bg + 1) M / BG), and RMSNorm's barrier is the group's own (named
// barrier 1 + bg for BG = 2, else __syncthreads). A lane takes vectors v0 + lane, v0 + lane + 32,
// ... of every row, so a row's sum of squares is taken in the same order whatever its position
// among the rows. nw: the lane's first kTileHeldNormVectors vectors of the norm weight
// (kGemvRmsNorm).
template <typename T, int M, int P, int BG = 1>
__device__ __forceinline__ void tile_stage_slice(uint4* act, int row_stride, int v0, int v1,
                                                 const T* x, int64_t x_stride,
                                                 const T* norm_weight,
                                                 const uint4 (&nw)[kTileHeldNormVectors], int m,
                                                 int k, float eps, float (*ss)[M]) {
  static_assert(M % BG == 0, "the rows split evenly among the band groups");
  constexpr int MG = M / BG;  // the group's rows
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int kw = warp % kTileWarps, bg = warp / kTileWarps, r0 = bg * MG;
  // Rows per pass and vectors per lane per pass: at most 4 loads in flight before their use.
  constexpr int kRows = MG < 4 ? MG : 4;
  constexpr int kB = 4 / kRows;
  float sum_sq[MG] = {};
  for (int base = v0 + lane; base < v1; base += 32 * kB) {
#pragma unroll
    for (int i0 = 0; i0 < MG; i0 += kRows) {
      uint4 a[kB][kRows], b[kB][kRows];
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        const int v = base + 32 * j;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          a[j][r] = b[j][r] = make_uint4(0, 0, 0, 0);
          if (v < v1 && r0 + i0 + r < m) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (r0 + i0 + r) * x_stride) + v;
            a[j][r] = *xr;
            if constexpr (P == kGemvSiluMul) b[j][r] = xr[k / 8];  // up, k columns on
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        const int v = base + 32 * j;
        if (v >= v1) break;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          uint4& at = act[(r0 + i0 + r) * row_stride + v];
          if constexpr (P == kGemvSiluMul) {
            at = silu_mul8<T>(a[j][r], b[j][r]);
          } else {
            at = a[j][r];
          }
          if constexpr (P == kGemvRmsNorm) {
            float f[8], s = 0.f;
            unpack8<T>(a[j][r], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s);
            sum_sq[i0 + r] += s;
          }
        }
      }
    }
  }
  if constexpr (P == kGemvRmsNorm) {
#pragma unroll
    for (int i = 0; i < MG; ++i) {
      const float s = warp_sum(sum_sq[i]);
      if (lane == 0) ss[kw][r0 + i] = s;
    }
    tile_group_sync<BG>(bg);  // every warp's slice of the group's rows summed (none: 0)
    float inv_rms[MG];
#pragma unroll
    for (int i = 0; i < MG; ++i) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kTileWarps; ++w) s += ss[w][r0 + i];
      inv_rms[i] = r0 + i < m ? rsqrtf(s / k + eps) : 0.f;
    }
    // The lane's own vectors, in place: the held ones, then any further ones.
    auto scale = [&](int v, const uint4& w) {
#pragma unroll
      for (int i = 0; i < MG; ++i) {
        uint4& at = act[(r0 + i) * row_stride + v];
        at = rms_scaled8<T>(at, w, inv_rms[i]);
      }
    };
#pragma unroll
    for (int j = 0; j < kTileHeldNormVectors; ++j) {
      if (v0 + lane + 32 * j < v1) scale(v0 + lane + 32 * j, nw[j]);
    }
    for (int v = v0 + lane + 32 * kTileHeldNormVectors; v < v1; v += 32) {
      scale(v, reinterpret_cast<const uint4*>(norm_weight)[v]);
    }
  }
}

// sx[i][c] = the sum of act row c over span i (`span` tiles: one, or a group where groups sit at
// fixed chunk positions) in fp32, for the rows c of [c0, c0 + rows) and the spans of the warp's
// slice (tiles [tile0, tile1), a whole number of spans): 8 lanes per (span, row), then a
// shuffle. Other columns are left unwritten: they only feed the accumulators of unused columns.
template <typename T, int M>
__device__ __forceinline__ void tile_slice_sums(float* sx, const uint4* act, int row_stride,
                                                int tile0, int tile1, int span, int c0,
                                                int rows) {
  constexpr int kVectors = kTileK / 8;
  const int lane = threadIdx.x % 32, sub = lane % 8;
  const int pairs = (tile1 - tile0) / span * rows;
  for (int p0 = 0; p0 < pairs; p0 += 4) {  // the same trip count in every lane (shuffles)
    const int p = p0 + lane / 8;
    const int i = p / rows, c = c0 + p % rows;
    float s = 0.f;
    if (p < pairs) {
      const uint4* v = act + c * row_stride + (tile0 + i * span) * kVectors;
      for (int e = sub; e < span * kVectors; e += 8) {
        float f[8];
        unpack8<T>(v[e], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) s += f[q];
      }
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (p < pairs && sub == 0) sx[(tile0 / span + i) * kTileSumCols<M> + c] = s;
  }
}

// G > 0: every group is G tiles and sits at fixed positions of every chunk (D % G == 0, each
// warp's slice a multiple of D tiles starting at a group boundary; the launcher checks): the
// chunk's groups are scaled with no per-tile check, alternating two accumulators so that one
// group's scaling waits on its mma chain while the next group's mmas issue, and x's sums are
// taken per group. G == 0: any group (the group of each tile is checked).
template <typename T, int M, int P, bool SILU_MUL, int G = 0, int D = kTileStages, int R = 2,
          int BG = 1>
__global__ void __launch_bounds__(kTileWarps * 32 * BG) quant_tile_gemv_kernel(
    T* out,                               // [m, out_stride]: n columns (SILU_MUL: n / 2)
    const T* __restrict__ x,              // [m, x_stride]: k columns (2k for kGemvSiluMul)
    const uint4* __restrict__ tiles,      // [bands][k / 64][32]
    const uint2* __restrict__ tile_scales,  // [bands][groups][8]: rows g, g + 8
    const T* __restrict__ bias,           // [n] or null
    const T* residual,                    // [m, residual_stride] or null; may be `out` itself
    const T* __restrict__ norm_weight,    // [k] (kGemvRmsNorm)
    int m, int n, int k, int64_t x_stride, int64_t out_stride, int64_t residual_stride, float eps,
    int groups, int group_shift,          // group of tile i: (64 i) >> group_shift
    bool interleaved,
    float* split_sums,                    // gridDim.y > 1: [bands][gridDim.y][4 * NT][32]
    unsigned* split_counts) {             // gridDim.y > 1: [bands], zero between launches
  // Split k (gridDim.y = S > 1, the launcher's choice where M rows of the whole k do not fit in
  // shared memory): CTA (c, s) multiplies tiles [s k_tiles / S, (s + 1) k_tiles / S) of bands c,
  // c + gridDim.x, ...; below, k_tiles, tile_begin, tile_end, act and sx are of that split.
  // Dynamic shared memory: act [M][split_k / 8 + kTileRowPad] (x after the prologue); per warp a
  // ring of R chunks of D tiles (32 lanes x 16 bytes) and of their scale words (8 rows g x 8
  // bytes); sx [split_k / 64 / max(G, 1)][kTileSumCols] (x's sum over each tile, or each group
  // for G > 0).
  constexpr int NT = M > 8 ? 2 : 1;  // n-tiles: 8 rows of x each
  static_assert(M <= 16, "two n-tiles of 8 rows at most");
  extern __shared__ uint4 act[];
  __shared__ float row_sum_sq[kTileWarps][M];  // kGemvRmsNorm: the warps' sums of squares
  // BG band groups of kTileWarps warps (BG = 2: 2-16 rows unsplit, the launcher's choice):
  // group bg takes the CTA's bands bg, bg + BG, ..., all sharing one copy of x, each group
  // staging its half of the rows. Warp w of a group takes the same slice of k in every band
  // (kw), and the group's warps add their sums in partial[bg][band's buffer]: two buffers a
  // group for BG = 1 (one barrier a band), one for BG = 2 (two barriers a band; the same static
  // memory). A group's barrier: tile_group_sync.
  static_assert(BG == 1 || BG == 2, "one or two band groups");
  constexpr int kBuffers = 2 / BG;
  __shared__ float partial[BG][kBuffers][kTileWarps][4 * NT][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bg = warp / kTileWarps, kw = warp % kTileWarps;
  const int g = lane >> 2, t = lane & 3;
  const int splits = gridDim.y, all_tiles = k / kTileK;
  const int k_tiles = all_tiles / splits;       // the split's (the launcher checks it divides)
  const int tile_offset = blockIdx.y * k_tiles;  // its first tile in the weight's k
  const int k8 = k_tiles * (kTileK / 8);
  constexpr int kPad = kTileRowPad<M>;
  const int act_vectors = M * (k8 + kPad);
  uint4* ring = act + act_vectors + warp * R * D * 32;
  uint2* ring_sc = reinterpret_cast<uint2*>(act + act_vectors + BG * kTileWarps * R * D * 32) +
                   warp * R * D * 8;
  float* sx = reinterpret_cast<float*>(act + act_vectors + BG * kTileWarps * R * D * (32 + 4));
  const int bands = (n + kTileRows - 1) / kTileRows;
  // CTA c owns bands c, c + grid, ...; its band group bg every BG-th of them (my_bands: the
  // group's; the group's band i is the CTA's BG i + bg); in each, warp kw the tiles
  // [tile_begin, tile_end).
  const int cta_bands = int(blockIdx.x) < bands ? (bands - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int my_bands = cta_bands > bg ? (cta_bands - 1 - bg) / BG + 1 : 0;
  auto band_of = [&](int bi) { return int(blockIdx.x) + (bi * BG + bg) * int(gridDim.x); };
  const int tile_begin = k_tiles * kw / kTileWarps, tile_end = k_tiles * (kw + 1) / kTileWarps;
  const int per_band = tile_end - tile_begin;
  // The warp's stream: per band, per_band tiles padded to a multiple of D positions, in chunks
  // of D positions (padding positions copy and multiply nothing). Chunk c goes to ring slot
  // c % R by cp.async (one commit group per chunk), R chunks ahead of its multiply; band ends
  // fall between chunks, and a chunk's slots and sources are offsets from one base.
  const int padded = (per_band + D - 1) / D * D;
  const bool full = per_band > 0 && padded == per_band;  // (k < 512: some warps have no tiles)
  const int64_t w_step = int64_t(BG) * gridDim.x * all_tiles * 32;  // one band of the group's
  const int64_t sc_step = int64_t(BG) * gridDim.x * groups * 8;       // to the next
  // Group of tile i: i >> tile_group_shift (one group: a shift past any tile index).
  const int tile_group_shift = group_shift - 6;
  // The copy cursor: band copy_band of this CTA's and position copy_j0 in it, with that band's
  // words (w: this lane's of the slice's first tile; sc: the band's scale words).
  int copy_band = 0, copy_j0 = 0;
  const uint4* copy_w =
      tiles + (int64_t(band_of(0)) * all_tiles + tile_offset + tile_begin) * 32 + lane;
  const uint2* copy_sc = tile_scales + int64_t(band_of(0)) * groups * 8;
  static_assert(D * 8 <= 32, "a lane copies one scale word of a chunk");
  // The scale word this lane copies: row sc_g's of the chunk's position sc_d.
  const int sc_d = lane / 8, sc_g = lane % 8;
  const uint64_t policy = l2_evict_first_policy();  // the weights' and scales' copies
  // The next chunk into ring slot `slot` (FULL: all its positions are tiles of the band).
  auto copy_chunk = [&](int slot, auto full_chunk) {
    constexpr bool FULL = decltype(full_chunk)::value;
    if (copy_band < my_bands) {
      uint4* slots = ring + slot * D * 32 + lane;
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if (FULL || copy_j0 + d < per_band) {
          cp_async16(slots + d * 32, copy_w + (copy_j0 + d) * 32, 16, policy);
        }
      }
      if (sc_d < D && (FULL || copy_j0 + sc_d < per_band)) {
        cp_async8(ring_sc + (slot * D + sc_d) * 8 + sc_g,
                  copy_sc + ((tile_offset + tile_begin + copy_j0 + sc_d) >> tile_group_shift) * 8 +
                      sc_g,
                  policy);
      }
      copy_j0 += D;
      if (copy_j0 == padded) {
        copy_j0 = 0;
        ++copy_band;
        copy_w += w_step;
        copy_sc += sc_step;
      }
    }
    cp_async_commit();
  };
  // The weights (and the norm's) do not depend on the previous kernel: request them before
  // waiting on it.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (full) {
      copy_chunk(r, std::true_type{});
    } else {
      copy_chunk(r, std::false_type{});
    }
  }
  const int v0 = tile_begin * (kTileK / 8), v1 = tile_end * (kTileK / 8);
  uint4 norm_held[kTileHeldNormVectors];
#pragma unroll
  for (int j = 0; j < kTileHeldNormVectors; ++j) {
    const int v = v0 + lane + 32 * j;
    norm_held[j] = P == kGemvRmsNorm && v < v1 ? reinterpret_cast<const uint4*>(norm_weight)[v]
                                               : make_uint4(0, 0, 0, 0);
  }
  wait_for_previous_grid();

  // Each warp stages, and sums, the slice of x it multiplies, of its group's rows: no barrier
  // but RMSNorm's, and for BG = 2 one that lets each group read the other's rows.
  // (x from the split's first column; the RMSNorm prologue runs unsplit)
  tile_stage_slice<T, M, P, BG>(act, k8 + kPad, v0, v1, x + tile_offset * kTileK, x_stride,
                                norm_weight, norm_held, m, k, eps, row_sum_sq);
  __syncwarp();
  allow_next_grid();
  tile_slice_sums<T, M>(sx, act, k8 + kPad, tile_begin, tile_end, G > 0 ? G : 1, bg * (M / BG),
                        M / BG);
  if constexpr (BG > 1) {
    __syncthreads();
  } else {
    __syncwarp();
  }

  constexpr uint32_t kMagic = TileMagic<T>::kPair;
  // bf16: the mma sums x (magic + q) over the group, and sum x (q - zero) = that - (magic +
  // zero) sum x, within fp32 rounding of a sum 128 + q times larger than each x q. fp16's magic
  // is 1024: over long groups (per channel) that loses too much, so the pair (magic, magic) is
  // subtracted first (exact) and the mma sums x q.
  constexpr bool kSubtractMagic = TileMagic<T>::kSubtract;
  constexpr float kMagicValue = TileMagic<T>::kValue;
  // Column g of n-tile h's B is row 8h + g of x; lanes past the M staged rows read row 0
  // (unused columns).
  constexpr int kSumCols = kTileSumCols<M>;
  const T* xrow[NT];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    const int row = 8 * h + g;
    xrow[h] = reinterpret_cast<const T*>(act) + (row < M ? row : 0) * (8 * (k8 + kPad)) + 4 * t;
  }
  float acc[NT][4] = {};  // this group's, per n-tile: rows g, g + 8 x columns 2t, 2t + 1
  float sum[NT][4] = {};  // this band's, scaled
  float scale_lo = 0.f, scale_hi = 0.f, zero_lo = 0.f, zero_hi = 0.f;  // zero: magic + zero
  // sum x over the tiles this warp has summed into acc (columns 2t, 2t + 1 of each n-tile): a
  // group may straddle two warps' slices of k, each of which corrects for its own part.
  float2 sx_acc[NT] = {};
  int group = -1;
  // A group's scale and magic + zero (fp16: zero alone, the mma's inputs already less the magic)
  // of rows g (lo) and g + 8 (hi), from its scale words.
  auto group_scales = [&](uint2 words, float& s_lo, float& z_lo, float& s_hi, float& z_hi) {
    tile_scale<T>(words.x, s_lo, z_lo);
    tile_scale<T>(words.y, s_hi, z_hi);
    if constexpr (kSubtractMagic) z_lo -= kMagicValue, z_hi -= kMagicValue;
  };
  // A group's sums a into the band's, a zeroed: sum += scale (a - zero sx) for each n-tile's
  // columns 2t, 2t + 1 of rows g and g + 8; gx: x's sums over the group, per n-tile.
  auto add_group = [&](float (&a)[NT][4], const float2 (&gx)[NT], float s_lo, float z_lo,
                       float s_hi, float z_hi) {
#pragma unroll
    for (int h = 0; h < NT; ++h) {
      sum[h][0] = fmaf(s_lo, fmaf(-z_lo, gx[h].x, a[h][0]), sum[h][0]);
      sum[h][1] = fmaf(s_lo, fmaf(-z_lo, gx[h].y, a[h][1]), sum[h][1]);
      sum[h][2] = fmaf(s_hi, fmaf(-z_hi, gx[h].x, a[h][2]), sum[h][2]);
      sum[h][3] = fmaf(s_hi, fmaf(-z_hi, gx[h].y, a[h][3]), sum[h][3]);
      a[h][0] = a[h][1] = a[h][2] = a[h][3] = 0.f;
    }
  };
  auto flush = [&]() {
    add_group(acc, sx_acc, scale_lo, zero_lo, scale_hi, zero_hi);
#pragma unroll
    for (int h = 0; h < NT; ++h) sx_acc[h] = make_float2(0.f, 0.f);
  };
  // The four mmas of one tile from the lane's weight word into a; xt[h]: n-tile h's x at the tile.
  auto mma_tile = [&](const uint4& w, const T* const (&xt)[NT], float (&a)[NT][4]) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t q = words[j];
      uint32_t f[4] = {nibble_pair(q, kMagic), nibble_pair(q >> 4, kMagic),
                       nibble_pair(q >> 8, kMagic), nibble_pair(q >> 12, kMagic)};
      if constexpr (kSubtractMagic) {
#pragma unroll
        for (int r = 0; r < 4; ++r) f[r] = sub_pair<T>(f[r], kMagic);
      }
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        const uint2 b = *reinterpret_cast<const uint2*>(xt[h] + 16 * j);
        mma_16816<T>(a[h], f, b.x, b.y);
      }
    }
  };
  // Tile `tile` (G == 0); at a new group, the last one's sums are scaled first and the group's
  // scale words (sc) read. sxt: the sums of x at the tile.
  auto multiply = [&](const uint4& w, const uint2* sc, int tile, const T* const (&xt)[NT],
                      const float* sxt) {
    const int gi = tile >> tile_group_shift;
    if (gi != group) {
      flush();
      group = gi;
      group_scales(*sc, scale_lo, zero_lo, scale_hi, zero_hi);
    }
#pragma unroll
    for (int h = 0; h < NT; ++h) {
      const float2 tile_sx = *reinterpret_cast<const float2*>(sxt + 8 * h);
      sx_acc[h].x += tile_sx.x;
      sx_acc[h].y += tile_sx.y;
    }
    mma_tile(w, xt, acc);
  };
  // G > 0: a group's sums a, scaled by its scale words into sum (and a zeroed); sxg: x's sums
  // over the group. Scale words of 0 (no group pending) add nothing.
  float accs[2][NT][4] = {};
  uint2 pending_words = make_uint2(0, 0);
  // (a span of this warp's slice: the scaling of "no group" reads it, times 0, before any group)
  const float* pending_sx = sx + (tile_begin / (G > 0 ? G : 1)) * kSumCols;
  auto scale_group = [&](float (&a)[NT][4], uint2 words, const float* sxg) {
    float s_lo, z_lo, s_hi, z_hi;
    group_scales(words, s_lo, z_lo, s_hi, z_hi);
    float2 gx[NT];
#pragma unroll
    for (int h = 0; h < NT; ++h) gx[h] = *reinterpret_cast<const float2*>(sxg + 8 * h);
    add_group(a, gx, s_lo, z_lo, s_hi, z_hi);
  };
  // G > 0, chunk c (positions j0 .. j0 + D - 1, all tiles of the band): D / G groups, group q
  // into accs[q & 1]; the group before it (the last of the previous chunk for q = 0, pending in
  // accs[1]) is scaled after q's mmas are issued. D / G == 1 scales each group at once.
  auto chunk_groups = [&](int c, int j0) {
    constexpr int kSpan = G > 0 ? G : 1;
    constexpr int kGroups = D / kSpan;
    static_assert(D % kSpan == 0 && (kGroups == 1 || kGroups % 2 == 0),
                  "a chunk holds one group or an even number of them");
    const int slot = c % R;
    cp_async_wait<R - 1>();
    __syncwarp();
    const int tile0 = tile_begin + j0;
    const uint4* slots = ring + slot * D * 32 + lane;
    const uint2* slots_sc = ring_sc + slot * D * 8 + g;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      float (&a)[NT][4] = accs[kGroups == 1 ? 0 : (q & 1)];
#pragma unroll
      for (int d = q * kSpan; d < (q + 1) * kSpan; ++d) {
        const T* xd[NT];
#pragma unroll
        for (int h = 0; h < NT; ++h) xd[h] = xrow[h] + (tile0 + d) * kTileK;
        mma_tile(slots[d * 32], xd, a);
      }
      const uint2 words = slots_sc[q * kSpan * 8];
      const float* sxg = sx + ((tile0 + q * kSpan) / kSpan) * kSumCols + 2 * t;
      if constexpr (kGroups == 1) {
        scale_group(a, words, sxg);
      } else {
        scale_group(accs[(q & 1) ^ 1], pending_words, pending_sx);
        pending_words = words;
        pending_sx = sxg;
      }
    }
    __syncwarp();
    copy_chunk(slot, std::true_type{});
  };
  // Chunk c (positions j0 .. j0 + D - 1 of its band; FULL: all are tiles of the band) from its
  // ring slot, which then takes the copies of chunk c + R.
  auto chunk = [&](auto full_chunk, int c, int j0) {
    constexpr bool FULL = decltype(full_chunk)::value;
    const int slot = c % R;
    cp_async_wait<R - 1>();  // chunk c has landed (c + 1 .. c + R - 1 may be in flight)
    __syncwarp();            // the scale words came through other lanes' copies
    const int tile0 = tile_begin + j0;
    const T* xt[NT];
#pragma unroll
    for (int h = 0; h < NT; ++h) xt[h] = xrow[h] + tile0 * kTileK;
    const float* sxt = sx + tile0 * kSumCols + 2 * t;
    const uint4* slots = ring + slot * D * 32 + lane;
    const uint2* slots_sc = ring_sc + slot * D * 8 + g;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (FULL || j0 + d < per_band) {
        const T* xd[NT];
#pragma unroll
        for (int h = 0; h < NT; ++h) xd[h] = xt[h] + d * kTileK;
        multiply(slots[d * 32], slots_sc + d * 8, tile_offset + tile0 + d, xd,
                 sxt + d * kSumCols);
      }
    }
    __syncwarp();  // every lane has read the slot before any refills it
    copy_chunk(slot, full_chunk);
  };

  for (int bi = 0, c = 0; bi < my_bands; ++bi) {
    if constexpr (G > 0) {
      for (int j0 = 0; j0 < padded; j0 += D, ++c) chunk_groups(c, j0);
      if constexpr (D / G > 1) {
        scale_group(accs[1], pending_words, pending_sx);
        pending_words = make_uint2(0, 0);
      }
    } else if (full) {
      for (int j0 = 0; j0 < padded; j0 += D, ++c) chunk(std::true_type{}, c, j0);
    } else {
      for (int j0 = 0; j0 < padded; j0 += D, ++c) chunk(std::false_type{}, c, j0);
    }
    // The end of band bi: the warps' sums meet in shared memory, one warp writes the outputs.
    if constexpr (G == 0) {
      flush();
      group = -1;
    }
    const int buffer = bi % kBuffers;
    // (one buffer: band bi - 1's writing warp has read it)
    if (kBuffers == 1 && bi > 0) tile_group_sync<BG>(bg);
#pragma unroll
    for (int h = 0; h < NT; ++h) {
#pragma unroll
      for (int c4 = 0; c4 < 4; ++c4) {
        partial[bg][buffer][kw][4 * h + c4][lane] = sum[h][c4];
        sum[h][c4] = 0.f;
      }
    }
    tile_group_sync<BG>(bg);
    if (kw == bi % kTileWarps) {
      const int band = band_of(bi);
      float y[NT][4];
#pragma unroll
      for (int h = 0; h < NT; ++h) {
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
          y[h][c4] = 0.f;
#pragma unroll
          for (int w = 0; w < kTileWarps; ++w) {
            y[h][c4] += partial[bg][buffer][w][4 * h + c4][lane];
          }
        }
      }
      if (splits > 1) {  // split k: the sums go out, the band's last split adds them (below)
        float* mine = split_sums + (int64_t(band) * splits + blockIdx.y) * (4 * NT * 32) + lane;
#pragma unroll
        for (int h = 0; h < NT; ++h) {
#pragma unroll
          for (int c4 = 0; c4 < 4; ++c4) mine[(4 * h + c4) * 32] = y[h][c4];
        }
      } else {
#pragma unroll
        for (int h = 0; h < NT; ++h) {  // n-tile h: rows 8h .. 8h + 7 of x and out
          if (8 * h >= m) break;
          quant_tile_epilogue<T, SILU_MUL>(
              y[h], band, g, t, out + 8 * h * out_stride, bias,
              residual ? residual + 8 * h * residual_stride : nullptr, m - 8 * h, n, out_stride,
              residual_stride, interleaved);
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the kernel
  if (splits == 1) return;
  // Split k, once all of this CTA's bands are done (a fence per band would hold its warp until
  // the ring's copies land): each band's warp counts its split in, and the band's last split
  // to arrive adds the splits' sums in split order (the same bits whichever arrives last) and
  // writes the outputs.
  __threadfence();  // this warp's sums are visible before its counts say so
  for (int bi = kw; bi < my_bands; bi += kTileWarps) {
    const int band = band_of(bi);
    unsigned arrived = 0;
    if (lane == 0) arrived = atomicAdd(split_counts + band, 1u);
    if (__shfl_sync(0xffffffffu, arrived, 0) != unsigned(splits - 1)) continue;
    __threadfence();  // the other splits' sums (read past L1)
    const float* sums = split_sums + int64_t(band) * splits * (4 * NT * 32) + lane;
    float y[NT][4] = {};
    for (int sp = 0; sp < splits; ++sp) {
#pragma unroll
      for (int h = 0; h < NT; ++h) {
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) y[h][c4] += __ldcg(sums + (sp * 4 * NT + 4 * h + c4) * 32);
      }
    }
    if (lane == 0) split_counts[band] = 0;  // ready for the next launch
#pragma unroll
    for (int h = 0; h < NT; ++h) {
      if (8 * h >= m) break;
      quant_tile_epilogue<T, SILU_MUL>(
          y[h], band, g, t, out + 8 * h * out_stride, bias,
          residual ? residual + 8 * h * residual_stride : nullptr, m - 8 * h, n, out_stride,
          residual_stride, interleaved);
    }
  }
}

// The weight as T [n, k] (logical row order), one thread per 8 consecutive values of a row:
// exactly ops/quant_linear.py `dequantize` of the layout it was made from.
template <typename T>
__global__ void quant_tile_dequantize_kernel(T* __restrict__ out,
                                             const uint32_t* __restrict__ tiles,
                                             const uint32_t* __restrict__ tile_scales, int n,
                                             int k, int group_size, bool interleaved) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int k8 = k / 8;
  if (idx >= int64_t(n) * k8) return;
  const int row = int(idx / k8), c = int(idx % k8) * 8;
  int band, r;
  if (!interleaved) {
    band = row / kTileRows, r = row % kTileRows;
  } else if (row < n / 2) {
    band = row / 8, r = row % 8;
  } else {
    band = (row - n / 2) / 8, r = 8 + (row - n / 2) % 8;
  }
  const int k_tiles = k / kTileK, g = r & 7, hi = r >> 3;
  const int tile = c / kTileK, j = (c % kTileK) / 16, t0 = (c % 16) / 4;  // t0: 0 or 2
  float scale, zero;
  tile_scale<T>(tile_scales[((int64_t(band) * (k / group_size) + c / group_size) * 8 + g) * 2 + hi],
                scale, zero);
  const uint16_t mbits = uint16_t(TileMagic<T>::kPair & 0xFFFFu);
  zero -= to_float<T>(*reinterpret_cast<const T*>(&mbits));  // exact: integers below 2^11
  constexpr int kNibble[4] = {0, 4, 2, 6};  // value e of a lane's four in word j
  float v[8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int lane = g * 4 + t0 + h;
    const uint32_t word = tiles[((int64_t(band) * k_tiles + tile) * 32 + lane) * 4 + j];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float q = float((word >> (4 * (kNibble[e] + hi))) & 0xFu);
      v[4 * h + e] = (q - zero) * scale;
    }
  }
  *reinterpret_cast<uint4*>(out + int64_t(row) * k + c) = pack8<T>(v);
}

}  // namespace tinyvllm
