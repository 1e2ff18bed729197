// AVX2 + FMA + F16C kernels (this file alone is compiled with -mavx2 -mfma -mf16c; isa.cpp calls
// it only after __builtin_cpu_supports says so). kernels_avx512vnni.cpp compiles it again with
// TINYVLLM_KERNELS_VNNI and AVX-512 enabled, keeping its float helpers and quantize_row and
// replacing its GEMM with 512-bit tiles (same block dot contract, so the same results). The dot
// products are llama.cpp's: unsigned 4-bit (or |int8|) weights times signed int8 activations with
// vpmaddubsw, pairs summed with vpmaddwd, one float FMA per 32-value block and pair of rows. A tile of R weight rows x C activation rows
// shares each weight unpack across C rows and each activation load across R rows.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "kquants.h"

namespace tinyvllm::cpu {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

inline float half(uint16_t h) { return _cvtsh_ss(h); }

void quantize_row(const float* x, int64_t nb, ActBlock* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lane mixing
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(r);
    }
    const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                              _mm256_add_epi32(q[2], q[3])));
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].qs), p8);
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

// The block dot contract, shared by every tile (so a row's result does not depend on the tile or
// batch that computed it) and mirrored by the scalar path: per (weight row, activation row), four
// float lanes; lane l takes block b's integer products of values [4l, 4l + 4) and [16 + 4l,
// 20 + 4l), converted to float and fused-multiply-added with the block's scale d_w * d_x; after
// the last block y = ((l0 + l2) + (l1 + l3)) + corr + bias, where corr is the weight offsets'
// term summed block by block in order: Q4_1 sum(m * s), Q4_0 -8 * sum(d * s), Q8_0 none.
//
// Four lanes (not eight) because the 4-bit types add the two half blocks' vpmaddubsw results
// with one 16-bit add (two products of at most 15 * 127 each, four per sum: no overflow) before
// one 128-bit widening vpmaddwd. On Zen 1 both multiplies issue on one pipe (FP0), one 128-bit
// operation per cycle, so this is 3 FP0 cycles per block pair instead of 4.

// One weight block ready for vpmaddubsw, as two 128-bit halves (values 0-15 and 16-31): unsigned
// nibbles (4-bit types) or |w| plus w for the sign (Q8_0), its scale d, and c (Q4_0: d, Q4_1: m;
// the correction term's factor). Halves, not one 256-bit register: the 4-bit types' nibbles are
// already split that way (low nibbles: values 0-15, high: 16-31), and Zen 1 executes every
// 256-bit operation as two 128-bit ones, so building and folding a 256-bit value only added a
// vinserti128 per unpack and a vextracti128 per block pair.
template <QType T> struct Unpacked;

// An activation block's int8 values 0-15 and 16-31.
struct ActHalves {
  __m128i lo, hi;
  explicit ActHalves(const ActBlock& xb)
      : lo(_mm_load_si128(reinterpret_cast<const __m128i*>(xb.qs))),
        hi(_mm_load_si128(reinterpret_cast<const __m128i*>(xb.qs + 16))) {}
};

struct Nibbles {
  __m128i lo, hi;
  static constexpr bool kCorrect = true;
  Nibbles() = default;  // for the array in tile(); every element is assigned before use
  explicit Nibbles(const uint8_t* qs) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    lo = _mm_and_si128(t, mask);
    hi = _mm_and_si128(_mm_srli_epi16(t, 4), mask);
  }
};

template <> struct Unpacked<QType::Q4_0> : Nibbles {
  static constexpr float kCorrScale = -8.0f;
  static float d(const uint8_t* p) { return half(reinterpret_cast<const BlockQ4_0*>(p)->d); }
  static float c(const uint8_t* p) { return d(p); }
  Unpacked() = default;
  explicit Unpacked(const uint8_t* p) : Nibbles(reinterpret_cast<const BlockQ4_0*>(p)->qs) {}
};

template <> struct Unpacked<QType::Q4_1> : Nibbles {
  static constexpr float kCorrScale = 1.0f;
  static float d(const uint8_t* p) { return half(reinterpret_cast<const BlockQ4_1*>(p)->d); }
  static float c(const uint8_t* p) { return half(reinterpret_cast<const BlockQ4_1*>(p)->m); }
  Unpacked() = default;
  explicit Unpacked(const uint8_t* p) : Nibbles(reinterpret_cast<const BlockQ4_1*>(p)->qs) {}
};

