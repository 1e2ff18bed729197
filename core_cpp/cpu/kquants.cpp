// The linear and row dequantization over K-quant weights (kquants.h). The linear quantizes each
// activation row once per call to int8 per 256 values (Kernels::quantize_q8k), then takes each
// weight row's dot products with the activation rows over the packed super-blocks in integers
// (Kernels::kquant_dot_rows: kquants.h's portable code, or kernels_avx2.cpp's intrinsics over
// tiles of 4 activation rows; the same values on every ISA and in any tile), so that a row's
// result never depends on the batch it came in. The embedding lookup dequantizes rows with
// ggml's arithmetic.
#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kquants.h"
#include "linear.h"

namespace tinyvllm::cpu {
namespace {

constexpr int64_t kMinRowsPerThread = 16;  // below this a wake-up costs more than it saves
constexpr int64_t kChunksPerThread = 8;

int64_t super_block_bytes(KQuantType type) {
  switch (type) {
    case KQuantType::Q4_K: return sizeof(BlockQ4_K);
    case KQuantType::Q5_K: return sizeof(BlockQ5_K);
    case KQuantType::Q6_K: return sizeof(BlockQ6_K);
  }
  return 0;
}

}  // namespace

bool is_kquant(int qtype) {
  return qtype == static_cast<int>(KQuantType::Q4_K) ||
         qtype == static_cast<int>(KQuantType::Q5_K) ||
         qtype == static_cast<int>(KQuantType::Q6_K);
}

int64_t kquant_row_bytes(int qtype, int64_t k) {
  if (!is_kquant(qtype)) {
    throw std::invalid_argument("qtype: expected a K-quant type code, Q4_K (12), Q5_K (13) or "
                                "Q6_K (14), got " + std::to_string(qtype));
  }
  if (k <= 0 || k % kSuperBlock != 0) {
    throw std::invalid_argument("k: expected a positive multiple of 256 for K-quant type " +
                                std::to_string(qtype) + ", got " + std::to_string(k));
  }
  return k / kSuperBlock * super_block_bytes(static_cast<KQuantType>(qtype));
}

void kquant_project(const Kernels& kern, ThreadPool& workers, const float* x, int64_t x_stride,
                    const uint8_t* w, int qtype, const float* bias, float* out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, bool accumulate) {
  const int64_t row_bytes = kquant_row_bytes(qtype, k);
  const int64_t num_blocks = k / kSuperBlock;
  static std::vector<BlockQ8K> xq;  // [m, num_blocks]; guarded by kernel_mutex
  if (static_cast<int64_t>(xq.size()) < m * num_blocks) xq.resize(m * num_blocks);
  for (int64_t j = 0; j < m; ++j) kern.quantize_q8k(x + j * x_stride, k, &xq[j * num_blocks]);
  auto rows = [&](int64_t begin, int64_t end) {
    constexpr int64_t kChunk = 64;  // activation rows per call, into y
    float y[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* w_row = w + r * row_bytes;
      for (int64_t j0 = 0; j0 < m; j0 += kChunk) {
        const int64_t rows_here = std::min(kChunk, m - j0);
        kern.kquant_dot_rows(qtype, w_row, &xq[j0 * num_blocks], num_blocks, rows_here,
                             num_blocks, y);
        for (int64_t j = 0; j < rows_here; ++j) {
          float& o = out[(j0 + j) * out_stride + r];
          const float v = bias ? y[j] + bias[r] : y[j];
          o = accumulate ? o + v : v;
        }
      }
    }
  };
  if (n < 2 * kMinRowsPerThread || workers.num_threads() == 1) return rows(0, n);
  const int64_t grain = std::max<int64_t>(kMinRowsPerThread,
                                          n / (kChunksPerThread * workers.num_threads()));
  workers.run(n, grain, rows);
}

void kquant_linear(const float* x, int64_t x_stride, const uint8_t* w, int qtype,
                   const float* bias, float* out, int64_t out_stride, int64_t m, int64_t n,
                   int64_t k, const std::string& isa) {
  kquant_row_bytes(qtype, k);  // checks qtype and k
  if (n <= 0 || m < 0 || x_stride < k || out_stride < n) {
    throw std::invalid_argument(
        "quantized_linear: need n > 0, m >= 0, x_stride >= k and out_stride >= n; got m=" +
        std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
        " x_stride=" + std::to_string(x_stride) + " out_stride=" + std::to_string(out_stride));
  }
  const Kernels& kern = select_kernels(isa);
  if (m == 0) return;
  std::lock_guard<std::mutex> lock(kernel_mutex());
  kquant_project(kern, pool(), x, x_stride, w, qtype, bias, out, out_stride, m, n, k, false);
}

void kquant_dequantize_rows(const uint8_t* w, int qtype, int64_t k, const int64_t* row_ids,
                            int64_t num_ids, float* out) {
  const int64_t row_bytes = kquant_row_bytes(qtype, k);
  for (int64_t i = 0; i < num_ids; ++i) {
    dequantize_kquant_row(qtype, w + row_ids[i] * row_bytes, k, out + i * k);  // a few rows
  }
}

}  // namespace tinyvllm::cpu
