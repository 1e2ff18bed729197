// GGUF K-quant super-blocks (ggml-common.h; gguf-py's gguf.quants Q4_K / Q5_K / Q6_K): 256 values
// in sub-blocks of 32 (Q4_K, Q5_K) or 16 (Q6_K), each with its own integer scale under one fp16
// super-block scale. The linear over them dequantizes each weight row to float32 with ggml's
// arithmetic and takes float dot products (no activation quantization): kquants.cpp.
#pragma once

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

}  // namespace

}  // namespace tinyvllm::cpu
