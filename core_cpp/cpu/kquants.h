// GGUF K-quant super-blocks (ggml-common.h; gguf-py's gguf.quants Q4_K / Q5_K / Q6_K): 256 values
// in sub-blocks of 32 (Q4_K, Q5_K) or 16 (Q6_K), each with its own integer scale under one fp16
// super-block scale. The linear over them quantizes each activation row to int8 per 256 values
// (BlockQ8K, llama.cpp's block_q8_K) and takes integer dot products against the packed values,
// as llama.cpp does; the embedding lookup dequantizes rows with ggml's arithmetic: kquants.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant_blocks.h"

namespace tinyvllm::cpu {

constexpr int kSuperBlock = 256;  // QK_K: values per super-block
constexpr int kScaleBytes = 12;   // K_SCALE_SIZE: Q4_K / Q5_K's eight 6-bit scales and minima

// ggml type codes (GGMLQuantizationType), as Python passes them.
enum class KQuantType : int { Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#pragma pack(push, 1)
struct BlockQ4_K {  // value = d * sc[j] * nibble - dmin * m[j], j the 32-value sub-block
  uint16_t d;       // fp16
  uint16_t dmin;    // fp16
  uint8_t scales[kScaleBytes];
  uint8_t qs[kSuperBlock / 2];  // per 64 values: 32 bytes, low nibbles first then high
};
struct BlockQ5_K {  // as Q4_K with a fifth bit: bit j of qh[l] tops value l of sub-block j
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kScaleBytes];
  uint8_t qh[kSuperBlock / 8];
  uint8_t qs[kSuperBlock / 2];
};
struct BlockQ6_K {  // value = d * scales[v / 16] * (q - 32), q six bits: ql's nibble | qh's 2 bits
  uint8_t ql[kSuperBlock / 2];
  uint8_t qh[kSuperBlock / 4];
  int8_t scales[kSuperBlock / 16];
  uint16_t d;  // fp16
};
#pragma pack(pop)

// 256 activations for the K-quant dot products (llama.cpp's block_q8_K with a float scale):
// x ~= d * qs; bsums[i] the sum of qs[16 i, 16 i + 16).
struct BlockQ8K {
  float d;
  int8_t qs[kSuperBlock];
  int16_t bsums[kSuperBlock / 16];
};
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210,
              "ggml K-quant block sizes");

