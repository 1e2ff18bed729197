// The portable path: plain C++ any compiler vectorises as it can. Always built; the oracle for the
// SIMD paths: the same quantization and the same linear arithmetic (the block dot contract below,
// bit for bit); the attention helpers differ from them in float summation order and exp.
#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "kquants.h"

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

// The block dot contract of kernels_avx2.cpp, so the two paths agree bit for bit: per (weight row,
// activation row) four float lanes; lane l takes each block's integer products of values
// [4l, 4l + 4) and [16 + 4l, 20 + 4l), fused-multiply-added with the block's scale d_w * d_x;
// y = ((l0 + l2) + (l1 + l3)) + corr + bias, corr the weight offsets' term summed in block order
// (Q4_1: sum(m * s), Q4_0: -8 * sum(d * s), Q8_0: none). The 4-bit weights are the unsigned
// nibbles (Q4_0's -8 is in corr).
constexpr int kLanes = 4;

inline int weight_value(const BlockQ4_0& w, int v) {  // low nibbles are values 0..15
  return v < kBlock / 2 ? w.qs[v] & 0x0f : w.qs[v - kBlock / 2] >> 4;
}
inline int weight_value(const BlockQ4_1& w, int v) {
  return v < kBlock / 2 ? w.qs[v] & 0x0f : w.qs[v - kBlock / 2] >> 4;
}
inline int weight_value(const BlockQ8_0& w, int v) { return w.qs[v]; }

inline float correction_factor(const BlockQ4_0& w) { return fp16_to_fp32(w.d); }
inline float correction_factor(const BlockQ4_1& w) { return fp16_to_fp32(w.m); }
inline float correction_factor(const BlockQ8_0&) { return 0.0f; }
inline float correction_scale(const BlockQ4_0&) { return -8.0f; }
inline float correction_scale(const BlockQ4_1&) { return 1.0f; }
inline float correction_scale(const BlockQ8_0&) { return 0.0f; }

template <typename Block>
float row_dot(const Block* w, const ActBlock* x, int64_t nb) {
  float acc[kLanes] = {};
  float corr = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = fp16_to_fp32(w[b].d) * x[b].d;
    for (int l = 0; l < kLanes; ++l) {
      int sum = 0;
      for (int half = 0; half < 2; ++half) {
        for (int v = half * kBlock / 2 + 4 * l; v < half * kBlock / 2 + 4 * l + 4; ++v) {
          sum += weight_value(w[b], v) * x[b].qs[v];
        }
      }
      acc[l] = std::fma(static_cast<float>(sum), scale, acc[l]);
    }
    corr += correction_factor(w[b]) * x[b].s;
  }
  return ((acc[0] + acc[2]) + (acc[1] + acc[3])) + correction_scale(w[0]) * corr;
}

template <typename Block>
void gemm_rows_t(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const auto* w = reinterpret_cast<const Block*>(g.w + r * g.nb * sizeof(Block));
    const float bias = g.bias ? g.bias[r] : 0.0f;
    for (int64_t j = 0; j < g.m; ++j) {
      const float v = row_dot(w, g.xq + j * g.nb, g.nb);
      float& y = g.out[j * g.out_stride + r];
      y = g.accumulate ? y + (v + bias) : v + bias;
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


void dot_tokens(const float* q, const float* k, int64_t stride, int64_t num_tokens, int64_t d,
                float scale, float* scores) {
  for (int64_t t = 0; t < num_tokens; ++t) scores[t] = dot_lanes(q, k + t * stride, d) * scale;
}

void sum_tokens(const float* p, const float* v, int64_t stride, int64_t num_tokens, int64_t d,
                float* out) {
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t i = 0; i < d; ++i) out[i] += p[t] * v[t * stride + i];
}

// A half-precision token's d values widened to float (d at most kMaxHeadDim per call).
constexpr int64_t kMaxHeadDim = 256;

void widen(const uint16_t* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

void dot_tokens_f16(const float* q, int64_t n, const uint16_t* k, int64_t stride,
                    int64_t num_tokens, int64_t d, float scale, float* scores,
                    int64_t scores_stride) {
  float kt[kMaxHeadDim];
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i0 = 0; i0 < d; i0 += kMaxHeadDim) {  // d beyond kMaxHeadDim: in pieces
      const int64_t m = std::min(kMaxHeadDim, d - i0);
      widen(k + t * stride + i0, m, kt);
      for (int64_t g = 0; g < n; ++g) {
        float& score = scores[g * scores_stride + t];
        const float part = dot_lanes(q + g * d + i0, kt, m);
        score = i0 == 0 ? part : score + part;
      }
    }
    for (int64_t g = 0; g < n; ++g) scores[g * scores_stride + t] *= scale;
  }
}

void sum_tokens_f16(const float* p, int64_t p_stride, int64_t n, const uint16_t* v,
                    int64_t stride, int64_t num_tokens, int64_t d, float* out) {
  for (int64_t g = 0; g < n; ++g)
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t i = 0; i < d; ++i)
        out[g * d + i] += p[g * p_stride + t] * fp16_to_fp32(v[t * stride + i]);
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

void int8_rows(const Int8Args& a, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int8_t* w = a.w + r * a.k;
    for (int64_t j = 0; j < a.m; ++j) {
      const int8_t* x = a.xq + j * a.k;
      int32_t acc = 0;
      for (int64_t i = 0; i < a.k; ++i) acc += static_cast<int32_t>(x[i]) * w[i];
      a.out[j * a.out_stride + r] = int8_output(acc, a.x_scale[j], a.w_scale[r], a.bias, r);
    }
  }
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
  static const Kernels k{"scalar",       quantize_row,   nullptr,        nullptr,
                         gemm_rows,      dot_tokens,     sum_tokens,     dot_tokens_f16,
                         sum_tokens_f16, to_f16,         int8_rows,      exp_sum,
                         silu_mul,       quantize_row_q8k, kquant_dot_rows};
  return k;
}

float dot_lanes(const float* a, const float* b, int64_t n) {
  float lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[i + l] * b[i + l];
  float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
            ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace tinyvllm::cpu
