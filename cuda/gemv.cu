// Launchers of the skinny (decode) linear layer: checks sizes, picks the kernel (scalar, gemv.cuh;
// tensor cores, gemv_mma.cuh), M and the prologue, sizes the grid so that every warp is resident
// at once, and launches with programmatic dependent launch so that the weight prefetch overlaps
// the previous kernel's tail.
//
// Instantiations: {float16, bfloat16} x prologue {none, rmsnorm, silu_mul, merge} and the
// SwiGLU-product epilogue after {none, rmsnorm}, each x M {1, 2} (scalar) and M {4, 8, 16}
// (tensor cores).
#include <algorithm>
#include <mutex>
#include <string>

#include "gemv.cuh"
#include "gemv_mma.cuh"
#include "launchers.h"

namespace tinyvllm {
namespace {

constexpr int kGemvMaxM = 2;
constexpr int kGemvSmemBytes = 64 * 1024;  // the staged activations, M x k
constexpr int kMmaMaxM = 16;
constexpr int kMmaActBytes = 128 * 1024;   // tensor cores: the staged activations, M x k
constexpr int kMmaRingBytes = kTileWarps * kMmaStages * 4 * 32 * 16;

// f(M) with the tensor-core kernel's M for m rows: 4, 8 or 16 (an integral_constant).
template <typename F>
void with_mma_rows(int64_t m, F&& f) {
  dispatch_rows<4, 8, 16>(int(m), std::forward<F>(f));
}
int mma_rows(int64_t m) {
  int rows = 0;
  with_mma_rows(m, [&](auto r) { rows = r; });
  return rows;
}

// The tensor-core kernel's rows per CTA (its M): m rounded up to 4, 8 or 16; with chunks (mma 2,
// any m) at most as many as the staging holds of k values, down to 4.
int mma_cta_rows(int64_t m, int64_t k, bool chunks) {
  int rows = mma_rows(std::min<int64_t>(m, kMmaMaxM));
  while (chunks && rows > 4 && int64_t(rows) * k * 2 > kMmaActBytes) rows /= 2;
  return rows;
}

// CTAs of one instantiation resident per SM with `smem` bytes of staging (set up once per kernel).
template <typename T, int M, int P, bool S>
int resident_ctas(int smem) {
  auto kernel = gemv_kernel<T, M, P, S>;
  static std::once_flag once;
  std::call_once(once, [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kGemvSmemBytes),
               "gemv: cudaFuncSetAttribute");
  });
  int ctas = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kGemvWarps * 32, smem),
             "gemv: occupancy");
  return std::max(1, ctas);
}

template <typename T, int M, int P, bool S>
void launch(T* out, const T* x, const T* weight, const T* bias, const T* residual,
            const T* norm_weight, int m, int n, int k, int64_t x_stride, int64_t out_stride,
            int64_t residual_stride, float eps, bool prefetch_all, const DecodePartitions& parts,
            cudaStream_t stream) {
  const int smem = M * k * int(sizeof(T));
  // At least one row per warp; at most what is resident at once.
  const int64_t wanted = (int64_t(S ? n / 2 : n) + kGemvWarps - 1) / kGemvWarps;
  const int grid =
      int(std::min<int64_t>(wanted, int64_t(num_sms()) * resident_ctas<T, M, P, S>(smem)));
  launch_pdl(gemv_kernel<T, M, P, S>, dim3(grid), dim3(kGemvWarps * 32), smem, stream, out, x,
             weight, bias, residual, norm_weight, m, n, k, x_stride, out_stride, residual_stride,
             eps, parts, prefetch_all);
}

