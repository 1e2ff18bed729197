// Decode GEMV over GGUF block formats read as the file stores them, one row per output feature
// (ops/quantized.py's layout; ggml-common.h):
//
//   Q4_0  18 bytes / 32 values: fp16 d, 16 bytes of nibbles    w = (q - 8) * d
//   Q4_1  20 bytes / 32 values: fp16 d, fp16 m, 16 bytes       w = q * d + m
//   Q8_0  34 bytes / 32 values: fp16 d, 32 int8                w = q * d
//   Q4_K 144 bytes / 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 each),
//        128 bytes of nibbles; sub-block j (32 values) w = d sc_j q - dmin m_j
//   Q5_K 176 bytes: d, dmin, the 12 scale bytes, qh[32] (bit j of qh[l]: the 5th bit of element l
//        of sub-block j), 128 bytes of nibbles; as Q4_K with q of 5 bits
//   Q6_K 210 bytes: ql[128], qh[64], int8 scales[16] (one per 16 values), fp16 d last;
//        w = d sc (q - 32), q of 6 bits
//
// Nibble order: in the 32-value types byte j holds element j (low nibble) and element j + 16
// (high). In the K-quants 32 bytes hold two 32-value spans, byte l element l of the first (low
// nibble) and of the second (high): Q4_K / Q5_K sub-blocks 2c and 2c + 1 from qs[32c ..], Q6_K
// values 128h + 32g + l and 128h + 32g + 64 + l (g = 0, 1) from ql[64h + 32g ..] with the high bits
// in qh[32h + l] at bits 2g and 2g + 4.
//
// gguf_gemv_kernel (32-value types): out[m, n] = x[m, k] . w^T (+ bias) for decode-sized m (at most
// M rows). Each warp owns R rows (gguf_wide_rows) and each lane one block of each per step, so a
// warp reads 32 consecutive blocks of a row (576 / 640 / 1088 contiguous bytes) per step, the next
// step's requested before this one's are used. Blocks are only 2- or 4-byte aligned: a lane reads
// the aligned 32-bit words that cover its block and realigns them by a funnel shift (Q4_0 / Q8_0
// blocks in 16-bit loads took twice the load instructions). Elements become floats in the mantissa
// as the K-quants' do (below; Q8_0's int8 with its sign bit flipped, q + 128), so per block the lane
// forms dot = sum x (2^B + u) and sx = sum x and adds d dot + (m - (2^B + offset) d) sx. The
// activations are not quantized (unlike the CPU kernels): the result is the float product with the
// dequantized weight, up to summation order.
//
// gguf_kquant_gemv_kernel (K-quants): warps of 2 rows; two lanes share a 64-value chunk
// (the two spans of one 32 bytes above), each taking the 32 values of one span: the 32 bytes of
// nibbles (both lanes read them, one using the low nibbles and one the high), and the span's scale
// and min (Q6_K: one scale per 16 values). A warp reads 4 consecutive super-blocks of a row per
// step, and the two lanes of a chunk read 32 contiguous x values each, so one load of x by the warp
// touches 16 cache lines rather than 32: with one chunk a lane, x's lines at a 128-byte stride left
// the L1 the bottleneck (87% busy at 49% of DRAM bandwidth, ncu); with 16 values a lane the header
// decoding per value made it compute-bound (`kKLaneValues`; cuda/NOTES.md has the three). Q4_K /
// Q5_K super-blocks are 16-byte aligned (144 and 176 bytes in rows of whole super-blocks), read in
// 16-byte words; Q6_K ones only 2-byte aligned, read in aligned 32-bit words realigned by a funnel
// shift. Each element becomes a float without a conversion instruction: its bits go into the
// mantissa of 2^B (B its bit width), giving 2^B + q exactly, and the 2^B (and Q6_K's 32) comes off
// per 16 values through sum x: sum x w = scale * sum x (2^B + q) - (scale (2^B + offset) + min) *
// sum x.
//
// Both GEMVs take the decoder layer's fusions (gemv.cuh's, for LlamaDecoderLayer.forward_fused):
//   P = kGemvRmsNorm  each CTA stages rmsnorm(x) * norm_weight in shared memory (gemv_stage_x,
//                     one unused vector after every 4 so that lanes 64 bytes apart read distinct
//                     banks) and the warps read it there; kGemvNone reads x from global memory
//   residual          out = residual + y, in place (o_proj, down_proj)
//   silu_out          a warp's R rows are R / 2 gate rows and their up rows n / 2 further on;
//                     out[:, j] = silu(gate_j) * up_j (gate_up_proj writing the SwiGLU product)
// rounded where the unfused ops round (the normalised x, y, silu(gate) and the product to T).
// Both are launched with PDL: a warp requests its first blocks before waiting for the kernel
// before (the weight is not its output), and the next kernel may launch once x is staged.
//
// gguf_dequantize_kernel / gguf_kquant_dequantize_kernel: rows of the weight as T with gguf-py's
// arithmetic (prefill-sized batches, embedding lookups).
#pragma once

