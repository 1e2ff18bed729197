// Launchers of the GGUF block GEMV and dequantize (gguf_gemv.cuh): size checks and the choice of
// instantiation (gguf_gemv_launch.cuh; the RMSNorm prologue's are in gguf_gemv_rmsnorm.cu).
#include <string>
#include <type_traits>

#include "gguf_gemv_launch.cuh"

namespace tinyvllm {

extern template void gguf_gemv_prologue<__half, kGemvRmsNorm>(const GgufGemvArgs<__half>&, int,
                                                              cudaStream_t);
extern template void gguf_gemv_prologue<__nv_bfloat16, kGemvRmsNorm>(
    const GgufGemvArgs<__nv_bfloat16>&, int, cudaStream_t);

namespace {

constexpr int kGgufGemvMaxM = 8;

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

}  // namespace

void gguf_gemv(ptr_t out, ptr_t x, ptr_t qweight, ptr_t bias, ptr_t residual, ptr_t norm_weight,
               int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride,
               int64_t residual_stride, float eps, int prologue, int silu_mul_out, int qtype,
               int dtype, stream_t stream) {
  const std::string where = "gguf_gemv: ";
  check_layout(where, qtype, n, k, qweight);
  require(m >= 0 && m <= kGgufGemvMaxM, where + "m=" + std::to_string(m) + " rows; at most " +
                                            std::to_string(kGgufGemvMaxM) + " are served");
  require(x_stride % 8 == 0 && aligned16(reinterpret_cast<void*>(x)),
          where + "x must be 16-byte aligned with x_stride a multiple of 8 (got " +
              std::to_string(x_stride) + ")");
  require(prologue == kGemvNone || prologue == kGemvRmsNorm,
          where + "prologue=" + std::to_string(prologue) +
              "; none (0) and rms_norm (1) are served");
  require(prologue != kGemvRmsNorm || (norm_weight != 0 && aligned16(reinterpret_cast<void*>(
                                                               norm_weight))),
          where + "rms_norm needs a 16-byte aligned norm_weight");
  require(!silu_mul_out || n % 2 == 0,
          where + "silu_mul_out needs an even n (gate rows then up rows), got n=" +
              std::to_string(n));
  require(!(silu_mul_out && residual), where + "silu_mul_out takes no residual");
  if (m == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "gguf_gemv", {
    using T = scalar_t;
    const GgufGemvArgs<T> a{reinterpret_cast<T*>(out), reinterpret_cast<const T*>(x),
                            reinterpret_cast<const uint8_t*>(qweight),
                            reinterpret_cast<const T*>(bias), reinterpret_cast<const T*>(residual),
                            reinterpret_cast<const T*>(norm_weight), int(m), int(n), int(k),
                            x_stride, out_stride, residual_stride, eps, silu_mul_out != 0};
    if (prologue == kGemvRmsNorm) {
      gguf_gemv_prologue<T, kGemvRmsNorm>(a, qtype, s);
    } else {
      gguf_gemv_prologue<T, kGemvNone>(a, qtype, s);
    }
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
    gguf_launch::dispatch_qtype(qtype, [&](auto qt) {
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
