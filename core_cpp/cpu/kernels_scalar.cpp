// The portable path: plain C++ any compiler vectorises as it can. Always built; the oracle for the
// SIMD paths (same quantization, same integer dot products; only float summation order differs).
#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace tinyvllm::cpu {
namespace {

void quantize_row(const float* x, int64_t nb, ActBlock* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));  // default mode: half to even
      out[b].qs[i] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

// Integer dot product of one weight block with one activation block, and the block's float value.
inline float block_dot(const BlockQ4_0& w, const ActBlock& a) {
  int sum = 0;
  for (int i = 0; i < kBlock / 2; ++i) {
    sum += (w.qs[i] & 0x0f) * a.qs[i] + (w.qs[i] >> 4) * a.qs[i + kBlock / 2];
  }
  return fp16_to_fp32(w.d) * (a.d * static_cast<float>(sum) - 8.0f * a.s);
}

inline float block_dot(const BlockQ4_1& w, const ActBlock& a) {
  int sum = 0;
  for (int i = 0; i < kBlock / 2; ++i) {
    sum += (w.qs[i] & 0x0f) * a.qs[i] + (w.qs[i] >> 4) * a.qs[i + kBlock / 2];
  }
  return fp16_to_fp32(w.d) * a.d * static_cast<float>(sum) + fp16_to_fp32(w.m) * a.s;
}

inline float block_dot(const BlockQ8_0& w, const ActBlock& a) {
  int sum = 0;
  for (int i = 0; i < kBlock; ++i) sum += w.qs[i] * a.qs[i];
  return fp16_to_fp32(w.d) * a.d * static_cast<float>(sum);
}

template <typename Block>
void gemm_rows_t(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* w = reinterpret_cast<const Block*>(g.w + r * g.nb * sizeof(Block));
    const float bias = g.bias ? g.bias[r] : 0.0f;
    for (int64_t j = 0; j < g.m; ++j) {
      const ActBlock* x = g.xq + j * g.nb;
      float acc = 0.0f;
      for (int64_t b = 0; b < g.nb; ++b) acc += block_dot(w[b], x[b]);
      float& y = g.out[j * g.out_stride + r];
      y = g.accumulate ? y + (acc + bias) : acc + bias;
    }
  }
}

void gemm_rows(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  switch (g.qtype) {
    case QType::Q4_0: return gemm_rows_t<BlockQ4_0>(g, row_begin, row_end);
    case QType::Q4_1: return gemm_rows_t<BlockQ4_1>(g, row_begin, row_end);
    case QType::Q8_0: return gemm_rows_t<BlockQ8_0>(g, row_begin, row_end);
  }
}

// Eight running sums (the AVX2 path's lanes), so the compiler may vectorise without reassociating.
float dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[i + l] * b[i + l];
  float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
            ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void dot_tokens(const float* q, const float* k, int64_t stride, int64_t num_tokens, int64_t d,
                float scale, float* scores) {
  for (int64_t t = 0; t < num_tokens; ++t) scores[t] = dot(q, k + t * stride, d) * scale;
}

void sum_tokens(const float* p, const float* v, int64_t stride, int64_t num_tokens, int64_t d,
                float* out) {
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t i = 0; i < d; ++i) out[i] += p[t] * v[t * stride + i];
}

float exp_sum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

void silu_mul(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k{"scalar", quantize_row, gemm_rows, dot_tokens, sum_tokens, exp_sum, silu_mul};
  return k;
}

}  // namespace tinyvllm::cpu
