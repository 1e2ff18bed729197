// Skinny linear layer for decode: out[m, n] = act(x)[m, :k] . weight[n, :k] + bias, m <= 2.
//
// At decode batch sizes the product is a matrix-vector product bound by reading the weight once,
// so the kernel streams every weight row exactly once, 16 bytes per lane per load, with several
// loads in flight per lane, and keeps the m activation rows in shared memory where the whole CTA
// reuses them. What the decoder does around each projection is folded in, to save launches:
//   prologue  kNone      act(x) = x
//             kRmsNorm   act(x) = rmsnorm(x) * norm_weight   (input_layernorm before qkv_proj, ...)
//             kSiluMul   act(x) = silu(x[:, :k]) * x[:, k:]  (SwiGLU before down_proj)
//             kMergeSplits act(x) = the merge of a split decode's partitions (decode_merge.cuh):
//                        o_proj takes the place of the attention's reduce launch; x is unused
//   epilogue  residual   out = residual + x . W^T, in place  (the residual stream after o/down_proj)
//             SILU_MUL   y = act(x) . W^T over n = 2 * n_out rows; out[:, j] =
//                        silu(y[:, j]) * y[:, n_out + j] (gate_up_proj writing the SwiGLU
//                        product, so that down_proj stages n_out values with no exponentials
//                        instead of 2 * n_out): the two rows a warp streams together are gate
//                        row j and up row n_out + j
// prefetch_all: while the previous kernel runs, the whole weight is requested into L2 (one bulk
// prefetch per warp), for a projection whose predecessor leaves the memory bus idle (o_proj after
// decode attention: 33.5 MB at Llama-3-8B, which the attention's ~10 us of latency covers).
// Rounding points follow the unfused ops (the normalised / activated value and the product are
// rounded to T before the next step), so results equal norm -> cuBLAS -> add up to the order of
// the fp32 sum.
//
// Work split: all warps of the grid are resident at once (the launcher sizes the grid by occupancy)
// and warp g owns the contiguous rows [n * g / W, n * (g + 1) / W) of the W warps, taking them
// kRows at a time: no partial second wave, at most one row of imbalance between warps.
#pragma once

#include "common.cuh"
#include "decode_merge.cuh"

