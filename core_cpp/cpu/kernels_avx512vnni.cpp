// The AVX-512 VNNI kernels: kernels_avx2.cpp's float helpers and quantize_row compiled again with
// -mavx512f -mavx512vl -mavx512bw -mavx512vnni, and a GEMM of 512-bit tiles. Called only when
// the running CPU reports those features. The results are bit-identical to the AVX2 and scalar
// kernels: every tile below follows kernels_avx2.cpp's block dot contract.
//
// The GEMM (more than kNarrowRows activation rows) puts sixteen pairs side by side: one weight row
// against sixteen activation rows, one contract lane per zmm. A weight block's four bytes of a
// contract lane are broadcast to all sixteen lanes, the sixteen rows' bytes come from a layout
// transposed once per product. The sixteen pairs' block scales are one multiply, shared by the
// four contract lanes' FMAs; with each pair's four lanes in one 128-bit lane instead, as the GEMV
// below, a multiply per four pairs made the float multiply pipes the bound (Q4_1 on a Zen 4
// core: 1.29 against 1.09 cycles per (block, weight row, activation row)). The GEMV (kNarrowRows
// rows or fewer) puts four weight rows against one activation row broadcast.
#define TINYVLLM_KERNELS_VNNI 1
// GCC 12's avx512fintrin.h initialises its "undefined" operands from themselves, which
// -Wmaybe-uninitialized and -Wuninitialized report at every inlined intrinsic.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// The AVX2 file's quantize_row and int8_rows, which this table replaces, are not used here.
#pragma GCC diagnostic ignored "-Wunused-function"
#include "kernels_avx2.cpp"

#include <algorithm>
#include <cstddef>

namespace tinyvllm::cpu {
namespace {

constexpr int kQuad = 4;  // pairs per zmm

struct alignas(64) Zmm {  // one 512-bit value in memory (a std::vector of __m512 drops alignment)
  char bytes[64];
  __m512i i() const { return _mm512_load_si512(bytes); }
  __m512 f() const { return _mm512_load_ps(reinterpret_cast<const float*>(bytes)); }
  void set(__m512i v) { _mm512_store_si512(bytes, v); }
  void set(__m512 v) { _mm512_store_ps(reinterpret_cast<float*>(bytes), v); }
};

// Signed bytes w -> unsigned w + 128, for vpdpbusd's unsigned operand.
inline __m512i flip_sign(__m512i w) {
  return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// A chunk of up to 16 activation rows laid out for the GEMM tile, one lane per row: for block b
// and contract lane l, lo[b * 4 + l] holds each row's values 4l .. 4l + 3 (one 32-bit word per
// lane), hi those of 16 + 4l .. 19 + 4l, as vpdpbusd's signed operand (against Q8_0 weights: the
// values + 128, its unsigned one); dx[b] and s[b] each row's scale d and sum s. Rows past the
// chunk are zeros: their lanes compute 0 and are not stored.
struct ChunkLayout {
  std::vector<Zmm> lo, hi;  // [nb * kQuad]
  std::vector<Zmm> dx, s;   // [nb]
  int rows = 0;
};

// -128 * (the contract's lane sums of activation values lo, hi), for the narrow tile's unsigned
// Q8_0 weights w + 128: sum (w + 128) * x - 128 * sum x = sum w * x, in exact integers.
inline __m512i q8_init(__m512i lo, __m512i hi) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo),
                                           ones, hi);
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
}

// Sizes L for `rows` activation rows (not thread-safe: vectors grow); fill_layout writes it.
void size_layout(int64_t rows, int64_t nb, ChunkLayout& L) {
  L.rows = static_cast<int>(rows);
  const size_t size = static_cast<size_t>(nb * kQuad);
  if (L.lo.size() < size) {
    L.lo.resize(size);
    L.hi.resize(size);
  }
  if (L.dx.size() < static_cast<size_t>(nb)) {
    L.dx.resize(nb);
    L.s.resize(nb);
  }
}