template <> struct Unpacked<QType::Q8_0> {
  __m128i lo, hi, w_lo, w_hi;  // |w| for vpmaddubsw, w whose sign moves onto the activations
  static constexpr bool kCorrect = false;
  static constexpr float kCorrScale = 0.0f;
  static float d(const uint8_t* p) { return half(reinterpret_cast<const BlockQ8_0*>(p)->d); }
  static float c(const uint8_t*) { return 0.0f; }
  Unpacked() = default;  // for the array in tile(); every element is assigned before use
  explicit Unpacked(const uint8_t* p) {
    const auto* b = reinterpret_cast<const BlockQ8_0*>(p);
    w_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
    w_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs + 16));
    lo = _mm_sign_epi8(w_lo, w_lo);
    hi = _mm_sign_epi8(w_hi, w_hi);
  }
};

// The four int32 lanes of the contract for one weight block and one activation block: lane l
// sums the products of values [4l, 4l + 4) (low halves) and [16 + 4l, 20 + 4l) (high halves).
template <QType T>
inline __m128i block_dot4(const Unpacked<T>& w, const ActHalves& x) {
  __m128i x_lo = x.lo, x_hi = x.hi;
  if constexpr (T == QType::Q8_0) {
    x_lo = _mm_sign_epi8(x_lo, w.w_lo);
    x_hi = _mm_sign_epi8(x_hi, w.w_hi);
  }
  const __m128i ones = _mm_set1_epi16(1);
  if constexpr (T == QType::Q8_0) {  // products up to 127 * 128: widen before adding the halves
    return _mm_add_epi32(_mm_madd_epi16(_mm_maddubs_epi16(w.lo, x_lo), ones),
                         _mm_madd_epi16(_mm_maddubs_epi16(w.hi, x_hi), ones));
  } else {
    return _mm_madd_epi16(
        _mm_add_epi16(_mm_maddubs_epi16(w.lo, x_lo), _mm_maddubs_epi16(w.hi, x_hi)), ones);
  }
}

inline float hsum4(__m128 v) {  // (l0 + l2) + (l1 + l3)
  const __m128 s = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline void store(const GemmArgs& g, int64_t j, int64_t r, float v) {
  const float bias = g.bias ? g.bias[r] : 0.0f;
  float& y = g.out[j * g.out_stride + r];
  y = g.accumulate ? y + (v + bias) : v + bias;
}

constexpr int64_t kActRowsPerChunk = 16;  // activation rows kept hot in L1/L2 while weights stream

// What the tiles read besides the blocks, as floats laid out for broadcasts and lane loads:
// R weight rows' block scales d and correction factors c ([R][nb] each, converted from fp16 once
// per row tile and chunk of activations), and the chunk's activation sums s transposed
// ([nb][kActRowsPerChunk]: one load gives a block's s for four activation rows).
struct TileScales {
  const float* wd;
  const float* corr;  // [R][kActRowsPerChunk] at the tile's first activation row
};

template <QType T>
void load_row_scales(const uint8_t* w_row0, int64_t row_bytes, int rows, int64_t nb, float* wd,
                     float* wc) {
  for (int i = 0; i < rows; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w_row0 + i * row_bytes + b * block_bytes(T);
      wd[i * nb + b] = Unpacked<T>::d(p);
      wc[i * nb + b] = Unpacked<T>::c(p);
    }
  }
}

// corr of the contract for R weight rows and the chunk's first 4 * V activation rows, into
// corr[i * kActRowsPerChunk + c]; one lane per activation row, each adding its products in block
// order as a scalar sum would. The V vectors per weight row are independent chains.
template <QType T, int R, int V>
inline void corrections(const float* wc, const float* s_t, int64_t nb, float* corr) {
  constexpr int kVecs = V;
  __m128 sum[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) sum[i][v] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < R; ++i) {
      const __m128 cw = _mm_broadcast_ss(wc + i * nb + b);
      for (int v = 0; v < kVecs; ++v) {
        const __m128 sv = _mm_load_ps(s_t + b * kActRowsPerChunk + 4 * v);
        sum[i][v] = _mm_add_ps(sum[i][v], _mm_mul_ps(cw, sv));
      }
    }
  }
  const __m128 scale = _mm_set1_ps(Unpacked<T>::kCorrScale);
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) {
      _mm_storeu_ps(corr + i * kActRowsPerChunk + 4 * v, _mm_mul_ps(scale, sum[i][v]));
    }
}