#include "common.cuh"
#include "gemv.cuh"

namespace tinyvllm {

constexpr int kGgufGemvWarps = 4;

// Rows of the weight per warp (R) of gguf_gemv_kernel: 4 where the weight has at least
// gguf_wide_rows(m) rows (each value of x loaded and converted once for 4 rows of the weight),
// 2 below, where the grid would otherwise leave SMs idle (SmolLM2's 576-row projections at 4 rows
// a warp are 36 CTAs). One row of x needs more warps to keep the loads in flight: a full wave at
// 4 rows a warp from 16,384 rows. The K-quant kernel keeps 2 (cuda/NOTES.md has both measured).
constexpr int gguf_wide_rows(int m) { return m == 1 ? 16384 : 4096; }

enum GgufType : int {
  kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ8_0 = 8, kGgufQ4_K = 12, kGgufQ5_K = 13, kGgufQ6_K = 14
};

constexpr bool gguf_is_kquant(int qtype) { return qtype >= kGgufQ4_K && qtype <= kGgufQ6_K; }

// (a >> n) for n >= 0, (a << -n) otherwise; n known at compile time.
__device__ __forceinline__ uint32_t shift_right(uint32_t a, int n) { return n >= 0 ? a >> n : a << -n; }

// The Field-bit field of `word` at bit b moved to the top of the mantissa of 2^Bits, under that
// exponent (a shift and a lop3, no conversion instruction): with Field = Bits, the bits of the
// float 2^Bits + u; with fewer, its low bits, the rest to be or-ed in.
template <int Bits, int Field = Bits>
__device__ __forceinline__ uint32_t magic_bits(uint32_t word, int b) {
  constexpr int S = 23 - Bits;
  return and_or(shift_right(word, b - S), ((1u << Field) - 1u) << S, (127u + Bits) << 23);
}

template <int Bits>
__device__ __forceinline__ float magic_float(uint32_t word, int b) {
  return __uint_as_float(magic_bits<Bits>(word, b));
}

// N 32-bit words from the aligned word holding p's byte on, and in `shift` the bit offset of p in
// the first (0, 8, 16 or 24) for a funnel shift to realign them.
template <int N>
__device__ __forceinline__ void load_aligned_words(const uint8_t* p, uint32_t (&w)[N], uint32_t& shift) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uint32_t* base = reinterpret_cast<const uint32_t*>(a & ~uintptr_t(3));
  shift = uint32_t(a & 3) * 8;
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = __ldg(base + i);
}

// The 32-value types: bytes per block, the alignment of a block in a row of whole blocks, the
// bits of a stored code u and how a weight comes from it, w = d (u - kOffset) + m (m only where
// kMin; Q8_0's int8 q is stored as u = q + 128 once its sign bit is flipped).
template <int QT> struct GgufFormat;
template <> struct GgufFormat<kGgufQ4_0> {
  static constexpr int kBytes = 18, kAlign = 2, kBits = 4, kOffset = 8;
  static constexpr bool kMin = false;
};
template <> struct GgufFormat<kGgufQ4_1> {
  static constexpr int kBytes = 20, kAlign = 4, kBits = 4, kOffset = 0;
  static constexpr bool kMin = true;
};
template <> struct GgufFormat<kGgufQ8_0> {
  static constexpr int kBytes = 34, kAlign = 2, kBits = 8, kOffset = 128;
  static constexpr bool kMin = false;
};