// Tensor cores: each CTA takes ceil(bands / resident CTAs) bands (strided), all CTAs resident.
template <typename T, int M, int P, bool S>
void launch_mma(T* out, const T* x, const T* weight, const T* bias, const T* residual,
                const T* norm_weight, int m, int n, int k, int64_t x_stride, int64_t out_stride,
                int64_t residual_stride, float eps, const DecodePartitions& parts,
                cudaStream_t stream) {
  auto kernel = gemv_mma_kernel<T, M, P, S>;
  static std::once_flag once;
  std::call_once(once, [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kMmaActBytes + kMmaRingBytes),
               "gemv (tensor cores): cudaFuncSetAttribute");
  });
  const int smem = M * k * int(sizeof(T)) + kMmaRingBytes;
  const int grid = resident_grid(kernel, kTileWarps * 32, smem, (n + kTileRows - 1) / kTileRows,
                                 "gemv (tensor cores): occupancy");
  // gridDim.y: chunks of M rows (more than M rows only with mma 2)
  launch_pdl(kernel, dim3(grid, unsigned((m + M - 1) / M)), dim3(kTileWarps * 32), smem, stream,
             out, x, weight, bias, residual, norm_weight, m, n, k, x_stride, out_stride,
             residual_stride, eps, parts);
}

template <typename T, int P, bool S = false>
void launch_m(int m, T* out, const T* x, const T* weight, const T* bias, const T* residual,
              const T* norm_weight, int n, int k, int64_t x_stride, int64_t out_stride,
              int64_t residual_stride, float eps, bool prefetch_all, int mma, cudaStream_t s,
              const DecodePartitions& parts = {}) {
  if (mma) {
    dispatch_rows<4, 8, 16>(mma_cta_rows(m, k, mma == 2), [&](auto rows) {
      launch_mma<T, decltype(rows)::value, P, S>(out, x, weight, bias, residual, norm_weight, m,
                                                 n, k, x_stride, out_stride, residual_stride,
                                                 eps, parts, s);
    });
  } else {
    dispatch_rows<1, 2>(m, [&](auto rows) {
      launch<T, decltype(rows)::value, P, S>(out, x, weight, bias, residual, norm_weight, m, n,
                                             k, x_stride, out_stride, residual_stride, eps,
                                             prefetch_all, parts, s);
    });
  }
}

// Sizes every GEMV entry point checks ("gemv: ..." / "gemv_merge: ..."); mma: the tensor-core
// kernel, which stages m rounded up to 4, 8 or 16 rows.
void check_shape(const std::string& where, int64_t m, int64_t n, int64_t k, int mma_mode) {
  const bool mma = mma_mode != 0, chunks = mma_mode == 2;
  const int64_t max_m = chunks ? int64_t(4) * 65535 : mma ? kMmaMaxM : kGemvMaxM;
  require(mma_mode >= 0 && mma_mode <= 2, where + "mma=" + std::to_string(mma_mode) + " unknown");
  require(m >= 0 && m <= max_m, where + "m=" + std::to_string(m) + " rows; at most " +
                                    std::to_string(max_m) + " are served" +
                                    (mma ? " (tensor cores)" : ""));
  require(n > 0 && n <= INT32_MAX / 2, where + "n=" + std::to_string(n) + " out of range");
  require(k > 0 && k % (mma ? kTileK : 8) == 0 && k <= INT32_MAX / 2,
          where + "k=" + std::to_string(k) + " must be a positive multiple of " +
              (mma ? "64 (tensor cores)" : "8"));
  const int64_t staged = mma ? mma_cta_rows(m, k, chunks) * k : m * k;
  const int64_t limit = (mma ? kMmaActBytes : kGemvSmemBytes) / 2;
  require(staged <= limit, where + "m * k = " + std::to_string(staged) +
                               (mma ? " activations (m rounded up to 4, 8 or 16)" : " activations") +
                               " exceed the staging buffer (" + std::to_string(limit) + ")");
}

}  // namespace