// The corrections of a chunk of `rows` activation rows: only the vectors that hold them (a
// verification step's or a small batch's few rows need one or two of the chunk's four).
template <QType T, int R>
inline void chunk_corrections(const float* wc, const float* s_t, int64_t nb, int64_t rows,
                              float* corr) {
  static_assert(kActRowsPerChunk == 16, "four vectors of four rows");
  switch ((rows + 3) / 4) {
    case 1: return corrections<T, R, 1>(wc, s_t, nb, corr);
    case 2: return corrections<T, R, 2>(wc, s_t, nb, corr);
    case 3: return corrections<T, R, 3>(wc, s_t, nb, corr);
    default: return corrections<T, R, 4>(wc, s_t, nb, corr);
  }
}

// out[j + c][r + i] for i < R, c < C: R weight rows from w_row0 (row_bytes apart), C activation
// rows from x0 (nb blocks apart). R * C accumulators of 4 lanes stay in registers.
template <QType T, int R, int C>
void tile(const uint8_t* w_row0, int64_t row_bytes, const ActBlock* x0, int64_t nb,
          const TileScales& ts, const GemmArgs& g, int64_t r, int64_t j) {
  const int bb = block_bytes(T);
  __m128 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    Unpacked<T> w[R];
    for (int i = 0; i < R; ++i) w[i] = Unpacked<T>(w_row0 + i * row_bytes + b * bb);
    for (int c = 0; c < C; ++c) {
      const ActBlock& xb = x0[c * nb + b];
      const ActHalves xv(xb);
      const __m128 dx = _mm_broadcast_ss(&xb.d);
      for (int i = 0; i < R; ++i) {
        const __m128 scale = _mm_mul_ps(_mm_broadcast_ss(ts.wd + i * nb + b), dx);
        acc[i][c] = _mm_fmadd_ps(_mm_cvtepi32_ps(block_dot4<T>(w[i], xv)), scale, acc[i][c]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < C; ++c) {
      const float corr = Unpacked<T>::kCorrect ? ts.corr[i * kActRowsPerChunk + c] : 0.0f;
      store(g, j + c, r + i, hsum4(acc[i][c]) + corr);
    }
  }
}

// The GEMV tile of the 4-bit types, four weight rows against one activation row, with the
// per-block scalar work vectorised: the four rows' fp16 (d, m) pairs (Q4_0: (d, d)) convert in one
// vcvtph2ps and multiply the activation block's (d, s) at once, giving each row's block scale
// d * x.d (even lanes) and its correction term m * x.s (odd lanes, summed in a vector). Same
// products and summation order as tile<T, 4, 1>, so the same results, with fewer instructions.
template <QType T>
inline uint32_t scale_pair(const uint8_t* block) {
  uint16_t d;
  std::memcpy(&d, block, 2);
  if constexpr (T == QType::Q4_0) return d | (static_cast<uint32_t>(d) << 16);
  uint32_t dm;
  std::memcpy(&dm, block, 4);
  return dm;
}

template <QType T>
void gemv4_4bit(const uint8_t* w_row0, int64_t row_bytes, const ActBlock* x, int64_t nb,
                const GemmArgs& g, int64_t r, int64_t j) {
  const int bb = block_bytes(T);
  __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  __m256 corr = _mm256_setzero_ps();
  alignas(32) float scale[8];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w_row0 + b * bb;
    const ActBlock& xb = x[b];
    const ActHalves xv(xb);
    const __m128i dm16 = _mm_setr_epi32(
        static_cast<int>(scale_pair<T>(p)), static_cast<int>(scale_pair<T>(p + row_bytes)),
        static_cast<int>(scale_pair<T>(p + 2 * row_bytes)),
        static_cast<int>(scale_pair<T>(p + 3 * row_bytes)));
    // (d, s) of the activation block in every lane pair (the two floats are adjacent).
    const __m256 xds =
        _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(&xb.d)));
    const __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(dm16), xds);
    corr = _mm256_add_ps(corr, prod);
    _mm256_store_ps(scale, prod);
    for (int i = 0; i < 4; ++i) {
      const Unpacked<T> w(p + i * row_bytes);
      const __m128 dot = _mm_cvtepi32_ps(block_dot4<T>(w, xv));
      acc[i] = _mm_fmadd_ps(dot, _mm_broadcast_ss(&scale[2 * i]), acc[i]);
    }
  }
  alignas(32) float c[8];
  _mm256_store_ps(c, corr);
  for (int i = 0; i < 4; ++i) {
    store(g, j, r + i, hsum4(acc[i]) + Unpacked<T>::kCorrScale * c[2 * i + 1]);
  }
}