// A block's bytes as loaded: the aligned 32-bit words from the one holding its first byte (one
// load each, where 16-bit loads of a 2-byte aligned block took twice as many), and the bit offset
// of the block in the first word. The last word may hold bytes past the block, never past the
// aligned word of its last byte.
template <int QT> struct GgufWords {
  using F = GgufFormat<QT>;
  static constexpr int kWords = (F::kBytes + (4 - F::kAlign) + 3) / 4;
  uint32_t w[kWords];
  uint32_t shift;
  __device__ __forceinline__ void load(const uint8_t* p) {
    if constexpr (F::kAlign == 4) {
      const uint32_t* base = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = __ldg(base + i);
      shift = 0;
    } else {
      load_aligned_words(p, w, shift);
    }
  }
};

// A block decoded from its words: d, m and the codes, kBits words of them (Q8_0's sign bits
// flipped). Element j of a 4-bit block is the low nibble of byte j (j < 16) or the high nibble of
// byte j - 16; of Q8_0, byte j.
template <int QT> struct GgufBlock {
  using F = GgufFormat<QT>;
  static constexpr int kBytes = F::kBytes, kQWords = F::kBits;
  // sum x w = d sum x (2^kBits + u) + (m - kBase d) sum x
  static constexpr float kBase = float((1 << F::kBits) + F::kOffset);
  uint32_t qs[kQWords];
  float d, m;
  __device__ __forceinline__ void decode(const GgufWords<QT>& r) {
    // The codes start 2 bytes into the block: words realigned by shift + 16 (32 takes the next
    // word whole).
    const uint32_t head = F::kAlign == 4 ? r.w[0] : __funnelshift_r(r.w[0], r.w[1], r.shift);
    d = __half2float(__ushort_as_half(uint16_t(head & 0xFFFFu)));
    m = F::kMin ? __half2float(__ushort_as_half(uint16_t(head >> 16))) : 0.f;
#pragma unroll
    for (int i = 0; i < kQWords; ++i) {
      qs[i] = F::kAlign == 4 ? r.w[1 + i] : __funnelshift_rc(r.w[i], r.w[i + 1], r.shift + 16);
      if (F::kBits == 8) qs[i] ^= 0x80808080u;
    }
  }
  __device__ __forceinline__ void load(const uint8_t* p) {
    GgufWords<QT> r;
    r.load(p);
    decode(r);
  }
  static __device__ __forceinline__ int word(int j) { return F::kBits == 8 ? j >> 2 : (j & 15) >> 2; }
  static __device__ __forceinline__ int bit(int j) {
    return F::kBits == 8 ? 8 * (j & 3) : 8 * (j & 3) + 4 * (j >> 4);
  }
  __device__ __forceinline__ uint32_t u(int j) const {
    return (qs[word(j)] >> bit(j)) & ((1u << F::kBits) - 1u);
  }
  __device__ __forceinline__ float magic(int j) const { return magic_float<F::kBits>(qs[word(j)], bit(j)); }
  // Element j dequantized with gguf-py's arithmetic: d (q - 8), d q + m (each rounded), d q.
  __device__ __forceinline__ float value(int j) const {
    const float q = float(int(u(j)) - F::kOffset);
    return F::kMin ? __fadd_rn(__fmul_rn(d, q), m) : __fmul_rn(d, q);
  }
};

// A GEMV launch's operands (cuda/gguf_gemv.cu fills it; the fusions as in the header).
template <typename T> struct GgufGemvArgs {
  T* out;                  // [m, out_stride]: n columns (silu_out: n / 2)
  const T* x;              // [m, x_stride]: k columns
  const uint8_t* qweight;  // [n, row bytes]
  const T* bias;           // [n] or null
  const T* residual;       // [m, residual_stride] or null; may be out itself
  const T* norm_weight;    // [k] (kGemvRmsNorm)
  int m, n, k;
  int64_t x_stride, out_stride, residual_stride;
  float eps;
  bool silu_out;
};

