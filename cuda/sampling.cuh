// Sampling after penalties without a sort and without a host sync. Framework-free device code.
//
// Semantics: service/tinyvllm/ops/sampling.py (`sample_ref`). Per row:
//   greedy (temperature <= 0): argmax of the logits, ties -> lowest index;
//   else v = logit / temperature (IEEE division, as the reference), then
//   top-k:  keep keys >= T_k, the k-th largest (radix select on counts);
//   top-p:  over the top-k survivors, keep keys >= T_p, the key at which the descending
//           cumulative mass first reaches top_p * total (radix select on masses);
//   min-p:  drop exp(v - max) < min_p (the reference's p < min_p * p_max: the sum cancels);
//   race:   argmax over survivors of v - log(E), E ~ Exp(1): the reference's argmax(p / E).
// Ties at a threshold all survive (the reference keeps an arbitrary subset of equal logits).
//
// Radix select works on an order-preserving 32-bit key of the float, digits of 11, 11, 10 bits,
// one histogram pass per digit. Masses are fixed point (2^-44 units of exp(v - max) <= 1) so
// every sum is exact and order-independent: the same row gives the same threshold whatever the
// thread schedule, and the descending scan always finds its crossing.
//
// Passes over the row in global memory (one CTA per filtered row):
//   top-k:        1 (level-0 count histogram) + 1 (gather the candidates, keys in or above the
//                 threshold's top digit, into shared memory); the rest runs in shared memory;
//   top-p alone:  1 (max) + 1 (level-0 mass histogram) + 1 (gather);
//   min-p alone:  1 (max) + 1 (race);
//   no filter, greedy: 1, split over up to kMaxSplits CTAs per row (partials merged by a second
//                 kernel).
// When the candidates do not fit in kMaxCandidates, the remaining digits and the race also read
// the row from global memory (up to 7 passes; correct, slower).
//
// Noise: the given Exp(1) tensor, or Philox4x32-10 with key = the row's seed and counter
// (token / 4, 0, offset lo, offset hi), token i taking word i % 4 (ops/sampling.py
// `philox_exponential` is the host copy).
#pragma once

#include <cfloat>
#include <climits>
#include <type_traits>

#include "common.cuh"
#include "random_argmax.cuh"

namespace tinyvllm {
namespace sampling {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;                // float4 groups per thread in flight per iteration
constexpr int kMaxCandidates = 8192;      // 64 KiB of (value, index) in shared memory
constexpr int kMaxSplits = 16;            // CTAs per row for the single-pass rows
constexpr int kBins = 2048;               // 11-bit digits (the last one has 10 bits)
constexpr int kMassBits = 44;             // fixed point of the masses: vocab < 2^20 keeps sums < 2^64
constexpr int kMaxVocab = (1 << 20) - 1;

struct Partial {  // one CTA's best (score, token) for the merge kernel
  float score;
  int index;
};

struct SharedStorage {
  // A bin's mass is (mass_hi << 32) + mass_lo: 64-bit shared atomics are slow, two native 32-bit
  // ones with the carry (add_mass) are exact.
  unsigned int mass_lo[kBins];
  unsigned int mass_hi[kBins];
  unsigned int count[kBins];
  float cand_value[kMaxCandidates];
  int cand_index[kMaxCandidates];
  unsigned long long scan[kWarps];
  float best_score[kWarps];
  int best_index[kWarps];
  int num_candidates;
  unsigned int found_digit;
  unsigned long long found_above;
  unsigned long long found_target;
};

// ---- keys, noise ------------------------------------------------------------------------------

// Monotone map float -> uint32 (larger float, larger key; -inf lowest among non-NaN).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// log(E) of each token's Exp(1) draw, from the noise tensor or from Philox. A thread visiting the
// four tokens of one Philox group in a row computes the group once.
struct Noise {
  const float* noise;  // [vocab] of this row, or null
  uint2 key;
  uint32_t offset_lo, offset_hi;
  uint32_t cached_group = 0xFFFFFFFFu;
  uint4 cached;

