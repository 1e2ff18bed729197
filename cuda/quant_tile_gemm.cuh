// W4A16 GEMM on tensor cores over the tile layout (quant_tiles.cuh, ops/quant_tiles.py) for
// batches past the GEMV's rows (prompt chunks, mixed steps, decode batches of 17 rows or more),
// where dequantizing the whole weight for cuBLAS would write and read it in 16 bits every call.
// Two kernels: quant_tile_gemm_kernel (mma.sync, every GPU) and, where the sm_90a code runs,
// quant_tile_wgmma_kernel (warpgroup MMA, below), which ops/quant_tiles.gemm_plan prefers there.
//
// A CTA of kGemmWarps warps owns kGemmWarps bands (16 weight rows each, one a warp) and BM rows of
// x, over the tiles [s k_tiles / S, (s + 1) k_tiles / S) of k (split s of gridDim.z = S). Per tile
// (64 values of k) the CTA copies x's BM x 64 block into shared memory and each warp its band's
// 512 bytes (one 16-byte cp.async a lane), kGemmStages tiles ahead (one commit group per tile, a
// barrier per tile). The lane's word j of the tile is its A fragment of k-step j as (magic + q)
// pairs (quant_tiles.cuh); here it is dequantized in registers, ((magic + q) - (magic + zero)) *
// scale per pair, which is exact before the one rounding of the product: the weight the mma
// multiplies is the reference's dequantized weight bit for bit, so the result is cuBLAS's over
// `quant_tile_dequantize` but for the order of the fp32 sums. The same A fragments go to BM / 8
// mmas, one per 8 rows of x (B: lane (g, t) reads x at k0 + 16j + 4t .. + 3 of row g, one 8-byte
// load; the staged rows are padded by 32 bytes so that a half-warp's loads fall on distinct banks).
// With S = 1 the CTA writes out (+ bias) rounded to T; with S > 1, float32 sums per split into
// `partial` [S][m][n], added by the caller. Rows are in logical order (tile_row): an interleaved
// gate_up writes gate in [0, n / 2) and up in [n / 2, n).
#pragma once

#include "quant_tiles.cuh"
#include "wgmma.cuh"