// The functions below are compiled into each ISA's kernels file (kernels_*.cpp, built with that
// ISA's flags, so the compiler vectorises them for it): internal linkage, so that the linker never
// hands the portable path a copy built for AVX2.
namespace {

// Sub-block j's 6-bit scale and minimum from the 12 packed bytes (ggml's get_scale_min_k4):
// bytes 0..3 hold scales 0..3 (low 6 bits), 4..7 minima 0..3; scales and minima 4..7 are the
// nibbles of bytes 8..11 with their top two bits in the top bits of bytes 0..3 / 4..7.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One super-block -> y[256], in gguf.quants' float32 order: (d * sc) * q - (dmin * m) for
// Q4_K / Q5_K, (d * scale) * q for Q6_K; no fused multiply-add (the build passes
// -ffp-contract=off), so the values equal gguf.quants.dequantize bit for bit.
// Q4_K / Q5_K: 32 bytes of qs per 64 values, sub-block 2g in the low nibbles, 2g + 1 in the high
// ones (constant shifts, so the compiler vectorises each loop); Q5_K's fifth bit of value l in
// sub-block j is bit j of qh[l].
// Sub-blocks 2g and 2g + 1 of a Q4_K / Q5_K super-block: d * scale and dmin * minimum of each.
struct SubBlockPair {
  float ds0, dm0, ds1, dm1;
};

inline SubBlockPair sub_block_pair(const uint8_t* scales, int g, float d, float dmin) {
  int sc0, m0, sc1, m1;
  scale_min_k4(2 * g, scales, &sc0, &m0);
  scale_min_k4(2 * g + 1, scales, &sc1, &m1);
  return {d * static_cast<float>(sc0), dmin * static_cast<float>(m0),
          d * static_cast<float>(sc1), dmin * static_cast<float>(m1)};
}

inline void dequantize_super_block(const BlockQ4_K& b, float* y) {
  const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
  for (int g = 0; g < 4; ++g) {
    const auto [ds0, dm0, ds1, dm1] = sub_block_pair(b.scales, g, d, dmin);
    const uint8_t* q = b.qs + 32 * g;
    float* yg = y + 64 * g;
    for (int l = 0; l < 32; ++l) yg[l] = ds0 * static_cast<float>(q[l] & 0x0f) - dm0;
    for (int l = 0; l < 32; ++l) yg[32 + l] = ds1 * static_cast<float>(q[l] >> 4) - dm1;
  }
}

inline void dequantize_super_block(const BlockQ5_K& b, float* y) {
  const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
  for (int g = 0; g < 4; ++g) {
    const auto [ds0, dm0, ds1, dm1] = sub_block_pair(b.scales, g, d, dmin);
    const uint8_t* q = b.qs + 32 * g;
    const uint8_t lo_bit = static_cast<uint8_t>(1u << (2 * g)), hi_bit = lo_bit << 1;
    float* yg = y + 64 * g;
    for (int l = 0; l < 32; ++l) {
      const int v = (q[l] & 0x0f) | ((b.qh[l] & lo_bit) ? 16 : 0);
      yg[l] = ds0 * static_cast<float>(v) - dm0;
    }
    for (int l = 0; l < 32; ++l) {
      const int v = (q[l] >> 4) | ((b.qh[l] & hi_bit) ? 16 : 0);
      yg[32 + l] = ds1 * static_cast<float>(v) - dm1;
    }
  }
}

// Q6_K, values [32P, 32P + 32) of a half (128 values): the low (P = 0, 1) or high (P = 2, 3)
// nibbles of ql[32 (P % 2) + l], bits 2P and 2P + 1 of qh[l] on top, minus 32; one scale per 16
// values. P is a template argument so that the shifts are constants the compiler vectorises.
template <int P>
inline void dequantize_q6_k_part(const uint8_t* ql, const uint8_t* qh, const int8_t* scales,
                                 float d, float* y) {
  constexpr int kLoShift = 4 * (P / 2), kHiShift = 2 * P;
  ql += 32 * (P % 2);
  for (int half = 0; half < 2; ++half) {
    const float s = d * static_cast<float>(scales[2 * P + half]);
    for (int l = 16 * half; l < 16 * half + 16; ++l) {
      const int q = (((ql[l] >> kLoShift) & 0x0f) | (((qh[l] >> kHiShift) & 3) << 4)) - 32;
      y[32 * P + l] = s * static_cast<float>(q);
    }
  }
}

inline void dequantize_super_block(const BlockQ6_K& b, float* y) {
  const float d = fp16_to_fp32(b.d);
  for (int h = 0; h < 2; ++h) {  // two halves of 128 values: ql[64h..], qh[32h..], scales[8h..]
    const uint8_t* ql = b.ql + 64 * h;
    const uint8_t* qh = b.qh + 32 * h;
    const int8_t* scales = b.scales + 8 * h;
    dequantize_q6_k_part<0>(ql, qh, scales, d, y + 128 * h);
    dequantize_q6_k_part<1>(ql, qh, scales, d, y + 128 * h);
    dequantize_q6_k_part<2>(ql, qh, scales, d, y + 128 * h);
    dequantize_q6_k_part<3>(ql, qh, scales, d, y + 128 * h);
  }
}

template <typename Block>
void dequantize_kquant_row_t(const uint8_t* row, int64_t k, float* y) {
  const auto* blocks = reinterpret_cast<const Block*>(row);
  for (int64_t b = 0; b < k / kSuperBlock; ++b) {
    dequantize_super_block(blocks[b], y + b * kSuperBlock);
  }
}

// One packed row of k values (k a multiple of 256) of K-quant type `qtype` -> y[k].
inline void dequantize_kquant_row(int qtype, const uint8_t* row, int64_t k, float* y) {
  switch (static_cast<KQuantType>(qtype)) {
    case KQuantType::Q4_K: return dequantize_kquant_row_t<BlockQ4_K>(row, k, y);
    case KQuantType::Q5_K: return dequantize_kquant_row_t<BlockQ5_K>(row, k, y);
    case KQuantType::Q6_K: return dequantize_kquant_row_t<BlockQ6_K>(row, k, y);
  }
}

// k activations -> k / 256 blocks, each x ~= d * qs with d = max|x| / 127 and qs = round(x / d)
// (x times 1 / d, half to even: quantize_row's arithmetic over 256 values instead of 32).
inline void quantize_row_q8k(const float* x, int64_t k, BlockQ8K* y) {
  for (int64_t b = 0; b < k / kSuperBlock; ++b) {
    const float* xb = x + b * kSuperBlock;
    float amax = 0.0f;
    for (int i = 0; i < kSuperBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < kSuperBlock; ++i) {
      y[b].qs[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));  // default mode: half to even
    }
    for (int g = 0; g < kSuperBlock / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += y[b].qs[16 * g + i];
      y[b].bsums[g] = static_cast<int16_t>(sum);
    }
    y[b].d = d;
  }
}

