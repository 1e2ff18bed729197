// Launchers of the W4A16 tile-layout GEMV, GEMM (quant_tile_gemm.cuh) and dequantize
// (quant_tiles.cuh): size checks and
// the choice of instantiation, {float16, bfloat16} x M {1, 2, 4, 8, 16} x prologue {none,
// rmsnorm, silu_mul}, and the SwiGLU-product epilogue after {none, rmsnorm}, each with its
// groups checked per tile or (group_size 128 where every warp's slice allows) at fixed positions;
// and the split of k across CTAs where the staged rows of the whole k do not fit.
#include <algorithm>
#include <mutex>
#include <string>

#include "launchers.h"
#include "quant_tile_gemm.cuh"
#include "quant_tiles.cuh"

namespace tinyvllm {
namespace {

constexpr int kTileMaxM = 16;  // two n-tiles of the mma's 8 columns
constexpr int kStages = kTileStages;
constexpr int kMaxSplits = 16;  // CTAs sharing a band, each over its own slice of k

// Dynamic shared memory of a launch of M rows: the staged activations (M x k), the rings of
// the warps of `band_groups` groups, `chunks` chunks of kStages tiles each (512 bytes of weights
// and 64 of scales a tile), and x's sums per tile (sized for one tile each: groups at fixed
// positions use fewer).
constexpr int ring_bytes(int stages, int chunks, int band_groups) {
  return band_groups * kTileWarps * chunks * stages * 32 * (16 + 2);
}
template <int M>
int64_t tile_smem_bytes(int64_t k, int chunks = 2, int band_groups = 1) {
  return M * (k * 2 + 16 * kTileRowPad<M>) + ring_bytes(kStages, chunks, band_groups) +
         (k / kTileK) * kTileSumCols<M> * 4;
}

// f(M) with the instantiation's M for m rows: 1, 2, 4, 8 or 16 (an integral_constant).
template <typename F>
void with_tile_rows(int m, F&& f) {
  dispatch_rows<1, 2, 4, 8, 16>(m, std::forward<F>(f));
}

// The dynamic shared memory a CTA of one instantiation may take on this device: the opt-in
// limit per block less the kernel's static shared memory (asked once).
template <typename T, int M, int P, bool S>
int kernel_smem_cap() {
  static const int cap = dynamic_smem_cap(quant_tile_gemv_kernel<T, M, P, S, 0, kStages>,
                                          "quant_tile_gemv: shared memory per block");
  return cap;
}

// The same for every instantiation of M rows (the least of them), so that how many rows fit
// does not depend on the prologue or the dtype.
template <int M>
int tile_smem_cap() {
  auto least = [](auto t) {
    using T = decltype(t);
    return std::min({kernel_smem_cap<T, M, kGemvNone, false>(),
                     kernel_smem_cap<T, M, kGemvRmsNorm, false>(),
                     kernel_smem_cap<T, M, kGemvSiluMul, false>(),
                     kernel_smem_cap<T, M, kGemvNone, true>(),
                     kernel_smem_cap<T, M, kGemvRmsNorm, true>()});
  };
  return std::min(least(__half{}), least(__nv_bfloat16{}));
}

// Tiles per group where every group sits at fixed positions of each warp's chunks (the kernel's
// G): group_size 128 and every warp's slice of a split's k a multiple of kStages tiles (so also
// of 2); else 0 (the group of each tile is checked).
int fixed_group_tiles(int k, int group_size, int splits) {
  constexpr int kG = 2;
  if (group_size != kG * kTileK || k / group_size < 2) return 0;
  const int k_tiles = k / kTileK / splits;
  if (k_tiles % kG != 0) return 0;
  for (int w = 0; w < kTileWarps; ++w) {
    const int begin = k_tiles * w / kTileWarps, end = k_tiles * (w + 1) / kTileWarps;
    if (end == begin || (end - begin) % kStages != 0 || begin % kG != 0) return 0;
  }
  return kG;
}

// Where k is split, each split's CTAs add their sums for a band into split_sums; the band's
// last split adds them all in order. What a launch of M rows split `splits` ways needs there.
template <int M>
int64_t split_sum_floats(int n, int splits) {
  return splits > 1 ? int64_t((n + kTileRows - 1) / kTileRows) * splits * 4 * (M > 8 ? 2 : 1) * 32
                    : 0;
}

// CTAs of M rows an SM holds at `smem` bytes of dynamic shared memory, by shared memory alone.
template <int M>
int tile_ctas_per_sm(int64_t smem) {
  static const int64_t per_cta = [] {  // static shared memory and the block's reserved bytes
    int device = 0, reserved = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device),
               "quant_tile_gemv: reserved shared memory");
    cudaFuncAttributes attr{};
    check_cuda(cudaFuncGetAttributes(
                   &attr, quant_tile_gemv_kernel<__nv_bfloat16, M, kGemvNone, false, 0, kStages>),
               "quant_tile_gemv: attributes");
    return int64_t(attr.sharedSizeBytes) + reserved;
  }();
  static const int per_sm = [] {
    int device = 0, bytes = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
               "quant_tile_gemv: shared memory per SM");
    return bytes;
  }();
  return int(per_sm / (smem + per_cta));
}

