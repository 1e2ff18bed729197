// Skinny linear layer for decode: out[m, n] = act(x)[m, :k] . weight[n, :k] + bias, m <= 8.
//
// At decode batch sizes the product is a matrix-vector product bound by reading the weight once,
// so the kernel streams every weight row exactly once, 16 bytes per lane per load, with several
// loads in flight per lane, and keeps the m activation rows in shared memory where the whole CTA
// reuses them. What the decoder does around each projection is folded in, to save launches:
//   prologue  kNone      act(x) = x
//             kRmsNorm   act(x) = rmsnorm(x) * norm_weight   (input_layernorm before qkv_proj, ...)
//             kSiluMul   act(x) = silu(x[:, :k]) * x[:, k:]  (SwiGLU before down_proj)
//   epilogue  residual   out = residual + x . W^T, in place  (the residual stream after o/down_proj)
// Rounding points follow the unfused ops (the normalised / activated value and the product are
// rounded to T before the next step), so results equal norm -> cuBLAS -> add up to the order of
// the fp32 sum.
//
// Work split: all warps of the grid are resident at once (the launcher sizes the grid by occupancy)
// and warp g owns the contiguous rows [n * g / W, n * (g + 1) / W) of the W warps, taking them
// kRows at a time: no partial second wave, at most one row of imbalance between warps.
#pragma once

#include "common.cuh"

