// Launcher for paged decode attention: checks sizes, picks the instantiation.
//
// Instantiations: {float16, bfloat16} x cache {same, FP8 E4M3} x head_dim {64, 128} x MAX_G
// {1, 4, 8} x new token {fused, not} (48 kernels), block size 16. MAX_G is how many query heads of
// one KV head a CTA serves (`heads_per_cta`): 4 covers GQA ratios up to 4 with fewer registers;
// ratios above 4 use 8 and, above 8, several CTAs per KV head. A launch of few CTAs (a small
// batch over few partitions: auto_heads_per_cta) takes 1: a CTA per query head, each reading its
// KV head's K/V (again from L2), since there each warp's work is one dependent chain, not
// bandwidth, and four heads a warp make it four times as long. The reduce kernel does not depend
// on the cache (2 kernels).
#include <cmath>

#include "attention_args.h"
#include "attention_decode.cuh"
#include "launchers.h"

namespace tinyvllm {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

DecodePartitions partitions_of(const DecodeParams& p, int head_dim) {
  return DecodePartitions{p.split_out, p.split_max, p.split_sum, p.seq_lens,
                          p.num_heads, head_dim,    p.num_splits, p.partition_size};
}

template <typename T>
void launch_merge(T* out, const DecodePartitions& parts, int num_seqs, cudaStream_t stream) {
  launch_pdl(paged_decode_reduce_kernel<T>, dim3(parts.num_heads, num_seqs), dim3(parts.head_dim),
             0, stream, out, parts);
}

// The instantiation for a launch with (FUSED) or without the new token, shared memory set up.
template <typename T, typename Cache, int HEAD_DIM, int MAX_G, bool FUSED>
auto decode_kernel() {
  auto kernel = paged_decode_kernel<T, Cache, HEAD_DIM, MAX_G, FUSED>;
  // Once per instantiation, for the largest partition (a magic static is thread-safe).
  static const cudaError_t smem_ok = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(decode_smem_floats<MAX_G>(kDecodeMaxPartition, HEAD_DIM) * sizeof(float)));
  check_cuda(smem_ok, "paged_decode_kernel: shared memory");
  return kernel;
}

template <typename T, typename Cache, int HEAD_DIM, int MAX_G>
void launch_decode(DecodeParams p, const DecodeNewToken& nt, int num_seqs, bool merge,
                   cudaStream_t stream) {
  p.head_chunks = (p.group_size + MAX_G - 1) / MAX_G;
  const size_t smem = decode_smem_floats<MAX_G>(p.partition_size, HEAD_DIM) * sizeof(float);
  auto kernel = nt.cos_sin != nullptr ? decode_kernel<T, Cache, HEAD_DIM, MAX_G, true>()
                                      : decode_kernel<T, Cache, HEAD_DIM, MAX_G, false>();
  const dim3 grid(p.num_kv_heads * p.head_chunks, num_seqs, p.num_splits);
  // PDL launches: each kernel's launch overlaps the previous kernel's tail (see common.cuh).
  launch_pdl(kernel, grid, dim3(kDecodeThreads), smem, stream, p, nt);
  if (p.num_splits > 1 && merge) {
    launch_merge(static_cast<T*>(p.out), partitions_of(p, HEAD_DIM), num_seqs, stream);
  }
}

// Query heads per CTA (MAX_G) when the caller leaves it to the launcher (heads_per_cta 0): one
// where a CTA per (query head, sequence, partition) makes at most kOneHeadCtasPerSm per SM.
// H200, 32 / 8 heads, d128, fused new token (cuda/NOTES.md, "Decode attention"): one head a CTA
// took 4.3 / 5.9 us against 7.7 / 10.1 at batch 1 over 16 partitions (4 CTAs a SM), 27.7
// against 21.1 at batch 1 over 64 and 10.8 against 9.2 at batch 2 over 16 (8 CTAs a SM).
constexpr int kOneHeadCtasPerSm = 4;

int auto_heads_per_cta(int num_seqs, int num_heads, int num_splits, int group_size) {
  if (int64_t(num_seqs) * num_heads * num_splits <= int64_t(kOneHeadCtasPerSm) * num_sms()) {
    return 1;
  }
  return group_size <= 4 ? 4 : 8;
}