// The ways to split k for a launch of M rows (requested: 1 .. kMaxSplits, or 0 to choose): it
// must divide k's tiles and leave each CTA's staged rows within the device's shared memory
// (RMSNorm's row scale needs the whole row: no split). Chosen: 1 where the whole k fits, else
// the fewest splits that leave two CTAs an SM (llama3-8b-shape down_proj at 8 rows: 4 splits,
// two CTAs an SM, 25.0 us against 31.8 for 2 splits, one CTA an SM; H200), else the fewest
// that fit. 0: none fits.
template <int M>
int tile_splits(int64_t k, int prologue, int requested) {
  const int64_t k_tiles = k / kTileK;
  auto fits = [&](int s) {
    return k_tiles % s == 0 && tile_smem_bytes<M>(k / s) <= tile_smem_cap<M>();
  };
  if (requested) return fits(requested) ? requested : 0;
  if (fits(1)) return 1;
  if (prologue == kGemvRmsNorm) return 0;
  int fewest = 0;
  for (int s = 2; s <= kMaxSplits; ++s) {
    if (!fits(s)) continue;
    if (tile_ctas_per_sm<M>(tile_smem_bytes<M>(k / s)) >= 2) return s;
    if (!fewest) fewest = s;
  }
  return fewest;
}

// Each CTA takes ceil(bands / resident CTAs of its split) bands (strided), so that all CTAs are
// resident at once and none has a band more than the others but the last few.
template <typename T, int M, int P, bool S, int G, int R = 2, int BG = 1>
void launch_g(T* out, const T* x, const uint4* tiles, const uint2* scales, const T* bias,
              const T* residual, const T* norm_weight, int m, int n, int k, int64_t x_stride,
              int64_t out_stride, int64_t residual_stride, float eps, int groups, int shift,
              bool interleaved, int splits, float* split_sums, unsigned* split_counts,
              cudaStream_t stream) {
  auto kernel = quant_tile_gemv_kernel<T, M, P, S, G, kStages, R, BG>;
  static std::once_flag once;
  std::call_once(once, [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kernel_smem_cap<T, M, P, S>()),
               "quant_tile_gemv: cudaFuncSetAttribute");
  });
  const int smem = int(tile_smem_bytes<M>(k / splits, R, BG));
  const int threads = kTileWarps * 32 * BG;
  const int grid = resident_grid(kernel, threads, smem, (n + kTileRows - 1) / kTileRows,
                                 "quant_tile_gemv: occupancy", splits);
  launch_pdl(kernel, dim3(grid, splits), dim3(threads), smem, stream, out, x, tiles,
             scales, bias, residual, norm_weight, m, n, k, x_stride, out_stride, residual_stride,
             eps, groups, shift, interleaved, split_sums, split_counts);
}