// Every C-row group of activations in [j0, j1) against R weight rows from r.
template <QType T, int R, int C>
void tile_cols(const GemmArgs& g, int64_t r, int64_t j0, int64_t j1, const float* s_t,
               float* wd, float* wc) {
  static_assert(C >= 1 && C <= 4, "the remainder below is one tile of 1 to 3 rows");
  const int64_t row_bytes = g.nb * block_bytes(T);
  const uint8_t* w = g.w + r * row_bytes;
  load_row_scales<T>(w, row_bytes, R, g.nb, wd, wc);
  alignas(16) float corr[R * kActRowsPerChunk];
  if constexpr (Unpacked<T>::kCorrect) chunk_corrections<T, R>(wc, s_t, g.nb, j1 - j0, corr);
  int64_t j = j0;
  for (; j + C <= j1; j += C) {
    tile<T, R, C>(w, row_bytes, g.xq + j * g.nb, g.nb, TileScales{wd, corr + j - j0}, g, r, j);
  }
  // The last j1 - j < C rows in one narrower tile, so each weight unpack still serves them all
  // (a verification step's 2-5 rows, a small batch).
  const TileScales rest{wd, corr + j - j0};
  const ActBlock* x = g.xq + j * g.nb;
  switch (j1 - j) {
    case 0: break;
    case 1: tile<T, R, 1>(w, row_bytes, x, g.nb, rest, g, r, j); break;
    case 2: if constexpr (C > 2) { tile<T, R, 2>(w, row_bytes, x, g.nb, rest, g, r, j); } break;
    default: if constexpr (C > 3) { tile<T, R, 3>(w, row_bytes, x, g.nb, rest, g, r, j); } break;
  }
}

// GEMM: 2 weight rows x 4 activation rows, 8 accumulators; each weight unpack is used 4x and each
// activation load 2x. Measured on Zen 1 against 1x8, 3x4, 4x4, 2x8 and 4x2: fastest (the larger
// tiles spill).
constexpr int kTileRows = 2, kTileCols = 4;
constexpr int kGemvRows = 4;  // GEMV: four independent weight rows keep the FMA pipes busy

template <QType T>
void gemm_rows_t(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  const int64_t row_bytes = g.nb * block_bytes(T);
  std::vector<float> s_t(g.nb * kActRowsPerChunk, 0.0f);  // lanes past a short chunk: unused
  std::vector<float> wd(kGemvRows * g.nb), wc(kGemvRows * g.nb);  // for the tallest tile
  for (int64_t j0 = 0; j0 < g.m; j0 += kActRowsPerChunk) {
    const int64_t j1 = j0 + kActRowsPerChunk < g.m ? j0 + kActRowsPerChunk : g.m;
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t b = 0; b < g.nb; ++b) {
        s_t[b * kActRowsPerChunk + j - j0] = g.xq[j * g.nb + b].s;
      }
    }
    int64_t r = row_begin;
    if (j1 - j0 == 1 && T != QType::Q8_0) {  // GEMV of the 4-bit types
      for (; r + 4 <= row_end; r += 4) {
        gemv4_4bit<T>(g.w + r * row_bytes, row_bytes, g.xq + j0 * g.nb, g.nb, g, r, j0);
      }
    } else if (j1 - j0 == 1) {
      for (; r + kGemvRows <= row_end; r += kGemvRows) {
        tile_cols<T, kGemvRows, 1>(g, r, j0, j1, s_t.data(), wd.data(), wc.data());
      }
    } else {
      for (; r + kTileRows <= row_end; r += kTileRows) {
        tile_cols<T, kTileRows, kTileCols>(g, r, j0, j1, s_t.data(), wd.data(), wc.data());
      }
    }
    for (; r < row_end; ++r) {
      tile_cols<T, 1, kTileCols>(g, r, j0, j1, s_t.data(), wd.data(), wc.data());
    }
  }
}

#if !defined(TINYVLLM_KERNELS_VNNI)  // the VNNI build has its own (kernels_avx512vnni.cpp)
void gemm_rows(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  switch (g.qtype) {
    case QType::Q4_0: return gemm_rows_t<QType::Q4_0>(g, row_begin, row_end);
    case QType::Q4_1: return gemm_rows_t<QType::Q4_1>(g, row_begin, row_end);
    case QType::Q8_0: return gemm_rows_t<QType::Q8_0>(g, row_begin, row_end);
  }
}
#endif

// Eight cache values as floats: float32 as they are, IEEE half widened (F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float value(float x) { return x; }
inline float value(uint16_t h) { return half(h); }

template <typename E>
float dot(const float* a, const E* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  }
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * value(b[i]);
  return s;
}

