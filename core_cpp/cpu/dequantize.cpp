// Packed rows back to float: the embedding lookup of a quantized token_embd (a few rows per step).
#include <stdexcept>
#include <string>

#include "linear.h"

namespace tinyvllm::cpu {
namespace {

void dequantize_block(QType type, const uint8_t* p, float* y) {
  constexpr int kHalf = kBlock / 2;
  if (type == QType::Q8_0) {
    const auto* b = reinterpret_cast<const BlockQ8_0*>(p);
    const float d = fp16_to_fp32(b->d);
    for (int i = 0; i < kBlock; ++i) y[i] = b->qs[i] * d;
    return;
  }
  if (type == QType::Q4_0) {
    const auto* b = reinterpret_cast<const BlockQ4_0*>(p);
    const float d = fp16_to_fp32(b->d);
    for (int i = 0; i < kHalf; ++i) {
      y[i] = ((b->qs[i] & 0x0f) - 8) * d;
      y[i + kHalf] = ((b->qs[i] >> 4) - 8) * d;
    }
    return;
  }
  const auto* b = reinterpret_cast<const BlockQ4_1*>(p);
  const float d = fp16_to_fp32(b->d), m = fp16_to_fp32(b->m);
  for (int i = 0; i < kHalf; ++i) {
    y[i] = (b->qs[i] & 0x0f) * d + m;
    y[i + kHalf] = (b->qs[i] >> 4) * d + m;
  }
}

void check_row_ids(const int64_t* row_ids, int64_t num_ids, int64_t num_rows) {
  for (int64_t i = 0; i < num_ids; ++i) {
    if (row_ids[i] < 0 || row_ids[i] >= num_rows) {
      throw std::out_of_range("dequantize_rows: row id " + std::to_string(row_ids[i]) +
                              " outside [0, " + std::to_string(num_rows) + ")");
    }
  }
}

}  // namespace

void dequantize_rows(const uint8_t* w, int qtype, int64_t num_rows, int64_t k,
                     const int64_t* row_ids, int64_t num_ids, float* out) {
  if (is_kquant(qtype)) {
    kquant_row_bytes(qtype, k);  // checks k
    check_row_ids(row_ids, num_ids, num_rows);
    return kquant_dequantize_rows(w, qtype, k, row_ids, num_ids, out);
  }
  const QType type = check_qtype(qtype);
  if (k <= 0 || k % kBlock != 0) {
    throw std::invalid_argument("dequantize_rows: k must be a positive multiple of 32, got " +
                                std::to_string(k));
  }
  const int64_t nb = k / kBlock, bb = block_bytes(type);
  check_row_ids(row_ids, num_ids, num_rows);
  for (int64_t i = 0; i < num_ids; ++i) {
    const uint8_t* row = w + row_ids[i] * nb * bb;
    for (int64_t b = 0; b < nb; ++b) dequantize_block(type, row + b * bb, out + i * k + b * kBlock);
  }
}

}  // namespace tinyvllm::cpu
