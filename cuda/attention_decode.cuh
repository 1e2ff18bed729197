// Paged attention, decode: one query per sequence over its paged K/V. Framework-free device code.
//
// Grid (num_kv_heads * head_chunks, num_seqs, num_splits). A CTA takes one KV head, up to MAX_G of
// the query heads that share it (GQA: K/V are read once for all of them) and one partition of the
// context (split-K / flash-decoding, so that a few long sequences still fill the chip):
//   phase 1  scores of every token of the partition, kept in shared memory      (reads K once)
//   phase 2  max and sum per head over the partition (exact softmax inside it)
//   phase 3  probability-weighted sum of V                                         (reads V once)
// With several partitions, each writes (normalised out, max, sum) and `paged_decode_reduce_kernel`
// merges them (or the o_proj GEMV does, as its prologue: decode_merge.cuh); with one, the CTA
// writes the final output.
//
// Fused new token (DecodeNewToken, the engine's decode step): q, k and v arrive straight from the
// qkv projection. The kernel rotates q and k (GPT-NeoX halves, as rotary_embedding_and_cache),
// writes the rotated k and v into the token's cache slot and attends with the fresh values, so the
// rotary + cache-write launch disappears. fp32 accumulation throughout; scores are
// kept in the log2 domain (q is pre-scaled by scale * log2(e)) so exp2 does the softmax.
//
// Lane layout: a token's head_dim elements are read by HEAD_DIM / 8 lanes, 8 elements each (16 bytes
// of a 16-bit cache, 8 bytes of an FP8 one), so a warp reads 32 / (HEAD_DIM / 8) whole tokens per
// load and every load is coalesced.
//
// FP8 cache: elements are converted to float as they are used; the K scale is folded into the
// query's pre-scale and the V scale into the output (kv_cache.cuh).
#pragma once

#include <math_constants.h>

#include "decode_merge.cuh"
#include "kv_cache.cuh"

namespace tinyvllm {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeBlockSize = 16;      // tokens per KV block (the only one instantiated)
constexpr int kDecodeMaxPartition = 512;  // tokens per split, at most (shared memory for scores)

struct DecodeParams {
  void* out;                  // [num_seqs, num_heads, head_dim]
  const void* query;          // [num_seqs, num_heads, head_dim] with strides below
  const void* key_cache;      // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  const int* block_tables;    // [num_seqs, max_num_blocks_per_seq]
  const int* seq_lens;        // [num_seqs]
  float* split_out;           // [num_seqs, num_heads, num_splits, head_dim]
  float* split_max;           // [num_seqs, num_heads, num_splits] (log2 domain)
  float* split_sum;           // [num_seqs, num_heads, num_splits]
  int num_heads;
  int num_kv_heads;
  int group_size;             // num_heads / num_kv_heads
  int head_chunks;            // ceil(group_size / MAX_G)
  int q_stride_token;         // 32-bit (checked) so that the struct stays within 128 bytes, where
  int q_stride_head;          // nvcc reads fields straight from the parameter bank
  int max_num_blocks_per_seq;
  int num_splits;
  int partition_size;         // multiple of kDecodeBlockSize, <= kDecodeMaxPartition
  float scale_log2;           // softmax scale * log2(e)
  const float* k_scale;       // [1], FP8 cache only
  const float* v_scale;       // [1], FP8 cache only
};

// Optional second argument of the decode kernel (kept apart so that DecodeParams stays within 128
// bytes, see above).
struct DecodeNewToken {
  const void* key;              // [num_seqs, kv_stride]: num_kv_heads * head_dim keys, not rotated
  const void* value;            // [num_seqs, kv_stride]
  const int64_t* positions;     // [num_seqs]
  const int64_t* slot_mapping;  // [num_seqs]; negative: padding, nothing written
  const float* cos_sin;         // [max_position, head_dim] cos | sin halves; nullptr: not fused,
                                // the query is already rotated and the token already cached
  int kv_stride;                // elements between rows of key / value
};

template <int MAX_G>
constexpr size_t decode_smem_floats(int partition_size, int head_dim) {
  return size_t(MAX_G) * partition_size + size_t(kDecodeWarps) * MAX_G * head_dim;
}

template <typename T, typename Cache, int HEAD_DIM, int MAX_G>
struct DecodeCta {
  using Load = CacheVec8<T, Cache>;
  using Vec = typename Load::Vec;
  static constexpr int kVec = 8;  // cache elements per load
  static constexpr int kLanesPerToken = HEAD_DIM / kVec;
  static constexpr int kTokensPerLoad = 32 / kLanesPerToken;
  static constexpr int kLoadsPerBlock = kDecodeBlockSize / kTokensPerLoad;