  __device__ float log_exp1(int index) {
    // Clamped as the reference clamps (a masked token must never win with 0 / 0).
    if (noise) return logf(fmaxf(noise[index], FLT_MIN));
    const uint32_t group = uint32_t(index) >> 2;
    if (group != cached_group) {
      cached = philox4x32_10(make_uint4(group, 0u, offset_lo, offset_hi), key);
      cached_group = group;
    }
    const uint32_t lane = index & 3;
    const uint32_t bits = lane == 0 ? cached.x : lane == 1 ? cached.y : lane == 2 ? cached.z : cached.w;
    const float u = __uint2float_rn((bits >> 9) * 2u + 1u) * 0x1p-24f;  // exact, in (0, 1)
    // The inner log must be accurate (u near 1 gives the smallest E, the likeliest winners); the
    // outer one only shifts a score by ~1e-6.
    return __logf(-logf(u));
  }
};

// ---- the two places a row's elements come from ------------------------------------------------

// The row in global memory, scaled by 1 / temperature; this CTA visits groups [begin, end) of four
// tokens. f(index, value, valid) is called the same number of times by every thread (warp
// collectives inside f are allowed).
struct RowSource {
  const float* row;
  int n;
  float temperature;
  int group_begin, group_end;
  bool vec;    // row start 16-byte aligned
  bool scale;  // temperature != 1 (division by 1 is exact: skip it)

  __device__ float4 load(int g) const {
    const int i = 4 * g;
    if (g >= group_end) return make_float4(0.f, 0.f, 0.f, 0.f);
    if (vec && i + 3 < n) return __ldg(reinterpret_cast<const float4*>(row + i));
    float4 r;
    r.x = row[i];  // i < n since g < group_end <= ceil(n / 4)
    r.y = i + 1 < n ? row[i + 1] : 0.f;
    r.z = i + 2 < n ? row[i + 2] : 0.f;
    r.w = i + 3 < n ? row[i + 3] : 0.f;
    return r;
  }

  template <class F>
  __device__ void for_each(F&& f) const {
    for (int base = group_begin; base < group_end; base += kUnroll * kThreads) {
      float4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = load(base + u * kThreads + threadIdx.x);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int g = base + u * kThreads + threadIdx.x;
        const float e[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * g + j;
          const bool valid = g < group_end && i < n;
          f(i, !valid ? 0.f : scale ? e[j] / temperature : e[j], valid);
        }
      }
    }
  }
};

// Candidates gathered into shared memory (values already scaled).
struct CandidateSource {
  const float* value;
  const int* index;
  int n;

  template <class F>
  __device__ void for_each(F&& f) const {
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + threadIdx.x;
      const bool valid = i < n;
      f(valid ? index[i] : 0, valid ? value[i] : 0.f, valid);
    }
  }
};

__device__ __forceinline__ CandidateSource candidates(const SharedStorage& sm) {
  return {sm.cand_value, sm.cand_index, min(sm.num_candidates, kMaxCandidates)};
}

// ---- block reductions -------------------------------------------------------------------------

// The block's best (score, lowest index among equal scores), in every thread.
template <bool NAN_FIRST = false>
__device__ Best block_best(Best b, SharedStorage& sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  b = warp_best<NAN_FIRST>(b);
  if (lane == 0) {
    sm.best_score[warp] = b.score;
    sm.best_index[warp] = b.index;
  }
  __syncthreads();
  b = lane < kWarps ? Best{sm.best_score[lane], sm.best_index[lane]} : Best{-INFINITY, INT_MAX};
  b = warp_best<NAN_FIRST>(b);
  __syncthreads();
  return b;
}

// Sum of x over threads with a larger threadIdx (a descending exclusive scan); *total = all.
__device__ unsigned long long block_suffix_exclusive(unsigned long long x, SharedStorage& sm,
                                                     unsigned long long* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long incl = x;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long y = __shfl_down_sync(0xffffffffu, incl, off);
    if (lane + off < 32) incl += y;
  }
  if (lane == 0) sm.scan[warp] = incl;
  __syncthreads();
  unsigned long long later = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    all += sm.scan[w];
    if (w > warp) later += sm.scan[w];
  }
  __syncthreads();
  *total = all;
  return incl - x + later;
}

// NAN_FIRST: torch.argmax's order (see beats); else NaN values are skipped.
template <bool NAN_FIRST = false, class Src>
__device__ Best source_argmax(const Src& src, SharedStorage& sm) {
  Best best{-INFINITY, INT_MAX};
  src.for_each([&](int i, float v, bool valid) {
    if (valid && beats<NAN_FIRST>(v, i, best)) best = {v, i};
  });
  return block_best<NAN_FIRST>(best, sm);
}