// The R weight rows warp `g` of the grid streams and the outputs they make from o0 on: rows
// o0 .. o0 + R - 1, or with silu_out gate rows o0 .. o0 + R / 2 - 1 and their up rows (rows past
// the end repeat the last one; their outputs are not written).
template <int R> struct GgufWarpRows {
  int o0, n_out;
  bool active;
  int row[R];
  __device__ __forceinline__ GgufWarpRows(int64_t g, int n, bool silu_out) {
    static_assert(R % 2 == 0, "silu_out pairs gate and up rows");
    n_out = silu_out ? n / 2 : n;
    o0 = int(g * (silu_out ? R / 2 : R));
    active = o0 < n_out;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      row[r] = silu_out ? (r < R / 2 ? 0 : n_out) + min(o0 + r % (R / 2), n_out - 1)
                        : min(o0 + r, n - 1);
    }
  }
};

// Where a GEMV reads x: global memory (kGemvNone), or the CTA's staging of act(x) (gemv_stage_x
// with a padding vector after every 4; vec(i, v) is vector v, values 8v .. 8v + 7, of row i).
template <typename T, int M, int P> struct GgufX {
  const T* x;
  int64_t x_stride;
  const uint4* act;
  int k8;
  __device__ __forceinline__ uint4 vec(int i, int v) const {
    if constexpr (P == kGemvNone) {
      return __ldg(reinterpret_cast<const uint4*>(x + i * x_stride) + v);
    } else {
      return act[staged_at<4>(i, v, k8, k8 / 4)];
    }
  }
};

// Bytes of shared memory a CTA stages for M rows of k values (0 for kGemvNone).
constexpr int gguf_stage_bytes(int P, int M, int k) {
  return P == kGemvNone ? 0 : M * (k / 8 + k / 32) * 16;
}

// Waits for the kernel before (launched with PDL, the GEMV may start while it drains: nothing
// it wrote is read before this), stages act(x) for the CTA (every thread must call it), lets the
// next kernel launch, and returns where the warps read x.
template <typename T, int M, int P>
__device__ __forceinline__ GgufX<T, M, P> gguf_stage_x(const GgufGemvArgs<T>& a) {
  GgufX<T, M, P> gx{a.x, a.x_stride, nullptr, a.k / 8};
  wait_for_previous_grid();
  if constexpr (P != kGemvNone) {
    extern __shared__ uint4 gguf_act[];
    __shared__ float inv_rms[M];
    gemv_stage_x<T, M, P, 4>(gguf_act, gx.k8, a.x, a.x_stride, a.norm_weight, inv_rms, a.m, a.eps,
                             gx.k8 / 4);
    __syncthreads();
    gx.act = gguf_act;
  }
  allow_next_grid();
  return gx;
}

// The end of a GEMV: sums each lane's acc[r][i] over the warp and writes the outputs (lanes take
// turns): y + bias, + the residual, or silu(gate) * up.
template <typename T, int R, int M>
__device__ __forceinline__ void gguf_write_rows(const float (&acc)[R][M], int lane,
                                                const GgufWarpRows<R>& w,
                                                const GgufGemvArgs<T>& a) {
  if (a.silu_out) {
#pragma unroll
    for (int c = 0; c < R / 2; ++c) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float g = warp_sum(acc[c][i]), u = warp_sum(acc[c + R / 2][i]);
        const int o = w.o0 + c;
        if (lane == (c * M + i) % 32 && i < a.m && o < w.n_out) {
          const float gate = round_to<T>(g + (a.bias ? to_float(a.bias[o]) : 0.f));
          const float up = round_to<T>(u + (a.bias ? to_float(a.bias[w.n_out + o]) : 0.f));
          a.out[i * a.out_stride + o] =
              from_float<T>(round_to<T>(gate / (1.f + __expf(-gate))) * up);
        }
      }
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float s = warp_sum(acc[r][i]);
      const int o = w.o0 + r;
      if (lane == (r * M + i) % 32 && i < a.m && o < w.n_out) {
        float y = s + (a.bias ? to_float(a.bias[o]) : 0.f);
        if (a.residual) y = to_float(a.residual[i * a.residual_stride + o]) + round_to<T>(y);
        a.out[i * a.out_stride + o] = from_float<T>(y);
      }
    }
  }
}