  const DecodeParams& p;
  int seq, split, kv_head, head0, num_g, len, num_blocks;
  const int* table;  // this partition's entries of the block table
  int fresh;         // index in the partition of the fused new token, -1 if none
  float* fresh_v;    // [HEAD_DIM]: its value, as read back from the cache (without the V scale)
  int lane_token, lane_chunk, warp, lane;
  float* logits;     // [MAX_G][partition_size]
  float* reduce_buf; // [kDecodeWarps][MAX_G][HEAD_DIM]

  // K or V rows of one block for this lane: kLoadsPerBlock vectors of kVec elements, load i at
  // row_of(cache, b) + i * kTokensPerLoad * token_stride.
  __device__ __forceinline__ const Cache* row_of(const Cache* cache, int b) const {
    return cache + (int64_t(table[b]) * kDecodeBlockSize + lane_token) * token_stride() +
           kv_head * HEAD_DIM + lane_chunk * kVec;
  }

  __device__ __forceinline__ int64_t token_stride() const {
    return int64_t(p.num_kv_heads) * HEAD_DIM;
  }

  __device__ __forceinline__ void load_block(const Cache* cache, int b,
                                             Vec (&v)[kLoadsPerBlock]) const {
    const Cache* base = row_of(cache, b);
#pragma unroll
    for (int i = 0; i < kLoadsPerBlock; ++i) {
      v[i] = __ldg(reinterpret_cast<const Vec*>(base + i * kTokensPerLoad * token_stride()));
    }
  }

  // Token index (within the partition) of load i of block b for this lane.
  __device__ __forceinline__ int token_of(int b, int i) const {
    return b * kDecodeBlockSize + i * kTokensPerLoad + lane_token;
  }

  // q . k of one token, summed over the token's kLanesPerToken lanes (every one of them gets it).
  __device__ __forceinline__ static float token_dot(const float (&q)[kVec], const float (&k)[kVec]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = fmaf(q[e], k[e], s);
#pragma unroll
    for (int off = kLanesPerToken / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
  }

  // This lane's rotary factors at the new token's position (GPT-NeoX halves: x1 c - x2 s |
  // x2 c + x1 s, the partner half kLanesPerToken / 2 lanes away) and the token's cache slot:
  // step inputs, loaded before the wait on the kernel before.
  struct NewToken {
    float cos[kVec], sin[kVec];  // sin carries the sign of this lane's half
    int64_t slot;
  };

  __device__ __forceinline__ NewToken load_new_token(const DecodeNewToken& nt) const {
    constexpr int kHalfLanes = kLanesPerToken / 2;
    NewToken t;
    const float* cos = nt.cos_sin + nt.positions[seq] * HEAD_DIM + (lane_chunk % kHalfLanes) * kVec;
    const float sign = lane_chunk < kHalfLanes ? -1.f : 1.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      t.cos[e] = __ldg(cos + e);
      t.sin[e] = sign * __ldg(cos + HEAD_DIM / 2 + e);
    }
    t.slot = nt.slot_mapping[seq];
    return t;
  }