namespace tinyvllm {

enum GemvPrologue : int { kGemvNone = 0, kGemvRmsNorm = 1, kGemvSiluMul = 2 };

constexpr int kGemvWarps = 8;   // warps per CTA
constexpr int kGemvRows = 2;    // weight rows a warp streams together
constexpr int kGemvUnroll = 4;  // 16-byte loads per row in flight per lane

// A weight vector is read once: do not keep it in L1.
__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
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

// Writes act(x)[:, c0 : c0 + len] of the M staged rows into act (row stride `len8` vectors); rows
// at or past m are zero.
template <typename T, int M, int P>
__device__ __forceinline__ void gemv_stage(uint4* act, int len8, const T* x, int64_t x_stride,
                                           const T* norm_weight, const float* inv_rms, int m,
                                           int k, int c0) {
  for (int idx = threadIdx.x; idx < M * len8; idx += blockDim.x) {
    const int row = idx / len8, v = idx - row * len8;
    uint4 out = make_uint4(0, 0, 0, 0);
    if (row < m) {
      const T* xr = x + row * x_stride + c0 + v * 8;
      const uint4 xv = *reinterpret_cast<const uint4*>(xr);
      if constexpr (P == kGemvNone) {
        out = xv;
      } else if constexpr (P == kGemvRmsNorm) {
        float xf[8], wf[8], of[8];
        unpack8<T>(xv, xf);
        unpack8<T>(*reinterpret_cast<const uint4*>(norm_weight + c0 + v * 8), wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) of[j] = round_to<T>(xf[j] * inv_rms[row]) * wf[j];
        out = pack8<T>(of);
      } else {
        float gf[8], uf[8], of[8];
        unpack8<T>(xv, gf);
        unpack8<T>(*reinterpret_cast<const uint4*>(xr + k), uf);
#pragma unroll
        for (int j = 0; j < 8; ++j) of[j] = round_to<T>(gf[j] / (1.f + __expf(-gf[j]))) * uf[j];
        out = pack8<T>(of);
      }
    }
    act[idx] = out;
  }
}

template <typename T, int M, int P>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(
    T* out,                           // [m, out_stride], n columns written
    const T* __restrict__ x,          // [m, x_stride]: k columns (2k for kSiluMul)
    const T* __restrict__ weight,     // [n, k], rows contiguous
    const T* __restrict__ bias,       // [n] or null
    const T* residual,                // [m, residual_stride] or null; may be `out` itself
    const T* __restrict__ norm_weight,  // [k] (kRmsNorm)
    int m, int n, int k, int64_t x_stride, int64_t out_stride, int64_t residual_stride,
    float eps, int k_chunk) {
  extern __shared__ uint4 act[];  // [M][k_chunk / 8]
  __shared__ float inv_rms[M];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if constexpr (P == kGemvRmsNorm) {
    __shared__ float partial[kGemvWarps][M];
    float sum_sq[M];
#pragma unroll
    for (int r = 0; r < M; ++r) sum_sq[r] = 0.f;
    for (int v = threadIdx.x; v < k / 8; v += blockDim.x) {
#pragma unroll
      for (int r = 0; r < M; ++r) {
        if (r < m) {
          float xf[8];
          unpack8<T>(*reinterpret_cast<const uint4*>(x + r * x_stride + v * 8), xf);
#pragma unroll
          for (int j = 0; j < 8; ++j) sum_sq[r] = fmaf(xf[j], xf[j], sum_sq[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const float s = warp_sum(sum_sq[r]);
      if (lane == 0) partial[warp][r] = s;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) s += partial[w][threadIdx.x];
      inv_rms[threadIdx.x] = rsqrtf(s / k + eps);
    }
    __syncthreads();
  }

  // This warp's rows; the pass count is uniform over the CTA (chunked staging synchronises).
  const int64_t num_warps = int64_t(gridDim.x) * kGemvWarps;
  const int64_t global_warp = int64_t(blockIdx.x) * kGemvWarps + warp;
  const int row_begin = int(n * global_warp / num_warps);
  const int row_end = int(n * (global_warp + 1) / num_warps);
  const int max_rows = int((n + num_warps - 1) / num_warps);
  const int passes = (max_rows + kGemvRows - 1) / kGemvRows;
  const bool single_chunk = k_chunk >= k;
  const int chunk8 = k_chunk / 8;
  if (single_chunk) {
    gemv_stage<T, M, P>(act, k / 8, x, x_stride, norm_weight, inv_rms, m, k, 0);
    __syncthreads();
  }

  for (int pass = 0; pass < passes; ++pass) {
    const int row0 = row_begin + pass * kGemvRows;
    float acc[kGemvRows][M];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
      for (int i = 0; i < M; ++i) acc[r][i] = 0.f;
    const uint4* wrow[kGemvRows];
    bool live[kGemvRows];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      live[r] = row0 + r < row_end;
      wrow[r] = reinterpret_cast<const uint4*>(weight + int64_t(live[r] ? row0 + r : 0) * k);
    }

    for (int c0 = 0; c0 < k; c0 += k_chunk) {
      const int len8 = min(k_chunk, k - c0) / 8;
      const int stride8 = single_chunk ? k / 8 : chunk8;
      if (!single_chunk) {
        __syncthreads();
        gemv_stage<T, M, P>(act, stride8, x, x_stride, norm_weight, inv_rms, m, k, c0);
        __syncthreads();
      }
      const uint4* wchunk[kGemvRows];
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) wchunk[r] = wrow[r] + c0 / 8;
      for (int v0 = lane; v0 < len8; v0 += 32 * kGemvUnroll) {
        uint4 w[kGemvRows][kGemvUnroll];
#pragma unroll
        for (int u = 0; u < kGemvUnroll; ++u) {
          const int v = v0 + u * 32;
#pragma unroll
          for (int r = 0; r < kGemvRows; ++r) {
            w[r][u] = (live[r] && v < len8) ? load_streaming(wchunk[r] + v) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int u = 0; u < kGemvUnroll; ++u) {
          const int v = v0 + u * 32;
          if (v >= len8) break;
#pragma unroll
          for (int i = 0; i < M; ++i) {
            float a[8];
            unpack8<T>(act[i * stride8 + v], a);
#pragma unroll
            for (int r = 0; r < kGemvRows; ++r) acc[r][i] += dot8<T>(w[r][u], a);
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float s = warp_sum(acc[r][i]);
        const int row = row0 + r;
        if (lane == (r * M + i) % 32 && live[r] && i < m) {
          float y = s + (bias ? to_float(bias[row]) : 0.f);
          if (residual) y = to_float(residual[i * residual_stride + row]) + round_to<T>(y);
          out[i * out_stride + row] = from_float<T>(y);
        }
      }
    }
  }
}

}  // namespace tinyvllm