void fill_layout(const ActBlock* x0, int64_t rows, int64_t nb, bool q8, ChunkLayout& L) {
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) int32_t words[2 * kQuad][kActRowsPerChunk] = {};
    alignas(64) float d[kActRowsPerChunk] = {}, s[kActRowsPerChunk] = {};
    for (int64_t row = 0; row < rows; ++row) {
      const ActBlock& xb = x0[row * nb + b];
      int32_t w[2 * kQuad];
      std::memcpy(w, xb.qs, sizeof w);
      for (int l = 0; l < 2 * kQuad; ++l) words[l][row] = w[l];
      d[row] = xb.d;
      s[row] = xb.s;
    }
    for (int l = 0; l < kQuad; ++l) {
      const __m512i lo = _mm512_load_si512(words[l]), hi = _mm512_load_si512(words[kQuad + l]);
      L.lo[b * kQuad + l].set(q8 ? flip_sign(lo) : lo);
      L.hi[b * kQuad + l].set(q8 ? flip_sign(hi) : hi);
    }
    L.dx[b].set(_mm512_load_ps(d));
    L.s[b].set(_mm512_load_ps(s));
  }
}

void build_layout(const ActBlock* x0, int64_t rows, int64_t nb, bool q8, ChunkLayout& L) {
  size_layout(rows, nb, L);
  fill_layout(x0, rows, nb, q8, L);
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

template <QType T>
constexpr size_t qs_offset() {  // where a block's values start
  return T == QType::Q4_0 ? offsetof(BlockQ4_0, qs)
       : T == QType::Q4_1 ? offsetof(BlockQ4_1, qs) : offsetof(BlockQ8_0, qs);
}

// Bytes of packed nibbles -> the low nibbles (values 0-15 of a block) and the high ones (16-31).
inline void split_nibbles(__m512i t, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(t, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), mask);
}

// 16 bytes at offset `off` of four rows `row_bytes` apart, one row per 128-bit lane.
inline __m512i four_rows(const uint8_t* p, int64_t row_bytes, size_t off) {
  __m512i t = _mm512_castsi128_si512(load16(p + off));
  t = _mm512_inserti32x4(t, load16(p + row_bytes + off), 1);
  t = _mm512_inserti32x4(t, load16(p + 2 * row_bytes + off), 2);
  return _mm512_inserti32x4(t, load16(p + 3 * row_bytes + off), 3);
}

// A zero for a vpdpbusd accumulator as the zeroing idiom (vpxord x, x, x: no execution unit):
// left to itself the compiler copies one shared zero register, a zmm move that takes a slot of
// the pipes the multiplies need.
inline __m512i fresh_zero() {
  __m512i z;
  asm volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}

// y = ((l0 + l2) + (l1 + l3)) of 128-bit lane c: kernels_avx2.cpp's hsum4.
inline float lane_sum(const float* v, int c) {
  return (v[4 * c] + v[4 * c + 2]) + (v[4 * c + 1] + v[4 * c + 3]);
}

// R weight rows' blocks laid out once per tile of rows, 32 bytes per block holding values 0-31,
// so each contract lane's 4-byte words broadcast straight from memory: the 4-bit types' nibbles
// (vpdpbusd's unsigned operand, against the signed activations), Q8_0's signed values (against
// the activations + 128, the layout's for Q8_0) with init[(i * nb + b) * 4 + l] = -128 times
// contract lane l's sum of weights: sum (x + 128) * w - 128 * sum w = sum x * w, exactly.
template <QType T>
void unpack_rows(const uint8_t* w_row0, int64_t row_bytes, int rows, int64_t nb, uint8_t* out,
                 int32_t* init) {
  const int bb = block_bytes(T);
  for (int i = 0; i < rows; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qs = w_row0 + i * row_bytes + b * bb + qs_offset<T>();
      uint8_t* o = out + (i * nb + b) * kBlock;
      if constexpr (T == QType::Q8_0) {
        const __m128i lo = load16(qs), hi = load16(qs + 16), ones = _mm_set1_epi8(1);
        _mm_store_si128(reinterpret_cast<__m128i*>(o), lo);
        _mm_store_si128(reinterpret_cast<__m128i*>(o + 16), hi);
        const __m128i sums = _mm_dpbusd_epi32(_mm_dpbusd_epi32(_mm_setzero_si128(), ones, lo),
                                              ones, hi);  // lane l: its 8 values' sum
        _mm_storeu_si128(reinterpret_cast<__m128i*>(init + (i * nb + b) * kQuad),
                         _mm_sub_epi32(_mm_setzero_si128(), _mm_slli_epi32(sums, 7)));
      } else {
        const __m128i t = load16(qs), mask = _mm_set1_epi8(0x0f);
        _mm_store_si128(reinterpret_cast<__m128i*>(o), _mm_and_si128(t, mask));
        _mm_store_si128(reinterpret_cast<__m128i*>(o + 16),
                        _mm_and_si128(_mm_srli_epi16(t, 4), mask));
      }
    }
  }
}

