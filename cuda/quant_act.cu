// Launcher of the per-token activation quantization (quant_act.cuh).
#include <algorithm>
#include <cmath>
#include <string>

#include "launchers.h"
#include "quant_act.cuh"

namespace tinyvllm {

void quantize_rows(ptr_t out,           // [num_tokens, k] int8 / fp8 e4m3, row stride out_stride
                   ptr_t scales,        // [num_tokens] float32
                   ptr_t x,             // [num_tokens, k], row stride x_stride
                   ptr_t static_scale,  // [1] float32, or 0: dynamic (one scale per row)
                   int64_t num_tokens, int k, int64_t x_stride, int64_t out_stride,
                   float qmax, float scale_divisor, float min_absmax, int dtype, int qdtype,
                   stream_t stream) {
  require(k > 0, "quantize_rows: k=" + std::to_string(k) + " must be positive");
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          "quantize_rows: num_tokens=" + std::to_string(num_tokens) + " out of range");
  require(qdtype == kInt8 || qdtype == kFloat8E4M3,
          std::string("quantize_rows: qdtype must be int8 or float8_e4m3fn, got ") +
              dtype_name(qdtype));
  require(qmax > 0.f, "quantize_rows: qmax must be positive");
  require(scale_divisor > 0.f && std::isfinite(scale_divisor),
          "quantize_rows: scale_divisor must be positive and finite");
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  const float qmin = qdtype == kInt8 ? -qmax - 1.f : -qmax;
  auto* o = reinterpret_cast<uint8_t*>(out);
  auto* sc = reinterpret_cast<float*>(scales);
  auto* st = reinterpret_cast<const float*>(static_scale);
  TINYVLLM_DISPATCH_FLOAT(dtype, "quantize_rows", {
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    constexpr int n = 16 / sizeof(scalar_t);
    const bool wide = k % n == 0 && x_stride % n == 0 && out_stride % n == 0 &&
                      aligned16(reinterpret_cast<void*>(x)) && out % n == 0;
    const int64_t packs = wide ? k / n : k;
    const unsigned threads = static_cast<unsigned>(
        std::min<int64_t>(kRowThreads, std::max<int64_t>(32, (packs + 31) / 32 * 32)));
    const unsigned grid = static_cast<unsigned>(num_tokens);
    if (qdtype == kInt8) {
      if (wide) {
        quantize_rows_kernel<scalar_t, true, n><<<grid, threads, 0, s>>>(
            o, sc, xi, st, k, x_stride, out_stride, scale_divisor, qmin, qmax, min_absmax);
      } else {
        quantize_rows_kernel<scalar_t, true, 1><<<grid, threads, 0, s>>>(
            o, sc, xi, st, k, x_stride, out_stride, scale_divisor, qmin, qmax, min_absmax);
      }
    } else if (wide) {
      quantize_rows_kernel<scalar_t, false, n><<<grid, threads, 0, s>>>(
          o, sc, xi, st, k, x_stride, out_stride, scale_divisor, qmin, qmax, min_absmax);
    } else {
      quantize_rows_kernel<scalar_t, false, 1><<<grid, threads, 0, s>>>(
          o, sc, xi, st, k, x_stride, out_stride, scale_divisor, qmin, qmax, min_absmax);
    }
  });
  check_launch("quantize_rows_kernel");
}

void rescale_int32(ptr_t out,      // [m, n] dtype, row stride out_stride
                   ptr_t acc,      // [m, n] int32, row stride acc_stride
                   ptr_t x_scale,  // [m] float32
                   ptr_t w_scale,  // [n] float32
                   ptr_t bias,     // [n] dtype, or 0
                   int64_t m, int n, int64_t acc_stride, int64_t out_stride, int dtype,
                   stream_t stream) {
  require(n > 0, "rescale_int32: n=" + std::to_string(n) + " must be positive");
  require(m >= 0 && m <= INT32_MAX, "rescale_int32: m=" + std::to_string(m) + " out of range");
  if (m == 0) return;
  const cudaStream_t s = as_stream(stream);
  const int64_t quads = (n + 3) / 4;
  const unsigned threads = static_cast<unsigned>(
      std::min<int64_t>(kRowThreads, std::max<int64_t>(32, (quads + 31) / 32 * 32)));
  const dim3 grid(static_cast<unsigned>(m), static_cast<unsigned>((quads + threads - 1) / threads));
  TINYVLLM_DISPATCH_FLOAT(dtype, "rescale_int32", {
    rescale_int32_kernel<scalar_t><<<grid, threads, 0, s>>>(
        reinterpret_cast<scalar_t*>(out), reinterpret_cast<const int32_t*>(acc),
        reinterpret_cast<const float*>(x_scale), reinterpret_cast<const float*>(w_scale),
        reinterpret_cast<const scalar_t*>(bias), n, acc_stride, out_stride);
  });
  check_launch("rescale_int32_kernel");
}

}  // namespace tinyvllm