// A super-block's dot product with its 256 activations (the portable path; kernels_avx2.cpp
// computes the same integers with intrinsics). The integer sums are exact (below 2^31: Q4_K /
// Q5_K at most 8 * 63 * 32 * 31 * 127, Q6_K 16 * 128 * 16 * 63 * 127 before its offset), so any
// order gives the same integers; the float part is the fixed expression below:
//   Q4_K / Q5_K: x.d * (d * sum_j sc_j * (q_j . x_j)) - x.d * (dmin * sum_j m_j * sum(x_j))
//   Q6_K:        x.d * (d * sum_j sc_j * ((q_j - 32) . x_j))
// Each sub-block's integer dot is summed on its own (16-bit products widened and added: pmaddwd,
// NEON's smlal), then times its scale in scalar code; a product times the scale in every lane
// would need 32-bit multiplies, which SSE2 lacks.
// Q4_K, and with kFive Q5_K's fifth bits (bit 2g of qh[l] for sub-block 2g, 2g + 1 for 2g + 1).
template <bool kFive, typename Block>
inline float dot_q45_k(const Block& b, const BlockQ8K& x) {
  int32_t sumi = 0, summ = 0;
  for (int g = 0; g < 4; ++g) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * g, b.scales, &sc0, &m0);
    scale_min_k4(2 * g + 1, b.scales, &sc1, &m1);
    const uint8_t* q = b.qs + 32 * g;
    const int8_t* a = x.qs + 64 * g;
    int32_t s0 = 0, s1 = 0;
    for (int l = 0; l < 32; ++l) {
      int16_t v = q[l] & 0x0f;
      if constexpr (kFive) v |= ((b.qh[l] >> (2 * g)) & 1) << 4;
      s0 += v * a[l];
    }
    for (int l = 0; l < 32; ++l) {
      int16_t v = q[l] >> 4;
      if constexpr (kFive) v |= ((b.qh[l] >> (2 * g + 1)) & 1) << 4;
      s1 += v * a[32 + l];
    }
    sumi += sc0 * s0 + sc1 * s1;
    summ += m0 * (x.bsums[4 * g] + x.bsums[4 * g + 1]) +
            m1 * (x.bsums[4 * g + 2] + x.bsums[4 * g + 3]);
  }
  return x.d * (fp16_to_fp32(b.d) * static_cast<float>(sumi)) -
         x.d * (fp16_to_fp32(b.dmin) * static_cast<float>(summ));
}