namespace tinyvllm {

enum GemvPrologue : int {
  kGemvNone = 0,
  kGemvRmsNorm = 1,
  kGemvSiluMul = 2,
  kGemvMergeSplits = 3,
};

constexpr int kGemvWarps = 8;   // warps per CTA
constexpr int kGemvRows = 2;    // weight rows a warp streams together
constexpr int kGemvUnroll = 4;  // 16-byte loads per row in flight per lane

// A weight vector is read once: do not keep it in L1, and in L2 under `policy`
// (l2_evict_first_policy).
__device__ __forceinline__ uint4 load_streaming(const void* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

template <typename T>
__device__ __forceinline__ float dot8(const uint4& w, const float (&a)[8]) {
  float wf[8];
  unpack8<T>(w, wf);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s = fmaf(wf[j], a[j], s);
  return s;
}

// rmsnorm of 8 elements given the row's 1 / rms: round(x * scale) * w, as the unfused op rounds.
// The product of two T values is exact in fp32, so T's own pair multiply rounds it the same way:
// a rounding and a multiply for two elements an instruction each.
template <typename T>
__device__ __forceinline__ uint4 rms_scaled8(const uint4& x, const uint4& w, float scale) {
  float xf[8];
  unpack8<T>(x, xf);
  const uint32_t wp[4] = {w.x, w.y, w.z, w.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[i] = mul_pair<T>(pack2<T>(xf[2 * i] * scale, xf[2 * i + 1] * scale), wp[i]);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// silu(gate) * up of 8 elements, rounded as the unfused op rounds.
template <typename T>
__device__ __forceinline__ uint4 silu_mul8(const uint4& gate, const uint4& up) {
  float gf[8], uf[8], of[8];
  unpack8<T>(gate, gf);
  unpack8<T>(up, uf);
#pragma unroll
  for (int e = 0; e < 8; ++e) of[e] = round_to<T>(gf[e] / (1.f + __expf(-gf[e]))) * uf[e];
  return pack8<T>(of);
}

constexpr int kStageBatch = 4;  // vectors a thread loads before using any (latency hiding)

// Where vector v of staged row i lies: rows of k8 + row_pad vectors, and with BP > 0 one more
// (unwritten, counted in row_pad) after every BP of them, for readers whose lanes are BP vectors
// apart (the GGUF GEMV's 32-value blocks: 5 vectors a block put 8 lanes on distinct banks).
template <int BP>
__device__ __forceinline__ int staged_at(int i, int v, int k8, int row_pad) {
  return i * (k8 + row_pad) + v + (BP > 0 ? v / BP : 0);
}

// Writes act(x) of the M staged rows into act ([M][k8 + row_pad] vectors: row_pad vectors
// after each row, unwritten; BP: staged_at); rows at or past m are zero. kRmsNorm: inv_rms must
// hold each row's 1 / rms (see gemv_row_scale).
template <typename T, int M, int P, int BP = 0>
__device__ __forceinline__ void gemv_stage(uint4* act, int k8, const T* x, int64_t x_stride,
                                           const T* norm_weight, const float* inv_rms, int m,
                                           int row_pad = 0) {
  const int total = M * k8;
  for (int base = threadIdx.x; base < total; base += kStageBatch * blockDim.x) {
    uint4 a[kStageBatch], b[kStageBatch];
#pragma unroll
    for (int j = 0; j < kStageBatch; ++j) {  // all loads first
      const int idx = base + j * blockDim.x;
      const int row = idx / k8, v = idx - row * k8;
      a[j] = b[j] = make_uint4(0, 0, 0, 0);
      if (idx < total && row < m) {
        const uint4* xr = reinterpret_cast<const uint4*>(x + row * x_stride) + v;
        a[j] = *xr;
        if constexpr (P == kGemvRmsNorm) b[j] = reinterpret_cast<const uint4*>(norm_weight)[v];
        if constexpr (P == kGemvSiluMul) b[j] = xr[k8];  // up, k columns to the right
      }
    }
#pragma unroll
    for (int j = 0; j < kStageBatch; ++j) {
      const int idx = base + j * blockDim.x;
      if (idx >= total) break;
      const int row = idx / k8, at = staged_at<BP>(row, idx - row * k8, k8, row_pad);
      if constexpr (P == kGemvNone) {
        act[at] = a[j];
      } else if constexpr (P == kGemvRmsNorm) {
        act[at] = rms_scaled8<T>(a[j], b[j], row < m ? inv_rms[row] : 0.f);
      } else {
        act[at] = silu_mul8<T>(a[j], b[j]);
      }
    }
  }
}

// kMergeSplits: act = the merged attention output of the M sequences (head after head, as the
// decode kernel lays out [num_heads, head_dim]); rows at or past m are zero.
template <typename T, int M>
__device__ __forceinline__ void gemv_stage_merged(uint4* act, int k8, const DecodePartitions& parts,
                                                  int m) {
  const int vecs_per_head = parts.head_dim / 8;
  for (int idx = threadIdx.x; idx < M * k8; idx += blockDim.x) {
    const int row = idx / k8, v = idx - row * k8;
    float f[8] = {};
    if (row < m) merge_partitions<8>(parts, row, v / vecs_per_head, (v % vecs_per_head) * 8, f);
    act[idx] = pack8<T>(f);
  }
}

// inv_rms[i] = 1 / sqrt(sum over the CTA of sum_sq[i] / k + eps) for the M rows (block-wide; at
// most kGemvWarps warps).
template <int M>
__device__ __forceinline__ void gemv_inv_rms(const float (&sum_sq)[M], float* inv_rms, int k,
                                             float eps) {
  __shared__ float partial[kGemvWarps][M];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float s = warp_sum(sum_sq[i]);
    if (lane == 0) partial[warp][i] = s;
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float s = 0.f;
    for (int w = 0; w < int(blockDim.x) / 32; ++w) s += partial[w][threadIdx.x];
    inv_rms[threadIdx.x] = rsqrtf(s / k + eps);
  }
  __syncthreads();
}

// inv_rms[i] = 1 / sqrt(mean(x[i]^2) + eps) for the m rows (block-wide; loads batched).
template <typename T, int M>
__device__ __forceinline__ void gemv_row_scale(float* inv_rms, const T* x, int64_t x_stride,
                                               int k8, int m, float eps) {
  float sum_sq[M];
#pragma unroll
  for (int i = 0; i < M; ++i) sum_sq[i] = 0.f;
  for (int base = threadIdx.x; base < k8; base += kStageBatch * blockDim.x) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      uint4 a[kStageBatch];
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int v = base + j * blockDim.x;
        a[j] = (v < k8 && i < m) ? reinterpret_cast<const uint4*>(x + i * x_stride)[v]
                                 : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        float xf[8];
        unpack8<T>(a[j], xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum_sq[i] = fmaf(xf[e], xf[e], sum_sq[i]);
      }
    }
  }
  gemv_inv_rms<M>(sum_sq, inv_rms, k8 * 8, eps);
}

// kRmsNorm in one pass when every row has at most J vectors per thread (k8 <= J * blockDim): x
// and the norm weight are loaded once (one memory latency instead of two), the sums of squares
// reduced across the CTA, and each thread normalises the vectors it holds in registers. Thread t
// holds vectors t, t + blockDim, ... of every row, so that a row's sum is taken in the same order
// whatever its position among the m rows (a row of x gives the same bits in any batch).
template <typename T, int M, int J, int BP = 0>
__device__ __forceinline__ void gemv_stage_rmsnorm_one_pass(uint4* act, int k8, const T* x,
                                                            int64_t x_stride,
                                                            const T* norm_weight, float* inv_rms,
                                                            int m, float eps, int row_pad = 0) {
  uint4 a[M][J], w[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    w[j] = v < k8 ? reinterpret_cast<const uint4*>(norm_weight)[v] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      a[i][j] = (v < k8 && i < m) ? reinterpret_cast<const uint4*>(x + i * x_stride)[v]
                                  : make_uint4(0, 0, 0, 0);
    }
  }
  float sum_sq[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    sum_sq[i] = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      float xf[8], ss = 0.f;
      unpack8<T>(a[i][j], xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = fmaf(xf[e], xf[e], ss);
      sum_sq[i] += ss;
    }
  }
  gemv_inv_rms<M>(sum_sq, inv_rms, k8 * 8, eps);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v >= k8) break;
