// Launchers of the weight-only quantized linear layers (quant_gemv.cuh): size checks and the
// choice of instantiation, {float16, bfloat16} x bits {4, 8} x M {1, 2, 4, 8} for the GEMV.
#include <string>

#include "launchers.h"
#include "quant_gemv.cuh"

namespace tinyvllm {
namespace {

constexpr int kQuantGemvMaxM = 8;   // the SIMT kernel (any bits)
constexpr int kQuantMmaMaxM = 16;   // the tensor-core kernel (4 bits, k % 64 == 0)

template <typename T>
void launch_mma(T* out, const T* x, const uint32_t* qweight, const T* scales, const T* zeros,
                const T* bias, int m, int n, int k, int64_t x_stride, int64_t out_stride,
                int group_size, cudaStream_t stream) {
  const int grid = (n + 15) / 16;
  if (m <= 8) {
    quant_mma_kernel<T, 1><<<grid, kQuantMmaWarps * 32, 0, stream>>>(
        out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride, group_size);
  } else {
    quant_mma_kernel<T, 2><<<grid, kQuantMmaWarps * 32, 0, stream>>>(
        out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride, group_size);
  }
  check_launch("quant_gemv (mma)");
}

template <typename T, int M, int BITS>
void launch_gemv(T* out, const T* x, const uint32_t* qweight, const T* scales, const T* zeros,
                 const T* bias, int m, int n, int k, int64_t x_stride, int64_t out_stride,
                 int group_size, cudaStream_t stream) {
  constexpr int kRowsPerCta = kQuantGemvWarps * kQuantRowsPerWarp;
  const int grid = (n + kRowsPerCta - 1) / kRowsPerCta;
  quant_gemv_kernel<T, M, BITS><<<grid, kQuantGemvWarps * 32, 0, stream>>>(
      out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride, group_size);
  check_launch("quant_gemv");
}

template <typename T, int BITS>
void launch_gemv_m(T* out, const T* x, const uint32_t* qweight, const T* scales, const T* zeros,
                   const T* bias, int m, int n, int k, int64_t x_stride, int64_t out_stride,
                   int group_size, cudaStream_t s) {
  if (m == 1) {
    launch_gemv<T, 1, BITS>(out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride,
                            group_size, s);
  } else if (m == 2) {
    launch_gemv<T, 2, BITS>(out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride,
                            group_size, s);
  } else if (m <= 4) {
    launch_gemv<T, 4, BITS>(out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride,
                            group_size, s);
  } else {
    launch_gemv<T, 8, BITS>(out, x, qweight, scales, zeros, bias, m, n, k, x_stride, out_stride,
                            group_size, s);
  }
}

// What both entry points check ("quant_gemv: ..." / "quant_dequantize: ...").
void check_layout(const std::string& where, int64_t n, int64_t k, int bits, int group_size,
                  ptr_t qweight) {
  require(bits == 4 || bits == 8, where + "bits=" + std::to_string(bits) + "; 4 or 8 are served");
  require(n > 0 && n <= INT32_MAX, where + "n=" + std::to_string(n) + " out of range");
  require(k > 0 && k % 32 == 0 && k <= INT32_MAX / 2,
          where + "k=" + std::to_string(k) + " must be a positive multiple of 32");
  require(group_size > 0 && group_size % 32 == 0 && k % group_size == 0,
          where + "group_size=" + std::to_string(group_size) +
              " must be a multiple of 32 that divides k=" + std::to_string(k));
  require(aligned16(reinterpret_cast<void*>(qweight)), where + "qweight must be 16-byte aligned");
}

}  // namespace

void quant_gemv(ptr_t out, ptr_t x, ptr_t qweight, ptr_t scales, ptr_t zeros, ptr_t bias,
                int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride, int bits,
                int group_size, int method, int dtype, stream_t stream) {
  const std::string where = "quant_gemv: ";
  check_layout(where, n, k, bits, group_size, qweight);
  const bool mma_fits = bits == 4 && k % kQuantMmaTileK == 0;
  require(method >= 0 && method <= 2, where + "method=" + std::to_string(method) + " unknown");
  require(method != 2 || mma_fits, where + "method=2 (tensor cores) needs bits=4 and k a "
                                           "multiple of 64, got bits=" + std::to_string(bits) +
                                           " k=" + std::to_string(k));
  // Auto: tensor cores from 3 rows where they fit, else the SIMT kernel. On an H100 at 8B shapes
  // (cuda/NOTES.md) the SIMT kernel is 1.3-1.6x faster at m = 1 and 2, the tensor-core one
  // 1.0-1.25x faster at m = 4 and 1.7-2.0x at m = 8.
  const bool use_mma = method == 2 || (method == 0 && mma_fits && m >= 3);
  const int max_m = use_mma ? kQuantMmaMaxM : kQuantGemvMaxM;
  require(m >= 0 && m <= max_m, where + "m=" + std::to_string(m) + " rows; at most " +
                                    std::to_string(max_m) + " are served here");
  require(x_stride % 8 == 0 && aligned16(reinterpret_cast<void*>(x)),
          where + "x must be 16-byte aligned with x_stride a multiple of 8 (got " +
              std::to_string(x_stride) + ")");
  if (m == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "quant_gemv", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    auto* q = reinterpret_cast<const uint32_t*>(qweight);
    auto* sc = reinterpret_cast<const scalar_t*>(scales);
    auto* z = reinterpret_cast<const scalar_t*>(zeros);
    auto* b = reinterpret_cast<const scalar_t*>(bias);
    if (use_mma) {
      launch_mma<scalar_t>(o, xi, q, sc, z, b, int(m), int(n), int(k), x_stride, out_stride,
                           group_size, s);
    } else if (bits == 4) {
      launch_gemv_m<scalar_t, 4>(o, xi, q, sc, z, b, int(m), int(n), int(k), x_stride,
                                 out_stride, group_size, s);
    } else {
      launch_gemv_m<scalar_t, 8>(o, xi, q, sc, z, b, int(m), int(n), int(k), x_stride,
                                 out_stride, group_size, s);
    }
  });
}

void quant_dequantize(ptr_t out, ptr_t qweight, ptr_t scales, ptr_t zeros, int64_t n, int64_t k,
                      int bits, int group_size, int dtype, stream_t stream) {
  const std::string where = "quant_dequantize: ";
  check_layout(where, n, k, bits, group_size, qweight);
  require(aligned16(reinterpret_cast<void*>(out)), where + "out must be 16-byte aligned");
  const cudaStream_t s = as_stream(stream);
  const int64_t words = n * k / (32 / bits);
  const int threads = 256;
  const unsigned grid = unsigned((words + threads - 1) / threads);
  TINYVLLM_DISPATCH_HALF(dtype, "quant_dequantize", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* q = reinterpret_cast<const uint32_t*>(qweight);
    auto* sc = reinterpret_cast<const scalar_t*>(scales);
    auto* z = reinterpret_cast<const scalar_t*>(zeros);
    if (bits == 4) {
      quant_dequantize_kernel<scalar_t, 4><<<grid, threads, 0, s>>>(o, q, sc, z, int(n), int(k),
                                                                     group_size);
    } else {
      quant_dequantize_kernel<scalar_t, 8><<<grid, threads, 0, s>>>(o, q, sc, z, int(n), int(k),
                                                                     group_size);
    }
    check_launch("quant_dequantize");
  });
}

}  // namespace tinyvllm