template <typename T, int M, int P, bool S>
void launch(T* out, const T* x, const uint4* tiles, const uint2* scales, const T* bias,
            const T* residual, const T* norm_weight, int m, int n, int k, int64_t x_stride,
            int64_t out_stride, int64_t residual_stride, float eps, int group_size,
            bool interleaved, int splits, float* split_sums, unsigned* split_counts,
            cudaStream_t stream) {
  const int groups = k / group_size;
  // Power-of-two groups: the group of tile i is (64 i) >> shift; one group: any shift > log2(k).
  int shift = 31;
  if (groups > 1) {
    shift = 0;
    while ((1 << shift) < group_size) ++shift;
  }
  auto go = [&](auto g, auto r, auto bg) {
    launch_g<T, M, P, S, decltype(g)::value, decltype(r)::value, decltype(bg)::value>(
        out, x, tiles, scales, bias, residual, norm_weight, m, n, k, x_stride, out_stride,
        residual_stride, eps, groups, shift, interleaved, splits, split_sums, split_counts,
        stream);
  };
  using G0 = std::integral_constant<int, 0>;
  using G2 = std::integral_constant<int, 2>;
  using BG1 = std::integral_constant<int, 1>;
  using R2 = std::integral_constant<int, 2>;
  const bool fixed = fixed_group_tiles(k, group_size, splits) == 2;
  // One row (batch-1 decode): a ring of three chunks where it fits, so that a third more of the
  // weight is requested before the PDL wait (llama3-8b-shape TPOT 2.26 -> 2.20 ms on an H200;
  // at two rows the isolated down_proj was slower with three, 13.7 against 12.9 us).
  // 2-16 rows, unsplit: a CTA of two band groups, 16 warps on one staged copy of x, each group
  // staging (and normalizing) half of its rows. At 16 rows (9-16) only where one CTA of 8 warps
  // fills the SM's shared memory (228 KB an SM: k of 1920-4224; 4096: 172 KB). H200,
  // llama3-8b-shape W4A16, one group -> two: gate_up at 16 rows 37.1 -> 29.5 us, batch 16
  // (64/256) 3,928 -> 4,147 tok/s; qkv with RMSNorm at 8 rows 14.2 -> 9.8 us, batch 8 2,688 ->
  // 2,998 and batch 4 1,648 -> 1,793; gate_up at 2 rows 21.2 -> 19.8 us.
  // Else at 16 rows (k where two 8-warp CTAs fit an SM, or two groups do not fit) a third chunk
  // per warp, where it fits, keeps more of the weight in flight (measured at k = 4096 before two
  // groups ran there: batch 16 3,857 -> 3,971 tok/s). Whether two groups also pay at 16 rows
  // where two 8-warp CTAs fit is unmeasured.
  if constexpr (M >= 2) {
    using BG2 = std::integral_constant<int, 2>;
    if (splits == 1 && (M < 16 || tile_ctas_per_sm<M>(tile_smem_bytes<M>(k)) < 2) &&
        tile_smem_bytes<M>(k, 2, 2) <= tile_smem_cap<M>()) {
      fixed ? go(G2{}, R2{}, BG2{}) : go(G0{}, R2{}, BG2{});
      return;
    }
  }
  if constexpr (M == 1 || M == 16) {
    using R3 = std::integral_constant<int, 3>;
    if (splits == 1 && tile_smem_bytes<M>(k, 3) <= tile_smem_cap<M>()) {
      fixed ? go(G2{}, R3{}, BG1{}) : go(G0{}, R3{}, BG1{});
      return;
    }
  }
  fixed ? go(G2{}, R2{}, BG1{}) : go(G0{}, R2{}, BG1{});
}

template <typename T, int P, bool S = false>
void launch_m(int m, T* out, const T* x, const uint4* tiles, const uint2* scales, const T* bias,
              const T* residual, const T* norm_weight, int n, int k, int64_t x_stride,
              int64_t out_stride, int64_t residual_stride, float eps, int group_size,
              bool interleaved, int splits, float* split_sums, unsigned* split_counts,
              cudaStream_t s) {
  with_tile_rows(m, [&](auto rows) {
    launch<T, decltype(rows)::value, P, S>(out, x, tiles, scales, bias, residual, norm_weight, m,
                                           n, k, x_stride, out_stride, residual_stride, eps,
                                           group_size, interleaved, splits, split_sums,
                                           split_counts, s);
  });
}