namespace tinyvllm {

constexpr int kGemmWarps = 8;    // bands a CTA: 128 weight rows
constexpr int kGemmStages = 4;   // tiles of k in flight
constexpr int kGemmRowPad = 16;  // elements after each staged row of x (32 bytes)

template <int BM>
constexpr int gemm_smem_bytes() {
  return kGemmStages * (BM * (kTileK + kGemmRowPad) * 2 + kGemmWarps * 32 * 16);
}

// The A fragment of one k-step from the lane's word q of a tile and its group's scale words sc
// (.x row g's, .y row g + 8's, each scale | (magic + zero) << 16): registers 0 / 2 are row g's
// values (4t, 4t + 1) / (4t + 2, 4t + 3), 1 / 3 row g + 8's, each ((magic + q) - (magic + zero))
// * scale in 16-bit pairs: exact but for the product's one rounding.
template <typename T>
__device__ __forceinline__ void dequantize_word(uint32_t q, uint2 sc, uint32_t (&f)[4]) {
  constexpr uint32_t kMagic = TileMagic<T>::kPair;
  const uint32_t s_lo = __byte_perm(sc.x, 0, 0x1010), z_lo = __byte_perm(sc.x, 0, 0x3232);
  const uint32_t s_hi = __byte_perm(sc.y, 0, 0x1010), z_hi = __byte_perm(sc.y, 0, 0x3232);
  f[0] = mul_pair<T>(sub_pair<T>(nibble_pair(q, kMagic), z_lo), s_lo);
  f[1] = mul_pair<T>(sub_pair<T>(nibble_pair(q >> 4, kMagic), z_hi), s_hi);
  f[2] = mul_pair<T>(sub_pair<T>(nibble_pair(q >> 8, kMagic), z_lo), s_lo);
  f[3] = mul_pair<T>(sub_pair<T>(nibble_pair(q >> 12, kMagic), z_hi), s_hi);
}

// What warp `warp` of a GEMM CTA reads: its band (16 weight rows; none past the last), the CTA's
// first row of x (blockIdx.y blocks of `rows`) and its split's tiles [tile_begin, + num_tiles) of
// k (split blockIdx.z of gridDim.z), with where its words, scale words and x start.
template <typename T>
struct GemmWarpSlice {
  int band, row0, tile_begin, num_tiles, tile_group_shift;
  bool has_band;
  const uint4* wsrc;   // the lane's word of the split's first tile
  const uint2* scsrc;  // row g's (and g + 8's) scale words of the band's first group
  const T* xsrc;       // x at the split's first tile
  __device__ __forceinline__ GemmWarpSlice(int warp, int warps, int rows, int n, int k,
                                           const uint4* tiles, const uint2* tile_scales,
                                           const T* x, int groups, int group_shift) {
    const int lane = threadIdx.x % 32, all_tiles = k / kTileK;
    band = blockIdx.x * warps + warp;
    has_band = band < (n + kTileRows - 1) / kTileRows;
    row0 = blockIdx.y * rows;
    tile_begin = int(int64_t(all_tiles) * blockIdx.z / gridDim.z);
    num_tiles = int(int64_t(all_tiles) * (blockIdx.z + 1) / gridDim.z) - tile_begin;
    tile_group_shift = group_shift - 6;  // group of tile i: i >> this
    wsrc = tiles + (int64_t(has_band ? band : 0) * all_tiles + tile_begin) * 32 + lane;
    scsrc = tile_scales + int64_t(has_band ? band : 0) * groups * 8 + (lane >> 2);
    xsrc = x + int64_t(tile_begin) * kTileK;
  }
  // Tile i's group scale words: .x row g's, .y row g + 8's, each scale | (magic + zero) << 16.
  __device__ __forceinline__ uint2 scale_words(int i) const {
    return scsrc[((tile_begin + i) >> tile_group_shift) * 8];
  }
};

// Stores one band's sums: acc[4h + c] is row g (c < 2) or g + 8 of the band times row
// row0 + 8h + 2t + (c & 1) of x (the mma C layout over NT n-tiles, also wgmma's), as out (+ bias)
// rounded to T, or as split blockIdx.z's float32 sums into partial.
template <typename T, int NT>
__device__ __forceinline__ void store_gemm_band(const float* acc, int band, int row0, int g,
                                                int t, T* out, float* partial, const T* bias,
                                                int m, int n, int64_t out_stride,
                                                bool interleaved) {
#pragma unroll
  for (int h = 0; h < NT; ++h) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = row0 + 8 * h + 2 * t + (c & 1);  // row of x and out
      const int row = tile_row(band, g + (c >= 2 ? 8 : 0), n, interleaved);  // of the weight
      if (col < m && row < n) {
        const float y = acc[4 * h + c];
        if (partial != nullptr) {
          partial[(int64_t(blockIdx.z) * m + col) * n + row] = y;
        } else {
          out[col * out_stride + row] = from_float<T>(y + (bias ? to_float(bias[row]) : 0.f));
        }
      }
    }
  }
}