// Eight tokens at a time: eight accumulators, each q load shared, and one transposing reduction
// (hadd) for all eight sums instead of a horizontal sum per token.
template <typename E>
void dot_tokens_t(const float* q, const E* k, int64_t stride, int64_t num_tokens, int64_t d,
                  float scale, float* scores) {
  int64_t t = 0;
  if (d % 8 == 0) {
    for (; t + 8 <= num_tokens; t += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; ++j) {
          acc[j] = _mm256_fmadd_ps(qv, load8(k + (t + j) * stride + i), acc[j]);
        }
      }
      const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]),
                                       _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]),
                                       _mm256_hadd_ps(acc[6], acc[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                        _mm256_permute2f128_ps(h0, h1, 0x31));
      _mm256_storeu_ps(scores + t, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
  }
  for (; t < num_tokens; ++t) scores[t] = dot(q, k + t * stride, d) * scale;
}

// out += sum_t p[t] * v[t]: 64 output values at a time stay in registers across the tokens.
template <typename E>
void sum_tokens_t(const float* p, const E* v, int64_t stride, int64_t num_tokens, int64_t d,
                  float* out) {
  constexpr int kRegs = 8;
  int64_t i = 0;
  for (; i + 8 * kRegs <= d; i += 8 * kRegs) {
    __m256 acc[kRegs];
    for (int r = 0; r < kRegs; ++r) acc[r] = _mm256_loadu_ps(out + i + 8 * r);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const __m256 pt = _mm256_broadcast_ss(p + t);
      const E* vt = v + t * stride + i;
      for (int r = 0; r < kRegs; ++r) acc[r] = _mm256_fmadd_ps(pt, load8(vt + 8 * r), acc[r]);
    }
    for (int r = 0; r < kRegs; ++r) _mm256_storeu_ps(out + i + 8 * r, acc[r]);
  }
  for (; i + 8 <= d; i += 8) {
    __m256 acc = _mm256_loadu_ps(out + i);
    for (int64_t t = 0; t < num_tokens; ++t) {
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), load8(v + t * stride + i), acc);
    }
    _mm256_storeu_ps(out + i, acc);
  }
  for (; i < d; ++i)
    for (int64_t t = 0; t < num_tokens; ++t) out[i] += p[t] * value(v[t * stride + i]);
}

void dot_tokens(const float* q, const float* k, int64_t stride, int64_t num_tokens, int64_t d,
                float scale, float* scores) {
  dot_tokens_t(q, k, stride, num_tokens, d, scale, scores);
}
void sum_tokens(const float* p, const float* v, int64_t stride, int64_t num_tokens, int64_t d,
                float* out) {
  sum_tokens_t(p, v, stride, num_tokens, d, out);
}

// The half-precision helpers take a group of N query heads (GQA) and widen each key or value
// once for all of them; every head's arithmetic is dot_tokens_t's / sum_tokens_t's, so a head's
// result does not depend on the group it is computed in. A group keeps its accumulators (8 per
// head) in registers: 3 heads in the VNNI build's 32 (AVX-512VL), 1 in AVX2's 16 (3 there
// spilled every accumulator to the stack on every token).
#if defined(TINYVLLM_KERNELS_VNNI)
constexpr int64_t kMaxGroup = 3;
#else
constexpr int64_t kMaxGroup = 1;
#endif

template <int N>
void dot_tokens_group(const float* q, const uint16_t* k, int64_t stride, int64_t num_tokens,
                      int64_t d, float scale, float* scores, int64_t scores_stride) {
  int64_t t = 0;
  if (d % 8 == 0) {
    for (; t + 8 <= num_tokens; t += 8) {
      __m256 acc[N][8];
      for (int g = 0; g < N; ++g)
        for (int j = 0; j < 8; ++j) acc[g][j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        for (int j = 0; j < 8; ++j) {
          const __m256 kv = load8(k + (t + j) * stride + i);
          for (int g = 0; g < N; ++g) {
            acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), kv, acc[g][j]);
          }
        }
      }
      for (int g = 0; g < N; ++g) {
        const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]),
                                         _mm256_hadd_ps(acc[g][2], acc[g][3]));
        const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][4], acc[g][5]),
                                         _mm256_hadd_ps(acc[g][6], acc[g][7]));
        const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                          _mm256_permute2f128_ps(h0, h1, 0x31));
        _mm256_storeu_ps(scores + g * scores_stride + t,
                         _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
      }
    }
  }
  for (int g = 0; g < N; ++g) {
    for (int64_t u = t; u < num_tokens; ++u) {
      scores[g * scores_stride + u] = dot(q + g * d, k + u * stride, d) * scale;
    }
  }
}