// What both entry points check ("quant_tile_gemv: ..." / "quant_tile_dequantize: ...").
void check_tiles(const std::string& where, int64_t n, int64_t k, int group_size, bool interleaved,
                 ptr_t tiles, ptr_t scales) {
  require(n > 0 && n <= INT32_MAX / 2, where + "n=" + std::to_string(n) + " out of range");
  require(k > 0 && k % kTileK == 0 && k <= INT32_MAX / 2,
          where + "k=" + std::to_string(k) + " must be a positive multiple of 64");
  require(group_size > 0 && group_size % kTileK == 0 && k % group_size == 0 &&
              (group_size == k || (group_size & (group_size - 1)) == 0),
          where + "group_size=" + std::to_string(group_size) +
              " must be k or a power of two of at least 64 that divides k=" + std::to_string(k));
  require(!interleaved || n % kTileRows == 0,
          where + "an interleaved layout needs n=" + std::to_string(n) + " a multiple of 16");
  require(aligned16(reinterpret_cast<void*>(tiles)) && aligned16(reinterpret_cast<void*>(scales)),
          where + "tiles and tile_scales must be 16-byte aligned");
}

}  // namespace

void quant_tile_gemv(ptr_t out, ptr_t x, ptr_t tiles, ptr_t tile_scales, ptr_t bias,
                     ptr_t residual, ptr_t norm_weight, int64_t m, int64_t n, int64_t k,
                     int64_t x_stride, int64_t out_stride, int64_t residual_stride, float eps,
                     int group_size, int interleaved, int prologue, int silu_mul_out,
                     int splits, ptr_t split_sums, int64_t split_sums_len, ptr_t split_counts,
                     int64_t split_counts_len, int dtype, stream_t stream) {
  const std::string where = "quant_tile_gemv: ";
  check_tiles(where, n, k, group_size, interleaved != 0, tiles, tile_scales);
  require(m >= 0 && m <= kTileMaxM, where + "m=" + std::to_string(m) + " rows; at most " +
                                        std::to_string(kTileMaxM) + " are served");
  require(prologue >= kGemvNone && prologue <= kGemvSiluMul,
          where + "prologue=" + std::to_string(prologue) + " unknown");
  require(splits >= 0 && splits <= kMaxSplits && (splits <= 1 || (k / kTileK) % splits == 0),
          where + "splits=" + std::to_string(splits) + " must be 0 (the launcher's choice) or 1-" +
              std::to_string(kMaxSplits) + " dividing k / 64=" + std::to_string(k / kTileK));
  require(splits <= 1 || prologue != kGemvRmsNorm,
          where + "rmsnorm needs the whole row of x in one CTA: splits=" +
              std::to_string(splits) + " must be 0 or 1");
  if (m > 0) {
    with_tile_rows(int(m), [&](auto rows) {
      constexpr int M = decltype(rows)::value;
      // (the messages are built only on failure: this runs at every launch)
      const int chosen = tile_splits<M>(k, prologue, splits);
      if (chosen == 0) {
        throw std::invalid_argument(
            where + "m=" + std::to_string(m) + " rows of k=" + std::to_string(k) +
            " (m rounded up to 1, 2, 4, 8 or 16)" +
            (splits ? " split " + std::to_string(splits) + " ways take " +
                          std::to_string(tile_smem_bytes<M>(k / splits)) + " bytes"
                    : std::string(" fit no split of k")) +
            " of shared memory, the device allows " + std::to_string(tile_smem_cap<M>()) +
            "; quant_tile_rows(k, rms_norm) rows fit");
      }
      splits = chosen;
      const int64_t need = split_sum_floats<M>(int(n), splits);
      const int64_t bands = (n + kTileRows - 1) / kTileRows;
      if (splits > 1 && (split_sums == 0 || split_counts == 0 || need > split_sums_len ||
                         bands > split_counts_len)) {
        throw std::invalid_argument(
            where + "k split " + std::to_string(splits) + " ways needs split_sums of " +
            std::to_string(need) + " floats and split_counts of " + std::to_string(bands) +
            " (got " + std::to_string(split_sums_len) + " and " +
            std::to_string(split_counts_len) + ")");
      }
    });
  }
  require(!silu_mul_out || (interleaved && residual == 0 && prologue != kGemvSiluMul),
          where + "silu_mul_out needs an interleaved layout, no residual and no silu_mul "
                  "prologue");
  require(prologue != kGemvRmsNorm || norm_weight != 0, where + "rmsnorm needs norm_weight");
  require(x_stride % 8 == 0 && aligned16(reinterpret_cast<void*>(x)) &&
              (norm_weight == 0 || aligned16(reinterpret_cast<void*>(norm_weight))),
          where + "x and norm_weight must be 16-byte aligned with x_stride a multiple of 8 (got " +
              std::to_string(x_stride) + ")");
  if (m == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "quant_tile_gemv", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    auto* tl = reinterpret_cast<const uint4*>(tiles);
    auto* sc = reinterpret_cast<const uint2*>(tile_scales);
    auto* b = reinterpret_cast<const scalar_t*>(bias);
    auto* r = reinterpret_cast<const scalar_t*>(residual);
    auto* nw = reinterpret_cast<const scalar_t*>(norm_weight);
    const int mi = int(m), ni = int(n), ki = int(k);
    const bool il = interleaved != 0;
    auto* ss = reinterpret_cast<float*>(split_sums);
    auto* sn = reinterpret_cast<unsigned*>(split_counts);
    auto go = [&](auto prologue_c, auto silu_mul_out_c) {
      launch_m<scalar_t, decltype(prologue_c)::value, decltype(silu_mul_out_c)::value>(
          mi, o, xi, tl, sc, b, r, nw, ni, ki, x_stride, out_stride, residual_stride, eps,
          group_size, il, splits, ss, sn, s);
    };
    using None = std::integral_constant<int, kGemvNone>;
    using Norm = std::integral_constant<int, kGemvRmsNorm>;
    using Silu = std::integral_constant<int, kGemvSiluMul>;
    if (silu_mul_out && prologue == kGemvNone) {
      go(None{}, std::true_type{});
    } else if (silu_mul_out) {
      go(Norm{}, std::true_type{});
    } else if (prologue == kGemvNone) {
      go(None{}, std::false_type{});
    } else if (prologue == kGemvRmsNorm) {
      go(Norm{}, std::false_type{});
    } else {
      go(Silu{}, std::false_type{});
    }
  });
}