inline __m512i broadcast_word(const uint8_t* p) {
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return _mm512_set1_epi32(w);
}

// The sums v = ((l0 + l2) + (l1 + l3)) + corr of R weight rows against a chunk's activation
// rows, into ys[i][row] (one vector store per weight row; the caller adds the bias and stores
// them as store() does): per block, the chunk's activations load once for the R rows, each
// row's sixteen block scales are one multiply and its four contract lanes accumulate apart
// (acc[i][l], lane = activation row), as the contract's four lanes; the offset terms sum in
// block order beside them.
template <QType T, int R>
void tile512(const uint8_t* wq, const int32_t* winit, const float* wd, const float* wc,
             const ChunkLayout& x, int64_t nb, float* ys, int64_t ys_stride) {
  constexpr bool kCorrect = Unpacked<T>::kCorrect;
  __m512 acc[R][kQuad], corr[R];
  for (int i = 0; i < R; ++i) {
    corr[i] = _mm512_setzero_ps();
    for (int l = 0; l < kQuad; ++l) acc[i][l] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m512i lo[kQuad], hi[kQuad];
    for (int l = 0; l < kQuad; ++l) {
      lo[l] = x.lo[b * kQuad + l].i();
      hi[l] = x.hi[b * kQuad + l].i();
    }
    const __m512 dx = x.dx[b].f(), sx = x.s[b].f();
    for (int i = 0; i < R; ++i) {
      const uint8_t* w = wq + (i * nb + b) * kBlock;
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(wd[i * nb + b]), dx);
      for (int l = 0; l < kQuad; ++l) {
        __m512i dot;
        if constexpr (T == QType::Q8_0) {  // x + 128 against the signed weights, broadcast
          dot = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(fresh_zero(), lo[l], broadcast_word(w + 4 * l)), hi[l],
              broadcast_word(w + 16 + 4 * l));
          // the lane term added after (a broadcast operand), not held as each start
          dot = _mm512_add_epi32(dot, _mm512_set1_epi32(winit[(i * nb + b) * kQuad + l]));
        } else {
          dot = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(fresh_zero(), broadcast_word(w + 4 * l), lo[l]),
              broadcast_word(w + 16 + 4 * l), hi[l]);
        }
        acc[i][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i][l]);
      }
      if constexpr (kCorrect) {
        corr[i] = _mm512_add_ps(corr[i], _mm512_mul_ps(_mm512_set1_ps(wc[i * nb + b]), sx));
      }
    }
  }
  const __m512 corr_scale = _mm512_set1_ps(Unpacked<T>::kCorrScale);
  for (int i = 0; i < R; ++i) {
    const __m512 sums = _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][2]),
                                      _mm512_add_ps(acc[i][1], acc[i][3]));
    const __m512 y = _mm512_add_ps(sums, kCorrect ? _mm512_mul_ps(corr_scale, corr[i])
                                                  : _mm512_setzero_ps());
    _mm512_store_ps(ys + i * ys_stride, y);
  }
}

// kernels_avx2.cpp's quantize_row a block per two zmm: the same amax, d, rounding (the default
// round-to-nearest-even conversion) and sum, so the same blocks.
void quantize_row512(const float* x, int64_t nb, ActBlock* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) /
                    127.0f;
    const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    _mm_store_si128(reinterpret_cast<__m128i*>(out[b].qs), _mm512_cvtsepi32_epi8(q0));
    _mm_store_si128(reinterpret_cast<__m128i*>(out[b].qs + 16), _mm512_cvtsepi32_epi8(q1));
    out[b].d = d;
    out[b].s = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// exp256 sixteen lanes at a time: the same operations and constants, so the same values.
