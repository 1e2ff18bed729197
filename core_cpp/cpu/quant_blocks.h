// GGUF block layouts as ggml writes them (ggml-common.h), and the activation blocks the kernels
// quantize x into. Weights stay in the file's bytes: a weight row of k values is k / 32 blocks.
#pragma once

#include <cstdint>
#include <cstring>

namespace tinyvllm::cpu {

constexpr int kBlock = 32;  // values per block, every type here

// The type codes are ggml's (GGMLQuantizationType), so Python passes `tensor_type.value`.
enum class QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

#pragma pack(push, 1)
struct BlockQ4_0 {  // value = (nibble - 8) * d; low nibbles are values 0..15, high 16..31
  uint16_t d;       // fp16
  uint8_t qs[kBlock / 2];
};
struct BlockQ4_1 {  // value = nibble * d + m
  uint16_t d;       // fp16
  uint16_t m;       // fp16
  uint8_t qs[kBlock / 2];
};
struct BlockQ8_0 {  // value = q * d
  uint16_t d;       // fp16
  int8_t qs[kBlock];
};
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34,
              "ggml block sizes");

// One block of activations, quantized on the fly (llama.cpp's q8_0 / q8_1, with float scales):
// x ~= qs * d, and s = d * sum(qs) lets Q4_0's offset (-8) and Q4_1's minimum (m) be applied
// once per block instead of once per value.
struct alignas(32) ActBlock {
  int8_t qs[kBlock];
  float d;
  float s;
};

inline int block_bytes(QType t) {
  switch (t) {
    case QType::Q4_0: return sizeof(BlockQ4_0);
    case QType::Q4_1: return sizeof(BlockQ4_1);
    case QType::Q8_0: return sizeof(BlockQ8_0);
  }
  return 0;
}

// IEEE half -> float without F16C (the scalar path; the AVX2 path uses _cvtsh_ss).
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> IEEE half, rounded to nearest even as torch's .to(float16) and F16C's vcvtps2ph:
// overflow to inf, NaN to a quiet NaN, subnormal halves through one float addition (which
// rounds to nearest even) of a magic number that lines their 10 bits up at the bottom.
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= (127u + 16u) << 23) {  // |f| >= 65536 (or inf / nan): inf or nan
    return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (x < 113u << 23) {  // below 2^-14: a subnormal half or zero
    const uint32_t magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float magic, v;
    std::memcpy(&magic, &magic_bits, sizeof magic);
    std::memcpy(&v, &x, sizeof v);
    v += magic;
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return static_cast<uint16_t>(sign | (bits - magic_bits));
  }
  const uint32_t mant_odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;  // rebias, round
  return static_cast<uint16_t>(sign | (x >> 13));  // a carry out of 65504 makes inf
}

}  // namespace tinyvllm::cpu
