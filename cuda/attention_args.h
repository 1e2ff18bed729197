// Size and alignment checks shared by the decode and prefill attention launchers. P is
// DecodeParams or PrefillParams (same field names); `where` names the launcher in the message.
#pragma once

#include <string>

#include "kv_cache.cuh"

namespace tinyvllm {

template <typename P>
void check_attention_args(const P& p, const std::string& where, int num_seqs, int head_dim,
                          int block_size, int dtype, int cache_dtype) {
  require(cache_dtype == dtype || cache_dtype == kFloat8E4M3,
          where + "cache_dtype must be the query dtype or float8_e4m3fn, got " +
              dtype_name(cache_dtype));
  require(cache_dtype != kFloat8E4M3 || (p.k_scale && p.v_scale),
          where + "an FP8 cache needs k_scale and v_scale");
  require(head_dim == 64 || head_dim == 128,
          where + "head_dim=" + std::to_string(head_dim) + " unsupported (64, 128)");
  require(block_size == 16,
          where + "block_size=" + std::to_string(block_size) + " unsupported (16)");
  require(num_seqs > 0 && num_seqs <= 65535,
          where + "num_seqs=" + std::to_string(num_seqs) + " out of range [1, 65535]");
  require(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0,
          where + "num_heads=" + std::to_string(p.num_heads) + " is not a multiple of num_kv_heads=" +
              std::to_string(p.num_kv_heads));
  // 16-byte loads of q rows and 16- (8- for FP8) byte loads of cache rows.
  require(p.q_stride_token % 8 == 0 && p.q_stride_head % 8 == 0 && aligned16(p.query) &&
              aligned16(p.key_cache) && aligned16(p.value_cache) && aligned16(p.out),
          where + "query strides (" + std::to_string(p.q_stride_token) + ", " +
              std::to_string(p.q_stride_head) + ") and pointers must be 16-byte aligned");
}

}  // namespace tinyvllm