inline __m512 exp512(__m512 x) {
  using C = ExpConstants;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(C::kMin)), _mm512_set1_ps(C::kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(C::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::kPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                       _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// kernels_avx2.cpp's silu_mul sixteen lanes at a time, the rest as it does them.
void silu_mul512(const float* gate, const float* up, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
    const __m512 den = _mm512_add_ps(one, exp512(minus_g));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_div_ps(g, den), _mm512_loadu_ps(up + i)));
  }
  silu_mul(gate + i, up + i, y + i, n - i);
}

// load_row_scales with 16 blocks at a time: a gather of each block's first 32 bits (fp16 d, then
// Q4_1's m, or the first values, unused), narrowed to 16-bit halves and converted in one
// vcvtph2ps each. The same floats.
template <QType T>
void load_row_scales512(const uint8_t* w_row0, int64_t row_bytes, int rows, int64_t nb,
                        float* wd, float* wc) {
  const int bb = block_bytes(T);
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(bb));
  for (int i = 0; i < rows; ++i) {
    const uint8_t* row = w_row0 + i * row_bytes;
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
      const __m512i words = _mm512_i32gather_epi32(offsets, row + b * bb, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
      _mm512_storeu_ps(wd + i * nb + b, d);
      if constexpr (T == QType::Q4_1) {
        _mm512_storeu_ps(wc + i * nb + b,
                         _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))));
      } else {
        _mm512_storeu_ps(wc + i * nb + b, T == QType::Q4_0 ? d : _mm512_setzero_ps());
      }
    }
    for (; b < nb; ++b) {
      const uint8_t* p = row + b * bb;
      wd[i * nb + b] = Unpacked<T>::d(p);
      wc[i * nb + b] = Unpacked<T>::c(p);
    }
  }
}

// R weight rows from r against every chunk of a block of activation rows (layouts L[0, chunks),
// chunk c holding rows 16 c on): the rows' scales are converted and their blocks unpacked once
// for all the chunks. ys[i][c * 16 + row]: as tile512.
template <QType T, int R>
void rows_against_chunks(const GemmArgs& g, int64_t r, const ChunkLayout* L, int chunks,
                         float* wd, float* wc, uint8_t* wq, int32_t* winit, float* ys,
                         int64_t ys_stride) {
  const int64_t row_bytes = g.nb * block_bytes(T);
  const uint8_t* w = g.w + r * row_bytes;
  load_row_scales512<T>(w, row_bytes, R, g.nb, wd, wc);
  unpack_rows<T>(w, row_bytes, R, g.nb, wq, winit);
  for (int c = 0; c < chunks; ++c) {
    tile512<T, R>(wq, winit, wd, wc, L[c], g.nb, ys + c * kActRowsPerChunk, ys_stride);
  }
}

// out[j0 + j][r0 + i] for i < rows and j < cols from ys[i][j], with store()'s arithmetic:
// (v + bias), added to out when accumulating. Each activation row's outputs are contiguous.
void store_transposed(const GemmArgs& g, const float* ys, int64_t ys_stride, int64_t r0,
                      int64_t rows, int64_t j0, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    float* out = g.out + (j0 + j) * g.out_stride + r0;
    for (int64_t i = 0; i < rows; ++i) {
      const float v = ys[i * ys_stride + j] + (g.bias ? g.bias[r0 + i] : 0.0f);
      out[i] = g.accumulate ? out[i] + v : v;
    }
  }
}

