// Paged prefill attention for Hopper (sm_90a): the same contract as attention_prefill.cuh (every
// new query of a sequence attends causally to the cached keys before it and the new keys up to
// itself), on warpgroup MMA. Framework-free device code; caches of the query's dtype only (an FP8
// cache keeps the mma.sync kernel).
//
// A CTA owns kSm90BlockM = 128 consecutive new queries of one head and has three warpgroups:
// - a loader: Q once, then the K and V tiles of kSm90BlockN = 128 keys, gathered from the paged
//   cache with cp.async into 128-byte-swizzled shared tiles (wgmma.cuh), two stages each. Each
//   thread's copies arrive on the stage's full mbarrier when they land; the loader waits only for
//   a stage's empty mbarrier (every consumer done reading it).
// - two consumers of 64 queries each. Per tile (FlashAttention 3's intra-warpgroup overlap):
//     S_t = Q K_t^T          wgmma, Q and K from shared memory, fp32 in registers
//     O  += P_{t-1} V_{t-1}  wgmma, P from registers (bf16/fp16), V read transposed, issued
//                            right after S_t so that it runs while the softmax of S_t does
//     online softmax of S_t  (log2 domain): P_t and the rescale of O, applied once P V is done.
//   The consumers take turns issuing their MMAs (named barriers), so one's softmax runs under the
//   other's MMAs (FlashAttention 3's ping-pong).
// The registers of S's accumulator are the A fragments of P V (same layout), so P never touches
// shared memory. A consumer whose rows are all done (causal) still waits and arrives on every
// tile's barriers, issuing nothing. CTAs take the query tiles last-first: the long causal rows
// start first.
#pragma once

#include <math_constants.h>

#include "attention_prefill.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace tinyvllm {

constexpr int kSm90Consumers = 2;                     // warpgroups that compute
constexpr int kSm90Threads = 128 * (1 + kSm90Consumers);  // and one that loads
constexpr int kSm90BlockM = 64 * kSm90Consumers;
constexpr int kSm90BlockN = 128;
// Registers per thread after setmaxnreg: the loader gives up what the consumers take. Both stay
// within what the launch granted the CTA (65536 / kSm90Threads each, in steps of 8), or the
// consumers' setmaxnreg.inc would wait forever.
constexpr int kSm90LoaderRegs = 80;
constexpr int kSm90ConsumerRegs = 208;
static_assert(128 * kSm90LoaderRegs + 128 * kSm90Consumers * kSm90ConsumerRegs <=
                  kSm90Threads * (65536 / kSm90Threads / 8 * 8),
              "setmaxnreg budget exceeds the launch's registers");