#pragma unroll
    for (int i = 0; i < M; ++i) {
      act[staged_at<BP>(i, v, k8, row_pad)] =
          rms_scaled8<T>(a[i][j], w[j], i < m ? inv_rms[i] : 0.f);
    }
  }
}

// x's first m rows into act with prologue P (none, SiLU-and-mul, RMSNorm: in one pass where the
// rows fit the threads' registers, else the row scales first; either way a row's scale does not
// depend on its position among the rows); kMergeSplits stages elsewhere (gemv_stage_merged).
template <typename T, int M, int P, int BP = 0>
__device__ __forceinline__ void gemv_stage_x(uint4* act, int k8, const T* x, int64_t x_stride,
                                             const T* norm_weight, float* inv_rms, int m,
                                             float eps, int row_pad = 0) {
  if constexpr (P == kGemvRmsNorm) {
    // Rows of up to blockDim vectors (k = 2048 at 256 threads) at any M; up to 4 x blockDim at
    // M <= 2 (decode at Llama-3-8B's k = 4096).
    constexpr int kJ = M <= 2 ? 4 : 1;
    if (k8 <= int(blockDim.x)) {
      gemv_stage_rmsnorm_one_pass<T, M, 1, BP>(act, k8, x, x_stride, norm_weight, inv_rms, m,
                                               eps, row_pad);
    } else if (kJ > 1 && k8 <= kJ * int(blockDim.x)) {
      gemv_stage_rmsnorm_one_pass<T, M, kJ, BP>(act, k8, x, x_stride, norm_weight, inv_rms, m,
                                                eps, row_pad);
    } else {
      gemv_row_scale<T, M>(inv_rms, x, x_stride, k8, m, eps);
      gemv_stage<T, M, P, BP>(act, k8, x, x_stride, norm_weight, inv_rms, m, row_pad);
    }
  } else {
    gemv_stage<T, M, P, BP>(act, k8, x, x_stride, norm_weight, inv_rms, m, row_pad);
  }
}

