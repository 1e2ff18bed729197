#include "linear.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <vector>

namespace tinyvllm::cpu {
namespace {

constexpr int64_t kRowAlign = 4;            // the GEMV tile: 4 weight rows
constexpr int64_t kMinRowsPerThread = 32;   // below this a wake-up costs more than it saves
constexpr int64_t kParallelQuantizeRows = 16;
constexpr int64_t kQuantizeGrain = 4;
constexpr int64_t kChunksPerThread = 8;

bool cpu_has_avx2() {
#if defined(TINYVLLM_HAVE_AVX2)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::vector<ActBlock>& act_buffer(int64_t size) {
  static std::vector<ActBlock> buffer;  // reused: guarded by kernel_mutex()
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer;
}

}  // namespace

void quantize_rows(const Kernels& kern, const float* x, int64_t x_stride, int64_t m, int64_t nb,
                   ActBlock* xq, ThreadPool& workers) {
  if (m < kParallelQuantizeRows || workers.num_threads() == 1) {
    for (int64_t j = 0; j < m; ++j) kern.quantize_row(x + j * x_stride, nb, xq + j * nb);
    return;
  }
  workers.run(m, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) kern.quantize_row(x + j * x_stride, nb, xq + j * nb);
  });
}

void gemm_parallel(const Kernels& kern, GemmArgs args, int64_t n, ThreadPool& workers) {
  if (kern.prepare) {
    const int64_t pieces = kern.prepare(args);
    if (pieces > 1 && workers.num_threads() > 1) {
      workers.run(pieces, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) kern.prepare_piece(args, i);
      });
    } else {
      for (int64_t i = 0; i < pieces; ++i) kern.prepare_piece(args, i);
    }
  }
  if (n < 2 * kMinRowsPerThread || workers.num_threads() == 1) {
    return kern.gemm_rows(args, 0, n);
  }
  // Chunks of whole tiles, a few per thread, so a late worker's share goes to the others.
  const int64_t tiles = (n + kRowAlign - 1) / kRowAlign;
  const int64_t grain = std::max<int64_t>(kMinRowsPerThread / kRowAlign,
                                          tiles / (kChunksPerThread * workers.num_threads()));
  workers.run(tiles, grain, [&](int64_t begin, int64_t end) {
    kern.gemm_rows(args, begin * kRowAlign, std::min(end * kRowAlign, n));
  });
}

void int8_linear(const float* x, int64_t x_stride, const int8_t* w, const float* w_scale,
                 const float* input_scale, float scale_divisor, const float* bias, float* out,
                 int64_t out_stride, int64_t m, int64_t n, int64_t k, const std::string& isa) {
  if (k <= 0 || n <= 0 || m < 0 || x_stride < k || out_stride < n) {
    throw std::invalid_argument(
        "int8_linear: need k > 0, n > 0, m >= 0, x_stride >= k and out_stride >= n; got m=" +
        std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
        " x_stride=" + std::to_string(x_stride) + " out_stride=" + std::to_string(out_stride));
  }
  if (!(scale_divisor > 0.0f) || !std::isfinite(scale_divisor)) {
    throw std::invalid_argument("int8_linear: scale_divisor must be positive and finite, got " +
                                std::to_string(scale_divisor));
  }
  const Kernels& kern = select_kernels(isa);
  if (m == 0) return;
  std::lock_guard<std::mutex> lock(kernel_mutex());
  ThreadPool& workers = pool();
  static std::vector<int8_t> xq;  // reused: guarded by kernel_mutex()
  static std::vector<int32_t> x_sum;
  static std::vector<float> x_scale;
  if (static_cast<int64_t>(xq.size()) < m * k) xq.resize(m * k);
  if (static_cast<int64_t>(x_sum.size()) < m) {
    x_sum.resize(m);
    x_scale.resize(m);
  }
  constexpr float kMinAbsmax = 1e-10f;
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* row = x + j * x_stride;
      float scale;
      if (input_scale) {
        scale = *input_scale;
      } else {
        float absmax = 0.0f;
        for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(row[i]));
        scale = std::max(absmax, kMinAbsmax) / scale_divisor;  // IEEE division, as the reference
      }
      int32_t sum = 0;
      for (int64_t i = 0; i < k; ++i) {
        const float v = std::nearbyint(std::min(std::max(row[i] / scale, -128.0f), 127.0f));
        xq[j * k + i] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      x_sum[j] = sum;
      x_scale[j] = scale;
    }
  };
  if (m < kParallelQuantizeRows || workers.num_threads() == 1) {
    quantize(0, m);
  } else {
    workers.run(m, kQuantizeGrain, quantize);
  }
  const Int8Args args{xq.data(), x_sum.data(), x_scale.data(), w, w_scale, bias, out,
                      out_stride, m, k};
  if (n < 2 * kMinRowsPerThread || workers.num_threads() == 1) return kern.int8_rows(args, 0, n);
  const int64_t grain = std::max<int64_t>(kMinRowsPerThread,
                                          n / (kChunksPerThread * workers.num_threads()));
  workers.run(n, grain, [&](int64_t begin, int64_t end) { kern.int8_rows(args, begin, end); });
}

