// The merge of split-decode partitions (flash-decoding's second step), shared by the decode
// reduce kernel and the GEMV that can take its place as a prologue (o_proj, gemv.cuh).
//
// paged_decode_kernel with num_splits > 1 leaves, per (sequence, head), each partition's
// normalised output and its softmax max (log2 domain) and sum. The merged output is their mean
// weighted by sum_s * 2^(max_s - max): exactly what one partition over the whole context gives.
#pragma once

#include <math_constants.h>

#include "common.cuh"

namespace tinyvllm {

// A split decode's partitions, not yet merged.
struct DecodePartitions {
  const float* out;     // [num_seqs, num_heads, num_splits, head_dim]
  const float* max;     // [num_seqs, num_heads, num_splits]
  const float* sum;     // [num_seqs, num_heads, num_splits]
  const int* seq_lens;  // [num_seqs]
  int num_heads;
  int head_dim;
  int num_splits;
  int partition_size;
};

// The partitions as device pointers (torch data_ptr values) and sizes, checked on the host;
// `where` names the caller in the error.
inline DecodePartitions checked_partitions(const std::string& where, std::uintptr_t out,
                                           std::uintptr_t max, std::uintptr_t sum,
                                           std::uintptr_t seq_lens, int num_seqs, int num_heads,
                                           int head_dim, int num_splits, int partition_size) {
  require(out && max && sum && seq_lens, where + "split_out, split_max, split_sum and seq_lens "
                                                 "are required");
  require(num_seqs >= 0 && num_seqs <= 65535,
          where + "num_seqs=" + std::to_string(num_seqs) + " out of range");
  require(num_heads > 0 && num_heads <= 65535,
          where + "num_heads=" + std::to_string(num_heads) + " out of range");
  require(head_dim == 64 || head_dim == 128,
          where + "head_dim=" + std::to_string(head_dim) + " must be 64 or 128");
  require(num_splits >= 1 && partition_size > 0,
          where + "num_splits=" + std::to_string(num_splits) + ", partition_size=" +
              std::to_string(partition_size) + " must be positive");
  require(aligned16(reinterpret_cast<const void*>(out)),
          where + "split_out must be 16-byte aligned");
  auto f32 = [](std::uintptr_t p) { return reinterpret_cast<const float*>(p); };
  return DecodePartitions{f32(out),  f32(max), f32(sum),   reinterpret_cast<const int*>(seq_lens),
                          num_heads, head_dim, num_splits, partition_size};
}

// Partitions holding at least one token of a sequence of seq_len tokens.
__device__ __forceinline__ int used_partitions(int seq_len, int num_splits, int partition_size) {
  return min(num_splits, (seq_len + partition_size - 1) / partition_size);
}

// Merged output of dims [d0, d0 + N) of head `head` of sequence `seq`, whose first `used`
// partitions hold its tokens (zeros for none). One pass with the running max rescaling the sums
// (as flash attention does), the partitions read kBatch at a time: each batch's loads are all
// in flight together, so a merge of up to kBatch partitions waits on memory once.
template <int N>
__device__ __forceinline__ void merge_partitions(const DecodePartitions& p, int seq, int head,
                                                 int d0, int used, float (&res)[N]) {
  constexpr int kBatch = N == 1 ? 8 : 2;  // the reduce kernel, the GEMV staging (N = 8)
  const int64_t row = int64_t(seq) * p.num_heads + head;
  const float* mx = p.max + row * p.num_splits;
  const float* sm = p.sum + row * p.num_splits;
  const float* out = p.out + row * p.num_splits * p.head_dim + d0;
  float m = -CUDART_INF_F, den = 0.f, num[N] = {};
  for (int s0 = 0; s0 < used; s0 += kBatch) {
    float bm[kBatch], bs[kBatch], v[kBatch][N];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = s0 + j < used ? s0 + j : used - 1;  // past the end: a repeat, weighted 0
      bm[j] = mx[s];
      bs[j] = s0 + j < used ? sm[s] : 0.f;
      if constexpr (N % 4 == 0) {  // d0 and head_dim are multiples of N: aligned vectors
#pragma unroll
        for (int e = 0; e < N; e += 4) {
          *reinterpret_cast<float4*>(v[j] + e) =
              *reinterpret_cast<const float4*>(out + s * p.head_dim + e);
        }
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) v[j][e] = out[s * p.head_dim + e];
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const float m_new = fmaxf(m, bm[j]);
      const float rescale = exp2f(m - m_new), w = bs[j] * exp2f(bm[j] - m_new);
      den = fmaf(den, rescale, w);
#pragma unroll
      for (int e = 0; e < N; ++e) num[e] = fmaf(num[e], rescale, w * v[j][e]);
      m = m_new;
    }
  }
#pragma unroll
  for (int e = 0; e < N; ++e) res[e] = used > 0 ? num[e] / den : 0.f;
}

// The same, reading the sequence's length.
template <int N>
__device__ __forceinline__ void merge_partitions(const DecodePartitions& p, int seq, int head,
                                                 int d0, float (&res)[N]) {
  merge_partitions<N>(p, seq, head, d0,
                      used_partitions(p.seq_lens[seq], p.num_splits, p.partition_size), res);
}

}  // namespace tinyvllm
