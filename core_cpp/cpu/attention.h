// Decode attention over the paged KV cache (float32 or IEEE half), read in place (no gather of
// the context).
#pragma once

#include <cstdint>

#include "kernels.h"
#include "thread_pool.h"

namespace tinyvllm::cpu {

// One query token per sequence. Shape: out [b, h, d] contiguous; q [b, h, d] with token stride
// q_stride (heads contiguous); cache [2, num_blocks, block_size, hkv, d] (KV_CACHE_LAYOUT);
// block_tables [b, table_stride] int32; seq_lens [b] int32 (context length, this token included).
// The cache's elements are kv_type's.
void paged_decode_attention(float* out, const float* q, int64_t q_stride, const void* cache,
                            KvType kv_type, int64_t num_blocks, int64_t block_size, int64_t hkv,
                            int64_t d, int64_t h, const int32_t* block_tables,
                            int64_t table_stride, const int32_t* seq_lens, int64_t b,
                            float scale);

// Query rows, each attending as a decode row over its own context; already validated.
struct PagedRows {
  float* out;            // [num_rows, h, d]
  const float* q;        // [num_rows, q_stride], heads contiguous
  int64_t q_stride;
  const void* cache;     // KV_CACHE_LAYOUT, elements of kv_type
  KvType kv_type;
  int64_t num_blocks, block_size, hkv, d, h;
  const int32_t* tables;  // [*, table_stride]
  int64_t table_stride;
  const int32_t* row_table;  // [num_rows]: the table row of each query row (null: row i uses i)
  const int32_t* row_ctx;    // [num_rows]: context length of each row, its own token included
  int64_t num_rows;
  float scale;
};

// Runs on `workers` (the caller holds kernel_mutex()); one item per (row, KV head).
void attend_rows(const PagedRows& a, const Kernels& kern, ThreadPool& workers);

}  // namespace tinyvllm::cpu
