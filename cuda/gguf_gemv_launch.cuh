// Launch templates of the GGUF block GEMV (gguf_gemv.cuh), shared by the translation units that
// instantiate them: gguf_gemv.cu (no prologue) and gguf_gemv_rmsnorm.cu (the RMSNorm prologue),
// which compile side by side.
#pragma once

#include <string>
#include <type_traits>

#include "gguf_gemv.cuh"
#include "launchers.h"

namespace tinyvllm {
namespace gguf_launch {

// The dynamic shared memory one instantiation may take on this device (dynamic_smem_cap), set as
// its limit (once; kGemvNone stages nothing).
template <typename... Params>
int stage_cap(void (*kernel)(Params...)) {
  const int cap = dynamic_smem_cap(kernel, "gguf_gemv: shared memory per block");
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cap),
             "gguf_gemv: cudaFuncSetAttribute");
  return cap;
}

template <typename T, int M, int QT, int R, int P>
void launch_rows(const GgufGemvArgs<T>& a, cudaStream_t stream) {
  auto kernel = [] {
    if constexpr (gguf_is_kquant(QT)) {
      return gguf_kquant_gemv_kernel<T, M, QT, R, P>;
    } else {
      return gguf_gemv_kernel<T, M, QT, R, P>;
    }
  }();
  const int smem = gguf_stage_bytes(P, M, a.k);
  if constexpr (P != kGemvNone) {
    static const int cap = stage_cap(kernel);
    require(smem <= cap, "gguf_gemv: k=" + std::to_string(a.k) + " at " + std::to_string(M) +
                             " rows needs " + std::to_string(smem) +
                             " bytes of shared memory for the staged x; this GPU gives " +
                             std::to_string(cap));
  }
  const int per_warp = a.silu_out ? R / 2 : R;
  const int64_t warps = (int64_t(a.silu_out ? a.n / 2 : a.n) + per_warp - 1) / per_warp;
  const unsigned grid = unsigned((warps + kGgufGemvWarps - 1) / kGgufGemvWarps);
  launch_pdl(kernel, dim3(grid), dim3(kGgufGemvWarps * 32), smem, stream, a);
  check_launch("gguf_gemv");
}

template <typename T, int M, int QT, int P>
void launch_gemv(const GgufGemvArgs<T>& a, cudaStream_t s) {
  if constexpr (gguf_is_kquant(QT)) {
    launch_rows<T, M, QT, 2, P>(a, s);
  } else if ((a.silu_out ? a.n / 2 : a.n) >= gguf_wide_rows(M)) {
    launch_rows<T, M, QT, 4, P>(a, s);
  } else {
    launch_rows<T, M, QT, 2, P>(a, s);
  }
}

template <typename T, int QT, int P>
void launch_gemv_m(const GgufGemvArgs<T>& a, cudaStream_t s) {
  if (a.m == 1) {
    launch_gemv<T, 1, QT, P>(a, s);
  } else if (a.m == 2) {
    launch_gemv<T, 2, QT, P>(a, s);
  } else if (a.m <= 4) {
    launch_gemv<T, 4, QT, P>(a, s);
  } else {
    launch_gemv<T, 8, QT, P>(a, s);
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

}  // namespace gguf_launch

// The GEMV with prologue P for the runtime qtype: {float16, bfloat16} x {Q4_0, Q4_1, Q8_0, Q4_K,
// Q5_K, Q6_K} x M {1, 2, 4, 8} (checked by the caller, gguf_gemv).
template <typename T, int P>
void gguf_gemv_prologue(const GgufGemvArgs<T>& a, int qtype, cudaStream_t s) {
  gguf_launch::dispatch_qtype(qtype, [&](auto qt) {
    gguf_launch::launch_gemv_m<T, decltype(qt)::value, P>(a, s);
  });
}

}  // namespace tinyvllm
