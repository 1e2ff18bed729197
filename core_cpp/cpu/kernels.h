// The per-instruction-set kernels behind quantized_linear: one table of function pointers per ISA,
// chosen once at run time (isa.cpp). Raw pointers and sizes only: no torch, no Python.
#pragma once

#include <cstdint>

#include "quant_blocks.h"

namespace tinyvllm::cpu {
struct BlockQ8K;  // kquants.h
}

namespace tinyvllm::cpu {

struct GemmArgs {
  const ActBlock* xq;    // [m, nb] activations, quantized per block
  const uint8_t* w;      // [n, nb * block_bytes(qtype)] weight rows as in the GGUF file
  const float* bias;     // [n] or nullptr
  float* out;            // [m, out_stride], columns [0, n) written
  int64_t out_stride;
  int64_t m;
  int64_t nb;            // blocks per row: k / kBlock
  QType qtype;
  bool accumulate = false;  // out += the product (a residual add) instead of out = it
  const void* prepared = nullptr;  // what Kernels::prepare made of xq, for gemm_rows
};

// A W8A8 int8 product (ops/w8a8_linear.py's layout): int8 weights [n, k] with a float scale per
// output row, activations quantized per row to int8 with a scale per row, accumulated exactly
// in int32: out[j, r] = (float(sum_k xq[j] * w[r]) * x_scale[j]) * w_scale[r] (+ bias[r]).
struct Int8Args {
  const int8_t* xq;       // [m, k] activations, quantized per row
  const int32_t* x_sum;   // [m] each row's sum of xq
  const float* x_scale;   // [m]
  const int8_t* w;        // [n, k]
  const float* w_scale;   // [n]
  const float* bias;      // [n] or nullptr
  float* out;             // [m, out_stride], columns [0, n) written
  int64_t out_stride, m, k;
};

// The element type of a paged KV cache the CPU kernels read and write: float32, or IEEE half
// (stored as its bits; converted to float32 on reading, rounded to nearest even on writing).
enum class KvType : int { F32 = 0, F16 = 1 };

struct Kernels {
  const char* name;
  // One row of k = nb * kBlock floats -> nb activation blocks (round half to even, as torch.round).
  void (*quantize_row)(const float* x, int64_t nb, ActBlock* out);
  // Optional (nullptr: gemm_rows reads xq as it is): lays xq out for gemm_rows once per product,
  // before the threads split the weight rows. prepare sizes the layout (in the calling thread's
  // storage, until its next prepare), points args.prepared at it and returns how many pieces
  // prepare_piece must then fill (each once, in any order, on any thread).
  int64_t (*prepare)(GemmArgs& args);
  void (*prepare_piece)(const GemmArgs& args, int64_t piece);
  // out[j, r] = dot(x[j], w[r]) + bias[r] for every j < m and r in [row_begin, row_end).
  void (*gemm_rows)(const GemmArgs& args, int64_t row_begin, int64_t row_end);
  // Float helpers of attention over tokens at a stride (one cache block's keys or values):
  // scores[t] = dot(q, k + t * stride) * scale, and out += sum_t p[t] * (v + t * stride), for
  // t < num_tokens, vectors of d values.
  void (*dot_tokens)(const float* q, const float* k, int64_t stride, int64_t num_tokens,
                     int64_t d, float scale, float* scores);
  void (*sum_tokens)(const float* p, const float* v, int64_t stride, int64_t num_tokens,
                     int64_t d, float* out);
  // The same over a half-precision cache (k, v: IEEE half bits) for n query heads of one KV
  // head at once (q and out: [n, d]; scores and p: head g's at g * scores_stride / p_stride),
  // each value widened to float once for all of them: per head the float32 helpers' arithmetic
  // on the widened values, whatever n is.
  void (*dot_tokens_f16)(const float* q, int64_t n, const uint16_t* k, int64_t stride,
                         int64_t num_tokens, int64_t d, float scale, float* scores,
                         int64_t scores_stride);
  void (*sum_tokens_f16)(const float* p, int64_t p_stride, int64_t n, const uint16_t* v,
                         int64_t stride, int64_t num_tokens, int64_t d, float* out);
  // y[i] = x[i] as IEEE half, rounded to nearest even (fp32_to_fp16), for i < n.
  void (*to_f16)(const float* x, uint16_t* y, int64_t n);
  // out[j, r] for every j < m and r in [row_begin, row_end) (Int8Args).
  void (*int8_rows)(const Int8Args& args, int64_t row_begin, int64_t row_end);
  // x[i] = exp(x[i] - shift) for i < n; returns their sum (a softmax's numerators).
  float (*exp_sum)(float* x, int64_t n, float shift);
  // y[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
  void (*silu_mul)(const float* gate, const float* up, float* y, int64_t n);
  // k activations -> k / 256 BlockQ8K (kquants.h quantize_row_q8k), and a packed K-quant row's
  // dot product with num_rows activation rows of them (row c at x + c * x_stride) into out[c]
  // (kquant_dot_rows); the same values on every ISA and in any tile of rows.
  void (*quantize_q8k)(const float* x, int64_t k, BlockQ8K* y);
  void (*kquant_dot_rows)(int qtype, const uint8_t* row, const BlockQ8K* x, int64_t x_stride,
                          int64_t num_rows, int64_t num_blocks, float* out);
};

// sum_i a[i] * b[i] in eight running sums (the AVX2 path's lanes) added pairwise at the end, so
// that the compiler may vectorise it without reassociating; the scalar dot of every float helper.
float dot_lanes(const float* a, const float* b, int64_t n);

// The rescale every int8_rows path ends with: (float(acc) * x_scale) * w_scale (+ bias).
inline float int8_output(int32_t acc, float x_scale, float w_scale, const float* bias,
                         int64_t r) {
  const float y = (static_cast<float>(acc) * x_scale) * w_scale;
  return bias ? y + bias[r] : y;
}

const Kernels& scalar_kernels();
#if defined(TINYVLLM_HAVE_AVX2)
const Kernels& avx2_kernels();
const Kernels& avx512vnni_kernels();
#endif

}  // namespace tinyvllm::cpu