// ---- radix select -----------------------------------------------------------------------------

// Smallest integer >= top_p * total: a token survives while the mass strictly before it is
// below top_p of the total (the reference's `mass_before >= top_p` drops).
__device__ __forceinline__ unsigned long long nucleus_target(unsigned long long total,
                                                             float top_p) {
  const double t = ceil(double(top_p) * double(total));
  return t < 1.0 ? 1ull : static_cast<unsigned long long>(t);
}

struct Pick {
  uint32_t digit;
  unsigned long long above;   // weight of the digits above `digit`, plus the caller's `above`
  unsigned long long target;
};

// The digit at which the descending cumulative weight, starting from `above`, first reaches the
// target (target 0: the nucleus target of this histogram's total). Exactly one thread finds it
// because weights are exact integers and the target never exceeds above + total; if it did (it
// cannot), digit 0 is kept, which lets every element through.
template <class Bin>
__device__ Pick pick_digit(Bin bin, int bins, unsigned long long above, unsigned long long target,
                           float top_p, SharedStorage& sm) {
  const int per = bins / kThreads;
  const int lo = threadIdx.x * per;
  unsigned long long chunk = 0;
  for (int b = 0; b < per; ++b) chunk += bin(lo + b);
  if (threadIdx.x == 0) {
    sm.found_digit = 0;
    sm.found_above = above;
  }
  unsigned long long total;
  const unsigned long long excl = block_suffix_exclusive(chunk, sm, &total);  // syncs
  if (target == 0) target = nucleus_target(total, top_p);
  unsigned long long base = above + excl;
  if (base < target && target <= base + chunk) {
    for (int b = per - 1; b >= 0; --b) {
      const unsigned long long h = bin(lo + b);
      if (base + h >= target) {
        sm.found_digit = lo + b;
        sm.found_above = base;
        break;
      }
      base += h;
    }
  }
  __syncthreads();
  const Pick pick{sm.found_digit, sm.found_above, target};
  __syncthreads();
  return pick;
}

// Number of elements counted in digits >= first.
__device__ unsigned long long count_from(const unsigned int* hist, int bins, uint32_t first,
                                         SharedStorage& sm) {
  const int per = bins / kThreads;
  unsigned long long mine = 0;
  for (int b = threadIdx.x * per; b < (threadIdx.x + 1) * per; ++b) {
    if (b >= int(first)) mine += hist[b];
  }
  unsigned long long total;
  block_suffix_exclusive(mine, sm, &total);
  return total;
}

// Copies the row's elements with key >= min_key into shared memory (warp-aggregated slots).
// The caller has counted them: at most kMaxCandidates.
__device__ void gather(const RowSource& row, uint32_t min_key, SharedStorage& sm) {
  if (threadIdx.x == 0) sm.num_candidates = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  row.for_each([&](int i, float v, bool valid) {
    const bool take = valid && order_key(v) >= min_key;
    const unsigned mask = __ballot_sync(0xffffffffu, take);
    if (mask == 0) return;
    const int leader = __ffs(mask) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(&sm.num_candidates, __popc(mask));
    base = __shfl_sync(0xffffffffu, base, leader);
    const int slot = base + __popc(mask & ((1u << lane) - 1u));
    if (take && slot < kMaxCandidates) {
      sm.cand_value[slot] = v;
      sm.cand_index[slot] = i;
    }
  });
  __syncthreads();
}

// Exact 64-bit add from two 32-bit atomics: the low word's wraps carry into the high word.
__device__ __forceinline__ void add_mass(unsigned int* lo, unsigned int* hi, unsigned long long w) {
  const unsigned int wl = unsigned(w), wh = unsigned(w >> 32);
  const unsigned int old = atomicAdd(lo, wl);
  const unsigned int carry = old + wl < old ? 1u : 0u;
  if (wh + carry) atomicAdd(hi, wh + carry);
}

struct Selection {
  uint32_t key;        // threshold: keys >= key survive
  bool gathered;       // the candidates are now in shared memory; select again over them
  unsigned long long target;
};