template <typename T, int BM>
__global__ void __launch_bounds__(kGemmWarps * 32) quant_tile_gemm_kernel(
    T* __restrict__ out,                   // [m, out_stride] (S = 1)
    float* __restrict__ partial,           // [S][m][n] (S > 1), else null
    const T* __restrict__ x,               // [m, x_stride]
    const uint4* __restrict__ tiles,       // [bands][k / 64][32]
    const uint2* __restrict__ tile_scales,  // [bands][groups][8]
    const T* __restrict__ bias,            // [n] or null (S = 1 only)
    int m, int n, int k, int64_t x_stride, int64_t out_stride, int groups, int group_shift,
    bool interleaved) {
  constexpr int NT = BM / 8;  // n-tiles of 8 rows of x
  constexpr int kRow = kTileK + kGemmRowPad;
  extern __shared__ uint4 smem[];
  T* xs = reinterpret_cast<T*>(smem);                   // [stages][BM][kRow]
  uint4* ws = smem + kGemmStages * BM * kRow / 8;       // [stages][warps][32]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  // (warps past the last band copy x and wait with the rest)
  const GemmWarpSlice<T> sl(warp, kGemmWarps, BM, n, k, tiles, tile_scales, x, groups, group_shift);
  const bool has_band = sl.has_band;
  const int row0 = sl.row0, num_tiles = sl.num_tiles;
  const uint64_t policy = l2_evict_first_policy();

  // Tile i of the split into slot i % stages: x's block (rows past m zero) and the warps' bands.
  auto load_tile = [&](int i) {
    if (i < num_tiles) {
      const int slot = i % kGemmStages;
      T* xd = xs + slot * BM * kRow;
      for (int v = threadIdx.x; v < BM * (kTileK / 8); v += kGemmWarps * 32) {
        const int r = v / (kTileK / 8), c = v % (kTileK / 8);
        const bool ok = row0 + r < m;
        cp_async16(xd + r * kRow + c * 8,
                   sl.xsrc + int64_t(ok ? row0 + r : 0) * x_stride + int64_t(i) * kTileK + c * 8,
                   ok ? 16 : 0);
      }
      if (has_band) {
        cp_async16(ws + (slot * kGemmWarps + warp) * 32 + lane, sl.wsrc + int64_t(i) * 32, 16,
                   policy);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kGemmStages - 1; ++i) load_tile(i);

  float acc[NT][4] = {};
  const T* xlane = xs + g * kRow + 4 * t;
  // The tile's group scale words, read one tile ahead.
  uint2 sc = has_band && num_tiles > 0 ? sl.scale_words(0) : make_uint2(0, 0);
  for (int i = 0; i < num_tiles; ++i) {
    cp_async_wait<kGemmStages - 2>();
    __syncthreads();  // tile i landed for all; slot (i - 1) % stages free to refill
    load_tile(i + kGemmStages - 1);
    if (!has_band) continue;
    const uint2 sc_next = i + 1 < num_tiles ? sl.scale_words(i + 1) : sc;
    const int slot = i % kGemmStages;
    const uint4 wq = ws[(slot * kGemmWarps + warp) * 32 + lane];
    const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
    const T* xt = xlane + slot * BM * kRow;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t q = words[j];
      uint32_t f[4];
      dequantize_word<T>(q, sc, f);
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        const uint2 b = *reinterpret_cast<const uint2*>(xt + h * 8 * kRow + 16 * j);
        mma_16816<T>(acc[h], f, b.x, b.y);
      }
    }
    sc = sc_next;
  }
  if (!has_band) return;
  store_gemm_band<T, NT>(&acc[0][0], sl.band, row0, g, t, out, partial, bias, m, n, out_stride,
                         interleaved);
}

// The same product on Hopper (sm_90a) by warpgroup MMA: a CTA of WGS warpgroups owns 4 * WGS bands
// (warp w of the CTA band blockIdx.x * 4 * WGS + w) and BN rows of x. Per tile, x's BN x 64 block
// lands in shared memory in the 128-byte swizzle layout (wgmma.cuh) and each warpgroup issues four
// wgmma.m64nBNk16: A (its 4 bands' 64 weight rows) from registers, dequantized from the lane's word
// as above; B (x, K-major) read through a descriptor by the tensor cores once for all 4 warps.
// A tile's MMAs run while the next tile is dequantized (wait_group 1; the A fragments alternate
// between two register sets).
//
// Every thread copies a share of each tile (its chunks of x, its lane's word), kWgmmaAhead tiles
// ahead, through kWgmmaStages slots; no CTA-wide barrier holds the warpgroups in step. A slot's
// full mbarrier completes when all threads' copies into it have landed (cp.async arrives); its
// empty mbarrier when every warp has waited for its MMAs on it. A thread refills a slot only
// after its empty phase, so a warpgroup runs up to kWgmmaStages - kWgmmaAhead - 1 tiles ahead
// of the slowest, and the warpgroups' dequantizing (ALU) overlaps the others' MMAs. The words'
// copies carry no L2 policy: with `l2_evict_first_policy` on them this kernel raised an illegal
// instruction at that copy (compute-sanitizer, 128 rows of x, nvcc 13.0).
constexpr int kWgmmaStages = 8;
constexpr int kWgmmaAhead = 4;