void gemv(ptr_t out, ptr_t x, ptr_t weight, ptr_t bias, ptr_t residual, ptr_t norm_weight,
          int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride,
          int64_t residual_stride, float eps, int prologue, int silu_mul_out, int prefetch_weight,
          int mma, int dtype, stream_t stream) {
  const std::string where = "gemv: ";
  check_shape(where, m, n, k, mma);
  require(prologue >= kGemvNone && prologue <= kGemvSiluMul,
          where + "prologue=" + std::to_string(prologue) + " unknown");
  require(!silu_mul_out || (n % (mma ? kTileRows : 2) == 0 && residual == 0 &&
                            prologue != kGemvSiluMul),
          where + "silu_mul_out needs n=" + std::to_string(n) + " a multiple of " +
              (mma ? "16 (tensor cores)" : "2") + ", no residual and no silu_mul prologue");
  require(x_stride % 8 == 0, where + "x_stride=" + std::to_string(x_stride) +
                                 " must be a multiple of 8 elements (16-byte rows)");
  require(prologue != kGemvRmsNorm || norm_weight != 0, where + "rmsnorm needs norm_weight");
  for (ptr_t p : {x, weight, norm_weight}) {
    require(p == 0 || aligned16(reinterpret_cast<void*>(p)),
            where + "x, weight and norm_weight must be 16-byte aligned");
  }
  if (m == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "gemv", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    auto* w = reinterpret_cast<const scalar_t*>(weight);
    auto* b = reinterpret_cast<const scalar_t*>(bias);
    auto* r = reinterpret_cast<const scalar_t*>(residual);
    auto* nw = reinterpret_cast<const scalar_t*>(norm_weight);
    const int mi = int(m), ni = int(n), ki = int(k);
    const bool pf = prefetch_weight != 0;
    const int tc = mma;
    if (silu_mul_out && prologue == kGemvNone) {
      launch_m<scalar_t, kGemvNone, true>(mi, o, xi, w, b, r, nw, ni, ki, x_stride, out_stride,
                                          residual_stride, eps, pf, tc, s);
    } else if (silu_mul_out) {
      launch_m<scalar_t, kGemvRmsNorm, true>(mi, o, xi, w, b, r, nw, ni, ki, x_stride,
                                             out_stride, residual_stride, eps, pf, tc, s);
    } else if (prologue == kGemvNone) {
      launch_m<scalar_t, kGemvNone>(mi, o, xi, w, b, r, nw, ni, ki, x_stride, out_stride,
                                    residual_stride, eps, pf, tc, s);
    } else if (prologue == kGemvRmsNorm) {
      launch_m<scalar_t, kGemvRmsNorm>(mi, o, xi, w, b, r, nw, ni, ki, x_stride, out_stride,
                                       residual_stride, eps, pf, tc, s);
    } else {
      launch_m<scalar_t, kGemvSiluMul>(mi, o, xi, w, b, r, nw, ni, ki, x_stride, out_stride,
                                       residual_stride, eps, pf, tc, s);
    }
  });
}

void gemv_merge(ptr_t out, ptr_t split_out, ptr_t split_max, ptr_t split_sum, ptr_t seq_lens,
                ptr_t weight, ptr_t bias, ptr_t residual, int64_t m, int64_t n, int num_heads,
                int head_dim, int num_splits, int partition_size, int64_t out_stride,
                int64_t residual_stride, int mma, int dtype, stream_t stream) {
  const std::string where = "gemv_merge: ";
  const DecodePartitions parts =
      checked_partitions(where, split_out, split_max, split_sum, seq_lens, int(m), num_heads,
                         head_dim, num_splits, partition_size);
  const int64_t k = int64_t(num_heads) * head_dim;
  require(mma == 0 || mma == 1, where + "mma=" + std::to_string(mma) + " unknown");
  check_shape(where, m, n, k, mma);
  require(aligned16(reinterpret_cast<void*>(weight)), where + "weight must be 16-byte aligned");
  if (m == 0) return;
  TINYVLLM_DISPATCH_HALF(dtype, "gemv_merge", {
    launch_m<scalar_t, kGemvMergeSplits>(
        int(m), reinterpret_cast<scalar_t*>(out), nullptr,
        reinterpret_cast<const scalar_t*>(weight), reinterpret_cast<const scalar_t*>(bias),
        reinterpret_cast<const scalar_t*>(residual), nullptr, int(n), int(k), k, out_stride,
        residual_stride, 0.f, true, mma, as_stream(stream), parts);
  });
}

}  // namespace tinyvllm
