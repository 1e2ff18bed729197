// The Llama decoder stack over packed weights for one engine step, in one call: every layer's
// RMSNorm, qkv projection, rotary, K/V cache write, paged attention, o_proj + residual, RMSNorm,
// gate_up projection, SwiGLU and down_proj + residual, then the final norm. The torch module
// path (model/llama.py over PackedLinear) computes the same values op by op; this saves its
// per-op Python and tensor work, which at batch 1 costs more than the projections themselves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace tinyvllm::cpu {

struct PackedWeight {
  const uint8_t* w;  // [n, k / 32 * block_bytes] GGUF blocks, or K-quant super-blocks
  int qtype;         // ggml's code: Q4_0, Q4_1, Q8_0 (QType) or Q4_K, Q5_K, Q6_K (kquants.h)
};

// Consecutive output rows of a stacked projection in one type: a stack of one type is one shard;
// GGUF files of mixed quantizations (Q4_K_M: a Q6_K attn_v beside Q4_K q and k) give several.
struct PackedShard {
  PackedWeight weight;  // [rows, k] packed
  int64_t rows;         // 0: no shard
};

struct LayerParams {
  const float* input_norm;  // [hidden]
  PackedShard qkv[3];       // [q_size + 2 * kv_size, hidden] in row order
  const float* qkv_bias;    // [q_size + 2 * kv_size] or null
  PackedWeight o;           // [hidden, q_size]
  const float* post_norm;   // [hidden]
  PackedShard gate_up[2];   // [2 * intermediate, hidden]: gate rows, then up rows
  PackedWeight down;        // [hidden, intermediate]
  void* kv_cache;           // [2, num_blocks, block_size, num_kv_heads, head_dim], kv_type
};

struct DecoderShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;    // RMSNorm
  float scale;  // attention scores
};

// One flat batch, as ops.AttentionMetadata describes it: row i of sequence s (q_len new tokens,
// context seq_len) sees the first seq_len - q_len + 1 + i tokens. Rows past
// query_start_loc[num_seqs] are padding: their attention output is zero.
struct StepInputs {
  int64_t num_tokens;
  const int64_t* positions;      // [num_tokens]
  const int64_t* slot_mapping;   // [num_tokens]; negative: not written
  const float* cos_sin;          // [max_position, head_dim]: cos | sin halves
  int64_t max_position;
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  int64_t num_seqs;
  const int32_t* block_tables;     // [num_seqs, table_stride]
  int64_t table_stride;
  int64_t num_blocks, block_size;
  KvType kv_type;  // the caches' elements: float32, or IEEE half (written rounded to nearest even)
};

// residual [num_tokens, hidden] is the embedding on entry and the residual stream after the last
// layer on return; out [num_tokens, hidden] receives its final RMSNorm (weight final_norm).
// Raises std::invalid_argument / std::out_of_range for inconsistent sizes or ids.
void decoder_layers(float* residual, float* out, const std::vector<LayerParams>& layers,
                    const float* final_norm, const DecoderShape& shape, const StepInputs& step,
                    const std::string& isa);

}  // namespace tinyvllm::cpu
