// Writing new K/V rows into the paged cache. Framework-free device code.
//
// Cache layout (per K and per V): [num_blocks, block_size, num_kv_heads, head_dim], so the
// num_kv_heads * head_dim elements of one slot are contiguous and a token is a plain row copy.
#pragma once

#include "common.cuh"

namespace tinyvllm {

// One CTA per token; Vec is the copy unit (uint4 when every row is 16-byte aligned).
template <typename Vec>
__global__ void reshape_and_cache_kernel(
    const Vec* __restrict__ key,        // [num_tokens, key_stride_vec]
    const Vec* __restrict__ value,      // [num_tokens, value_stride_vec]
    Vec* __restrict__ key_cache,        // [num_slots, row_vecs]
    Vec* __restrict__ value_cache,      // [num_slots, row_vecs]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]; -1 = padding, skipped
    int row_vecs, int64_t key_stride_vec, int64_t value_stride_vec) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const Vec* k = key + token * key_stride_vec;
  const Vec* v = value + token * value_stride_vec;
  Vec* kc = key_cache + slot * row_vecs;
  Vec* vc = value_cache + slot * row_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    kc[i] = k[i];
    vc[i] = v[i];
  }
}

}  // namespace tinyvllm