  // Rotates this lane's chunk of a head row and rounds it to T, as rotary_embedding_and_cache
  // stores it. Every lane of the warp must call it (shuffles).
  __device__ __forceinline__ static void rotate(float (&x)[kVec], const NewToken& t) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float partner = __shfl_xor_sync(0xffffffffu, x[e], kLanesPerToken / 2);
      x[e] = round_to<T>(x[e] * t.cos[e] + partner * t.sin[e]);
    }
  }

  // q pre-scaled by scale * log2(e), times the K scale of an FP8 cache (rotated first when the new
  // token is fused: `fused`).
  __device__ __forceinline__ void load_query(float (&q)[MAX_G][kVec], bool fused,
                                             const NewToken& t) const {
    const T* base = static_cast<const T*>(p.query) + int64_t(seq) * p.q_stride_token +
                    lane_chunk * kVec;
    float scale = p.scale_log2;
    if constexpr (is_fp8_cache<Cache>()) scale *= __ldg(p.k_scale);
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      float f[kVec] = {};
      if (g < num_g) {
        unpack8<T>(*reinterpret_cast<const uint4*>(base + int64_t(head0 + g) * p.q_stride_head), f);
        if (fused) rotate(f, t);
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[g][i] = f[i] * scale;
    }
  }

  // Eight floats as the cache stores them (rounded to T, or quantised with `scale`).
  __device__ __forceinline__ static Vec to_cache_vec(const float (&f)[kVec], float scale) {
    if constexpr (is_fp8_cache<Cache>()) {
      Vec v;
      __nv_fp8_storage_t* e = reinterpret_cast<__nv_fp8_storage_t*>(&v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) e[i] = quantize_fp8(f[i], scale);
      return v;
    } else {
      return pack8<T>(f);
    }
  }

  // The fused new token, by warp 0: rotates its k, writes k and v to the token's cache slot (if
  // `writer`: chunk 0 of the KV head), writes its scores to `logits` and keeps v in fresh_v for
  // weighted_values, both as the cache holds them, so the stale slot is never read.
  // The new token's raw k and v rows of this lane (from the qkv projection: after the wait).
  __device__ __forceinline__ void load_new_kv(const DecodeNewToken& nt, uint4& k, uint4& v) const {
    const int64_t at = int64_t(seq) * nt.kv_stride + kv_head * HEAD_DIM + lane_chunk * kVec;
    k = *reinterpret_cast<const uint4*>(static_cast<const T*>(nt.key) + at);
    v = *reinterpret_cast<const uint4*>(static_cast<const T*>(nt.value) + at);
  }

  __device__ __forceinline__ void take_new_token(const NewToken& t, const uint4& raw_k,
                                                 const uint4& raw_v, bool writer,
                                                 const float (&q)[MAX_G][kVec]) const {
    float k[kVec], v[kVec];
    unpack8<T>(raw_k, k);
    unpack8<T>(raw_v, v);
    rotate(k, t);
    float ks = 1.f, vs = 1.f;
    if constexpr (is_fp8_cache<Cache>()) {
      ks = __ldg(p.k_scale);
      vs = __ldg(p.v_scale);
    }
    const Vec kc = to_cache_vec(k, ks), vc = to_cache_vec(v, vs);
    if (writer && t.slot >= 0 && lane_token == 0) {
      const int64_t row = (t.slot * p.num_kv_heads + kv_head) * HEAD_DIM + lane_chunk * kVec;
      *reinterpret_cast<Vec*>(const_cast<Cache*>(static_cast<const Cache*>(p.key_cache)) + row) = kc;
      *reinterpret_cast<Vec*>(const_cast<Cache*>(static_cast<const Cache*>(p.value_cache)) + row) =
          vc;
    }
    Load::unpack(kc, k);
    Load::unpack(vc, v);
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g >= num_g) break;
      const float s = token_dot(q[g], k);
      if (lane == 0) logits[g * p.partition_size + fresh] = s;
    }
    if (lane_token == 0) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) fresh_v[lane_chunk * kVec + e] = v[e];
    }
  }

  // Adds the fused new token's weighted value (skipped by weighted_values) to acc: warp 0.
  __device__ __forceinline__ void add_new_token(float (&acc)[MAX_G][kVec]) const {
    if (lane_token != 0) return;
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      if (g >= num_g) break;
      const float w = logits[g * p.partition_size + fresh];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(w, fresh_v[lane_chunk * kVec + e], acc[g][e]);
    }
  }

  // This warp's first block of K or V (block `warp`), which walk_blocks starts from.
  __device__ __forceinline__ void load_first(const Cache* cache,
                                             Vec (&first)[kLoadsPerBlock]) const {
    if (warp < num_blocks) load_block(cache, warp, first);
  }

  // Each warp walks blocks warp, warp + kDecodeWarps, ... from `first` (load_first); the next
  // block's loads are issued before the current block's math (body(b, rows)) so that two blocks
  // per warp are in flight. (Keeping three in flight for FP8 measured slower: more registers,
  // spills, fewer CTAs/SM.)
  template <typename Body>
  __device__ __forceinline__ void walk_blocks(const Cache* cache,
                                              const Vec (&first)[kLoadsPerBlock],
                                              Body&& body) const {
    Vec next[kLoadsPerBlock];
#pragma unroll
    for (int i = 0; i < kLoadsPerBlock; ++i) next[i] = first[i];
    for (int b = warp; b < num_blocks; b += kDecodeWarps) {
      Vec rows[kLoadsPerBlock];
#pragma unroll
      for (int i = 0; i < kLoadsPerBlock; ++i) rows[i] = next[i];
      if (b + kDecodeWarps < num_blocks) load_block(cache, b + kDecodeWarps, next);
      body(b, rows);
    }
  }

  __device__ __forceinline__ void scores(const float (&q)[MAX_G][kVec],
                                        const Vec (&first)[kLoadsPerBlock]) const {
    walk_blocks(static_cast<const Cache*>(p.key_cache), first,
                [&](int b, const Vec (&k)[kLoadsPerBlock]) {
#pragma unroll
      for (int i = 0; i < kLoadsPerBlock; ++i) {
        const int t = token_of(b, i);
        float kf[kVec];
        Load::unpack(k[i], kf);
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
          if (g >= num_g) break;
          const float s = token_dot(q[g], kf);
          // The fused new token's slot is stale: take_new_token writes its score.
          if (lane_chunk == 0 && t != fresh) {
            logits[g * p.partition_size + t] = t < len ? s : -CUDART_INF_F;
          }
        }
      }
    });
  }

  // Turns scores into exp2(s - max) in place; returns nothing, fills head_max / head_sum.
  __device__ __forceinline__ void softmax(float* head_max, float* head_sum) const {
    for (int g = warp; g < num_g; g += kDecodeWarps) {
      float* row = logits + g * p.partition_size;
      float m = -CUDART_INF_F;
      for (int t = lane; t < len; t += 32) m = fmaxf(m, row[t]);
      m = warp_max(m);
      float sum = 0.f;
      for (int t = lane; t < num_blocks * kDecodeBlockSize; t += 32) {
        const float e = t < len ? exp2f(row[t] - m) : 0.f;
        row[t] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        head_max[g] = m;
        head_sum[g] = sum;
      }
    }
  }

  __device__ __forceinline__ void weighted_values(float (&acc)[MAX_G][kVec],
                                                 const Vec (&first)[kLoadsPerBlock]) const {
    walk_blocks(static_cast<const Cache*>(p.value_cache), first,
                [&](int b, const Vec (&v)[kLoadsPerBlock]) {
#pragma unroll
      for (int i = 0; i < kLoadsPerBlock; ++i) {
        const int t = token_of(b, i);
        // Slots past the context may hold anything, NaN included; the new token's is stale.
        if (t >= len || t == fresh) continue;
        float vf[kVec];
        Load::unpack(v[i], vf);
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
          if (g >= num_g) break;
          const float w = logits[g * p.partition_size + t];
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
        }
      }
    });
  }

  // Sums acc over the lanes and warps that hold the same dims; result in reduce_buf[0].
  __device__ __forceinline__ void reduce_acc(float (&acc)[MAX_G][kVec]) const {
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
#pragma unroll
        for (int off = kLanesPerToken; off < 32; off <<= 1) {
          acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        }
      }
    }
    if (lane_token == 0) {
#pragma unroll
      for (int g = 0; g < MAX_G; ++g) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          reduce_buf[(warp * MAX_G + g) * HEAD_DIM + lane_chunk * kVec + e] = acc[g][e];
        }
      }
    }
  }

  // This partition's normalised output of element idx (= g * HEAD_DIM + d): the warps' sums.
  __device__ __forceinline__ float partition_out(int idx, const float* head_sum) const {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) total += reduce_buf[w * MAX_G * HEAD_DIM + idx];
    total /= head_sum[idx / HEAD_DIM];
    if constexpr (is_fp8_cache<Cache>()) total *= __ldg(p.v_scale);
    return total;
  }

  __device__ __forceinline__ void write(const float* head_max, const float* head_sum) const {
    for (int idx = threadIdx.x; idx < num_g * HEAD_DIM; idx += kDecodeThreads) {
      const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
      const float val = partition_out(idx, head_sum);
      const int64_t row = int64_t(seq) * p.num_heads + head0 + g;
      if (p.num_splits == 1) {
        static_cast<T*>(p.out)[row * HEAD_DIM + d] = from_float<T>(val);
      } else {
        const int64_t at = row * p.num_splits + split;
        p.split_out[at * HEAD_DIM + d] = val;
        if (d == 0) {
          p.split_max[at] = head_max[g];
          p.split_sum[at] = head_sum[g];
        }
      }
    }
  }

  // A zero-length sequence with a single partition: its output is zeros.
  __device__ __forceinline__ void write_zeros() const {
    for (int idx = threadIdx.x; idx < num_g * HEAD_DIM; idx += kDecodeThreads) {
      const int64_t row = int64_t(seq) * p.num_heads + head0 + idx / HEAD_DIM;
      static_cast<T*>(p.out)[row * HEAD_DIM + idx % HEAD_DIM] = from_float<T>(0.f);
    }
  }
};