// The narrow tile (GEMV and batches of up to kNarrowRows): 4 * Q weight rows (Q zmm, four rows
// each) against each of C activation rows broadcast, so every (weight row, activation row) pair
// takes one lane group and no lanes go unused whatever C is. Per block the weight rows' fp16
// scales convert once (one vcvtph2ps) and multiply each activation row's (d, s) at once, as
// gemv4_4bit does: row i's block scale d * x.d, and for the 4-bit types its offset term (Q4_1
// m * x.s, Q4_0 d * x.s) summed in a vector. xinit: Q8_0's -128 lane sums, [C][nb].
template <QType T, int Q, int C>
void narrow512(const uint8_t* w_row0, int64_t row_bytes, const ActBlock* x, const Zmm* xinit,
               int64_t nb, const GemmArgs& g, int64_t r) {
  const int bb = block_bytes(T);
  constexpr bool kFourBit = T != QType::Q8_0;
  __m512 acc[Q][C];
  __m256 corr[Q][C];
  for (int q = 0; q < Q; ++q) {
    for (int c = 0; c < C; ++c) {
      acc[q][c] = _mm512_setzero_ps();
      corr[q][c] = _mm256_setzero_ps();
    }
  }
  // Lane 4i + l takes row i's scale: element 2i of (d, c) pairs, element i of d alone.
  const __m512i spread =
      kFourBit ? _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6)
               : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  // The tile reads its 4 * Q rows block by block, streams the hardware prefetcher follows poorly
  // from DRAM: fetch the tile two ahead (contiguous rows) in order, 4 * Q blocks' bytes per block.
  const char* ahead = reinterpret_cast<const char*>(w_row0 + 2 * kQuad * Q * row_bytes);
  const int64_t ahead_step = kQuad * Q * bb;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t off = 0; off < ahead_step; off += 64) {
      _mm_prefetch(ahead + b * ahead_step + off, _MM_HINT_T0);
    }
    for (int q = 0; q < Q; ++q) {
      const uint8_t* p = w_row0 + (kQuad * q) * row_bytes + b * bb;
      __m512i w_lo, w_hi;
      __m128i dw16;  // the four rows' fp16 (d, c) pairs (4-bit types) or d (Q8_0)
      if constexpr (kFourBit) {
        split_nibbles(four_rows(p, row_bytes, qs_offset<T>()), w_lo, w_hi);
        dw16 = _mm_setr_epi32(
            static_cast<int>(scale_pair<T>(p)), static_cast<int>(scale_pair<T>(p + row_bytes)),
            static_cast<int>(scale_pair<T>(p + 2 * row_bytes)),
            static_cast<int>(scale_pair<T>(p + 3 * row_bytes)));
      } else {
        w_lo = flip_sign(four_rows(p, row_bytes, qs_offset<T>()));
        w_hi = flip_sign(four_rows(p, row_bytes, qs_offset<T>() + 16));
        const uint16_t d[4] = {reinterpret_cast<const BlockQ8_0*>(p)->d,
                               reinterpret_cast<const BlockQ8_0*>(p + row_bytes)->d,
                               reinterpret_cast<const BlockQ8_0*>(p + 2 * row_bytes)->d,
                               reinterpret_cast<const BlockQ8_0*>(p + 3 * row_bytes)->d};
        uint64_t d4;
        std::memcpy(&d4, d, sizeof d4);
        dw16 = _mm_cvtsi64_si128(static_cast<long long>(d4));
      }
      const __m256 dw = _mm256_cvtph_ps(dw16);  // Q8_0: the four d in the low half
      for (int c = 0; c < C; ++c) {
        const ActBlock& xb = x[c * nb + b];
        const auto* xqs = reinterpret_cast<const uint8_t*>(xb.qs);
        const __m512i x_lo = _mm512_broadcast_i32x4(load16(xqs));
        const __m512i x_hi = _mm512_broadcast_i32x4(load16(xqs + 16));
        __m512i start;
        __m512 scale;
        if constexpr (kFourBit) {
          start = fresh_zero();
          const __m256 xds =
              _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(&xb.d)));
          const __m256 prod = _mm256_mul_ps(dw, xds);
          corr[q][c] = _mm256_add_ps(corr[q][c], prod);
          scale = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(prod));
        } else {
          start = _mm512_broadcast_i32x4(_mm512_castsi512_si128(xinit[c * nb + b].i()));
          scale = _mm512_permutexvar_ps(
              spread, _mm512_castps128_ps512(_mm_mul_ps(_mm256_castps256_ps128(dw),
                                                        _mm_broadcast_ss(&xb.d))));
        }
        const __m512i dot =
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, w_lo, x_lo), w_hi, x_hi);
        acc[q][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[q][c]);
      }
    }
  }
  for (int q = 0; q < Q; ++q) {
    for (int c = 0; c < C; ++c) {
      alignas(64) float v[16];
      alignas(32) float cs[8];
      _mm512_store_ps(v, acc[q][c]);
      _mm256_store_ps(cs, corr[q][c]);
      for (int i = 0; i < kQuad; ++i) {
        const float off = kFourBit ? Unpacked<T>::kCorrScale * cs[2 * i + 1] : 0.0f;
        store(g, c, r + kQuad * q + i, lane_sum(v, i) + off);
      }
    }
  }
}