inline float dot_super_block(const BlockQ4_K& b, const BlockQ8K& x) {
  return dot_q45_k<false>(b, x);
}
inline float dot_super_block(const BlockQ5_K& b, const BlockQ8K& x) {
  return dot_q45_k<true>(b, x);
}

// Q6_K's values [32P, 32P + 32) of a half, as dequantize_q6_k_part reads them: sc_j * (q . x) of
// each 16-value sub-block j, q its unsigned six bits (the - 32 of every value is applied once
// per sub-block through its activation sum, bsums).
template <int P>
inline int32_t q6_k_part_dot(const uint8_t* ql, const uint8_t* qh, const int8_t* scales,
                             const int8_t* a) {
  constexpr int kLoShift = 4 * (P / 2), kHiShift = 2 * P;
  ql += 32 * (P % 2);
  int32_t sum = 0;
  for (int half = 0; half < 2; ++half) {
    int32_t s = 0;
    for (int l = 16 * half; l < 16 * half + 16; ++l) {
      const int16_t q = ((ql[l] >> kLoShift) & 0x0f) | (((qh[l] >> kHiShift) & 3) << 4);
      s += q * a[32 * P + l];
    }
    sum += scales[2 * P + half] * s;
  }
  return sum;
}

inline float dot_super_block(const BlockQ6_K& b, const BlockQ8K& x) {
  int32_t sumi = 0, offset = 0;  // offset: sum_j sc_j * sum(x_j), the values' - 32 over 32
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b.ql + 64 * h;
    const uint8_t* qh = b.qh + 32 * h;
    const int8_t* scales = b.scales + 8 * h;
    const int8_t* a = x.qs + 128 * h;
    sumi += q6_k_part_dot<0>(ql, qh, scales, a) + q6_k_part_dot<1>(ql, qh, scales, a) +
            q6_k_part_dot<2>(ql, qh, scales, a) + q6_k_part_dot<3>(ql, qh, scales, a);
    for (int j = 0; j < 8; ++j) offset += scales[j] * x.bsums[8 * h + j];
  }
  return x.d * (fp16_to_fp32(b.d) * static_cast<float>(sumi - 32 * offset));
}

template <typename Block>
float kquant_dot_t(const uint8_t* row, const BlockQ8K* x, int64_t num_blocks) {
  const auto* blocks = reinterpret_cast<const Block*>(row);
  float acc = 0.0f;
  for (int64_t b = 0; b < num_blocks; ++b) acc += dot_super_block(blocks[b], x[b]);
  return acc;
}

// dot(dequantize(row), x) over num_blocks super-blocks of K-quant type `qtype`, x quantized by
// quantize_row_q8k; super-blocks summed in order.
inline float kquant_dot(int qtype, const uint8_t* row, const BlockQ8K* x, int64_t num_blocks) {
  switch (static_cast<KQuantType>(qtype)) {
    case KQuantType::Q4_K: return kquant_dot_t<BlockQ4_K>(row, x, num_blocks);
    case KQuantType::Q5_K: return kquant_dot_t<BlockQ5_K>(row, x, num_blocks);
    case KQuantType::Q6_K: return kquant_dot_t<BlockQ6_K>(row, x, num_blocks);
  }
  return 0.0f;
}

// kquant_dot for each of num_rows activation rows (row c at x + c * x_stride) -> out[c].
inline void kquant_dot_rows(int qtype, const uint8_t* row, const BlockQ8K* x, int64_t x_stride,
                            int64_t num_rows, int64_t num_blocks, float* out) {
  for (int64_t c = 0; c < num_rows; ++c) {
    out[c] = kquant_dot(qtype, row, x + c * x_stride, num_blocks);
  }
}

}  // namespace

}  // namespace tinyvllm::cpu
