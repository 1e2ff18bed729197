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

}  // namespace tinyvllm::cpu
