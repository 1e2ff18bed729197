// Device pieces shared by the sampler (sampling.cuh) and the acceptance sampler (spec_decode.cuh):
// the Philox-4x32-10 counter-based generator their noise is keyed by, and the warp argmax with
// the lowest index winning ties (so the two kernels pick the same token from the same scores).
#pragma once

#include <cstdint>

namespace tinyvllm {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

struct Best {
  float score;
  int index;
};

// NAN_FIRST = false: a NaN score never wins (the samplers' races). NAN_FIRST = true:
// torch.argmax's order, a NaN above every number and the first NaN winning (greedy rows, whose
// reference is torch.argmax).
template <bool NAN_FIRST = false>
__device__ __forceinline__ bool beats(float score, int index, const Best& b) {
  if constexpr (NAN_FIRST) {
    const bool nan = score != score, best_nan = b.score != b.score;
    if (nan || best_nan) return nan && (!best_nan || index < b.index);
  }
  return score > b.score || (score == b.score && index < b.index);
}

// The warp's best (score, lowest index among equal scores), in every lane.
template <bool NAN_FIRST = false>
__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float s = __shfl_xor_sync(0xffffffffu, b.score, off);
    const int i = __shfl_xor_sync(0xffffffffu, b.index, off);
    if (beats<NAN_FIRST>(s, i, b)) b = {s, i};
  }
  return b;
}

}  // namespace tinyvllm
