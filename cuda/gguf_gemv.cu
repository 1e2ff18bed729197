// Launchers of the GGUF block GEMV and dequantize (gguf_gemv.cuh): size checks and the choice of
// instantiation, {float16, bfloat16} x {Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K} x M {1, 2, 4, 8}.
#include <string>
#include <type_traits>

#include "gguf_gemv.cuh"
#include "launchers.h"

namespace tinyvllm {
namespace {

constexpr int kGgufGemvMaxM = 8;

template <typename T, int M, int QT, int R>
void launch_rows(T* out, const T* x, const uint8_t* qweight, const T* bias, int m, int n, int k,
                 int64_t x_stride, int64_t out_stride, cudaStream_t stream) {
  const unsigned grid = unsigned((n + kGgufGemvWarps * R - 1) / (kGgufGemvWarps * R));
  if constexpr (gguf_is_kquant(QT)) {
    gguf_kquant_gemv_kernel<T, M, QT, R><<<grid, kGgufGemvWarps * 32, 0, stream>>>(
        out, x, qweight, bias, m, n, k, x_stride, out_stride);
  } else {
    gguf_gemv_kernel<T, M, QT, R><<<grid, kGgufGemvWarps * 32, 0, stream>>>(
        out, x, qweight, bias, m, n, k, x_stride, out_stride);
  }
  check_launch("gguf_gemv");
}

template <typename T, int M, int QT>
void launch_gemv(T* out, const T* x, const uint8_t* qweight, const T* bias, int m, int n, int k,
                 int64_t x_stride, int64_t out_stride, cudaStream_t s) {
  if constexpr (gguf_is_kquant(QT)) {
    launch_rows<T, M, QT, 2>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  } else if (n >= gguf_wide_rows(M)) {
    launch_rows<T, M, QT, 4>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  } else {
    launch_rows<T, M, QT, 2>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  }
}

template <typename T, int QT>
void launch_gemv_m(T* out, const T* x, const uint8_t* qweight, const T* bias, int m, int n, int k,
                   int64_t x_stride, int64_t out_stride, cudaStream_t s) {
  if (m == 1) {
    launch_gemv<T, 1, QT>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  } else if (m == 2) {
    launch_gemv<T, 2, QT>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  } else if (m <= 4) {
    launch_gemv<T, 4, QT>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  } else {
    launch_gemv<T, 8, QT>(out, x, qweight, bias, m, n, k, x_stride, out_stride, s);
  }
}

void check_layout(const std::string& where, int qtype, int64_t n, int64_t k, ptr_t qweight) {
  require(qtype == kGgufQ4_0 || qtype == kGgufQ4_1 || qtype == kGgufQ8_0 || gguf_is_kquant(qtype),
          where + "qtype=" + std::to_string(qtype) +
              "; Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13) and Q6_K (14) are served");
  require(n > 0 && n <= INT32_MAX, where + "n=" + std::to_string(n) + " out of range");
  const int64_t block = gguf_is_kquant(qtype) ? kKQuantValues : 32;
  require(k > 0 && k % block == 0 && k <= INT32_MAX / 2,
          where + "k=" + std::to_string(k) + " must be a positive multiple of " +
              std::to_string(block) + " for qtype " + std::to_string(qtype));
  if (gguf_is_kquant(qtype)) {
    require((qweight & 15) == 0, where + "qweight must be 16-byte aligned");
  } else {
    require((qweight & 3) == 0, where + "qweight must be 4-byte aligned");
  }
}

// F(std::integral_constant<int, QT>) for the runtime qtype (checked by check_layout).
template <typename F>
void dispatch_qtype(int qtype, F&& f) {
  switch (qtype) {
    case kGgufQ4_0: f(std::integral_constant<int, kGgufQ4_0>()); break;
    case kGgufQ4_1: f(std::integral_constant<int, kGgufQ4_1>()); break;
    case kGgufQ8_0: f(std::integral_constant<int, kGgufQ8_0>()); break;
    case kGgufQ4_K: f(std::integral_constant<int, kGgufQ4_K>()); break;
    case kGgufQ5_K: f(std::integral_constant<int, kGgufQ5_K>()); break;
    default: f(std::integral_constant<int, kGgufQ6_K>()); break;
  }
}

}  // namespace

void gguf_gemv(ptr_t out, ptr_t x, ptr_t qweight, ptr_t bias, int64_t m, int64_t n, int64_t k,
               int64_t x_stride, int64_t out_stride, int qtype, int dtype, stream_t stream) {
  const std::string where = "gguf_gemv: ";
  check_layout(where, qtype, n, k, qweight);
  require(m >= 0 && m <= kGgufGemvMaxM, where + "m=" + std::to_string(m) + " rows; at most " +
                                            std::to_string(kGgufGemvMaxM) + " are served");
  require(x_stride % 8 == 0 && aligned16(reinterpret_cast<void*>(x)),
          where + "x must be 16-byte aligned with x_stride a multiple of 8 (got " +
              std::to_string(x_stride) + ")");
  if (m == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "gguf_gemv", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    auto* q = reinterpret_cast<const uint8_t*>(qweight);
    auto* b = reinterpret_cast<const scalar_t*>(bias);
    const int mi = int(m), ni = int(n), ki = int(k);
    dispatch_qtype(qtype, [&](auto qt) {
      launch_gemv_m<scalar_t, decltype(qt)::value>(o, xi, q, b, mi, ni, ki, x_stride, out_stride, s);
    });
  });
}

void gguf_dequantize(ptr_t out, ptr_t qweight, ptr_t rows, int64_t num_rows, int64_t k, int qtype,
                     int dtype, stream_t stream) {
  const std::string where = "gguf_dequantize: ";
  check_layout(where, qtype, num_rows > 0 ? num_rows : 1, k, qweight);
  if (num_rows <= 0) return;
  const int threads = 256;
  const int64_t per_row = gguf_is_kquant(qtype) ? k / kKQuarterValues : k / 32;  // a thread each
  const unsigned grid = unsigned((num_rows * per_row + threads - 1) / threads);
  const cudaStream_t s = as_stream(stream);
  auto* r = reinterpret_cast<const int64_t*>(rows);
  TINYVLLM_DISPATCH_HALF(dtype, "gguf_dequantize", {
    auto* o = reinterpret_cast<scalar_t*>(out);
    auto* q = reinterpret_cast<const uint8_t*>(qweight);
    dispatch_qtype(qtype, [&](auto qt) {
      constexpr int QT = decltype(qt)::value;
      if constexpr (gguf_is_kquant(QT)) {
        gguf_kquant_dequantize_kernel<scalar_t, QT><<<grid, threads, 0, s>>>(o, q, r, int(num_rows), int(k));
      } else {
        gguf_dequantize_kernel<scalar_t, QT><<<grid, threads, 0, s>>>(o, q, r, int(num_rows), int(k));
      }
    });
    check_launch("gguf_dequantize");
  });
}

}  // namespace tinyvllm