template <int N>
void sum_tokens_group(const float* p, int64_t p_stride, const uint16_t* v, int64_t stride,
                      int64_t num_tokens, int64_t d, float* out) {
  constexpr int kRegs = 8;
  int64_t i = 0;
  for (; i + 8 * kRegs <= d; i += 8 * kRegs) {
    __m256 acc[N][kRegs];
    for (int g = 0; g < N; ++g)
      for (int r = 0; r < kRegs; ++r) acc[g][r] = _mm256_loadu_ps(out + g * d + i + 8 * r);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const uint16_t* vt = v + t * stride + i;
      __m256 pt[N];  // broadcast once per token, ahead of the accumulators' loop
      for (int g = 0; g < N; ++g) pt[g] = _mm256_broadcast_ss(p + g * p_stride + t);
      for (int r = 0; r < kRegs; ++r) {
        const __m256 vv = load8(vt + 8 * r);
        for (int g = 0; g < N; ++g) acc[g][r] = _mm256_fmadd_ps(pt[g], vv, acc[g][r]);
      }
    }
    for (int g = 0; g < N; ++g)
      for (int r = 0; r < kRegs; ++r) _mm256_storeu_ps(out + g * d + i + 8 * r, acc[g][r]);
  }
  if (i < d) {  // what sum_tokens_t does past its 64-value runs, per head
    for (int g = 0; g < N; ++g) {
      sum_tokens_t(p + g * p_stride, v + i, stride, num_tokens, d - i, out + g * d + i);
    }
  }
}

void dot_tokens_f16(const float* q, int64_t n, const uint16_t* k, int64_t stride,
                    int64_t num_tokens, int64_t d, float scale, float* scores,
                    int64_t scores_stride) {
  for (int64_t g = 0; g < n; g += kMaxGroup) {
    const float* qg = q + g * d;
    float* sg = scores + g * scores_stride;
    switch (std::min(kMaxGroup, n - g)) {
      case 1: dot_tokens_group<1>(qg, k, stride, num_tokens, d, scale, sg, scores_stride); break;
      case 2: dot_tokens_group<2>(qg, k, stride, num_tokens, d, scale, sg, scores_stride); break;
      default: dot_tokens_group<3>(qg, k, stride, num_tokens, d, scale, sg, scores_stride);
    }
  }
}

void sum_tokens_f16(const float* p, int64_t p_stride, int64_t n, const uint16_t* v,
                    int64_t stride, int64_t num_tokens, int64_t d, float* out) {
  for (int64_t g = 0; g < n; g += kMaxGroup) {
    const float* pg = p + g * p_stride;
    float* og = out + g * d;
    switch (std::min(kMaxGroup, n - g)) {
      case 1: sum_tokens_group<1>(pg, p_stride, v, stride, num_tokens, d, og); break;
      case 2: sum_tokens_group<2>(pg, p_stride, v, stride, num_tokens, d, og); break;
      default: sum_tokens_group<3>(pg, p_stride, v, stride, num_tokens, d, og);
    }
  }
}

inline __m128i load16(const int8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// W8A8 int8: each 16 values of a weight row and of up to kInt8Rows activation rows widened to
// 16 bits and multiplied by vpmaddwd (exact: no pair of int8 products leaves int32), the
// weight row's widening shared by the activation rows.
constexpr int kInt8Rows = 4;

template <int M>
void int8_tile(const Int8Args& a, int64_t r, int64_t j0) {
  const int8_t* w = a.w + r * a.k;
  __m256i acc[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= a.k; i += 16) {
    const __m256i wv = _mm256_cvtepi8_epi16(load16(w + i));
    for (int j = 0; j < M; ++j) {
      const __m256i xv = _mm256_cvtepi8_epi16(load16(a.xq + (j0 + j) * a.k + i));
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(xv, wv));
    }
  }
  for (int j = 0; j < M; ++j) {
    int32_t sum = hsum_i32(acc[j]);
    const int8_t* x = a.xq + (j0 + j) * a.k;
    for (int64_t t = i; t < a.k; ++t) sum += static_cast<int32_t>(x[t]) * w[t];
    a.out[(j0 + j) * a.out_stride + r] =
        int8_output(sum, a.x_scale[j0 + j], a.w_scale[r], a.bias, r);
  }
}