// Activation chunks per pass over the weight rows (256 rows): each weight row's scales and
// unpacked blocks serve all of them (Q4_1 at 256 rows: 1.06 -> 1.00 cycles per pair against
// passes of 4 chunks).
constexpr int kChunksPerPass = 16;

constexpr int kNarrowRows = 8;  // products of up to this many activation rows take narrow512

// What prepare512 makes of a product's activations: for up to kNarrowRows rows (read by the
// narrow tile as they are) and Q8_0, each row's blocks' -128 lane sums; for more, the chunk
// layouts of its rows.
struct Prepared {
  std::vector<ChunkLayout> chunks;
  std::vector<Zmm> xinit;  // [m][nb], lane 0 of each
};

int64_t prepare512(GemmArgs& g) {
  thread_local Prepared p;
  const bool q8 = g.qtype == QType::Q8_0;
  g.prepared = &p;
  if (g.m <= kNarrowRows) {
    if (!q8) return 0;
    const size_t size = static_cast<size_t>(g.m * g.nb);
    if (p.xinit.size() < size) p.xinit.resize(size);
    for (size_t i = 0; i < size; ++i) {
      const auto* qs = reinterpret_cast<const uint8_t*>(g.xq[i].qs);
      p.xinit[i].set(q8_init(_mm512_castsi128_si512(load16(qs)),
                             _mm512_castsi128_si512(load16(qs + 16))));
    }
    return 0;
  }
  const int64_t chunks = (g.m + kActRowsPerChunk - 1) / kActRowsPerChunk;
  if (p.chunks.size() < static_cast<size_t>(chunks)) p.chunks.resize(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rows = std::min<int64_t>(kActRowsPerChunk, g.m - c * kActRowsPerChunk);
    size_layout(rows, g.nb, p.chunks[c]);
  }
  return chunks;
}

void prepare_piece512(const GemmArgs& g, int64_t c) {
  auto& p = *static_cast<Prepared*>(const_cast<void*>(g.prepared));
  const int64_t j = c * kActRowsPerChunk;
  fill_layout(g.xq + j * g.nb, std::min<int64_t>(kActRowsPerChunk, g.m - j), g.nb,
              g.qtype == QType::Q8_0, p.chunks[c]);
}

// Weight rows [r, row_end) against the product's C <= kNarrowRows activation rows: narrow tiles
// of 8 (C <= 4) or 4 weight rows, the last few rows (fewer than four) against a chunk layout.
template <QType T, int C>
void narrow_rows(const GemmArgs& g, const Prepared& prep, int64_t r, int64_t row_end,
                 float* wd, float* wc, uint8_t* wq, int32_t* winit) {
  const int64_t row_bytes = g.nb * block_bytes(T);
  const Zmm* xinit = prep.xinit.data();
  if constexpr (C <= 4) {
    for (; r + 2 * kQuad <= row_end; r += 2 * kQuad) {
      narrow512<T, 2, C>(g.w + r * row_bytes, row_bytes, g.xq, xinit, g.nb, g, r);
    }
  }
  for (; r + kQuad <= row_end; r += kQuad) {
    narrow512<T, 1, C>(g.w + r * row_bytes, row_bytes, g.xq, xinit, g.nb, g, r);
  }
  if (r == row_end) return;
  thread_local ChunkLayout rest;
  build_layout(g.xq, C, g.nb, T == QType::Q8_0, rest);
  alignas(64) float ys[kActRowsPerChunk];
  for (; r < row_end; ++r) {
    rows_against_chunks<T, 1>(g, r, &rest, 1, wd, wc, wq, winit, ys, kActRowsPerChunk);
    store_transposed(g, ys, kActRowsPerChunk, r, 1, 0, C);
  }
}