// The tile word of lane (g, t) holds k = 4t .. 4t + 3 of a k-step (the mma.sync kernels pair it
// with x loaded in the same order), but wgmma reads x from shared memory in k's own order, so
// its A fragment must hold k = 2t, 2t + 1 (registers 0 / 1) and 2t + 8, 2t + 9 (2 / 3). Those
// are the nibble bytes 0 / 2 (t even) or 1 / 3 (t odd) of the words of lanes (g, t / 2) and
// (g, t / 2 + 2): two shuffles and one byte permute give the word in the order
// dequantize_word reads.
__device__ __forceinline__ uint32_t natural_k_word(uint32_t q, int t) {
  const int base = (threadIdx.x % 32) & ~3;
  const uint32_t lo = __shfl_sync(0xffffffffu, q, base + (t >> 1));
  const uint32_t hi = __shfl_sync(0xffffffffu, q, base + (t >> 1) + 2);
  return __byte_perm(lo, hi, t & 1 ? 0x7351 : 0x6240);
}

template <int BN, int WGS>
constexpr int wgmma_gemm_smem_bytes() {
  // + the slots' full and empty mbarriers, + the atom alignment
  return kWgmmaStages * (BN * kTileK * 2 + WGS * 4 * 32 * 16) + 2 * kWgmmaStages * 8 + 1024;
}

template <typename T, int BN, int WGS>
__global__ void __launch_bounds__(WGS * 128, 1) quant_tile_wgmma_kernel(
    T* __restrict__ out, float* __restrict__ partial, const T* __restrict__ x,
    const uint4* __restrict__ tiles, const uint2* __restrict__ tile_scales,
    const T* __restrict__ bias, int m, int n, int k, int64_t x_stride, int64_t out_stride,
    int groups, int group_shift, bool interleaved) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kWarps = WGS * 4, kThreads = WGS * 128, S = kWgmmaStages;
  constexpr uint32_t kXBytes = BN * kTileK * 2;  // a slot of x: BN swizzled rows of 128 bytes
  constexpr uint32_t kWBytes = kWarps * 32 * 16;  // a slot of words: one 512-byte band a warp
  constexpr int kXChunks = BN * 8 / kThreads;    // 16-byte chunks of x a thread copies a tile
  static_assert(BN * 8 % kThreads == 0, "x's 16-byte chunks a tile split evenly");
  static_assert((S & (S - 1)) == 0 && kWgmmaAhead < S - 1, "slots a power of two, slack left");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t smem0 = (smem_addr(smem_raw) + 1023) & ~1023u;
  unsigned char* const xs = smem_raw + (smem0 - smem_addr(smem_raw));  // [S][BN x 64]
  unsigned char* const ws = xs + S * kXBytes;                         // [S][warps][32] x 16 B
  const uint32_t full0 = smem0 + S * (kXBytes + kWBytes), empty0 = full0 + 8 * S;
  // The warp index through a shuffle: known warp-uniform, so no branch splits a warpgroup's MMAs.
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  const int t = lane & 3;
  // (warps past the last band multiply zeros: their scale is 0)
  const GemmWarpSlice<T> sl(warp, kWarps, BN, n, k, tiles, tile_scales, x, groups, group_shift);
  const bool has_band = sl.has_band;
  const int num_tiles = sl.num_tiles;
  if (threadIdx.x < S) {
    mbarrier_init(full0 + 8 * threadIdx.x, kThreads);  // every thread's copies
    mbarrier_init(empty0 + 8 * threadIdx.x, kWarps);   // every warp done with its MMAs
  }
  __syncthreads();

  // This thread's copies of a tile, fixed but for the tile's offset: chunks of x (rows past m
  // zero-filled) and the lane's word.
  const T* xsrc[kXChunks];
  uint32_t xdst[kXChunks];
  int xbytes[kXChunks];