template <typename T, typename Cache, int HEAD_DIM>
void dispatch_group(const DecodeParams& p, const DecodeNewToken& nt, int num_seqs,
                    int heads_per_cta, bool merge, cudaStream_t stream) {
  if (heads_per_cta == 1) {
    launch_decode<T, Cache, HEAD_DIM, 1>(p, nt, num_seqs, merge, stream);
  } else if (heads_per_cta == 4) {
    launch_decode<T, Cache, HEAD_DIM, 4>(p, nt, num_seqs, merge, stream);
  } else {
    launch_decode<T, Cache, HEAD_DIM, 8>(p, nt, num_seqs, merge, stream);
  }
}

template <typename T, typename Cache>
void dispatch_head_dim(const DecodeParams& p, const DecodeNewToken& nt, int num_seqs,
                       int head_dim, int heads_per_cta, bool merge, cudaStream_t stream) {
  if (head_dim == 64) {
    dispatch_group<T, Cache, 64>(p, nt, num_seqs, heads_per_cta, merge, stream);
  } else {
    dispatch_group<T, Cache, 128>(p, nt, num_seqs, heads_per_cta, merge, stream);
  }
}

void check_decode_args(const DecodeParams& p, const DecodeNewToken& nt, int num_seqs,
                       int head_dim, int block_size, int dtype, int cache_dtype) {
  const std::string where = "paged_attention_decode: ";
  check_attention_args(p, where, num_seqs, head_dim, block_size, dtype, cache_dtype);
  require(p.partition_size > 0 && p.partition_size % kDecodeBlockSize == 0 &&
              p.partition_size <= kDecodeMaxPartition,
          where + "partition_size=" + std::to_string(p.partition_size) +
              " must be a multiple of 16 in [16, 512]");
  require(p.num_splits >= 1 && p.num_splits <= 65535,
          where + "num_splits=" + std::to_string(p.num_splits) + " out of range");
  require(p.num_splits == 1 || (p.split_out && p.split_max && p.split_sum),
          where + "num_splits > 1 needs the split_out / split_max / split_sum workspace");
  if (nt.cos_sin != nullptr) {
    require(nt.key && nt.value && nt.positions && nt.slot_mapping,
            where + "a fused new token needs key, value, positions and slot_mapping");
    require(nt.kv_stride % 8 == 0 && aligned16(nt.key) && aligned16(nt.value),
            where + "new key / value rows (stride " + std::to_string(nt.kv_stride) +
                ") must be 16-byte aligned");
  }
}

}  // namespace