std::mutex& kernel_mutex() {
  static std::mutex m;
  return m;
}

bool cpu_has_avx512vnni() {
#if defined(TINYVLLM_HAVE_AVX2)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

std::string best_isa() {
  return cpu_has_avx512vnni() ? "avx512vnni" : cpu_has_avx2() ? "avx2" : "scalar";
}

const Kernels& select_kernels(const std::string& isa_arg) {
  std::string isa = isa_arg;
  if (isa == "auto") {
    const char* env = std::getenv("TINYVLLM_CPU_ISA");
    isa = env && *env ? env : best_isa();
  }
  if (isa == "scalar") return scalar_kernels();
  if (isa == "avx2") {
#if defined(TINYVLLM_HAVE_AVX2)
    if (cpu_has_avx2()) return avx2_kernels();
#endif
    throw std::invalid_argument("isa: avx2 needs a CPU with AVX2, FMA and F16C and a build "
                                "for x86-64; this one offers " + best_isa());
  }
  if (isa == "avx512vnni") {
#if defined(TINYVLLM_HAVE_AVX2)
    if (cpu_has_avx512vnni()) return avx512vnni_kernels();
#endif
    throw std::invalid_argument("isa: avx512vnni needs a CPU with AVX-512 F, VL, BW and VNNI "
                                "and a build for x86-64; this one offers " + best_isa());
  }
  throw std::invalid_argument("isa: expected auto, avx512vnni, avx2 or scalar, got '" + isa + "'");
}

QType check_qtype(int qtype) {
  if (qtype != static_cast<int>(QType::Q4_0) && qtype != static_cast<int>(QType::Q4_1) &&
      qtype != static_cast<int>(QType::Q8_0)) {
    throw std::invalid_argument("qtype: expected a GGML type code of Q4_0 (2), Q4_1 (3) or "
                                "Q8_0 (8), got " + std::to_string(qtype));
  }
  return static_cast<QType>(qtype);
}

void quantized_linear(const float* x, int64_t x_stride, const uint8_t* w, int qtype,
                      const float* bias, float* out, int64_t out_stride, int64_t m, int64_t n,
                      int64_t k, const std::string& isa) {
  if (is_kquant(qtype)) {
    return kquant_linear(x, x_stride, w, qtype, bias, out, out_stride, m, n, k, isa);
  }
  const QType type = check_qtype(qtype);
  if (k <= 0 || k % kBlock != 0 || n <= 0 || m < 0 || x_stride < k || out_stride < n) {
    throw std::invalid_argument(
        "quantized_linear: need k a positive multiple of 32, n > 0, m >= 0, x_stride >= k and "
        "out_stride >= n; got m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" +
        std::to_string(k) + " x_stride=" + std::to_string(x_stride) + " out_stride=" +
        std::to_string(out_stride));
  }
  const Kernels& kern = select_kernels(isa);
  if (m == 0) return;
  const int64_t nb = k / kBlock;
  std::lock_guard<std::mutex> lock(kernel_mutex());
  ThreadPool& workers = pool();
  ActBlock* xq = act_buffer(m * nb).data();
  quantize_rows(kern, x, x_stride, m, nb, xq, workers);
  gemm_parallel(kern, GemmArgs{xq, w, bias, out, out_stride, m, nb, type}, n, workers);
}

}  // namespace tinyvllm::cpu