#pragma unroll
  for (int u = 0; u < kXChunks; ++u) {
    const int v = u * kThreads + threadIdx.x, r = v / 8, c = v % 8;
    const bool ok = sl.row0 + r < m;
    xsrc[u] = sl.xsrc + int64_t(ok ? sl.row0 + r : 0) * x_stride + c * 8;
    xdst[u] = sw128_offset(r, c, BN);
    xbytes[u] = ok ? 16 : 0;
  }
  unsigned char* const wdst = ws + (warp * 32 + lane) * 16;
  // Tile i into slot i % S once every warp is done with the slot's tile i - S.
  auto produce = [&](int i) {
    if (i >= num_tiles) return;
    const int s = i & (S - 1);
    mbarrier_wait(empty0 + 8 * s, ((i / S) & 1) ^ 1);  // returns at once on the first round
#pragma unroll
    for (int u = 0; u < kXChunks; ++u) {
      cp_async16(xs + s * kXBytes + xdst[u], xsrc[u] + int64_t(i) * kTileK, xbytes[u]);
    }
    if (has_band) cp_async16(wdst + s * kWBytes, sl.wsrc + int64_t(i) * 32, 16);
    cp_async_arrive(full0 + 8 * s);
  };
#pragma unroll
  for (int i = 0; i < kWgmmaAhead; ++i) produce(i);

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  uint2 sc = has_band ? sl.scale_words(0) : make_uint2(0, 0);
  auto step = [&](int i, uint32_t (&a)[4][4]) {
    const int s = i & (S - 1);
    mbarrier_wait(full0 + 8 * s, (i / S) & 1);
    __syncwarp();  // the wait's loop may leave the warp split; the wgmma below needs it whole
    fence_proxy_async_smem();  // the copies are generic-proxy writes; wgmma reads async-proxy
    const uint2 sc_next = has_band && i + 1 < num_tiles ? sl.scale_words(i + 1) : sc;
    const uint4 wq = *reinterpret_cast<const uint4*>(wdst + s * kWBytes);
    const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) dequantize_word<T>(natural_k_word(words[j], t), sc, a[j]);
    sc = sc_next;
    wgmma_fence();
    const uint32_t xb = smem0 + s * kXBytes;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      wgmma_rs<T, BN, 0>(acc, a[j], sw128_desc(xb + 32 * j, 16, 1024));
    }
    wgmma_commit();
    wgmma_wait<1>();  // tile i - 1's MMAs are done: its registers and slot may be reused
    mbarrier_arrive_if(empty0 + 8 * ((i - 1) & (S - 1)), i > 0 && lane == 0);
    produce(i + kWgmmaAhead);
  };
  uint32_t a0[4][4], a1[4][4];
  int i = 0;
  for (; i + 1 < num_tiles; i += 2) {
    step(i, a0);
    step(i + 1, a1);
  }
  if (i < num_tiles) step(i, a0);
  wgmma_wait<0>();
  reg_fence(acc);
  if (!has_band) return;
  store_gemm_band<T, BN / 8>(acc, sl.band, sl.row0, lane >> 2, t, out, partial, bias, m, n,
                             out_stride, interleaved);
#else
  __trap();  // launched only where the sm_90a image runs
#endif
}

}  // namespace tinyvllm