void int8_rows(const Int8Args& a, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    int64_t j = 0;
    for (; j + kInt8Rows <= a.m; j += kInt8Rows) int8_tile<kInt8Rows>(a, r, j);
    for (; j < a.m; ++j) int8_tile<1>(a, r, j);
  }
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), h);
  }
  for (; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

// exp(x) for float lanes, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for exp(r), 2^n through the exponent bits. About 2 ulp; inputs clamped to the range
// whose result is a normal float (below it: the smallest normal instead of 0, which a softmax
// or a SiLU cannot tell from 0).
// Its constants, shared with the 512-bit exp (kernels_avx512vnni.cpp), so both compute the same
// values: the clamp, log2(e), ln2 in two parts, and the polynomial from its highest term down.
struct ExpConstants {
  static constexpr float kMin = -87.0f, kMax = 88.0f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

inline __m256 exp256(__m256 x) {
  using C = ExpConstants;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(C::kMin)), _mm256_set1_ps(C::kMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(C::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::kPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

float exp_sum(float* x, int64_t n, float shift) {
  const __m256 sv = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), sv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {  // the tail through the same lanes, padded with -inf's exp (0, not stored)
    alignas(32) float tail[8];
    for (int l = 0; l < 8; ++l) tail[l] = i + l < n ? x[i + l] - shift : -1e30f;
    __m256 e = exp256(_mm256_load_ps(tail));
    e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_load_ps(tail), _mm256_set1_ps(-1e29f),
                                       _CMP_GT_OQ));
    _mm256_store_ps(tail, e);
    for (int l = 0; i + l < n; ++l) x[i + l] = tail[l];
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc);
}

void silu_mul(const float* gate, const float* up, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 den = _mm256_add_ps(one, exp256(_mm256_xor_ps(g, sign)));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g, den), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// K-quant super-block dot products (kquants.h's dot_super_block, the same integers: every sum is
// exact, so the order differs freely) with llama.cpp's instructions: the unsigned 4- to 6-bit
// values times the int8 activations with vpmaddubsw (pairs at most 2 * 63 * 127, no saturation),
// then times the sub-block scales with vpmaddwd into int32 lanes; the float part is kquants.h's.
inline __m256i nibbles_lo(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline __m256i nibbles_hi(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
}
inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// 0x10 where bit `mask` of the qh byte is set (Q5_K's fifth bit), else 0.
inline __m256i fifth_bit(__m256i qh, uint8_t mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m), _mm256_set1_epi8(0x10));
}

// One super-block against C activation rows at once (xs[c]: row c's block): the weight values
// are unpacked once for the C rows. out[c] += the row's term, kquants.h's float expression, so
// a row's result is the same in any tile.
template <int C, bool kFive, typename Block>
inline void dot_q45_k_avx2(const Block& b, const BlockQ8K* const (&xs)[C], float (&out)[C]) {
  __m256i acc[C];
  int32_t summ[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_setzero_si256();
    summ[c] = 0;
  }
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFive) qh = load256(b.qh);
  for (int g = 0; g < 4; ++g) {
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * g, b.scales, &sc0, &m0);
    scale_min_k4(2 * g + 1, b.scales, &sc1, &m1);
    const __m256i q = load256(b.qs + 32 * g);
    __m256i v0 = nibbles_lo(q), v1 = nibbles_hi(q);
    if constexpr (kFive) {
      v0 = _mm256_or_si256(v0, fifth_bit(qh, static_cast<uint8_t>(1u << (2 * g))));
      v1 = _mm256_or_si256(v1, fifth_bit(qh, static_cast<uint8_t>(2u << (2 * g))));
    }
    const __m256i s0 = _mm256_set1_epi16(static_cast<int16_t>(sc0));
    const __m256i s1 = _mm256_set1_epi16(static_cast<int16_t>(sc1));
    for (int c = 0; c < C; ++c) {
      const BlockQ8K& x = *xs[c];
      const __m256i p0 = _mm256_maddubs_epi16(v0, load256(x.qs + 64 * g));
      const __m256i p1 = _mm256_maddubs_epi16(v1, load256(x.qs + 64 * g + 32));
      acc[c] = _mm256_add_epi32(acc[c], _mm256_add_epi32(_mm256_madd_epi16(p0, s0),
                                                         _mm256_madd_epi16(p1, s1)));
      summ[c] += m0 * (x.bsums[4 * g] + x.bsums[4 * g + 1]) +
                 m1 * (x.bsums[4 * g + 2] + x.bsums[4 * g + 3]);
    }
  }
  const float d = half(b.d), dmin = half(b.dmin);
  for (int c = 0; c < C; ++c) {
    out[c] += xs[c]->d * (d * static_cast<float>(hsum_i32(acc[c]))) -
              xs[c]->d * (dmin * static_cast<float>(summ[c]));
  }
}

