// Each (sequence, KV head) is one work item for the pool: its group of query heads walks the
// context's blocks twice (scores against K, then the softmax-weighted sum of V), so K and V are
// read once per step and the group shares every read (GQA).
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "linear.h"
#include "thread_pool.h"

namespace tinyvllm::cpu {
namespace {

constexpr int64_t kItemsPerThread = 4;  // fewer (row, KV head) items: split by query head

// A prefetch into L2 that the optimizer keeps: GCC takes a function whose only effect is
// __builtin_prefetch for a pure one and drops its calls.
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The cache lines of the block a walk reads next (its run of `run` bytes per token, `num`
// tokens a token stride apart), fetched in `parts` slices while the current block computes: the
// reads of a block wait on memory otherwise (the hardware prefetcher starts cold at each
// scattered block), and a slice at a time, rather than the whole block at once, leaves the
// miss queues room.
struct NextBlock {
  const char* base = nullptr;
  int64_t num = 0, token_bytes = 0, run = 0;
  void fetch(int64_t part, int64_t parts) const {
    if (!base) return;
    if (run == token_bytes) {  // every KV head of the block: one contiguous run
      const int64_t lines = (num * run + 63) / 64;
      const char* end = base + (part + 1) * lines / parts * 64;
      for (const char* p = base + part * lines / parts * 64; p < end; p += 64) prefetch_l2(p);
      return;
    }
    const int64_t lines_per_token = (run + 63) / 64, lines = num * lines_per_token;
    const int64_t begin = part * lines / parts, end = (part + 1) * lines / parts;
    int64_t t = begin / lines_per_token, j = begin % lines_per_token;
    for (int64_t l = begin; l < end; ++l) {
      prefetch_l2(base + t * token_bytes + j * 64);
      if (++j == lines_per_token) {
        j = 0;
        ++t;
      }
    }
  }
};

// Calls fn(t0, x, num_tokens, next) for each cache block of KV head `head` holding tokens < ctx:
// x is token t0's key (kv = 0) or value (kv = 1), the next ones a token stride (hkv * d) apart;
// next describes the block after it (for the last key block, the first value block) over
// `heads` KV heads.
template <typename E, typename Fn>
inline void for_each_block(const PagedRows& a, const int32_t* table, int64_t ctx, int kv,
                           int64_t head, int64_t heads, Fn fn) {
  const int64_t token_stride = a.hkv * a.d;
  const E* cache = static_cast<const E*>(a.cache);
  auto block = [&](int plane, int64_t i) {
    const int64_t first_slot = (plane * a.num_blocks + table[i]) * a.block_size;
    return cache + first_slot * token_stride + head * a.d;
  };
  for (int64_t t0 = 0, i = 0; t0 < ctx; t0 += a.block_size, ++i) {
    NextBlock next;
    const bool more = t0 + a.block_size < ctx;
    if (more || kv == 0) {
      const int64_t t1 = more ? t0 + a.block_size : 0;
      next.base = reinterpret_cast<const char*>(block(more ? kv : 1, more ? i + 1 : 0));
      next.num = std::min(a.block_size, ctx - t1);
      next.token_bytes = token_stride * static_cast<int64_t>(sizeof(E));
      next.run = heads * a.d * static_cast<int64_t>(sizeof(E));
    }
    fn(t0, block(kv, i), std::min(a.block_size, ctx - t0), next);
  }
}

// The kernels' helpers over one cache block for the n query heads of KV head hd: the float32
// ones a head at a time, the half ones for all n at once (each value widened once). Each call
// first fetches its share of the next block (`next`, in heads * n slices).
inline void dot_block(const Kernels& kern, const float* q, int64_t n, const float* k,
                      int64_t stride, int64_t num, int64_t d, float scale, float* scores,
                      int64_t scores_stride, const NextBlock& next, int64_t hd, int64_t heads) {
  for (int64_t g = 0; g < n; ++g) {
    next.fetch(hd * n + g, heads * n);
    kern.dot_tokens(q + g * d, k, stride, num, d, scale, scores + g * scores_stride);
  }
}
inline void dot_block(const Kernels& kern, const float* q, int64_t n, const uint16_t* k,
                      int64_t stride, int64_t num, int64_t d, float scale, float* scores,
                      int64_t scores_stride, const NextBlock& next, int64_t hd, int64_t heads) {
  for (int64_t g = 0; g < n; ++g) next.fetch(hd * n + g, heads * n);
  kern.dot_tokens_f16(q, n, k, stride, num, d, scale, scores, scores_stride);
}
inline void sum_block(const Kernels& kern, const float* p, int64_t p_stride, int64_t n,
                      const float* v, int64_t stride, int64_t num, int64_t d, float* out,
                      const NextBlock& next, int64_t hd, int64_t heads) {
  for (int64_t g = 0; g < n; ++g) {
    next.fetch(hd * n + g, heads * n);
    kern.sum_tokens(p + g * p_stride, v, stride, num, d, out + g * d);
  }
}
inline void sum_block(const Kernels& kern, const float* p, int64_t p_stride, int64_t n,
                      const uint16_t* v, int64_t stride, int64_t num, int64_t d, float* out,
                      const NextBlock& next, int64_t hd, int64_t heads) {
  for (int64_t g = 0; g < n; ++g) next.fetch(hd * n + g, heads * n);
  kern.sum_tokens_f16(p, p_stride, n, v, stride, num, d, out);
}

// Query heads [g0, g1) of each KV head in [head0, head0 + heads), for query row `row`: the
// context's blocks are walked once for all of them (scores against K, then the softmax-weighted
// sum of V). A query head's arithmetic does not depend on which others share the walk. E: the
// cache's element type (float, or uint16_t for IEEE half).
template <typename E>
void attend_one(const PagedRows& a, const Kernels& kern, int64_t row, int64_t head0, int64_t g0,
                int64_t g1, std::vector<float>& scores, int64_t heads) {
  const int64_t group = a.h / a.hkv, ctx = a.row_ctx[row], d = a.d, n = g1 - g0;
  const int64_t stride = a.hkv * d;
  const int32_t* table = a.tables + (a.row_table ? a.row_table[row] : row) * a.table_stride;
  scores.resize(heads * n * ctx);
  const float* q_row = a.q + row * a.q_stride;
  for_each_block<E>(a, table, ctx, 0, head0, heads,
                    [&](int64_t t0, const E* k, int64_t num, const NextBlock& next) {
    for (int64_t hd = 0; hd < heads; ++hd) {
      const float* q0 = q_row + ((head0 + hd) * group + g0) * d;
      dot_block(kern, q0, n, k + hd * d, stride, num, d, a.scale,
                scores.data() + hd * n * ctx + t0, ctx, next, hd, heads);
    }
  });
  for (int64_t g = 0; g < heads * n; ++g) {  // softmax per query head
    float* s = scores.data() + g * ctx;
    const float inv = 1.0f / kern.exp_sum(s, ctx, *std::max_element(s, s + ctx));
    for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
  }
  float* out_row = a.out + row * a.h * d;
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* o0 = out_row + ((head0 + hd) * group + g0) * d;
    std::fill(o0, o0 + n * d, 0.0f);
  }
  for_each_block<E>(a, table, ctx, 1, head0, heads,
                    [&](int64_t t0, const E* v, int64_t num, const NextBlock& next) {
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* o0 = out_row + ((head0 + hd) * group + g0) * d;
      sum_block(kern, scores.data() + hd * n * ctx + t0, ctx, n, v + hd * d, stride, num, d,
                o0, next, hd, heads);
    }
  });
}

template <typename E>
void attend_rows_t(const PagedRows& a, const Kernels& kern, ThreadPool& workers) {
  const int64_t group = a.h / a.hkv;
  if (a.num_rows >= kItemsPerThread * workers.num_threads()) {
    // One item per row, all its KV heads block by block: each cache block's keys (then values)
    // are read as one contiguous run of block_size * hkv * d values, not as runs of d values a
    // token stride apart per KV head.
    workers.run(a.num_rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t row = begin; row < end; ++row) {
        attend_one<E>(a, kern, row, 0, 0, group, scores, a.hkv);
      }
    });
    return;
  }
  // One item per (row, KV head), whose query heads share every K/V read; with few such items
  // (a decode of one or two sequences) one per query head instead, so every thread has work.
  const int64_t split = a.num_rows * a.hkv < kItemsPerThread * workers.num_threads() ? group : 1;
  const int64_t items = a.num_rows * a.hkv * split;
  workers.run(items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i / split, g0 = i % split * (group / split);
      attend_one<E>(a, kern, pair / a.hkv, pair % a.hkv, g0, g0 + group / split, scores, 1);
    }
  });
}

}  // namespace