// Radix select over the elements with key >= min_key. kMass = false: the largest key with at
// least `target` elements at or above it (top-k, target = k). kMass = true: the largest key whose
// inclusive descending mass reaches top_p of the total (top-p; target 0 = compute it). With
// may_gather (row source only), stops after the first digit when the elements at or above the
// chosen digit fit in shared memory, and gathers them.
template <bool kMass, class Src>
__device__ Selection select_threshold(const Src& src, float max_value, uint32_t min_key,
                                      unsigned long long target, float top_p, bool may_gather,
                                      SharedStorage& sm) {
  uint32_t prefix = 0;
  int prefix_bits = 0;
  unsigned long long above = 0;
  for (int level = 0; level < 3; ++level) {
    const int bits = level < 2 ? 11 : 10;
    const int bins = 1 << bits;
    const int shift = 32 - prefix_bits - bits;
    const bool count_too = kMass && may_gather && level == 0;
    for (int b = threadIdx.x; b < bins; b += kThreads) {
      sm.mass_lo[b] = 0;
      sm.mass_hi[b] = 0;
      sm.count[b] = 0;
    }
    __syncthreads();
    src.for_each([&](int, float v, bool valid) {
      const uint32_t key = order_key(v);
      if (!valid || key < min_key) return;
      if (prefix_bits > 0 && (key >> (32 - prefix_bits)) != prefix) return;
      const uint32_t digit = (key >> shift) & uint32_t(bins - 1);
      if constexpr (kMass) {
        const unsigned long long w = __float2ull_rz(expf(v - max_value) * 0x1p44f);
        if (w) add_mass(&sm.mass_lo[digit], &sm.mass_hi[digit], w);
        if (count_too) atomicAdd(&sm.count[digit], 1u);
      } else {
        atomicAdd(&sm.count[digit], 1u);
      }
    });
    __syncthreads();
    const Pick pick =
        kMass ? pick_digit([&](int b) { return (uint64_t(sm.mass_hi[b]) << 32) | sm.mass_lo[b]; },
                           bins, above, target, top_p, sm)
              : pick_digit([&](int b) { return uint64_t(sm.count[b]); }, bins, above, target,
                           top_p, sm);
    target = pick.target;
    if constexpr (std::is_same_v<Src, RowSource>) {
      if (may_gather && level == 0 && count_from(sm.count, bins, pick.digit, sm) <= kMaxCandidates) {
        gather(src, max(min_key, pick.digit << shift), sm);
        return {0u, true, target};
      }
    }
    prefix = (prefix << bits) | pick.digit;
    prefix_bits += bits;
    above = pick.above;
  }
  return {prefix, false, target};
}

// argmax of v - log(E) over the elements with key >= min_key (and exp(v - max) >= min_p).
template <class Src>
__device__ Best race(const Src& src, Noise& noise, uint32_t min_key, float min_p, float max_value,
                     SharedStorage& sm) {
  Best best{-INFINITY, INT_MAX};
  src.for_each([&](int i, float v, bool valid) {
    if (!valid || order_key(v) < min_key) return;
    if (min_p > 0.f && expf(v - max_value) < min_p) return;
    const float score = v - noise.log_exp1(i);
    if (beats(score, i, best)) best = {score, i};
  });
  return block_best(best, sm);
}

struct RowFilters {
  bool use_k, use_p, use_min_p;
  int top_k;
  float top_p, min_p;
};

// top-k, top-p and min-p, then the race, for one row by one CTA.
__device__ Best filtered_sample(const RowSource& row, const RowFilters& f, Noise& noise,
                                SharedStorage& sm) {
  bool in_smem = false;
  uint32_t threshold = 0;
  if (f.use_k) {
    Selection s = select_threshold<false>(row, 0.f, 0u, f.top_k, 0.f, true, sm);
    if (s.gathered) {
      in_smem = true;
      s = select_threshold<false>(candidates(sm), 0.f, 0u, f.top_k, 0.f, false, sm);
    }
    threshold = s.key;
  }
  float max_value = 0.f;
  if (f.use_p || f.use_min_p) {  // the maximum always survives top-k, so candidates hold it
    max_value = in_smem ? source_argmax(candidates(sm), sm).score : source_argmax(row, sm).score;
  }
  if (f.use_p) {
    Selection s = in_smem
        ? select_threshold<true>(candidates(sm), max_value, threshold, 0, f.top_p, false, sm)
        : select_threshold<true>(row, max_value, threshold, 0, f.top_p, true, sm);
    if (s.gathered) {
      in_smem = true;
      s = select_threshold<true>(candidates(sm), max_value, threshold, s.target, f.top_p, false,
                                 sm);
    }
    threshold = max(threshold, s.key);
  }
  const float min_p = f.use_min_p ? f.min_p : 0.f;
  return in_smem ? race(candidates(sm), noise, threshold, min_p, max_value, sm)
                 : race(row, noise, threshold, min_p, max_value, sm);
}

