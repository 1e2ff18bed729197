// Paged attention, prefill and chunked prefill: every new query of a sequence attends causally to
// the cached keys before it and to the new keys up to itself. Framework-free device code.
//
// Flash-attention 2 style on mma.sync tensor cores. Grid (num_heads, query tiles, num_seqs); a CTA
// owns kPrefillBlockM consecutive new queries of one head, each warp 16 of them, and walks the keys
// in tiles of kPrefillBlockN: S = Q K^T (fp32), online softmax in registers (log2 domain), O += P V.
// K/V tiles are gathered from the paged cache with cp.async; the next K tile loads during P V.
// Query i of a sequence with q_len new tokens and seq_len total sits at position
// seq_len - q_len + i and sees keys 0..that position.
//
// FP8 cache: K/V tiles are gathered (cp.async) into byte staging tiles, then dequantised to T tiles
// in shared memory before the mma. Each thread converts exactly the 16-byte chunks it gathered, so
// its own cp.async wait makes them visible and no extra barrier is needed; the next K tile's
// gather is issued right after the conversion and flies during QK^T, softmax and PV. The K scale
// is folded into the softmax scale, the V scale into the final normalisation (kv_cache.cuh).
#pragma once

#include <math_constants.h>

#include "kv_cache.cuh"
#include "mma.cuh"

namespace tinyvllm {

constexpr int kPrefillThreads = 128;
constexpr int kPrefillWarps = kPrefillThreads / 32;
constexpr int kPrefillBlockM = 16 * kPrefillWarps;  // query rows per CTA
constexpr int kPrefillBlockN = 64;                   // keys per tile
constexpr int kPrefillBlockSize = 16;                // tokens per KV block (the only one built)

struct PrefillParams {
  void* out;                   // [num_tokens, num_heads, head_dim]
  const void* query;           // [num_tokens, num_heads, head_dim] with strides below
  const void* key_cache;       // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;     // [num_blocks, block_size, num_kv_heads, head_dim]
  const int* block_tables;     // [num_seqs, max_num_blocks_per_seq]
  const int* seq_lens;         // [num_seqs]
  const int* query_start_loc;  // [num_seqs + 1]
  int num_heads;
  int num_kv_heads;
  int group_size;
  int64_t q_stride_token;
  int64_t q_stride_head;
  int max_num_blocks_per_seq;
  float scale_log2;            // softmax scale * log2(e)
  const float* k_scale;        // [1], FP8 cache only
  const float* v_scale;        // [1], FP8 cache only
};

// Shared-memory rows are padded by 16 bytes so that ldmatrix's 8 rows hit 8 different bank groups.
// An FP8 cache adds two unpadded byte tiles (K and V staging) after the T tiles.
template <int HEAD_DIM, bool FP8>
struct PrefillSmem {
  static constexpr int kRow = HEAD_DIM + 8;
  static constexpr size_t kTileBytes = size_t(kPrefillBlockM + 2 * kPrefillBlockN) * kRow * 2;
  static constexpr size_t kStagingBytes = FP8 ? size_t(2 * kPrefillBlockN) * HEAD_DIM : 0;
  static constexpr size_t kBytes = kTileBytes + kStagingBytes;
};

template <typename T, typename Cache, int HEAD_DIM>
struct PrefillCta {
  static constexpr bool kFp8 = is_fp8_cache<Cache>();
  static constexpr int kRow = PrefillSmem<HEAD_DIM, kFp8>::kRow;
  static constexpr int kChunks = HEAD_DIM / 8;        // 16-byte chunks per row
  static constexpr int kKSteps = HEAD_DIM / 16;       // k-steps of Q K^T
  static constexpr int kSTiles = kPrefillBlockN / 8;  // 16x8 tiles of S per warp
  static constexpr int kOTiles = HEAD_DIM / 8;        // 16x8 tiles of O per warp

  const PrefillParams& p;
  T* sq;  // [kPrefillBlockM][kRow]
  T* sk;  // [kPrefillBlockN][kRow]
  T* sv;  // [kPrefillBlockN][kRow]
  uint8_t* sk8;  // [kPrefillBlockN][HEAD_DIM], FP8 staging
  uint8_t* sv8;  // [kPrefillBlockN][HEAD_DIM], FP8 staging
  const int* table;
  int head, kv_head, q_start, m0, rows, kv_end, ctx;
  int warp, lane;
  float qk_scale;  // softmax scale * log2(e) (* K scale)
  float v_scale;   // 1, or the V scale of an FP8 cache

  __device__ __forceinline__ void load_q() const {
    const T* base = static_cast<const T*>(p.query) + (q_start + m0) * p.q_stride_token +
                    head * p.q_stride_head;
    for (int idx = threadIdx.x; idx < kPrefillBlockM * kChunks; idx += kPrefillThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = r < rows;
      const T* src = valid ? base + r * p.q_stride_token + c * 8 : base;
      cp_async16(sq + r * kRow + c * 8, src, valid ? 16 : 0);
    }
  }