template <int HEAD_DIM>
struct Sm90PrefillSmem {
  static constexpr uint32_t kQBytes = uint32_t(kSm90BlockM) * HEAD_DIM * 2;
  static constexpr uint32_t kKvBytes = uint32_t(kSm90BlockN) * HEAD_DIM * 2;  // one K or V tile
  static constexpr uint32_t kTileBytes = kQBytes + 4 * kKvBytes;  // Q, K x 2, V x 2
  static constexpr int kBarriers = 9;  // Q full; K full x 2, V full x 2; K empty x 2, V empty x 2
  // The tiles from a 1024-byte aligned start (the swizzle atom), then the barriers.
  static constexpr size_t kBytes = kTileBytes + 8 * kBarriers + 1024;
};

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kSm90Threads, 1)
paged_prefill_sm90_kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Smem = Sm90PrefillSmem<HEAD_DIM>;
  constexpr int kChunks = HEAD_DIM / 8;       // 16-byte chunks per row
  constexpr int kKSteps = HEAD_DIM / 16;      // k-steps of Q K^T
  constexpr int kPSteps = kSm90BlockN / 16;   // k-steps of P V
  constexpr int kS = kSm90BlockN / 2;         // S accumulator floats per thread
  constexpr int kO = HEAD_DIM / 2;            // O accumulator floats per thread
  constexpr uint32_t kRowBytes = 128;         // one swizzled row of a 64-element column block
  constexpr int kConsumerThreads = 128 * kSm90Consumers;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t smem0 = (smem_addr(smem_raw) + 1023) & ~1023u;
  unsigned char* const smem_gen = smem_raw + (smem0 - smem_addr(smem_raw));
  const uint32_t sq = smem0;
  // Stage i % 2 of the K and V tiles, and the barriers: full ones (the loader's copies of a tile
  // have landed) and empty ones (every consumer is done reading the stage).
  auto sk = [&](int i) { return sq + Smem::kQBytes + uint32_t(i % 2) * Smem::kKvBytes; };
  auto sv = [&](int i) { return sq + Smem::kQBytes + uint32_t(2 + i % 2) * Smem::kKvBytes; };
  const uint32_t bars = smem0 + Smem::kTileBytes;
  const uint32_t full_q = bars;
  auto full_k = [&](int i) { return bars + 8 * (1 + i % 2); };
  auto full_v = [&](int i) { return bars + 8 * (3 + i % 2); };
  auto empty_k = [&](int i) { return bars + 8 * (5 + i % 2); };
  auto empty_v = [&](int i) { return bars + 8 * (7 + i % 2); };

  const int head = blockIdx.x;
  const int seq = blockIdx.z;
  const int q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_start;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * kSm90BlockM;
  if (m0 >= q_len) return;
  const int seq_len = p.seq_lens[seq];
  const int ctx = seq_len - q_len;
  const int rows = min(kSm90BlockM, q_len - m0);
  const int kv_end = min(seq_len, ctx + m0 + rows);
  const int n_tiles = (kv_end + kSm90BlockN - 1) / kSm90BlockN;
  const int tid = threadIdx.x;
  // The warpgroup index through a shuffle, so that the compiler knows it is the same across the
  // warp: its branches and the MMAs in them are then not divergent.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);

  if (tid == 0) {
    mbarrier_init(full_q, 128);
    for (int i = 0; i < 2; ++i) {
      mbarrier_init(full_k(i), 128);
      mbarrier_init(full_v(i), 128);
      mbarrier_init(empty_k(i), kConsumerThreads);
      mbarrier_init(empty_v(i), kConsumerThreads);
    }
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- Loader warpgroup: Q once, then K and V tiles through two stages each. ----------------
    setmaxnreg_dec<kSm90LoaderRegs>();
    const int kv_head = head / p.group_size;
    const int* table = p.block_tables + int64_t(seq) * p.max_num_blocks_per_seq;
    const int64_t token_stride = int64_t(p.num_kv_heads) * HEAD_DIM;
    // Thread tid copies chunk c = tid % kChunks of rows r0 + i * kRowStep, i < kChunks: row i
    // of a tile lies in its KV block i * kRowStep / 16, at r0 + i * kRowStep within the block
    // (modulo 16; r0 < kRowStep <= 16).
    constexpr int kRowStep = 128 / kChunks;
    constexpr int kTileBlocks = kSm90BlockN / kPrefillBlockSize;
    const int c = tid % kChunks;
    const int r0 = tid / kChunks;
    {
      const T* base = static_cast<const T*>(p.query) + int64_t(q_start + m0) * p.q_stride_token +
                      int64_t(head) * p.q_stride_head + c * 8;
#pragma unroll
      for (int i = 0; i < kSm90BlockM / kRowStep; ++i) {
        const int r = r0 + i * kRowStep;
        const bool valid = r < rows;
        cp_async16(smem_gen + sw128_offset(r, c, kSm90BlockM),
                   valid ? base + r * p.q_stride_token : base, valid ? 16 : 0);
      }
      cp_async_arrive(full_q);
    }
    // The KV blocks of tile n0 (independent loads, one latency), for both its K and V copies.
    int block[kTileBlocks];
    auto locate = [&](int n0) {
#pragma unroll
      for (int b = 0; b < kTileBlocks; ++b) {
        block[b] = n0 + b * kPrefillBlockSize < kv_end
                       ? __ldg(table + n0 / kPrefillBlockSize + b) : 0;
      }
    };
    // Tile n0 of K or V into the tile at dst, arriving on `bar` once the copies land; rows past
    // kv_end are zero-filled (their V rows meet P = 0, and 0 * garbage could be NaN).
    auto load_kv = [&](uint32_t dst, const void* cache, int n0, uint32_t bar) {
      const T* base = static_cast<const T*>(cache) + kv_head * HEAD_DIM + c * 8;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int r = r0 + i * kRowStep;
        const bool valid = n0 + r < kv_end;
        const int slot = block[i * kRowStep / kPrefillBlockSize] * kPrefillBlockSize +
                         r % kPrefillBlockSize;
        cp_async16(smem_gen + (dst - smem0) + sw128_offset(r, c, kSm90BlockN),
                   valid ? base + int64_t(slot) * token_stride : base, valid ? 16 : 0);
      }
      cp_async_arrive(bar);
    };
    for (int t = 0; t < n_tiles; ++t) {
      locate(t * kSm90BlockN);
      mbarrier_wait(empty_k(t), (t / 2 & 1) ^ 1);  // every consumer is done with K(t - 2)
      load_kv(sk(t), p.key_cache, t * kSm90BlockN, full_k(t));
      mbarrier_wait(empty_v(t), (t / 2 & 1) ^ 1);
      load_kv(sv(t), p.value_cache, t * kSm90BlockN, full_v(t));
    }
    cp_async_wait<0>();
    return;
  }

  // ---- Consumer warpgroups: 64 query rows each. ------------------------------------------------
  setmaxnreg_inc<kSm90ConsumerRegs>();
  const int wg = warpgroup - 1;
  const int warp = (tid % 128) / 32;
  const int lane = tid % 32;
  // The two consumers take turns issuing their MMAs (named barriers 1 and 2): while one runs its
  // softmax, the other's MMAs keep the tensor cores busy (FlashAttention 3's ping-pong).
  auto my_turn = [&]() { named_barrier_sync(1 + wg, kConsumerThreads); };
  auto your_turn = [&]() { named_barrier_arrive(1 + (wg + 1) % 2, kConsumerThreads); };

  // This warpgroup's rows, its key range, and each thread's two rows (mma C layout).
  const int wg_rows = max(0, min(64, rows - wg * 64));
  const int wg_kv_end = min(kv_end, ctx + m0 + wg * 64 + wg_rows);
  const int wg_tiles = wg_rows > 0 ? (wg_kv_end + kSm90BlockN - 1) / kSm90BlockN : 0;
  const int wg_first_pos = ctx + m0 + wg * 64;  // keys up to it need no mask for any row here
  int row_pos[2];  // rows past q_len compute on the last valid position (finite, never written)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_pos[h] = min(ctx + m0 + wg * 64 + warp * 16 + lane / 4 + h * 8, kv_end - 1);
  }

  // A k-step of 16 elements is 32 bytes into a swizzled row; every 4 steps the next column block.
  auto kstep = [](int ks, int rows_of_tile) {
    return uint32_t(ks / 4) * rows_of_tile * kRowBytes + (ks % 4) * 32;
  };
  const uint32_t q_wg = sq + wg * 64 * kRowBytes;  // this warpgroup's 64 rows of Q
  auto issue_qk = [&](float (&s)[kS], uint32_t k_tile) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      wgmma_ss<T, kSm90BlockN>(s, sw128_desc(q_wg + kstep(ks, kSm90BlockM), 16, 1024),
                               sw128_desc(k_tile + kstep(ks, kSm90BlockN), 16, 1024), ks > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](float (&o)[kO], const uint32_t (&pf)[kPSteps][4], uint32_t v_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      wgmma_rs<T, HEAD_DIM>(o, pf[kk],
                            sw128_desc(v_tile + kk * 16 * kRowBytes, kSm90BlockN * kRowBytes,
                                       1024));
    }
    wgmma_commit();
  };
  // Running max (of raw scores) and sum of each of the thread's two rows.
  float m_row[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_row[2] = {0.f, 0.f};
  // Masks tile n0 of s, updates the running max and sum, turns s into P (unnormalised,
  // exp2(s * scale_log2 - max * scale_log2), one FMA and one MUFU per score) and returns the
  // factors that rescale O for the new max.
  auto softmax = [&](float (&s)[kS], int n0, float (&alpha)[2]) {
    if (n0 + kSm90BlockN - 1 > wg_first_pos) {  // a tile on or past the diagonal
#pragma unroll
      for (int j = 0; j < kS / 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + j * 8 + (lane % 4) * 2 + (e & 1);
          if (key > row_pos[e >> 1]) s[4 * j + e] = -CUDART_INF_F;
        }
      }
    }
    float mx[2] = {m_row[0], m_row[1]};
#pragma unroll
    for (int j = 0; j < kS / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
    }
    float sum[2] = {0.f, 0.f}, mx_scaled[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      // 0 on the first tile (m_row = -inf, mx finite)
      alpha[h] = fast_exp2((m_row[h] - mx[h]) * p.scale_log2);
      m_row[h] = mx[h];
      mx_scaled[h] = mx[h] * p.scale_log2;
    }
#pragma unroll
    for (int j = 0; j < kS / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], p.scale_log2, -mx_scaled[e >> 1]));
        sum[e >> 1] += s[4 * j + e];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_row[h] = l_row[h] * alpha[h] + sum[h];
  };
  // P as the 16-bit A fragments of P V: S's accumulator layout is theirs.
  auto pack_p = [](const float (&s)[kS], uint32_t (&pf)[kPSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  // Every consumer thread waits for each tile and arrives on each stage's empty barrier, also
  // past its own last tile (causal): the loader counts all of them.
  if (wg == 0) named_barrier_arrive(1, kConsumerThreads);  // the first turn is consumer 0's
  // After each wait on a full barrier: fence_proxy_async_smem, as the loader's copies are
  // generic-proxy writes and wgmma reads through the async proxy.
  auto acquire = [&](uint32_t bar, int parity) {
    mbarrier_wait(bar, parity);
    fence_proxy_async_smem();
  };
  acquire(full_q, 0);
  float s[kS];
  float o[kO];
#pragma unroll
  for (int i = 0; i < kO; ++i) o[i] = 0.f;
  uint32_t pc[kPSteps][4];  // P of the tile whose P V is next
  float alpha[2];
  acquire(full_k(0), 0);
  my_turn();
  if (wg_tiles > 0) {
    issue_qk(s, sk(0));
    your_turn();
    wgmma_wait<0>();
    reg_fence(s);
    softmax(s, 0, alpha);
    pack_p(s, pc);
  } else {
    your_turn();
  }
  mbarrier_arrive(empty_k(0));
  // Each MMA is issued and waited for in the same branch, and the branches depend only on
  // warpgroup-uniform values: the compiler then keeps the MMAs asynchronous.
  int t = 1;
  for (; t < wg_tiles; ++t) {
    acquire(full_k(t), t / 2 & 1);
    my_turn();
    issue_qk(s, sk(t));
    acquire(full_v(t - 1), (t - 1) / 2 & 1);
    issue_pv(o, pc, sv(t - 1));
    your_turn();
    wgmma_wait<1>();  // S_t is done; P_{t-1} V_{t-1} may still run
    reg_fence(s);
    mbarrier_arrive(empty_k(t));
    softmax(s, t * kSm90BlockN, alpha);
    wgmma_wait<0>();
    reg_fence(o);
    reg_fence(pc);
    mbarrier_arrive(empty_v(t - 1));
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] *= alpha[i / 2 % 2];
    pack_p(s, pc);
  }
  // Past this warpgroup's last tile (causal): its last P V, then turns and arrivals only.
  for (; t < n_tiles; ++t) {
    acquire(full_k(t), t / 2 & 1);
    my_turn();
    acquire(full_v(t - 1), (t - 1) / 2 & 1);
    if (t == wg_tiles) {
      issue_pv(o, pc, sv(t - 1));
      wgmma_wait<0>();
      reg_fence(o);
    }
    your_turn();
    mbarrier_arrive(empty_k(t));
    mbarrier_arrive(empty_v(t - 1));
  }
  acquire(full_v(n_tiles - 1), (n_tiles - 1) / 2 & 1);
  if (wg_tiles == n_tiles) {
    issue_pv(o, pc, sv(n_tiles - 1));
    wgmma_wait<0>();
    reg_fence(o);
  }

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_row[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int r = wg * 64 + warp * 16 + lane / 4 + h * 8;
    if (r >= rows) continue;
    T* dst = out + (int64_t(q_start + m0 + r) * p.num_heads + head) * HEAD_DIM + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < kO / 4; ++j) {
      *reinterpret_cast<uint32_t*>(dst + j * 8) =
          pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    }
  }
#else
  __trap();  // launched only where the sm_90a image runs (paged_attention_prefill)
#endif
}

}  // namespace tinyvllm