int quant_tile_rows(int64_t k, int rms_norm) {
  require(k > 0 && k % kTileK == 0 && k <= INT32_MAX / 2,
          "quant_tile_rows: k=" + std::to_string(k) + " must be a positive multiple of 64");
  int rows = 0;
  const int prologue = rms_norm ? kGemvRmsNorm : kGemvNone;
  auto fits = [&](auto m) {
    constexpr int M = decltype(m)::value;
    if (rows == 0 && tile_splits<M>(k, prologue, 0) > 0) rows = M;
  };
  fits(std::integral_constant<int, 16>{});
  fits(std::integral_constant<int, 8>{});
  fits(std::integral_constant<int, 4>{});
  fits(std::integral_constant<int, 2>{});
  fits(std::integral_constant<int, 1>{});
  return rows;
}

void quant_tile_dequantize(ptr_t out, ptr_t tiles, ptr_t tile_scales, int64_t n, int64_t k,
                           int group_size, int interleaved, int dtype, stream_t stream) {
  const std::string where = "quant_tile_dequantize: ";
  check_tiles(where, n, k, group_size, interleaved != 0, tiles, tile_scales);
  require(aligned16(reinterpret_cast<void*>(out)), where + "out must be 16-byte aligned");
  const cudaStream_t s = as_stream(stream);
  const int64_t threads_total = n * (k / 8);
  const int threads = 256;
  const unsigned grid = unsigned((threads_total + threads - 1) / threads);
  TINYVLLM_DISPATCH_HALF(dtype, "quant_tile_dequantize", {
    quant_tile_dequantize_kernel<scalar_t><<<grid, threads, 0, s>>>(
        reinterpret_cast<scalar_t*>(out), reinterpret_cast<const uint32_t*>(tiles),
        reinterpret_cast<const uint32_t*>(tile_scales), int(n), int(k), group_size,
        interleaved != 0);
    check_launch("quant_tile_dequantize");
  });
}