// FUSED: nt carries the step's new token (nt.cos_sin != nullptr).
template <typename T, typename Cache, int HEAD_DIM, int MAX_G, bool FUSED>
__global__ void __launch_bounds__(kDecodeThreads)
paged_decode_kernel(const DecodeParams p, const DecodeNewToken nt) {
  using Cta = DecodeCta<T, Cache, HEAD_DIM, MAX_G>;
  extern __shared__ float smem[];
  __shared__ float head_max[MAX_G], head_sum[MAX_G], fresh_v[HEAD_DIM];
  Cta c{p};
  c.seq = blockIdx.y;
  c.split = blockIdx.z;
  c.kv_head = blockIdx.x / p.head_chunks;
  const int chunk = blockIdx.x % p.head_chunks;
  c.head0 = c.kv_head * p.group_size + chunk * MAX_G;
  c.num_g = min(MAX_G, p.group_size - chunk * MAX_G);
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.lane_token = c.lane / Cta::kLanesPerToken;
  c.lane_chunk = c.lane % Cta::kLanesPerToken;
  c.logits = smem;
  c.reduce_buf = smem + MAX_G * p.partition_size;
  // Step metadata is input, never written by the kernel before (PDL launch): read it at once.
  const int seq_len = p.seq_lens[c.seq];
  const int start = c.split * p.partition_size;
  c.len = max(0, min(seq_len - start, p.partition_size));
  c.fresh = nt.cos_sin != nullptr && start + c.len == seq_len ? c.len - 1 : -1;
  c.fresh_v = fresh_v;
  c.num_blocks = (c.len + kDecodeBlockSize - 1) / kDecodeBlockSize;
  c.table = p.block_tables + int64_t(c.seq) * p.max_num_blocks_per_seq + start / kDecodeBlockSize;
  // FUSED (the new token fused in): the kernel before is the qkv projection, and every cached
  // token this CTA reads was written by an earlier step (the new token's slot is skipped), so the
  // first blocks of K and V are loaded while that kernel drains. Unfused, the kernel before wrote
  // the new token into the cache: wait first, and load V's first block only after the scores
  // (an instantiation of its own, so that these registers cost no occupancy there).
  const Cache* key_cache = static_cast<const Cache*>(p.key_cache);
  const Cache* value_cache = static_cast<const Cache*>(p.value_cache);
  typename Cta::Vec k_first[Cta::kLoadsPerBlock], v_first[Cta::kLoadsPerBlock];
  typename Cta::NewToken token{};
  if constexpr (FUSED) {
    c.load_first(key_cache, k_first);
    c.load_first(value_cache, v_first);
    if (c.len > 0) token = c.load_new_token(nt);
  }
  wait_for_previous_grid();  // q, k, v (and, unfused, this step's cache rows) come from before
  allow_next_grid();
  if constexpr (!FUSED) c.load_first(key_cache, k_first);
  if (c.len > 0) {
    const bool takes_new = c.fresh >= 0 && c.warp == 0;
    uint4 new_k, new_v;
    if (takes_new) c.load_new_kv(nt, new_k, new_v);  // in flight with the query's loads
    float q[MAX_G][Cta::kVec];
    c.load_query(q, FUSED, token);
    if (takes_new) c.take_new_token(token, new_k, new_v, chunk == 0, q);
    c.scores(q, k_first);
    __syncthreads();
    c.softmax(head_max, head_sum);
    __syncthreads();
    float acc[MAX_G][Cta::kVec] = {};
    if constexpr (!FUSED) c.load_first(value_cache, v_first);
    c.weighted_values(acc, v_first);
    if (c.fresh >= 0 && c.warp == 0) c.add_new_token(acc);
    c.reduce_acc(acc);
    __syncthreads();
  }
  if (c.len > 0) {
    c.write(head_max, head_sum);
  } else if (p.num_splits == 1) {
    c.write_zeros();
  }  // other empty partitions write nothing; the reduce skips them
}

// Grid (num_heads, num_seqs), head_dim threads: merges the partitions of one (seq, head).
template <typename T>
__global__ void paged_decode_reduce_kernel(T* __restrict__ out,  // [num_seqs, num_heads, head_dim]
                                           const DecodePartitions parts) {
  // The next kernel (o_proj) may launch at once: it streams its weights while this one waits on
  // the decode kernel, and its own wait still covers both.
  allow_next_grid();
  const int seq = blockIdx.y, head = blockIdx.x, d = threadIdx.x;
  // The sequence's length is step input, written before the decode kernel: read it at once.
  const int used = used_partitions(parts.seq_lens[seq], parts.num_splits, parts.partition_size);
  wait_for_previous_grid();  // the partitions come from the decode kernel (PDL launch)
  float val[1];
  merge_partitions<1>(parts, seq, head, d, used, val);
  out[(int64_t(seq) * parts.num_heads + head) * parts.head_dim + d] = from_float<T>(val[0]);
}

}  // namespace tinyvllm