// Weight rows per GEMM tile, which share each chunk's activation loads: four, or two for Q8_0,
// whose lane terms take registers too (measured per type: Q4_1 1.05, Q8_0 1.11-1.14 cycles per
// pair on a Zen 4 core; either type at the other's count 1.23-1.38).
constexpr int kMaxTileRows = 4;
template <QType T>
constexpr int kZmmTileRows = T == QType::Q8_0 ? 2 : 4;

// A thread's per-tile weight data: kZmmTileRows rows' block scales, offset factors, unpacked
// values (kBlock bytes per block) and Q8_0 lane terms (unpack_rows), sized for the product's nb.
struct RowScratch {
  std::vector<float> wd, wc;
  std::vector<Zmm> wq;
  std::vector<int32_t> winit;
  void fit(int64_t nb) {
    const size_t rows = std::max(kQuad, kMaxTileRows);
    if (wd.size() < rows * nb) {
      wd.resize(rows * nb);
      wc.resize(rows * nb);
      wq.resize((kMaxTileRows * nb * kBlock + sizeof(Zmm) - 1) / sizeof(Zmm));
      winit.resize(kMaxTileRows * nb * kQuad);
    }
  }
  uint8_t* unpacked() { return reinterpret_cast<uint8_t*>(wq.data()); }
};

template <QType T>
void gemm_rows512_t(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  const int64_t row_bytes = g.nb * block_bytes(T);
  const Prepared& prep = *static_cast<const Prepared*>(g.prepared);
  thread_local RowScratch scratch;
  scratch.fit(g.nb);
  float *wd = scratch.wd.data(), *wc = scratch.wc.data();
  uint8_t* wq = scratch.unpacked();
  int32_t* winit = scratch.winit.data();
  static_assert(kNarrowRows == 8, "one case per row count below");
  switch (g.m) {
    case 1: return narrow_rows<T, 1>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 2: return narrow_rows<T, 2>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 3: return narrow_rows<T, 3>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 4: return narrow_rows<T, 4>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 5: return narrow_rows<T, 5>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 6: return narrow_rows<T, 6>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 7: return narrow_rows<T, 7>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    case 8: return narrow_rows<T, 8>(g, prep, row_begin, row_end, wd, wc, wq, winit);
    default: break;
  }
  // Per pass of up to kChunksPerPass chunks, kOutRows weight rows at a time: their sums go to ys
  // (a weight row's activation rows contiguous), then out, each activation row's kOutRows
  // outputs together.
  constexpr int64_t kOutRows = 16, kPassRows = kChunksPerPass * kActRowsPerChunk;
  alignas(64) float ys[kOutRows * kPassRows];
  const int chunks = static_cast<int>((g.m + kActRowsPerChunk - 1) / kActRowsPerChunk);
  for (int c0 = 0; c0 < chunks; c0 += kChunksPerPass) {
    const int pass = std::min(kChunksPerPass, chunks - c0);
    const ChunkLayout* layouts = &prep.chunks[c0];
    const int64_t j0 = c0 * kActRowsPerChunk, cols = std::min(kPassRows, g.m - j0);
    for (int64_t r0 = row_begin; r0 < row_end; r0 += kOutRows) {
      const int64_t r1 = std::min(r0 + kOutRows, row_end);
      int64_t r = r0;
      constexpr int kRows = kZmmTileRows<T>;
      for (; r + kRows <= r1; r += kRows) {
        // The next tile's rows (contiguous) into the cache while this one computes.
        const char* next = reinterpret_cast<const char*>(g.w + (r + kRows) * row_bytes);
        for (int64_t off = 0; off < kRows * row_bytes && r + kRows < row_end;
             off += 64) {
          _mm_prefetch(next + off, _MM_HINT_T0);
        }
        rows_against_chunks<T, kRows>(g, r, layouts, pass, wd, wc, wq, winit,
                                              ys + (r - r0) * kPassRows, kPassRows);
      }
      for (; r < r1; ++r) {
        rows_against_chunks<T, 1>(g, r, layouts, pass, wd, wc, wq, winit,
                                  ys + (r - r0) * kPassRows, kPassRows);
      }
      store_transposed(g, ys, kPassRows, r0, r1 - r0, j0, cols);
    }
  }
}