template <int C>
inline void dot_q6_k_avx2(const BlockQ6_K& b, const BlockQ8K* const (&xs)[C], float (&out)[C]) {
  __m256i acc[C];
  int32_t offset[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_setzero_si256();
    offset[c] = 0;
  }
  const __m256i three = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b.ql + 64 * h;
    const int8_t* scales = b.scales + 8 * h;
    const __m256i lo = load256(ql), hi = load256(ql + 32), qh = load256(b.qh + 32 * h);
    const __m256i low4[4] = {nibbles_lo(lo), nibbles_lo(hi), nibbles_hi(lo), nibbles_hi(hi)};
    for (int p = 0; p < 4; ++p) {  // values [32p, 32p + 32) of the half
      const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), three);
      const __m256i q = _mm256_or_si256(low4[p], _mm256_slli_epi16(top, 4));
      const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * p]),
                                           _mm_set1_epi16(scales[2 * p + 1]));
      for (int c = 0; c < C; ++c) {
        const __m256i prod = _mm256_maddubs_epi16(q, load256(xs[c]->qs + 128 * h + 32 * p));
        acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(prod, sc));
      }
    }
    for (int c = 0; c < C; ++c) {
      for (int j = 0; j < 8; ++j) offset[c] += scales[j] * xs[c]->bsums[8 * h + j];
    }
  }
  const float d = half(b.d);
  for (int c = 0; c < C; ++c) {
    out[c] += xs[c]->d * (d * static_cast<float>(hsum_i32(acc[c]) - 32 * offset[c]));
  }
}

// out[c] = the row's dot with activation row c (x + c * x_stride), for C rows at once.
template <int C, typename Block, typename Dot>
void kquant_tile(const uint8_t* row, const BlockQ8K* x, int64_t x_stride, int64_t num_blocks,
                 float* out, Dot dot) {
  const auto* blocks = reinterpret_cast<const Block*>(row);
  float acc[C] = {};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const BlockQ8K* xs[C];
    for (int c = 0; c < C; ++c) xs[c] = x + c * x_stride + b;
    dot(blocks[b], xs, acc);
  }
  for (int c = 0; c < C; ++c) out[c] = acc[c];
}

template <typename Block, template <int> class Dot>
void kquant_rows(const uint8_t* row, const BlockQ8K* x, int64_t x_stride, int64_t num_rows,
                 int64_t num_blocks, float* out) {
  constexpr int kTile = 4;  // activation rows sharing each unpacked super-block
  int64_t c = 0;
  for (; c + kTile <= num_rows; c += kTile) {
    kquant_tile<kTile, Block>(row, x + c * x_stride, x_stride, num_blocks, out + c, Dot<kTile>{});
  }
  for (; c < num_rows; ++c) {
    kquant_tile<1, Block>(row, x + c * x_stride, x_stride, num_blocks, out + c, Dot<1>{});
  }
}

template <int C> struct DotQ4K {
  void operator()(const BlockQ4_K& b, const BlockQ8K* const (&xs)[C], float (&o)[C]) const {
    dot_q45_k_avx2<C, false>(b, xs, o);
  }
};
template <int C> struct DotQ5K {
  void operator()(const BlockQ5_K& b, const BlockQ8K* const (&xs)[C], float (&o)[C]) const {
    dot_q45_k_avx2<C, true>(b, xs, o);
  }
};
template <int C> struct DotQ6K {
  void operator()(const BlockQ6_K& b, const BlockQ8K* const (&xs)[C], float (&o)[C]) const {
    dot_q6_k_avx2<C>(b, xs, o);
  }
};

void kquant_dot_rows_avx2(int qtype, const uint8_t* row, const BlockQ8K* x, int64_t x_stride,
                          int64_t num_rows, int64_t num_blocks, float* out) {
  switch (static_cast<KQuantType>(qtype)) {
    case KQuantType::Q4_K:
      return kquant_rows<BlockQ4_K, DotQ4K>(row, x, x_stride, num_rows, num_blocks, out);
    case KQuantType::Q5_K:
      return kquant_rows<BlockQ5_K, DotQ5K>(row, x, x_stride, num_rows, num_blocks, out);
    case KQuantType::Q6_K:
      return kquant_rows<BlockQ6_K, DotQ6K>(row, x, x_stride, num_rows, num_blocks, out);
  }
}

}  // namespace

#if !defined(TINYVLLM_KERNELS_VNNI)
const Kernels& avx2_kernels() {
  static const Kernels k{"avx2",         quantize_row,   nullptr,        nullptr,
                         gemm_rows,      dot_tokens,     sum_tokens,     dot_tokens_f16,
                         sum_tokens_f16, to_f16,         int8_rows,      exp_sum,
                         silu_mul,       quantize_row_q8k, kquant_dot_rows_avx2};
  return k;
}
#endif

}  // namespace tinyvllm::cpu