void paged_attention_decode(
    ptr_t out,           // [num_seqs, num_heads, head_dim] contiguous
    ptr_t query,         // [num_seqs, num_heads, head_dim] strides (q_stride_token, q_stride_head, 1)
    ptr_t key_cache,     // [num_blocks, block_size, num_kv_heads, head_dim]
    ptr_t value_cache,   // [num_blocks, block_size, num_kv_heads, head_dim]
    ptr_t block_tables,  // [num_seqs, max_num_blocks_per_seq] int32
    ptr_t seq_lens,      // [num_seqs] int32
    ptr_t split_out,     // [num_seqs, num_heads, num_splits, head_dim] float32 (num_splits > 1)
    ptr_t split_max,     // [num_seqs, num_heads, num_splits] float32
    ptr_t split_sum,     // [num_seqs, num_heads, num_splits] float32
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int64_t q_stride_token, int64_t q_stride_head, int max_num_blocks_per_seq, int num_splits,
    int partition_size, float scale,
    ptr_t k_scale,       // [1] float32, read when cache_dtype is FP8
    ptr_t v_scale,       // [1] float32, read when cache_dtype is FP8
    ptr_t new_key,       // fused new token (0: none): [num_seqs, new_kv_stride], not rotated
    ptr_t new_value,     // [num_seqs, new_kv_stride]
    int64_t new_kv_stride,
    ptr_t positions,     // [num_seqs] int64
    ptr_t slot_mapping,  // [num_seqs] int64, negative: not written
    ptr_t cos_sin_cache, // [max_position, head_dim] float32; 0: no fused new token
    int merge_splits,    // 0: leave split partitions for paged_decode_merge / gemv_merge
    int heads_per_cta,   // query heads of one KV head per CTA: 1, 4 or 8; 0: the launcher's choice
    int dtype, int cache_dtype, stream_t stream) {
  DecodeNewToken nt{};
  nt.key = reinterpret_cast<const void*>(new_key);
  nt.value = reinterpret_cast<const void*>(new_value);
  nt.positions = reinterpret_cast<const int64_t*>(positions);
  nt.slot_mapping = reinterpret_cast<const int64_t*>(slot_mapping);
  nt.cos_sin = reinterpret_cast<const float*>(cos_sin_cache);
  require(new_kv_stride >= 0 && new_kv_stride <= INT32_MAX,
          "paged_attention_decode: new_kv_stride=" + std::to_string(new_kv_stride) +
              " out of range");
  nt.kv_stride = static_cast<int>(new_kv_stride);
  DecodeParams p{};
  p.out = reinterpret_cast<void*>(out);
  p.query = reinterpret_cast<const void*>(query);
  p.key_cache = reinterpret_cast<const void*>(key_cache);
  p.value_cache = reinterpret_cast<const void*>(value_cache);
  p.k_scale = reinterpret_cast<const float*>(k_scale);
  p.v_scale = reinterpret_cast<const float*>(v_scale);
  p.block_tables = reinterpret_cast<const int*>(block_tables);
  p.seq_lens = reinterpret_cast<const int*>(seq_lens);
  p.split_out = reinterpret_cast<float*>(split_out);
  p.split_max = reinterpret_cast<float*>(split_max);
  p.split_sum = reinterpret_cast<float*>(split_sum);
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group_size = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  require(q_stride_token >= 0 && q_stride_token <= INT32_MAX && q_stride_head >= 0 &&
              q_stride_head <= INT32_MAX,
          "paged_attention_decode: query strides (" + std::to_string(q_stride_token) + ", " +
              std::to_string(q_stride_head) + ") out of range");
  p.q_stride_token = static_cast<int>(q_stride_token);
  p.q_stride_head = static_cast<int>(q_stride_head);
  p.max_num_blocks_per_seq = max_num_blocks_per_seq;
  p.num_splits = num_splits;
  p.partition_size = partition_size;
  p.scale_log2 = scale * kLog2e;
  check_decode_args(p, nt, num_seqs, head_dim, block_size, dtype, cache_dtype);
  require(heads_per_cta == 0 || heads_per_cta == 1 || heads_per_cta == 4 || heads_per_cta == 8,
          "paged_attention_decode: heads_per_cta=" + std::to_string(heads_per_cta) +
              " must be 0 (the launcher's choice), 1, 4 or 8");
  if (heads_per_cta == 0) {
    heads_per_cta = auto_heads_per_cta(num_seqs, num_heads, num_splits, p.group_size);
  }
  const cudaStream_t s = as_stream(stream);
  TINYVLLM_DISPATCH_HALF(dtype, "paged_attention_decode", {
    if (cache_dtype == kFloat8E4M3) {
      dispatch_head_dim<scalar_t, fp8_e4m3>(p, nt, num_seqs, head_dim, heads_per_cta,
                                            merge_splits != 0, s);
    } else {
      dispatch_head_dim<scalar_t, scalar_t>(p, nt, num_seqs, head_dim, heads_per_cta,
                                            merge_splits != 0, s);
    }
  });
}

void paged_decode_merge(ptr_t out, ptr_t split_out, ptr_t split_max, ptr_t split_sum,
                        ptr_t seq_lens, int num_seqs, int num_heads, int head_dim,
                        int num_splits, int partition_size, int dtype, stream_t stream) {
  const DecodePartitions parts = checked_partitions("paged_decode_merge: ", split_out, split_max,
                                                    split_sum, seq_lens, num_seqs, num_heads,
                                                    head_dim, num_splits, partition_size);
  if (num_seqs == 0) return;
  TINYVLLM_DISPATCH_HALF(dtype, "paged_decode_merge", {
    launch_merge(reinterpret_cast<scalar_t*>(out), parts, num_seqs, as_stream(stream));
  });
}

}  // namespace tinyvllm