template <typename T, int M, int QT, int R, int P>
__global__ void __launch_bounds__(kGgufGemvWarps * 32) gguf_gemv_kernel(const GgufGemvArgs<T> a) {
  using Block = GgufBlock<QT>;
  const int lane = threadIdx.x & 31;
  const GgufWarpRows<R> wr(int64_t(blockIdx.x) * kGgufGemvWarps + (threadIdx.x >> 5), a.n,
                           a.silu_out);
  if (P == kGemvNone && !wr.active) return;  // staging needs every thread
  const int blocks = a.k / 32;
  const int64_t row_bytes = int64_t(blocks) * Block::kBytes;
  const uint8_t* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = a.qweight + wr.row[r] * row_bytes;

  // One step ahead: a step's blocks are requested before the previous step's are used (the
  // first before the wait for the kernel before: the weight is not its output).
  GgufWords<QT> next[R];
  auto request = [&](int blk) {
    if (blk < blocks) {
#pragma unroll
      for (int r = 0; r < R; ++r) next[r].load(rows[r] + int64_t(blk) * Block::kBytes);
    }
  };
  if (wr.active) request(lane);
  const GgufX<T, M, P> gx = gguf_stage_x<T, M, P>(a);
  if (!wr.active) return;

  float acc[R][M];
  zero_sums(acc);
  for (int blk = lane; blk < blocks; blk += 32) {
    Block w[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w[r].decode(next[r]);
    request(blk + 32);
    float dot[R][M], sx[M];
    zero_sums(dot);
    zero_sums(sx);
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // 8 activations at a time
      float xv[M][8];
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (M == 1 || i < a.m) {  // a launch has at least one row
          unpack8<T>(gx.vec(i, blk * 4 + p), xv[i]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[i][j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) sx[i] += xv[i][j];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float q = w[r].magic(p * 8 + j);
#pragma unroll
          for (int i = 0; i < M; ++i) dot[r][i] = fmaf(xv[i][j], q, dot[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float mb = fmaf(-Block::kBase, w[r].d, w[r].m);
#pragma unroll
      for (int i = 0; i < M; ++i) acc[r][i] += fmaf(w[r].d, dot[r][i], mb * sx[i]);
    }
  }

  gguf_write_rows<T, R, M>(acc, lane, wr, a);
}

// One thread per block: rows `rows` (null: 0 .. num_rows - 1) of the weight as T [num_rows, k].
template <typename T, int QT>
__global__ void gguf_dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ qweight,
                                       const int64_t* __restrict__ rows, int num_rows, int k) {
  using Block = GgufBlock<QT>;
  const int blocks = k / 32;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(num_rows) * blocks) return;
  const int r = int(idx / blocks), blk = int(idx % blocks);
  const int64_t src_row = rows != nullptr ? rows[r] : r;
  Block b;
  b.load(qweight + src_row * blocks * Block::kBytes + int64_t(blk) * Block::kBytes);
  T* dst = out + int64_t(r) * k + blk * 32;
#pragma unroll
  for (int j = 0; j < 32; ++j) dst[j] = from_float<T>(b.value(j));
}

// ---- K-quants --------------------------------------------------------------------------------

constexpr int kKQuantValues = 256;  // values per super-block
constexpr int kKChunkValues = 64;   // values of one 32-byte group of nibbles: two spans of 32
constexpr int kKChunks = kKQuantValues / kKChunkValues;
constexpr int kKQuarterValues = 16;  // values per scale (Q6_K) and per activation load pair
constexpr int kKLaneValues = 32;     // values per lane and step: 16 (a quarter) or 32 (a span)

// 4 32-bit words from a 2-byte aligned address: 5 aligned loads, realigned by a funnel shift.
// Reads up to 4 bytes past the 16 (the callers' spans are followed by more of their super-block).
__device__ __forceinline__ void load16_u16_aligned(const uint8_t* p, uint32_t (&w)[4]) {
  uint32_t a[5], shift;
  load_aligned_words(p, a, shift);
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = __funnelshift_r(a[i], a[i + 1], shift);
}

__device__ __forceinline__ void load16(const uint8_t* p, uint32_t (&w)[4]) {  // 16-byte aligned
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
  w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
}

// Scale and min j (0..7) of a Q4_K / Q5_K super-block from its 12 scale bytes as words s0..s2
// (ggml's get_scale_min_k4).
__device__ __forceinline__ void kquant_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int j,
                                                 uint32_t& sc, uint32_t& mn) {
  if (j < 4) {
    sc = (s0 >> (8 * j)) & 63u;
    mn = (s1 >> (8 * j)) & 63u;
  } else {
    const int b = 8 * (j - 4);
    sc = ((s2 >> b) & 0xFu) | (((s0 >> (b + 6)) & 3u) << 4);
    mn = ((s2 >> (b + 4)) & 0xFu) | (((s1 >> (b + 6)) & 3u) << 4);
  }
}

// A lane's slice of chunk c (0..3) of one super-block: V (16 or 32) values of one span (the low
// nibbles for span 0, the high ones for span 1) from the chunk's 32 bytes, with a scale d sc and a
// min dmin m (0 for Q6_K) per 16 values. Lane slot qi of the chunk's 64 / V takes span qi V / 32
// from its value V qi % 32. Loading shifts the words so that element j's nibble sits at bit
// 8 (j % 4) of word j / 4 and its high bits (Q5_K, Q6_K) at the same bit of h[j / 4].
template <int V> struct KSlot {
  static constexpr int kSlots = kKChunkValues / V;
  static __device__ __forceinline__ int span(int qi) { return qi * V / 32; }
  static __device__ __forceinline__ int first(int qi) { return V * qi % 32; }  // in the span
};

template <int QT, int V> struct KSlice;

// Element j of a slice as an unsigned integer: its nibble, and above it the High bits of h.
template <uint32_t High, int N>
__device__ __forceinline__ uint32_t kslice_u(const uint32_t (&q)[N], const uint32_t (&h)[N], int j) {
  const int b = 8 * (j & 3);
  return ((q[j >> 2] >> b) & 0xFu) | (((h[j >> 2] >> b) & High) << 4);
}

// The same element as the float 2^Bits + u, built in the mantissa (no conversion instruction).
template <int Bits, uint32_t High, int N>
__device__ __forceinline__ float kslice_magic(const uint32_t (&q)[N], const uint32_t (&h)[N], int j) {
  constexpr int S = 23 - Bits;
  const int b = 8 * (j & 3);
  uint32_t bits = magic_bits<Bits, 4>(q[j >> 2], b);
  if (High != 0) bits = and_or(shift_right(h[j >> 2], b - (S + 4)), High << (S + 4), bits);
  return __uint_as_float(bits);
}

template <int V> struct KSlice<kGgufQ4_K, V> {
  static constexpr int kBytes = 144, kBits = 4, kOffset = 0;
  static constexpr int kWords = V / 4, kScales = V / kKQuarterValues;
  uint32_t q[kWords], h[kWords];
  float scale[kScales], min[kScales];
  static __device__ __forceinline__ int span_value(int c, int s) { return 64 * c + 32 * s; }
  __device__ __forceinline__ void load_scale(const uint8_t* sb, int c, int s) {
    const uint4 head = __ldg(reinterpret_cast<const uint4*>(sb));
    uint32_t sc, mn;
    kquant_scale_min(head.y, head.z, head.w, 2 * c + s, sc, mn);
    const float d = __fmul_rn(__half2float(__ushort_as_half(uint16_t(head.x & 0xFFFFu))), float(sc));
    const float m = __fmul_rn(__half2float(__ushort_as_half(uint16_t(head.x >> 16))), float(mn));
#pragma unroll
    for (int i = 0; i < kScales; ++i) {
      scale[i] = d;
      min[i] = m;
    }
  }
  __device__ __forceinline__ void load(const uint8_t* sb, int c, int qi) {
    const int s = KSlot<V>::span(qi);
    load_scale(sb, c, s);
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i)
      load16(sb + 16 + 32 * c + KSlot<V>::first(qi) + 16 * i, *reinterpret_cast<uint32_t(*)[4]>(q + 4 * i));
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      q[i] >>= 4 * s;
      h[i] = 0;
    }
  }
  __device__ __forceinline__ uint32_t u(int j) const { return kslice_u<0>(q, h, j); }
  __device__ __forceinline__ float magic(int j) const { return kslice_magic<kBits, 0>(q, h, j); }
};