  // Keys n0..n0 + kPrefillBlockN - 1 of K or V; rows at or past kv_end are zero-filled.
  __device__ __forceinline__ void load_kv(T* dst, const void* cache, int n0) const {
    const T* base = static_cast<const T*>(cache);
    const int64_t token_stride = int64_t(p.num_kv_heads) * HEAD_DIM;
    for (int idx = threadIdx.x; idx < kPrefillBlockN * kChunks; idx += kPrefillThreads) {
      const int r = idx / kChunks, c = idx % kChunks, j = n0 + r;
      const bool valid = j < kv_end;
      const T* src = base;
      if (valid) {
        const int64_t slot = int64_t(table[j / kPrefillBlockSize]) * kPrefillBlockSize +
                             j % kPrefillBlockSize;
        src = base + slot * token_stride + kv_head * HEAD_DIM + c * 8;
      }
      cp_async16(dst + r * kRow + c * 8, src, valid ? 16 : 0);
    }
  }

  // As load_kv for an FP8 cache: 16 elements per 16-byte chunk into an unpadded byte tile.
  __device__ __forceinline__ void load_kv_fp8(uint8_t* dst, const void* cache, int n0) const {
    constexpr int kChunks8 = HEAD_DIM / 16;
    const uint8_t* base = static_cast<const uint8_t*>(cache);
    const int64_t token_stride = int64_t(p.num_kv_heads) * HEAD_DIM;
    for (int idx = threadIdx.x; idx < kPrefillBlockN * kChunks8; idx += kPrefillThreads) {
      const int r = idx / kChunks8, c = idx % kChunks8, j = n0 + r;
      const bool valid = j < kv_end;
      const uint8_t* src = base;
      if (valid) {
        const int64_t slot = int64_t(table[j / kPrefillBlockSize]) * kPrefillBlockSize +
                             j % kPrefillBlockSize;
        src = base + slot * token_stride + kv_head * HEAD_DIM + c * 16;
      }
      cp_async16(dst + r * HEAD_DIM + c * 16, src, valid ? 16 : 0);
    }
  }

  // Staged FP8 tile -> T tile (zero-filled rows stay zero), each thread the chunks load_kv_fp8
  // gave it (same loop): after the thread's cp_async_wait, before the barrier that publishes dst.
  __device__ __forceinline__ void dequant_tile(T* dst, const uint8_t* src) const {
    constexpr int kChunks8 = HEAD_DIM / 16;
    for (int idx = threadIdx.x; idx < kPrefillBlockN * kChunks8; idx += kPrefillThreads) {
      const int r = idx / kChunks8, c = idx % kChunks8;
      uint4 lo, hi;
      fp8x16_to<T>(*reinterpret_cast<const uint4*>(src + r * HEAD_DIM + c * 16), lo, hi);
      uint4* out = reinterpret_cast<uint4*>(dst + r * kRow + c * 16);
      out[0] = lo;
      out[1] = hi;
    }
  }

  // K tile n0 towards sk: straight there, or into its staging tile for an FP8 cache.
  __device__ __forceinline__ void load_k(int n0) const {
    if constexpr (kFp8) {
      load_kv_fp8(sk8, p.key_cache, n0);
    } else {
      load_kv(sk, p.key_cache, n0);
    }
  }
  __device__ __forceinline__ void load_v(int n0) const {
    if constexpr (kFp8) {
      load_kv_fp8(sv8, p.value_cache, n0);
    } else {
      load_kv(sv, p.value_cache, n0);
    }
  }

  __device__ __forceinline__ void q_fragments(uint32_t (&qf)[kKSteps][4]) const {
    const int row = warp * 16 + (lane / 8) % 2 * 8 + lane % 8;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      ldmatrix_x4(qf[ks], sq + row * kRow + ks * 16 + lane / 16 * 8);
    }
  }

  __device__ __forceinline__ void qk(const uint32_t (&qf)[kKSteps][4],
                                     float (&s)[kSTiles][4]) const {
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    const int key = lane / 16 * 8 + lane % 8;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, sk + (nt * 8 + key) * kRow + ks * 16 + (lane / 8) % 2 * 8);
        mma_16816<T>(s[nt], qf[ks], b[0], b[1]);
        mma_16816<T>(s[nt + 1], qf[ks], b[2], b[3]);
      }
    }
  }

  // Masks, rescales the running output and turns s into probabilities (unnormalised).
  __device__ __forceinline__ void online_softmax(float (&s)[kSTiles][4], int n0,
                                                 const int (&row_pos)[2], float (&m_row)[2],
                                                 float (&l_row)[2],
                                                 float (&o)[kOTiles][4]) const {
    float mx[2] = {m_row[0], m_row[1]};
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
        const float v = key <= row_pos[e >> 1] ? s[nt][e] * qk_scale : -CUDART_INF_F;
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    }
    float alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      alpha[h] = exp2f(m_row[h] - mx[h]);  // 0 on the first tile (m_row = -inf, mx finite)
      m_row[h] = mx[h];
    }
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - mx[e >> 1]);
        sum[e >> 1] += s[nt][e];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_row[h] = l_row[h] * alpha[h] + sum[h];