void gemm_rows512(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  switch (g.qtype) {
    case QType::Q4_0: return gemm_rows512_t<QType::Q4_0>(g, row_begin, row_end);
    case QType::Q4_1: return gemm_rows512_t<QType::Q4_1>(g, row_begin, row_end);
    case QType::Q8_0: return gemm_rows512_t<QType::Q8_0>(g, row_begin, row_end);
  }
}

}  // namespace

// W8A8 int8: 64 values of a weight row (+ 128: vpdpbusd's unsigned operand) against the same 64
// of each of up to kInt8Rows512 activation rows, sixteen int32 partial sums per pair summed
// once at the end; sum (w + 128) x - 128 sum x = sum w x, exactly. A tail of k is read masked
// (zeros add nothing).
constexpr int kInt8Rows512 = 8, kInt8WeightRows = 2;

template <int R, int M>
void int8_tile512(const Int8Args& a, int64_t r, int64_t j0) {
  __m512i acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j) acc[i][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = 0; t < a.k; t += 64) {
    const __mmask64 mask = a.k - t >= 64 ? ~__mmask64{0} : (__mmask64{1} << (a.k - t)) - 1;
    __m512i w[R];
    for (int i = 0; i < R; ++i) {
      w[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, a.w + (r + i) * a.k + t), flip);
    }
    for (int j = 0; j < M; ++j) {
      const __m512i x = _mm512_maskz_loadu_epi8(mask, a.xq + (j0 + j) * a.k + t);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w[i], x);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < M; ++j) {
      const int32_t sum = _mm512_reduce_add_epi32(acc[i][j]) - 128 * a.x_sum[j0 + j];
      a.out[(j0 + j) * a.out_stride + r + i] =
          int8_output(sum, a.x_scale[j0 + j], a.w_scale[r + i], a.bias, r + i);
    }
  }
}

template <int R>
void int8_rows512_t(const Int8Args& a, int64_t r) {
  int64_t j = 0;
  for (; j + kInt8Rows512 <= a.m; j += kInt8Rows512) int8_tile512<R, kInt8Rows512>(a, r, j);
  switch (a.m - j) {
    case 0: return;
    case 1: return int8_tile512<R, 1>(a, r, j);
    case 2: return int8_tile512<R, 2>(a, r, j);
    case 3: return int8_tile512<R, 3>(a, r, j);
    case 4: return int8_tile512<R, 4>(a, r, j);
    case 5: return int8_tile512<R, 5>(a, r, j);
    case 6: return int8_tile512<R, 6>(a, r, j);
    default: return int8_tile512<R, 7>(a, r, j);
  }
}

void int8_rows512(const Int8Args& a, int64_t row_begin, int64_t row_end) {
  int64_t r = row_begin;
  for (; r + kInt8WeightRows <= row_end; r += kInt8WeightRows) {
    int8_rows512_t<kInt8WeightRows>(a, r);
  }
  for (; r < row_end; ++r) int8_rows512_t<1>(a, r);
}

const Kernels& avx512vnni_kernels() {
  static const Kernels k{"avx512vnni",   quantize_row512, prepare512,    prepare_piece512,
                         gemm_rows512,   dot_tokens,      sum_tokens,    dot_tokens_f16,
                         sum_tokens_f16, to_f16,          int8_rows512,  exp_sum,
                         silu_mul512,    quantize_row_q8k, kquant_dot_rows_avx2};
  return k;
}

}  // namespace tinyvllm::cpu