// Grid (num_rows, splits). Greedy rows and rows without filters are split: CTA s visits its share
// of the row's four-token groups. Filtered rows run on CTA 0 alone. With splits == 1 the token is
// written to out; otherwise each CTA writes a partial and merge_partials_kernel picks the best.
__global__ void __launch_bounds__(kThreads, 2) sample_kernel(
    int64_t* __restrict__ out,              // [num_rows]
    Partial* __restrict__ partials,         // [num_rows, splits] (splits > 1)
    const float* __restrict__ logits,       // [num_rows, logits_stride], vocab used
    int64_t logits_stride, int vocab,
    const float* __restrict__ temperature,  // [num_rows]; <= 0: greedy
    const int64_t* __restrict__ top_k,      // [num_rows] or null
    const float* __restrict__ top_p,        // [num_rows] or null
    const float* __restrict__ min_p,        // [num_rows] or null
    const int64_t* __restrict__ seed,       // [num_rows] (unused with noise)
    const int64_t* __restrict__ offset,     // [num_rows] (unused with noise)
    const float* __restrict__ noise,        // [num_rows, noise_stride] or null
    int64_t noise_stride) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int row = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const float* row_logits = logits + row * logits_stride;
  const float t = temperature[row];
  const bool greedy = !(t > 0.f);
  RowFilters f;
  const long long k = top_k ? top_k[row] : 0;
  f.top_k = k <= 0 ? 0 : k >= vocab ? vocab : int(k);
  f.top_p = top_p ? top_p[row] : 1.f;
  f.min_p = min_p ? min_p[row] : 0.f;
  f.use_k = f.top_k > 0 && f.top_k < vocab;
  f.use_p = f.top_p < 1.f;
  f.use_min_p = f.min_p > 0.f;

  Noise nz;
  nz.noise = noise ? noise + row * noise_stride : nullptr;
  if (!noise) {
    const uint64_t s = uint64_t(seed[row]), o = uint64_t(offset[row]);
    nz.key = make_uint2(uint32_t(s), uint32_t(s >> 32));
    nz.offset_lo = uint32_t(o);
    nz.offset_hi = uint32_t(o >> 32);
  }

  const int num_groups = (vocab + 3) / 4;
  const bool vec = (reinterpret_cast<uintptr_t>(row_logits) & 15) == 0;
  Best best{-INFINITY, INT_MAX};
  if (greedy || !(f.use_k || f.use_p || f.use_min_p)) {
    const int per = (num_groups + splits - 1) / splits;
    const int begin = min(num_groups, split * per), end = min(num_groups, begin + per);
    const float scale_by = greedy ? 1.f : t;
    const RowSource src{row_logits, vocab, scale_by, begin, end, vec, scale_by != 1.f};
    best = greedy ? source_argmax<true>(src, sm) : race(src, nz, 0u, 0.f, 0.f, sm);
  } else if (split == 0) {
    const RowSource src{row_logits, vocab, t, 0, num_groups, vec, t != 1.f};
    best = filtered_sample(src, f, nz, sm);
    best.score = INFINITY;  // the one real partial of this row wins the merge
  }
  if (threadIdx.x == 0) {
    if (splits == 1) {
      out[row] = best.index == INT_MAX ? 0 : best.index;  // no candidate (all NaN): token 0
    } else {
      partials[int64_t(row) * splits + split] = {best.score, best.index};
    }
  }
}

// One warp per row: the best of the row's partials (lowest index among equal scores; a NaN score
// comes only from a greedy row's CTA, and wins as in torch.argmax).
__global__ void merge_partials_kernel(int64_t* __restrict__ out,
                                      const Partial* __restrict__ partials, int num_rows,
                                      int splits) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= num_rows) return;
  Best b{-INFINITY, INT_MAX};
  if (lane < splits) {
    const Partial p = partials[int64_t(row) * splits + lane];
    b = {p.score, p.index};
  }
  b = warp_best<true>(b);
  if (lane == 0) out[row] = b.index == INT_MAX ? 0 : b.index;  // no candidate (all NaN): 0
}

}  // namespace sampling
}  // namespace tinyvllm
