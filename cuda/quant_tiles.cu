// Launchers of the W4A16 tile-layout GEMV and its dequantize (quant_tiles.cuh): size checks and
// the choice of instantiation, {float16, bfloat16} x M {1, 2, 4, 8, 16} x prologue {none,
// rmsnorm, silu_mul}, and the SwiGLU-product epilogue after {none, rmsnorm}, each with its
// groups checked per tile or (group_size 128 where every warp's slice allows) at fixed positions.
#include <algorithm>
#include <mutex>
#include <string>

#include "launchers.h"
#include "quant_tiles.cuh"

namespace tinyvllm {
namespace {

constexpr int kTileMaxM = 16;  // two n-tiles of the mma's 8 columns
constexpr int kStages = kTileStages;

// Dynamic shared memory of a launch of M rows: the staged activations (M x k), the warps' rings
// of `chunks` chunks of kStages tiles (512 bytes of weights and 64 of scales each) and x's sums
// per tile (sized for one tile each: groups at fixed positions use fewer).
constexpr int ring_bytes(int stages, int chunks) {
  return kTileWarps * chunks * stages * 32 * (16 + 2);
}
template <int M>
int64_t tile_smem_bytes(int64_t k, int chunks = 2) {
  return M * (k * 2 + 16 * kTileRowPad<M>) + ring_bytes(kStages, chunks) +
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
// G): group_size 128 and every warp's slice of k a multiple of kStages tiles (so also of 2);
// else 0 (the group of each tile is checked).
int fixed_group_tiles(int k, int group_size) {
  constexpr int kG = 2;
  if (group_size != kG * kTileK || k / group_size < 2) return 0;
  const int k_tiles = k / kTileK;
  for (int w = 0; w < kTileWarps; ++w) {
    const int begin = k_tiles * w / kTileWarps, end = k_tiles * (w + 1) / kTileWarps;
    if (end == begin || (end - begin) % kStages != 0 || begin % kG != 0) return 0;
  }
  return kG;
}

// Each CTA takes ceil(bands / resident CTAs) bands (strided), so that all CTAs are resident at
// once and none has a band more than the others but the last few.
template <typename T, int M, int P, bool S, int G, int R = 2>
void launch_g(T* out, const T* x, const uint4* tiles, const uint2* scales, const T* bias,
              const T* residual, const T* norm_weight, int m, int n, int k, int64_t x_stride,
              int64_t out_stride, int64_t residual_stride, float eps, int groups, int shift,
              bool interleaved, cudaStream_t stream) {
  auto kernel = quant_tile_gemv_kernel<T, M, P, S, G, kStages, R>;
  static std::once_flag once;
  std::call_once(once, [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kernel_smem_cap<T, M, P, S>()),
               "quant_tile_gemv: cudaFuncSetAttribute");
  });
  const int smem = int(tile_smem_bytes<M>(k, R));
  const int grid = resident_grid(kernel, kTileWarps * 32, smem, (n + kTileRows - 1) / kTileRows,
                                 "quant_tile_gemv: occupancy");
  launch_pdl(kernel, dim3(grid), dim3(kTileWarps * 32), smem, stream, out, x, tiles, scales,
             bias, residual, norm_weight, m, n, k, x_stride, out_stride, residual_stride, eps,
             groups, shift, interleaved);
}

template <typename T, int M, int P, bool S>
void launch(T* out, const T* x, const uint4* tiles, const uint2* scales, const T* bias,
            const T* residual, const T* norm_weight, int m, int n, int k, int64_t x_stride,
            int64_t out_stride, int64_t residual_stride, float eps, int group_size,
            bool interleaved, cudaStream_t stream) {
  const int groups = k / group_size;
  // Power-of-two groups: the group of tile i is (64 i) >> shift; one group: any shift > log2(k).
  int shift = 31;
  if (groups > 1) {
    shift = 0;
    while ((1 << shift) < group_size) ++shift;
  }
  auto go = [&](auto g, auto r) {
    launch_g<T, M, P, S, decltype(g)::value, decltype(r)::value>(
        out, x, tiles, scales, bias, residual, norm_weight, m, n, k, x_stride, out_stride,
        residual_stride, eps, groups, shift, interleaved, stream);
  };
  using G0 = std::integral_constant<int, 0>;
  using G2 = std::integral_constant<int, 2>;
  const bool fixed = fixed_group_tiles(k, group_size) == 2;
  // One row (batch-1 decode): a ring of three chunks where it fits, so that a third more of the
  // weight is requested before the PDL wait (llama3-8b-shape TPOT 2.26 -> 2.20 ms on an H200;
  // at two rows the isolated down_proj was slower with three, 13.7 against 12.9 us).
  if constexpr (M == 1) {
    using R3 = std::integral_constant<int, 3>;
    if (tile_smem_bytes<M>(k, 3) <= tile_smem_cap<M>()) {
      fixed ? go(G2{}, R3{}) : go(G0{}, R3{});
      return;
    }
  }
  using R2 = std::integral_constant<int, 2>;
  fixed ? go(G2{}, R2{}) : go(G0{}, R2{});
}

template <typename T, int P, bool S = false>
void launch_m(int m, T* out, const T* x, const uint4* tiles, const uint2* scales, const T* bias,
              const T* residual, const T* norm_weight, int n, int k, int64_t x_stride,
              int64_t out_stride, int64_t residual_stride, float eps, int group_size,
              bool interleaved, cudaStream_t s) {
  with_tile_rows(m, [&](auto rows) {
    launch<T, decltype(rows)::value, P, S>(out, x, tiles, scales, bias, residual, norm_weight, m,
                                           n, k, x_stride, out_stride, residual_stride, eps,
                                           group_size, interleaved, s);
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
                     int group_size, int interleaved, int prologue, int silu_mul_out, int dtype,
                     stream_t stream) {
  const std::string where = "quant_tile_gemv: ";
  check_tiles(where, n, k, group_size, interleaved != 0, tiles, tile_scales);
  require(m >= 0 && m <= kTileMaxM, where + "m=" + std::to_string(m) + " rows; at most " +
                                        std::to_string(kTileMaxM) + " are served");
  if (m > 0) {
    with_tile_rows(int(m), [&](auto rows) {
      constexpr int M = decltype(rows)::value;
      require(tile_smem_bytes<M>(k) <= tile_smem_cap<M>(),
              where + "m=" + std::to_string(m) + " rows of k=" + std::to_string(k) +
                  " (m rounded up to 1, 2, 4, 8 or 16) take " +
                  std::to_string(tile_smem_bytes<M>(k)) +
                  " bytes of shared memory, the device allows " +
                  std::to_string(tile_smem_cap<M>()) + "; quant_tile_rows(k) rows fit");
    });
  }
  require(prologue >= kGemvNone && prologue <= kGemvSiluMul,
          where + "prologue=" + std::to_string(prologue) + " unknown");
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
    if (silu_mul_out && prologue == kGemvNone) {
      launch_m<scalar_t, kGemvNone, true>(mi, o, xi, tl, sc, b, r, nw, ni, ki, x_stride,
                                          out_stride, residual_stride, eps, group_size, il, s);
    } else if (silu_mul_out) {
      launch_m<scalar_t, kGemvRmsNorm, true>(mi, o, xi, tl, sc, b, r, nw, ni, ki, x_stride,
                                             out_stride, residual_stride, eps, group_size, il, s);
    } else if (prologue == kGemvNone) {
      launch_m<scalar_t, kGemvNone>(mi, o, xi, tl, sc, b, r, nw, ni, ki, x_stride, out_stride,
                                    residual_stride, eps, group_size, il, s);
    } else if (prologue == kGemvRmsNorm) {
      launch_m<scalar_t, kGemvRmsNorm>(mi, o, xi, tl, sc, b, r, nw, ni, ki, x_stride, out_stride,
                                       residual_stride, eps, group_size, il, s);
    } else {
      launch_m<scalar_t, kGemvSiluMul>(mi, o, xi, tl, sc, b, r, nw, ni, ki, x_stride, out_stride,
                                       residual_stride, eps, group_size, il, s);
    }
  });
}

int quant_tile_rows(int64_t k) {
  require(k > 0 && k % kTileK == 0 && k <= INT32_MAX / 2,
          "quant_tile_rows: k=" + std::to_string(k) + " must be a positive multiple of 64");
  int rows = 0;
  auto fits = [&](auto m) {
    constexpr int M = decltype(m)::value;
    if (rows == 0 && tile_smem_bytes<M>(k) <= tile_smem_cap<M>()) rows = M;
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

}  // namespace tinyvllm
