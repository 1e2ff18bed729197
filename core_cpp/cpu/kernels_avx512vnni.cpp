// The AVX-512 VNNI kernels: kernels_avx2.cpp's float helpers and quantize_row compiled again with
// -mavx512f -mavx512vl -mavx512bw -mavx512vnni, and a GEMM of 512-bit tiles. Called only when
// the running CPU reports those features. The results are bit-identical to the AVX2 and scalar
// kernels: every tile below follows kernels_avx2.cpp's block dot contract.
//
// A zmm register holds four 128-bit lanes, each one (weight row, activation row) pair's four
// contract lanes: the GEMM puts four activation rows side by side against one weight row
// broadcast to all four, the GEMV four weight rows against one activation row broadcast. So one
// vpdpbusd does four pairs' half-block products, and the float scale, FMA and offset terms run
// sixteen lanes at a time: about 1.25 zmm operations per (block, weight row, activation row)
// against about 6 xmm operations in the 128-bit tiles.
#define TINYVLLM_KERNELS_VNNI 1
// GCC 12's avx512fintrin.h initialises its "undefined" operands from themselves, which
// -Wmaybe-uninitialized reports at every inlined intrinsic.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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

// A chunk of up to 16 activation rows laid out for the GEMM tile: for block b and group q (rows
// 4q .. 4q + 3 of the chunk), lo / hi hold the four rows' values 0-15 / 16-31 in 128-bit lanes,
// dx their scales (lane 4c + l: row 4q + c's d), and for Q8_0 init the term that undoes the
// weights' +128 (below): -128 times each contract lane's sum of activations. s[b] holds the 16
// rows' activation sums s (lane c: row c), for the 4-bit types' offset terms. Rows past the
// chunk are zeros: their lanes compute 0 and are not stored.
struct ChunkLayout {
  std::vector<Zmm> lo, hi, init, dx;  // [nb * groups]
  std::vector<Zmm> s;                 // [nb]
  int groups = 0;
};

// -128 * (the contract's lane sums of an activation block's int8 values), for the unsigned Q8_0
// weights w + 128: sum (w + 128) * x - 128 * sum x = sum w * x, in exact integers.
inline __m512i q8_init(__m512i lo, __m512i hi) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo),
                                           ones, hi);
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
}

// Sizes L for `rows` activation rows (not thread-safe: vectors grow); fill_layout writes it.
void size_layout(int64_t rows, int64_t nb, ChunkLayout& L) {
  L.groups = static_cast<int>((rows + kQuad - 1) / kQuad);
  const size_t size = static_cast<size_t>(nb * L.groups);
  if (L.lo.size() < size) {
    L.lo.resize(size);
    L.hi.resize(size);
    L.init.resize(size);
    L.dx.resize(size);
  }
  if (L.s.size() < static_cast<size_t>(nb)) L.s.resize(nb);
}