#pragma unroll
    for (int dt = 0; dt < kOTiles; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dt][e] *= alpha[e >> 1];
    }
  }

  __device__ __forceinline__ void pv(const float (&s)[kSTiles][4], float (&o)[kOTiles][4]) const {
    const int key = (lane / 8) % 2 * 8 + lane % 8;
#pragma unroll
    for (int kk = 0; kk < kPrefillBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                             pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dt = 0; dt < kOTiles; dt += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sv + (kk * 16 + key) * kRow + (dt + lane / 16) * 8);
        mma_16816<T>(o[dt], a, b[0], b[1]);
        mma_16816<T>(o[dt + 1], a, b[2], b[3]);
      }
    }
  }

  __device__ __forceinline__ void write(const float (&o)[kOTiles][4], float (&l_row)[2]) const {
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_row[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? (kFp8 ? v_scale / l : 1.f / l) : 0.f;
      const int r = warp * 16 + lane / 4 + h * 8;
      if (r >= rows) continue;
      T* dst = out + (int64_t(q_start + m0 + r) * p.num_heads + head) * HEAD_DIM + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < kOTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(dst + dt * 8) =
            pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
      }
    }
  }
};

template <typename T, typename Cache, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads)
paged_prefill_kernel(const PrefillParams p) {
  using Cta = PrefillCta<T, Cache, HEAD_DIM>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Cta c{p};
  c.head = blockIdx.x;
  const int seq = blockIdx.z;
  c.q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - c.q_start;
  c.m0 = blockIdx.y * kPrefillBlockM;
  if (c.m0 >= q_len) return;
  const int seq_len = p.seq_lens[seq];
  c.ctx = seq_len - q_len;
  c.rows = min(kPrefillBlockM, q_len - c.m0);
  c.kv_end = min(seq_len, c.ctx + c.m0 + c.rows);
  c.kv_head = c.head / p.group_size;
  c.table = p.block_tables + int64_t(seq) * p.max_num_blocks_per_seq;
  c.warp = threadIdx.x / 32;
  c.lane = threadIdx.x % 32;
  c.sq = reinterpret_cast<T*>(smem_raw);
  c.sk = c.sq + kPrefillBlockM * Cta::kRow;
  c.sv = c.sk + kPrefillBlockN * Cta::kRow;
  c.sk8 = reinterpret_cast<uint8_t*>(c.sv + kPrefillBlockN * Cta::kRow);
  c.sv8 = c.sk8 + kPrefillBlockN * HEAD_DIM;
  c.qk_scale = p.scale_log2;
  c.v_scale = 1.f;
  if constexpr (Cta::kFp8) {
    c.qk_scale *= __ldg(p.k_scale);
    c.v_scale = __ldg(p.v_scale);
  }

  c.load_q();
  cp_async_commit();
  if (c.kv_end > 0) c.load_k(0);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[Cta::kKSteps][4];
  c.q_fragments(qf);

  // Rows past q_len compute on the last valid position (finite, never written).
  int row_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_pos[h] = min(c.ctx + c.m0 + c.warp * 16 + c.lane / 4 + h * 8, c.kv_end - 1);
  }
  float o[Cta::kOTiles][4] = {};
  float m_row[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_row[2] = {0.f, 0.f};
  for (int n0 = 0; n0 < c.kv_end; n0 += kPrefillBlockN) {
    c.load_v(n0);
    cp_async_commit();
    cp_async_wait<1>();  // K(n0) has landed
    if constexpr (Cta::kFp8) {
      c.dequant_tile(c.sk, c.sk8);  // own chunks: sk8's are free again for this thread
      if (n0 + kPrefillBlockN < c.kv_end) {
        c.load_k(n0 + kPrefillBlockN);
        cp_async_commit();
      }
    }
    __syncthreads();
    float s[Cta::kSTiles][4];
    c.qk(qf, s);
    c.online_softmax(s, n0, row_pos, m_row, l_row, o);
    __syncthreads();  // every warp is done with sk
    const bool more = n0 + kPrefillBlockN < c.kv_end;
    if (more) {
      if constexpr (!Cta::kFp8) {
        c.load_k(n0 + kPrefillBlockN);
        cp_async_commit();
      }
      cp_async_wait<1>();  // V(n0) has landed; K(next) may still fly
    } else {
      cp_async_wait<0>();
    }
    if constexpr (Cta::kFp8) c.dequant_tile(c.sv, c.sv8);
    __syncthreads();
    c.pv(s, o);
    __syncthreads();  // every warp is done with sv
  }
  c.write(o, l_row);
}

}  // namespace tinyvllm