// act = the GEMV's input: the merged partitions (kGemvMergeSplits), else x's rows with prologue P.
template <typename T, int M, int P>
__device__ __forceinline__ void gemv_stage_input(uint4* act, int k8, const T* x, int64_t x_stride,
                                                 const T* norm_weight, float* inv_rms, int m,
                                                 float eps, const DecodePartitions& parts) {
  if constexpr (P == kGemvMergeSplits) {
    gemv_stage_merged<T, M>(act, k8, parts, m);
  } else {
    gemv_stage_x<T, M, P>(act, k8, x, x_stride, norm_weight, inv_rms, m, eps);
  }
}

template <int R, int U>
__device__ __forceinline__ void gemv_load(uint4 (&w)[R][U], const uint4* const (&rows)[R],
                                          const bool (&live)[R], int v0, int k8,
                                          uint64_t policy) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int v = v0 + u * 32;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w[r][u] = (live[r] && v < k8) ? load_streaming(rows[r] + v, policy) : make_uint4(0, 0, 0, 0);
    }
  }
}

template <typename T, int M, int P, bool SILU_MUL>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(
    T* out,                             // [m, out_stride], n columns written (SILU_MUL: n / 2)
    const T* __restrict__ x,            // [m, x_stride]: k columns (2k for kSiluMul)
    const T* __restrict__ weight,       // [n, k], rows contiguous
    const T* __restrict__ bias,         // [n] or null
    const T* residual,                  // [m, residual_stride] or null; may be `out` itself
    const T* __restrict__ norm_weight,  // [k] (kRmsNorm)
    int m, int n, int k, int64_t x_stride, int64_t out_stride, int64_t residual_stride,
    float eps,
    const DecodePartitions parts,       // kMergeSplits: k = num_heads * head_dim
    bool prefetch_all) {                // the whole weight heads for L2 before the wait
  constexpr int R = kGemvRows, U = kGemvUnroll;
  static_assert(!SILU_MUL || R == 2, "SILU_MUL streams a gate row and its up row together");
  extern __shared__ uint4 act[];  // [M][k / 8]: act(x), the rows every warp multiplies
  __shared__ float inv_rms[M];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k8 = k / 8;
  const int iters = (k8 + 32 * U - 1) / (32 * U);  // per group of R rows

  // This warp's outputs [row_begin, row_end), R at a time (SILU_MUL: one, from two rows):
  // `groups` passes of `iters` iterations, flattened so that the loads of iteration j + 1 are in
  // flight while iteration j is multiplied.
  const int n_out = SILU_MUL ? n / 2 : n;
  const int per_group = SILU_MUL ? 1 : R;
  const int64_t num_warps = int64_t(gridDim.x) * kGemvWarps;
  const int64_t global_warp = int64_t(blockIdx.x) * kGemvWarps + warp;
  const int row_begin = int(n_out * global_warp / num_warps);
  const int row_end = int(n_out * (global_warp + 1) / num_warps);
  const int groups = (row_end - row_begin + per_group - 1) / per_group;
  const int total = groups * iters;
  const uint64_t policy = l2_evict_first_policy();  // the weight's loads
  // Weight row r of a group, or -1 past the warp's outputs.
  auto row_of = [&](int group, int r) {
    const int o = row_begin + group * per_group + (SILU_MUL ? 0 : r);
    return o < row_end ? o + (SILU_MUL ? r * n_out : 0) : -1;
  };

  const uint4* rows[R];
  bool live[R];
  auto point_at = [&](int group) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row_of(group, r);
      live[r] = row >= 0;
      rows[r] = reinterpret_cast<const uint4*>(weight + int64_t(live[r] ? row : 0) * k);
    }
  };
  point_at(0);
  uint4 w[R][U];
  // The weights do not depend on the previous kernel: start streaming them before waiting on it.
  gemv_load<R, U>(w, rows, live, lane, total > 0 ? k8 : 0, policy);
  if (total == 2) {  // a small matrix: its second (and last) pass heads for L2 as well
    const int group = 1 / iters, v0 = lane + (1 - group * iters) * 32 * U;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row_of(group, r);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (row >= 0 && v0 + u * 32 < k8) {
          prefetch_l2(reinterpret_cast<const uint4*>(weight + int64_t(row) * k) + v0 + u * 32);
        }
      }
    }
  }
  // The warp's rows are contiguous (SILU_MUL: its gate rows and its up rows): one request each.
  if (prefetch_all && lane < (SILU_MUL ? 2 : 1) && total > 1) {
    prefetch_l2_bulk(weight + int64_t(row_begin + lane * n_out) * k,
                     uint32_t(row_end - row_begin) * uint32_t(k) * sizeof(T));
  }
  wait_for_previous_grid();

  gemv_stage_input<T, M, P>(act, k8, x, x_stride, norm_weight, inv_rms, m, eps, parts);
  __syncthreads();
  allow_next_grid();  // every CTA of this grid is resident: the next one may launch and prefetch

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

  for (int j = 0; j < total; ++j) {
    const int group = j / iters, it = j - group * iters;
    const int v0 = lane + it * 32 * U;
    uint4 cur[R][U];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) cur[r][u] = w[r][u];
    const bool group_done = it == iters - 1;
    bool cur_live[R];
