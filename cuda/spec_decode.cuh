// Speculative decoding's acceptance (rejection) sampling. Framework-free device code.
//
// Semantics: service/tinyvllm/ops/spec_decode.py (`rejection_sample_ref`). One CTA per request b
// walks its k_b draft positions in order:
//   deterministic drafts (no draft_probs): t = argmax_v p[v] / E[v]; emit t; stop unless t == d
//       (accept with probability p(d); a rejection emits t ~ p without d, normalised);
//   with draft_probs q: accept d iff u * q(d) < p(d); else emit argmax_v max(p - q, 0)[v] / E[v]
//       and stop;
//   all accepted: emit the bonus argmax_v p[v] / E[v] of the last row.
// Ties of the race go to the lowest index, as torch.argmax's. The rest of the request's output
// row is PLACEHOLDER (-1).
//
// Noise: the given tensors, or Philox4x32-10 keyed by the request's seed with counter
// (token / 4, 0, offset + j lo, hi) for the Exp(1) of target row j -- the words of
// cuda/sampling.cuh's noise, so row j's race draws the same E as the sampling kernel drawing
// output token offset + j -- and counter (0, 1, offset + j lo, hi), word x, for the uniform of
// draft position j.
#pragma once

#include <cfloat>
#include <cstdint>

#include "random_argmax.cuh"

namespace tinyvllm {
namespace spec_decode {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kPlaceholder = -1;

// (bits >> 9) * 2 + 1 over 2^24: exactly representable, never 0 or 1.
__device__ __forceinline__ float unit_open(uint32_t bits) {
  return __uint2float_rn((bits >> 9) * 2u + 1u) * 0x1p-24f;
}

struct RowNoise {
  const float* noise;  // [vocab] of this target row, or null: Philox
  uint2 key;
  uint64_t offset;

  __device__ float exp1(int v) const {
    if (noise) return fmaxf(noise[v], FLT_MIN);  // clamped as the reference clamps
    const uint4 w = philox4x32_10(
        make_uint4(uint32_t(v) >> 2, 0u, uint32_t(offset), uint32_t(offset >> 32)), key);
    const uint32_t lane = v & 3;
    const uint32_t bits = lane == 0 ? w.x : lane == 1 ? w.y : lane == 2 ? w.z : w.w;
    return -logf(unit_open(bits));
  }

  __device__ float uniform() const {
    const uint4 w = philox4x32_10(make_uint4(0u, 1u, uint32_t(offset), uint32_t(offset >> 32)), key);
    return unit_open(w.x);
  }
};

// The CTA's argmax of w[v] / E[v] with w = p, or max(p - q, 0) when q is given. Every thread
// gets the result.
__device__ int race(const float* __restrict__ p, const float* __restrict__ q, int vocab,
                    const RowNoise& noise, float* smem_score, int* smem_index) {
  Best b{-1.0f, INT32_MAX};  // scores are >= 0: any token beats the start
  for (int v = threadIdx.x; v < vocab; v += kThreads) {
    const float w = q ? fmaxf(p[v] - q[v], 0.0f) : p[v];
    const float s = w / noise.exp1(v);
    if (beats(s, v, b)) b = {s, v};
  }
  b = warp_best(b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    smem_score[warp] = b.score;
    smem_index[warp] = b.index;
  }
  __syncthreads();
  if (warp == 0) {
    b = lane < kWarps ? Best{smem_score[lane], smem_index[lane]} : Best{-1.0f, INT32_MAX};
    b = warp_best(b);
    if (lane == 0) smem_index[0] = b.index;
  }
  __syncthreads();
  const int winner = smem_index[0];
  __syncthreads();  // smem is reused by the next race
  return winner;
}

__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(
    int64_t* __restrict__ out,                    // [num_reqs, out_stride]
    int64_t out_stride,
    const float* __restrict__ target_probs,       // [num_draft_tokens + num_reqs, vocab]
    const float* __restrict__ draft_probs,        // [num_draft_tokens, vocab] or null
    const int64_t* __restrict__ draft_token_ids,  // [num_draft_tokens]
    const int64_t* __restrict__ cu_num_draft,     // [num_reqs + 1]
    int vocab,
    const float* __restrict__ noise,              // [num_draft_tokens + num_reqs, vocab] or null
    const float* __restrict__ uniform,            // [num_draft_tokens] or null
    const int64_t* __restrict__ seed,             // [num_reqs] or null (with noise)
    const int64_t* __restrict__ offset) {         // [num_reqs] or null (with noise)
  __shared__ float smem_score[kWarps];
  __shared__ int smem_index[kWarps];
  const int b = blockIdx.x;
  const int64_t first = cu_num_draft[b];
  const int k = int(cu_num_draft[b + 1] - first);
  int64_t* row_out = out + b * out_stride;
  for (int j = threadIdx.x; j < out_stride; j += kThreads) row_out[j] = kPlaceholder;
  __syncthreads();
  const uint64_t s = seed ? uint64_t(seed[b]) : 0, off = offset ? uint64_t(offset[b]) : 0;
  const uint2 key = make_uint2(uint32_t(s), uint32_t(s >> 32));
  for (int j = 0; j <= k; ++j) {
    const int64_t row = first + b + j;  // target row of position j
    const RowNoise rn{noise ? noise + row * vocab : nullptr, key, off + uint64_t(j)};
    const float* p = target_probs + row * vocab;
    if (j == k) {  // every draft accepted: the bonus token
      const int t = race(p, nullptr, vocab, rn, smem_score, smem_index);
      if (threadIdx.x == 0) row_out[j] = t;
      return;
    }
    const int64_t d = draft_token_ids[first + j];
    if (draft_probs == nullptr) {
      const int t = race(p, nullptr, vocab, rn, smem_score, smem_index);
      if (threadIdx.x == 0) row_out[j] = t;
      if (t != d) return;
      continue;
    }
    const float* q = draft_probs + (first + j) * vocab;
    const float u = uniform ? uniform[first + j] : rn.uniform();
    if (u * q[d] < p[d]) {  // accepted with probability min(1, p(d) / q(d))
      if (threadIdx.x == 0) row_out[j] = d;
      continue;
    }
    const int t = race(p, q, vocab, rn, smem_score, smem_index);
    if (threadIdx.x == 0) row_out[j] = t;
    return;
  }
}

}  // namespace spec_decode
}  // namespace tinyvllm