void paged_decode_attention(float* out, const float* q, int64_t q_stride, const void* cache,
                            KvType kv_type, int64_t num_blocks, int64_t block_size, int64_t hkv,
                            int64_t d, int64_t h, const int32_t* block_tables,
                            int64_t table_stride, const int32_t* seq_lens, int64_t b,
                            float scale) {
  if (hkv <= 0 || h % hkv != 0 || d <= 0 || block_size <= 0 || b < 0) {
    throw std::invalid_argument("paged_decode_attention: need num_heads a multiple of "
                                "num_kv_heads and positive sizes, got h=" + std::to_string(h) +
                                " hkv=" + std::to_string(hkv) + " d=" + std::to_string(d));
  }
  for (int64_t s = 0; s < b; ++s) {
    const int64_t ctx = seq_lens[s];
    if (ctx <= 0 || (ctx - 1) / block_size >= table_stride) {
      throw std::invalid_argument("paged_decode_attention: sequence " + std::to_string(s) +
                                  " has seq_len " + std::to_string(ctx) + ", beyond its table");
    }
    for (int64_t i = 0; i <= (ctx - 1) / block_size; ++i) {
      const int32_t blk = block_tables[s * table_stride + i];
      if (blk < 0 || blk >= num_blocks) {
        throw std::out_of_range("paged_decode_attention: block id " + std::to_string(blk) +
                                " outside the cache's " + std::to_string(num_blocks));
      }
    }
  }
  const PagedRows a{out, q, q_stride, cache, kv_type, num_blocks, block_size, hkv, d, h,
                    block_tables, table_stride, nullptr, seq_lens, b, scale};
  const Kernels& kern = select_kernels("auto");
  std::lock_guard<std::mutex> lock(kernel_mutex());
  attend_rows(a, kern, pool());
}

void attend_rows(const PagedRows& a, const Kernels& kern, ThreadPool& workers) {
  if (a.kv_type == KvType::F16) return attend_rows_t<uint16_t>(a, kern, workers);
  attend_rows_t<float>(a, kern, workers);
}

}  // namespace tinyvllm::cpu
