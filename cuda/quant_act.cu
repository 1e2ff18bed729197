// Launchers of the per-token activation quantization (quant_act.cuh): alone (quantize_rows) and
// fused into the RMSNorm or SwiGLU before a W8A8 projection; and of the int8 GEMM's epilogue.
//
// Instantiations: {float32, float16, bfloat16} x {int8, fp8 e4m3} x {16-byte packs, single
// elements} per quantizing kernel (dispatch_quant); the wide form runs when the row length,
// strides and pointers allow 16-byte accesses of the activation.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "launchers.h"
#include "quant_act.cuh"

namespace tinyvllm {
namespace {

// The checks every quantizing launcher makes of its quantization arguments, then them as the
// kernels take them (qmin: -qmax for fp8, -qmax - 1 for int8).
RowQuant row_quant(const char* name, ptr_t static_scale, float qmax, float scale_divisor,
                   float min_absmax, int qdtype) {
  require(qdtype == kInt8 || qdtype == kFloat8E4M3,
          std::string(name) + ": qdtype must be int8 or float8_e4m3fn, got " +
              dtype_name(qdtype));
  require(qmax > 0.f, std::string(name) + ": qmax must be positive");
  require(scale_divisor > 0.f && std::isfinite(scale_divisor),
          std::string(name) + ": scale_divisor must be positive and finite");
  const float qmin = qdtype == kInt8 ? -qmax - 1.f : -qmax;
  return {reinterpret_cast<const float*>(static_scale), scale_divisor, qmin, qmax, min_absmax};
}

void require_rows(const char* name, const char* what, int n, int64_t num_tokens) {
  require(n > 0, std::string(name) + ": " + what + "=" + std::to_string(n) + " must be positive");
  require(num_tokens >= 0 && num_tokens <= INT32_MAX,
          std::string(name) + ": num_tokens=" + std::to_string(num_tokens) + " out of range");
}

// Calls launch(kInt8, kN) as std::integral_constants for the run-time choice; the instantiations
// of each quantizing kernel: {int8, fp8 e4m3} x {16-byte packs of the activation (kWide
// elements), single elements}, for each activation dtype.
template <int kWide, typename Launch>
void dispatch_quant(int qdtype, bool wide, const Launch& launch) {
  using Int8 = std::true_type;
  using Fp8 = std::false_type;
  using Wide = std::integral_constant<int, kWide>;
  using Single = std::integral_constant<int, 1>;
  if (qdtype == kInt8) {
    wide ? launch(Int8{}, Wide{}) : launch(Int8{}, Single{});
  } else {
    wide ? launch(Fp8{}, Wide{}) : launch(Fp8{}, Single{});
  }
}

}  // namespace

void quantize_rows(ptr_t out,           // [num_tokens, k] int8 / fp8 e4m3, row stride out_stride
                   ptr_t scales,        // [num_tokens] float32
                   ptr_t x,             // [num_tokens, k], row stride x_stride
                   ptr_t static_scale,  // [1] float32, or 0: dynamic (one scale per row)
                   int64_t num_tokens, int k, int64_t x_stride, int64_t out_stride,
                   float qmax, float scale_divisor, float min_absmax, int dtype, int qdtype,
                   stream_t stream) {
  require_rows("quantize_rows", "k", k, num_tokens);
  const RowQuant rq =
      row_quant("quantize_rows", static_scale, qmax, scale_divisor, min_absmax, qdtype);
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  auto* o = reinterpret_cast<uint8_t*>(out);
  auto* sc = reinterpret_cast<float*>(scales);
  TINYVLLM_DISPATCH_FLOAT(dtype, "quantize_rows", {
    auto* xi = reinterpret_cast<const scalar_t*>(x);
    constexpr int n = 16 / sizeof(scalar_t);
    const bool wide = can_go_wide(sizeof(scalar_t), k, {x_stride, out_stride}, {x}) && out % n == 0;
    const unsigned threads = row_threads(wide ? k / n : k);
    dispatch_quant<n>(qdtype, wide, [&](auto int8, auto width) {
      constexpr auto kernel =
          quantize_rows_kernel<scalar_t, decltype(int8)::value, decltype(width)::value>;
      kernel<<<unsigned(num_tokens), threads, 0, s>>>(o, sc, xi, rq.static_scale, k, x_stride,
                                                      out_stride, rq.scale_divisor, rq.qmin,
                                                      rq.qmax, rq.min_absmax);
    });
  });
  check_launch("quantize_rows_kernel");
}

void rms_norm_quant(ptr_t out,           // [num_tokens, hidden] int8 / fp8 e4m3, out_stride
                    ptr_t scales,        // [num_tokens] float32
                    ptr_t x,             // [num_tokens, hidden], row stride x_stride
                    ptr_t residual,      // [num_tokens, hidden], residual_stride; 0 = none
                    ptr_t weight,        // [hidden]
                    ptr_t static_scale,  // [1] float32, or 0: dynamic (one scale per row)
                    int64_t num_tokens, int hidden, int64_t x_stride, int64_t residual_stride,
                    int64_t out_stride, float eps, float qmax, float scale_divisor,
                    float min_absmax, int dtype, int qdtype, stream_t stream) {
  require_rows("rms_norm_quant", "hidden", hidden, num_tokens);
  const RowQuant rq =
      row_quant("rms_norm_quant", static_scale, qmax, scale_divisor, min_absmax, qdtype);
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_FLOAT(dtype, "rms_norm_quant", {
    constexpr int n = 16 / sizeof(scalar_t);
    // rms_norm's choice for a fresh output (layers.cu), and 8-bit packs that fit q's rows.
    const bool wide = can_go_wide(sizeof(scalar_t), hidden,
                                  {x_stride, residual ? residual_stride : 0}, {x, residual, weight})
                      && out_stride % n == 0 && out % n == 0;
    const unsigned threads = row_threads(wide ? hidden / n : hidden);
    dispatch_quant<n>(qdtype, wide, [&](auto int8, auto width) {
      constexpr auto kernel =
          rms_norm_quant_kernel<scalar_t, decltype(int8)::value, decltype(width)::value>;
      kernel<<<unsigned(num_tokens), threads, 0, s>>>(
          reinterpret_cast<uint8_t*>(out), reinterpret_cast<float*>(scales),
          reinterpret_cast<const scalar_t*>(x), reinterpret_cast<scalar_t*>(residual),
          reinterpret_cast<const scalar_t*>(weight), rq, hidden, x_stride, residual_stride,
          out_stride, eps);
    });
  });
  check_launch("rms_norm_quant_kernel");
}

void silu_and_mul_quant(ptr_t out,           // [num_tokens, d] int8 / fp8 e4m3, out_stride
                        ptr_t scales,        // [num_tokens] float32
                        ptr_t x,             // [num_tokens, 2 * d] (gate | up), x_stride
                        ptr_t static_scale,  // [1] float32, or 0: dynamic (one scale per row)
                        int64_t num_tokens, int d, int64_t x_stride, int64_t out_stride,
                        float qmax, float scale_divisor, float min_absmax, int dtype, int qdtype,
                        stream_t stream) {
  require_rows("silu_and_mul_quant", "d", d, num_tokens);
  const RowQuant rq =
      row_quant("silu_and_mul_quant", static_scale, qmax, scale_divisor, min_absmax, qdtype);
  if (num_tokens == 0) return;
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_FLOAT(dtype, "silu_and_mul_quant", {
    constexpr int n = 16 / sizeof(scalar_t);
    const bool wide = can_go_wide(sizeof(scalar_t), d, {x_stride, out_stride}, {x}) && out % n == 0;
    const unsigned threads = row_threads(wide ? d / n : d, kSiluQuantThreads);
    dispatch_quant<n>(qdtype, wide, [&](auto int8, auto width) {
      constexpr auto kernel =
          silu_and_mul_quant_kernel<scalar_t, decltype(int8)::value, decltype(width)::value>;
      kernel<<<unsigned(num_tokens), threads, 0, s>>>(
          reinterpret_cast<uint8_t*>(out), reinterpret_cast<float*>(scales),
          reinterpret_cast<const scalar_t*>(x), rq, d, x_stride, out_stride);
    });
  });
  check_launch("silu_and_mul_quant_kernel");
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