void fill_layout(const ActBlock* x0, int64_t rows, int64_t nb, bool q8, ChunkLayout& L) {
  const int groups = L.groups;
  for (int64_t b = 0; b < nb; ++b) {
    float* s = reinterpret_cast<float*>(L.s[b].bytes);
    if (rows < kActRowsPerChunk) L.s[b].set(_mm512_setzero_ps());
    for (int q = 0; q < groups; ++q) {
      const size_t at = static_cast<size_t>(b * groups + q);
      Zmm &lo = L.lo[at], &hi = L.hi[at];
      if ((q + 1) * kQuad > rows) {  // a last group with rows past the chunk: zeros there
        lo.set(_mm512_setzero_si512());
        hi.set(_mm512_setzero_si512());
        L.dx[at].set(_mm512_setzero_ps());
      }
      float* dx = reinterpret_cast<float*>(L.dx[at].bytes);
      for (int c = 0; c < kQuad && q * kQuad + c < rows; ++c) {
        const int64_t row = q * kQuad + c;
        const ActBlock& xb = x0[row * nb + b];
        std::memcpy(lo.bytes + 16 * c, xb.qs, 16);
        std::memcpy(hi.bytes + 16 * c, xb.qs + 16, 16);
        for (int l = 0; l < 4; ++l) dx[4 * c + l] = xb.d;
        s[row] = xb.s;
      }
      if (q8) L.init[at].set(q8_init(lo.i(), hi.i()));
    }
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

// Signed bytes w -> unsigned w + 128, for vpdpbusd's unsigned operand.
inline __m512i flip_sign(__m512i w) {
  return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// 16 bytes at offset `off` of four rows `row_bytes` apart, one row per 128-bit lane.
inline __m512i four_rows(const uint8_t* p, int64_t row_bytes, size_t off) {
  __m512i t = _mm512_castsi128_si512(load16(p + off));
  t = _mm512_inserti32x4(t, load16(p + row_bytes + off), 1);
  t = _mm512_inserti32x4(t, load16(p + 2 * row_bytes + off), 2);
  return _mm512_inserti32x4(t, load16(p + 3 * row_bytes + off), 3);
}

// One weight block's halves broadcast to all four lanes, unsigned for vpdpbusd: the 4-bit types'
// nibbles, Q8_0's values + 128 (xor 0x80).
template <QType T>
inline void weight_halves(const uint8_t* p, __m512i& lo, __m512i& hi) {
  if constexpr (T == QType::Q8_0) {
    const uint8_t* qs = p + qs_offset<T>();
    lo = flip_sign(_mm512_broadcast_i32x4(load16(qs)));
    hi = flip_sign(_mm512_broadcast_i32x4(load16(qs + 16)));
  } else {
    split_nibbles(_mm512_broadcast_i32x4(load16(p + qs_offset<T>())), lo, hi);
  }
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

// The contract's offset terms of R weight rows against the chunk's 16 activation rows, one lane
// per activation row, summed in block order; zeros for Q8_0 (which has none, but whose sums
// add them all the same, as the scalar path adds 0). Laid out [i][row] for one weight row,
// [row][i] for four (the epilogue's 128-bit stores).
template <QType T, int R>
void corrections512(const float* wc, const ChunkLayout& L, int64_t nb, float* corr) {
  __m512 sum[R];
  for (int i = 0; i < R; ++i) sum[i] = _mm512_setzero_ps();
  if constexpr (Unpacked<T>::kCorrect) {
    for (int64_t b = 0; b < nb; ++b) {
      for (int i = 0; i < R; ++i) {
        const __m512 term = _mm512_mul_ps(_mm512_set1_ps(wc[i * nb + b]), L.s[b].f());
        sum[i] = _mm512_add_ps(sum[i], term);
      }
    }
    const __m512 scale = _mm512_set1_ps(Unpacked<T>::kCorrScale);
    for (int i = 0; i < R; ++i) sum[i] = _mm512_mul_ps(scale, sum[i]);
  }
  if constexpr (R == 1) {
    _mm512_storeu_ps(corr, sum[0]);
  } else {
    alignas(64) float t[R][kActRowsPerChunk];
    for (int i = 0; i < R; ++i) _mm512_store_ps(t[i], sum[i]);
    for (int row = 0; row < kActRowsPerChunk; ++row)
      for (int i = 0; i < R; ++i) corr[row * R + i] = t[i][row];
  }
}

// The epilogue of a tile of four weight rows, sixteen lanes at a time with store()'s arithmetic:
// each 128-bit lane's sum (l0 + l2) + (l1 + l3) (two in-lane swaps and adds leave it in all
// four elements), the four weight rows' sums of an activation row blended into one lane, then
// + corr, + bias, (+ out), and each activation row's four outputs stored as one 128-bit value.
// corr: [row][4] (corrections512's transposed layout).
template <int G>
inline void store_quads(const __m512 (&acc)[kQuad][G], const float* corr, const GemmArgs& g,
                        int64_t r, int64_t j0, int64_t rows) {
  const __m512 bias =
      g.bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(g.bias + r)) : _mm512_setzero_ps();
  for (int q = 0; q < G; ++q) {
    __m512 sums[kQuad];
    for (int i = 0; i < kQuad; ++i) {
      // l0 + l2, l1 + l3, then their sum in every element of the lane
      const __m512 t = _mm512_add_ps(acc[i][q], _mm512_permute_ps(acc[i][q], 0x4e));
      sums[i] = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));
    }
    __m512 y = _mm512_mask_blend_ps(0x2222, sums[0], sums[1]);
    y = _mm512_mask_blend_ps(0x4444, y, sums[2]);
    y = _mm512_mask_blend_ps(0x8888, y, sums[3]);
    y = _mm512_add_ps(_mm512_add_ps(y, _mm512_loadu_ps(corr + q * 16)), bias);
    alignas(64) float v[16];
    _mm512_store_ps(v, y);
    for (int c = 0; c < kQuad && q * kQuad + c < rows; ++c) {
      float* out = g.out + (j0 + q * kQuad + c) * g.out_stride + r;
      __m128 o = _mm_load_ps(v + 4 * c);
      if (g.accumulate) o = _mm_add_ps(_mm_loadu_ps(out), o);
      _mm_storeu_ps(out, o);
    }
  }
}

// out[j0 + row][r + i] for i < R and the chunk's `rows` activation rows (G groups of four).
template <QType T, int R, int G>
void tile512(const uint8_t* w_row0, int64_t row_bytes, const ChunkLayout& L, int64_t nb,
             const float* wd, const float* corr, const GemmArgs& g, int64_t r, int64_t j0,
             int64_t rows) {
  const int bb = block_bytes(T);
  __m512 acc[R][G];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < G; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // The chunk's activations of block b stay in registers across the R weight rows (loads, not
    // the multiplies, bound a tile that reads them per row).
    __m512i lo[G], hi[G], init[G];
    __m512 dx[G];
    for (int q = 0; q < G; ++q) {
      lo[q] = L.lo[b * G + q].i();
      hi[q] = L.hi[b * G + q].i();
      dx[q] = L.dx[b * G + q].f();
      init[q] = T == QType::Q8_0 ? L.init[b * G + q].i() : _mm512_setzero_si512();
    }
    for (int i = 0; i < R; ++i) {
      __m512i w_lo, w_hi;
      weight_halves<T>(w_row0 + i * row_bytes + b * bb, w_lo, w_hi);
      const __m512 dw = _mm512_set1_ps(wd[i * nb + b]);
      for (int q = 0; q < G; ++q) {
        const __m512i start = T == QType::Q8_0 ? init[q] : fresh_zero();
        const __m512i dot =
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, w_lo, lo[q]), w_hi, hi[q]);
        acc[i][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[q]), acc[i][q]);
      }
    }
  }
  if constexpr (R == kQuad) {
    store_quads<G>(acc, corr, g, r, j0, rows);
  } else {
    for (int i = 0; i < R; ++i) {
      for (int q = 0; q < G; ++q) {
        alignas(64) float v[16];
        _mm512_store_ps(v, acc[i][q]);
        for (int c = 0; c < kQuad && q * kQuad + c < rows; ++c) {
          const int row = q * kQuad + c;
          store(g, j0 + row, r + i, lane_sum(v, c) + corr[i * kActRowsPerChunk + row]);
        }
      }
    }
  }
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
// chunk c holding rows j0 + 16 c on): the rows' scales are converted once for all the chunks.
template <QType T, int R>
void rows_against_chunks(const GemmArgs& g, int64_t r, const ChunkLayout* L, int chunks,
                         int64_t j0, float* wd, float* wc) {
  const int64_t row_bytes = g.nb * block_bytes(T);
  const uint8_t* w = g.w + r * row_bytes;
  load_row_scales512<T>(w, row_bytes, R, g.nb, wd, wc);
  alignas(64) float corr[R * kActRowsPerChunk];
  for (int c = 0; c < chunks; ++c) {
    const int64_t j = j0 + c * kActRowsPerChunk;
    const int64_t rows = std::min<int64_t>(kActRowsPerChunk, g.m - j);
    corrections512<T, R>(wc, L[c], g.nb, corr);
    switch (L[c].groups) {
      case 1: tile512<T, R, 1>(w, row_bytes, L[c], g.nb, wd, corr, g, r, j, rows); break;
      case 2: tile512<T, R, 2>(w, row_bytes, L[c], g.nb, wd, corr, g, r, j, rows); break;
      case 3: tile512<T, R, 3>(w, row_bytes, L[c], g.nb, wd, corr, g, r, j, rows); break;
      default: tile512<T, R, 4>(w, row_bytes, L[c], g.nb, wd, corr, g, r, j, rows); break;
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

constexpr int kChunksPerPass = 4;  // activation chunks (64 rows) per pass over the weight rows

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
                 float* wd, float* wc) {
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
  for (; r < row_end; ++r) rows_against_chunks<T, 1>(g, r, &rest, 1, 0, wd, wc);
}

template <QType T>
void gemm_rows512_t(const GemmArgs& g, int64_t row_begin, int64_t row_end) {
  const int64_t row_bytes = g.nb * block_bytes(T);
  const Prepared& prep = *static_cast<const Prepared*>(g.prepared);
  thread_local std::vector<float> wd, wc;
  if (wd.size() < static_cast<size_t>(kQuad * g.nb)) {
    wd.resize(kQuad * g.nb);
    wc.resize(kQuad * g.nb);
  }
  static_assert(kNarrowRows == 8, "one case per row count below");
  switch (g.m) {
    case 1: return narrow_rows<T, 1>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 2: return narrow_rows<T, 2>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 3: return narrow_rows<T, 3>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 4: return narrow_rows<T, 4>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 5: return narrow_rows<T, 5>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 6: return narrow_rows<T, 6>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 7: return narrow_rows<T, 7>(g, prep, row_begin, row_end, wd.data(), wc.data());
    case 8: return narrow_rows<T, 8>(g, prep, row_begin, row_end, wd.data(), wc.data());
    default: break;
  }
  const int chunks = static_cast<int>((g.m + kActRowsPerChunk - 1) / kActRowsPerChunk);
  for (int c0 = 0; c0 < chunks; c0 += kChunksPerPass) {
    const int pass = std::min(kChunksPerPass, chunks - c0);
    const ChunkLayout* layouts = &prep.chunks[c0];
    const int64_t j0 = c0 * kActRowsPerChunk;
    int64_t r = row_begin;
    for (; r + kQuad <= row_end; r += kQuad) {
      // The next tile's rows (contiguous) into the cache while this one computes.
      const char* next = reinterpret_cast<const char*>(g.w + (r + kQuad) * row_bytes);
      for (int64_t off = 0; off < kQuad * row_bytes && r + kQuad < row_end; off += 64) {
        _mm_prefetch(next + off, _MM_HINT_T0);
      }
      rows_against_chunks<T, kQuad>(g, r, layouts, pass, j0, wd.data(), wc.data());
    }
    for (; r < row_end; ++r) {
      rows_against_chunks<T, 1>(g, r, layouts, pass, j0, wd.data(), wc.data());
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

const Kernels& avx512vnni_kernels() {
  static const Kernels k{"avx512vnni",   quantize_row,   prepare512,     prepare_piece512,
                         gemm_rows512,   dot_tokens,     sum_tokens,     dot_tokens_f16,
                         sum_tokens_f16, to_f16,         exp_sum,        silu_mul};
  return k;
}

}  // namespace tinyvllm::cpu
