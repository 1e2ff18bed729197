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
inline void dequantize_super_block(const BlockQ4_K& b, float* y) {
  const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, b.scales, &sc, &m);
    const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
    const uint8_t* q = b.qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) y[32 * j + l] = ds * static_cast<float>((q[l] >> shift) & 0x0f) - dm;
  }
}

inline void dequantize_super_block(const BlockQ5_K& b, float* y) {
  const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, b.scales, &sc, &m);
    const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
    const uint8_t* q = b.qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 0x0f) | (((b.qh[l] >> j) & 1) << 4);
      y[32 * j + l] = ds * static_cast<float>(v) - dm;
    }
  }
}

inline void dequantize_super_block(const BlockQ6_K& b, float* y) {
  const float d = fp16_to_fp32(b.d);
  for (int h = 0; h < 2; ++h) {  // two halves of 128 values: ql[64h..], qh[32h..], scales[8h..]
    const uint8_t* ql = b.ql + 64 * h;
    const uint8_t* qh = b.qh + 32 * h;
    const int8_t* sc = b.scales + 8 * h;
    float* yh = y + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      yh[l] = (d * static_cast<float>(sc[is])) * static_cast<float>(q1);
      yh[l + 32] = (d * static_cast<float>(sc[is + 2])) * static_cast<float>(q2);
      yh[l + 64] = (d * static_cast<float>(sc[is + 4])) * static_cast<float>(q3);
      yh[l + 96] = (d * static_cast<float>(sc[is + 6])) * static_cast<float>(q4);
    }
  }
}

}  // namespace tinyvllm::cpu