template <int V> struct KSlice<kGgufQ5_K, V> : KSlice<kGgufQ4_K, V> {
  static constexpr int kBytes = 176, kBits = 5, kOffset = 0;
  using Base = KSlice<kGgufQ4_K, V>;
  using Base::q, Base::h, Base::kWords;
  __device__ __forceinline__ void load(const uint8_t* sb, int c, int qi) {
    const int s = KSlot<V>::span(qi);
    Base::load_scale(sb, c, s);
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      load16(sb + 48 + 32 * c + KSlot<V>::first(qi) + 16 * i, *reinterpret_cast<uint32_t(*)[4]>(q + 4 * i));
      load16(sb + 16 + KSlot<V>::first(qi) + 16 * i, *reinterpret_cast<uint32_t(*)[4]>(h + 4 * i));
    }
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      q[i] >>= 4 * s;
      h[i] >>= 2 * c + s;  // sub-block 2c + s's bit
    }
  }
  __device__ __forceinline__ uint32_t u(int j) const { return kslice_u<1>(q, h, j); }
  __device__ __forceinline__ float magic(int j) const { return kslice_magic<kBits, 1>(q, h, j); }
};

template <int V> struct KSlice<kGgufQ6_K, V> {
  static constexpr int kBytes = 210, kBits = 6, kOffset = 32;
  static constexpr int kWords = V / 4, kScales = V / kKQuarterValues;
  uint32_t q[kWords], h[kWords];
  float scale[kScales], min[kScales];
  static __device__ __forceinline__ int span_value(int c, int s) {
    return 128 * (c >> 1) + 32 * (c & 1) + 64 * s;
  }
  __device__ __forceinline__ void load(const uint8_t* sb, int c, int qi) {
    const int half = c >> 1, g = c & 1, s = KSlot<V>::span(qi), first = KSlot<V>::first(qi);
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      load16_u16_aligned(sb + 64 * half + 32 * g + first + 16 * i, *reinterpret_cast<uint32_t(*)[4]>(q + 4 * i));
      load16_u16_aligned(sb + 128 + 32 * half + first + 16 * i, *reinterpret_cast<uint32_t(*)[4]>(h + 4 * i));
    }
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      q[i] >>= 4 * s;
      h[i] >>= 2 * g + 4 * s;  // group g + 2s's two bits
    }
    const float d = __half2float(__ushort_as_half(__ldg(reinterpret_cast<const uint16_t*>(sb + 208))));