void quant_tile_gemm(ptr_t out, ptr_t partial, ptr_t x, ptr_t tiles, ptr_t tile_scales,
                     ptr_t bias, int64_t m, int64_t n, int64_t k, int64_t x_stride,
                     int64_t out_stride, int group_size, int interleaved, int block_rows,
                     int splits, int kernel, int dtype, stream_t stream) {
  const std::string where = "quant_tile_gemm: ";
  check_tiles(where, n, k, group_size, interleaved != 0, tiles, tile_scales);
  require(block_rows == 32 || block_rows == 64 || block_rows == 128,
          where + "block_rows=" + std::to_string(block_rows) + " must be 32, 64 or 128");
  require(kernel == 1 || kernel == 2 || kernel == 4,
          where + "kernel=" + std::to_string(kernel) +
              " must be 1 (mma.sync) or 2 / 4 (wgmma with that many warpgroups)");
  require(kernel == 1 || (device_has_pdl_code() && block_rows >= 64),
          where + "the wgmma kernel needs the sm_90a image on this device and block_rows 64 "
                  "or 128 (got " + std::to_string(block_rows) + ")");
  require(m >= 0 && m <= int64_t(65535) * block_rows,
          where + "m=" + std::to_string(m) + " out of range (at most 65535 blocks of " +
              std::to_string(block_rows) + " rows)");
  require(splits >= 1 && splits <= k / kTileK && splits <= 65535,
          where + "splits=" + std::to_string(splits) + " must be 1 to k / 64=" +
              std::to_string(k / kTileK));
  require((splits == 1) == (partial == 0) && (splits == 1 || bias == 0),
          where + "partial (float32 [splits, m, n]) is given exactly when splits > 1, and bias "
                  "only when splits == 1");
  require(x_stride % 8 == 0 && x_stride >= k && aligned16(reinterpret_cast<void*>(x)),
          where + "x must be 16-byte aligned with x_stride >= k a multiple of 8 (got " +
              std::to_string(x_stride) + ")");
  require(out_stride >= n, where + "out_stride=" + std::to_string(out_stride) + " < n");
  if (m == 0) return;
  const int groups = int(k / group_size);
  int shift = 31;  // one group: any shift past log2(k)
  if (groups > 1) {
    shift = 0;
    while ((1 << shift) < group_size) ++shift;
  }
  const int bands = int((n + kTileRows - 1) / kTileRows);
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "quant_tile_gemm", {
    // One launch of `kernel_fn` with `smem` bytes, `warps` bands a CTA and BM rows of x a CTA.
    auto go = [&](auto kernel_fn, int smem, int warps, int bm, std::once_flag& once) {
      std::call_once(once, [&] {
        check_cuda(cudaFuncSetAttribute(kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        smem),
                   "quant_tile_gemm: cudaFuncSetAttribute");
      });
      const dim3 grid((bands + warps - 1) / warps, unsigned((m + bm - 1) / bm), unsigned(splits));
      kernel_fn<<<grid, warps * 32, smem, s>>>(
          reinterpret_cast<scalar_t*>(out), reinterpret_cast<float*>(partial),
          reinterpret_cast<const scalar_t*>(x), reinterpret_cast<const uint4*>(tiles),
          reinterpret_cast<const uint2*>(tile_scales), reinterpret_cast<const scalar_t*>(bias),
          int(m), int(n), int(k), x_stride, out_stride, groups, shift, interleaved != 0);
      check_launch("quant_tile_gemm");
    };
    auto mma_sync = [&](auto rows) {
      constexpr int BM = decltype(rows)::value;
      static std::once_flag once;
      go(quant_tile_gemm_kernel<scalar_t, BM>, gemm_smem_bytes<BM>(), kGemmWarps, BM, once);
    };
    auto wgmma = [&](auto rows, auto wgs) {
      constexpr int BN = decltype(rows)::value, WGS = decltype(wgs)::value;
      static std::once_flag once;
      go(quant_tile_wgmma_kernel<scalar_t, BN, WGS>, wgmma_gemm_smem_bytes<BN, WGS>(), 4 * WGS,
         BN, once);
    };
    using R32 = std::integral_constant<int, 32>;
    using R64 = std::integral_constant<int, 64>;
    using R128 = std::integral_constant<int, 128>;
    using W2 = std::integral_constant<int, 2>;
    using W4 = std::integral_constant<int, 4>;
    if (kernel == 2) {
      block_rows == 64 ? wgmma(R64{}, W2{}) : wgmma(R128{}, W2{});
    } else if (kernel == 4) {
      block_rows == 64 ? wgmma(R64{}, W4{}) : wgmma(R128{}, W4{});
    } else if (block_rows == 32) {
      mma_sync(R32{});
    } else if (block_rows == 64) {
      mma_sync(R64{});
    } else {
      mma_sync(R128{});
    }
  });
}

}  // namespace tinyvllm