#pragma unroll
    for (int r = 0; r < R; ++r) cur_live[r] = live[r];
    if (j + 1 < total) {  // next iteration's loads, possibly of the next group of rows
      if (group_done) point_at(group + 1);
      gemv_load<R, U>(w, rows, live, group_done ? lane : v0 + 32 * U, k8, policy);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * 32;
      if (v < k8) {
#pragma unroll
        for (int i = 0; i < M; ++i) {
          float a[8];
          unpack8<T>(act[i * k8 + v], a);
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][i] += dot8<T>(cur[r][u], a);
        }
      }
    }
    if (SILU_MUL && group_done) {
      // Rounded as the unfused ops round: y to T, silu(gate) to T, the product to T.
      const int o = row_begin + group;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float g = warp_sum(acc[0][i]), u = warp_sum(acc[1][i]);
        acc[0][i] = acc[1][i] = 0.f;
        if (lane == i && cur_live[0] && i < m) {
          const float gate = round_to<T>(g + (bias ? to_float(bias[o]) : 0.f));
          const float up = round_to<T>(u + (bias ? to_float(bias[n_out + o]) : 0.f));
          out[i * out_stride + o] = from_float<T>(round_to<T>(gate / (1.f + __expf(-gate))) * up);
        }
      }
    } else if (group_done) {
      const int row0 = row_begin + group * R;
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int i = 0; i < M; ++i) {
          const float s = warp_sum(acc[r][i]);
          acc[r][i] = 0.f;
          const int row = row0 + r;
          if (lane == (r * M + i) % 32 && cur_live[r] && i < m) {
            float y = s + (bias ? to_float(bias[row]) : 0.f);
            if (residual) y = to_float(residual[i * residual_stride + row]) + round_to<T>(y);
            out[i * out_stride + row] = from_float<T>(y);
          }
        }
      }
    }
  }
}

}  // namespace tinyvllm