#pragma unroll
    for (int i = 0; i < kScales; ++i) {  // one int8 scale per 16 values
      const int8_t sc = int8_t(__ldg(sb + 192 + 8 * half + 2 * g + 4 * s + first / 16 + i));
      scale[i] = __fmul_rn(d, float(sc));
      min[i] = 0.f;
    }
  }
  __device__ __forceinline__ uint32_t u(int j) const { return kslice_u<3>(q, h, j); }
  __device__ __forceinline__ float magic(int j) const { return kslice_magic<kBits, 3>(q, h, j); }
};

// Value offset in its super-block of lane slot qi of chunk c.
template <int QT, int V>
__device__ __forceinline__ int kslot_value(int c, int qi) {
  return KSlice<QT, V>::span_value(c, KSlot<V>::span(qi)) + KSlot<V>::first(qi);
}

template <typename T, int M, int QT, int R, int P>
__global__ void __launch_bounds__(kGgufGemvWarps * 32)
    gguf_kquant_gemv_kernel(const GgufGemvArgs<T> a) {
  constexpr int V = kKLaneValues;
  using Slice = KSlice<QT, V>;
  using Slot = KSlot<V>;
  constexpr float kBase = float(1 << Slice::kBits) + float(Slice::kOffset);
  const int lane = threadIdx.x & 31;
  const GgufWarpRows<R> wr(int64_t(blockIdx.x) * kGgufGemvWarps + (threadIdx.x >> 5), a.n,
                           a.silu_out);
  if (P == kGemvNone && !wr.active) return;  // staging needs every thread
  const GgufX<T, M, P> gx = gguf_stage_x<T, M, P>(a);
  if (!wr.active) return;
  const int chunks = a.k / kKChunkValues;
  const int qi = lane % Slot::kSlots;
  const int64_t row_bytes = int64_t(a.k / kKQuantValues) * Slice::kBytes;
  const uint8_t* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = a.qweight + wr.row[r] * row_bytes;

  float acc[R][M];
  zero_sums(acc);

  for (int ci = lane / Slot::kSlots; ci < chunks; ci += 32 / Slot::kSlots) {
    const int sb = ci / kKChunks, c = ci % kKChunks;
    Slice w[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w[r].load(rows[r] + int64_t(sb) * Slice::kBytes, c, qi);
    const int x0 = sb * kKQuantValues + kslot_value<QT, V>(c, qi);
#pragma unroll
    for (int hq = 0; hq < Slice::kScales; ++hq) {  // 16 values a scale
      float dot[R][M], sx[M];
      zero_sums(dot);
      zero_sums(sx);
#pragma unroll
      for (int p = 0; p < 2; ++p) {  // 8 values at a time: the weights', then x's row by row
        const int l0 = kKQuarterValues * hq + 8 * p;
        float v[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) v[r][j] = w[r].magic(l0 + j);
#pragma unroll
        for (int i = 0; i < M; ++i) {
          if (M > 1 && i >= a.m) break;  // a launch has at least one row
          float xv[8];
          unpack8<T>(gx.vec(i, (x0 + l0) / 8), xv);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            sx[i] += xv[j];
#pragma unroll
            for (int r = 0; r < R; ++r) dot[r][i] = fmaf(xv[j], v[r][j], dot[r][i]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float off = fmaf(w[r].scale[hq], kBase, w[r].min[hq]);
#pragma unroll
        for (int i = 0; i < M; ++i) acc[r][i] += fmaf(w[r].scale[hq], dot[r][i], -off * sx[i]);
      }
    }
  }

  gguf_write_rows<T, R, M>(acc, lane, wr, a);
}

// One thread per 16-value quarter: rows `rows` (null: 0 .. num_rows - 1) of the weight as T
// [num_rows, k], with gguf-py's arithmetic: d sc q - dmin m (Q4_K, Q5_K), d sc (q - 32) (Q6_K),
// each product and difference rounded on its own.
template <typename T, int QT>
__global__ void gguf_kquant_dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ qweight,
                                              const int64_t* __restrict__ rows, int num_rows, int k) {
  using Slice = KSlice<QT, kKQuarterValues>;
  const int quarters = k / kKQuarterValues;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(num_rows) * quarters) return;
  const int r = int(idx / quarters), qx = int(idx % quarters);
  const int sb = qx / (kKQuantValues / kKQuarterValues), c = (qx / 4) % kKChunks, qi = qx % 4;
  const int64_t src_row = rows != nullptr ? rows[r] : r;
  Slice w;
  w.load(qweight + src_row * (k / kKQuantValues) * Slice::kBytes + int64_t(sb) * Slice::kBytes,
         c, qi);
  T* dst = out + int64_t(r) * k + sb * kKQuantValues + kslot_value<QT, kKQuarterValues>(c, qi);
#pragma unroll
  for (int j = 0; j < kKQuarterValues; ++j) {
    const float v = float(int(w.u(j)) - Slice::kOffset);
    dst[j] = from_float<T>(__fsub_rn(__fmul_rn(w.scale[0], v), w.min[0]));
  }
}

}  // namespace tinyvllm
