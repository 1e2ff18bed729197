// The fused decoder step: the phases of a layer run one after another on the calling thread, and
// each phase with enough work (projections, attention, large batches' elementwise ops) is split
// over the pool, so a whole step crosses from Python once.
#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>

#include "attention.h"
#include "linear.h"
#include "thread_pool.h"

namespace tinyvllm::cpu {
namespace {

constexpr int64_t kParallelRows = 4;  // elementwise phases with fewer rows stay on the caller
constexpr int64_t kChunksPerThread = 4;

// Buffers reused across steps (guarded by kernel_mutex()).
struct Workspace {
  std::vector<float> normed, qkv, attn, gate_up, act;
  std::vector<ActBlock> xq;
  std::vector<int32_t> row_table, row_ctx;
};

Workspace& workspace() {
  static Workspace ws;
  return ws;
}

// fn(begin, end) over the rows, in chunks on the pool, or on the caller when rows are few.
template <typename Fn>
void for_rows(ThreadPool& workers, int64_t rows, Fn fn) {
  if (rows < kParallelRows || workers.num_threads() == 1) return fn(0, rows);
  workers.run(rows, (rows + kChunksPerThread * workers.num_threads() - 1) /
                       (kChunksPerThread * workers.num_threads()), fn);
}

// x * rsqrt(mean(x^2) + eps) * w, as ops.rms_norm_ref in float32.
void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(dot_lanes(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

void rms_norm(ThreadPool& workers, const float* x, const float* w, float* y, int64_t rows,
              int64_t n, float eps) {
  for_rows(workers, rows, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) rms_norm_row(x + j * n, w, y + j * n, n, eps);
  });
}

// out[rows, n] (+)= x[rows, k] @ dequant(w).T + bias: int8 activations per 32 values against the
// 32-value blocks, per 256 against the K-quants (kquants.cpp), as quantized_linear computes them.
// out has row stride out_stride (n columns written).
void project(const Kernels& kern, ThreadPool& workers, Workspace& ws, const float* x, int64_t k,
             PackedWeight w, const float* bias, float* out, int64_t n, int64_t out_stride,
             int64_t rows, bool accumulate) {
  if (is_kquant(w.qtype)) {
    return kquant_project(kern, workers, x, k, w.w, w.qtype, bias, out, out_stride, rows, n, k,
                          accumulate);
  }
  const int64_t nb = k / kBlock;
  quantize_rows(kern, x, k, rows, nb, ws.xq.data(), workers);
  GemmArgs args{ws.xq.data(), w.w, bias, out, out_stride, rows, nb,
                static_cast<QType>(w.qtype)};
  args.accumulate = accumulate;
  gemm_parallel(kern, args, n, workers);
}

// A stacked projection's shards (n output rows in all), each into its columns of out.
template <size_t N>
void project_shards(const Kernels& kern, ThreadPool& workers, Workspace& ws, const float* x,
                    int64_t k, const PackedShard (&shards)[N], const float* bias, float* out,
                    int64_t n, int64_t rows) {
  int64_t first = 0;
  for (const PackedShard& shard : shards) {
    if (shard.rows == 0) continue;
    project(kern, workers, ws, x, k, shard.weight, bias ? bias + first : nullptr, out + first,
            shard.rows, n, rows, false);
    first += shard.rows;
  }
}

// GPT-NeoX rotary on q and k in place (the halves of each head), then K and V to their slots
// (as IEEE half for a half cache).
void rotary_and_cache(const Kernels& kern, const DecoderShape& s, const StepInputs& step,
                      float* qkv, int64_t width, void* cache, int64_t begin, int64_t end) {
  const int64_t d = s.head_dim, half = d / 2, q_size = s.num_heads * d;
  const int64_t kv_size = s.num_kv_heads * d;
  const int64_t slots = step.num_blocks * step.block_size;
  for (int64_t j = begin; j < end; ++j) {
    float* row = qkv + j * width;
    const float* cos = step.cos_sin + step.positions[j] * d;
    const float* sin = cos + half;
    for (int64_t head = 0; head < s.num_heads + s.num_kv_heads; ++head) {
      float* x = row + head * d;  // q heads, then k heads: contiguous in qkv
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
      }
    }
    const int64_t slot = step.slot_mapping[j];
    if (slot < 0) continue;
    const float* k = row + q_size;
    const float* v = k + kv_size;
    if (step.kv_type == KvType::F16) {
      auto* c = static_cast<uint16_t*>(cache);
      kern.to_f16(k, c + slot * kv_size, kv_size);
      kern.to_f16(v, c + (slots + slot) * kv_size, kv_size);
    } else {
      auto* c = static_cast<float*>(cache);
      std::copy(k, k + kv_size, c + slot * kv_size);
      std::copy(v, v + kv_size, c + (slots + slot) * kv_size);
    }
  }
}

void silu_and_mul(const Kernels& kern, ThreadPool& workers, const float* gate_up, float* act,
                  int64_t rows, int64_t inter) {
  for_rows(workers, rows, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* g = gate_up + j * 2 * inter;
      kern.silu_mul(g, g + inter, act + j * inter, inter);
    }
  });
}

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("decoder_layers: " + what);
}

void check_shape(const DecoderShape& s, const std::vector<LayerParams>& layers) {
  if (s.hidden <= 0 || s.hidden % kBlock || s.intermediate <= 0 || s.intermediate % kBlock ||
      s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads || s.head_dim <= 0 ||
      s.head_dim % 2 || (s.num_heads * s.head_dim) % kBlock) {
    bad("need hidden, intermediate and num_heads * head_dim multiples of 32, an even head_dim "
        "and num_heads a multiple of num_kv_heads; got hidden=" + std::to_string(s.hidden) +
        " intermediate=" + std::to_string(s.intermediate) + " heads=" +
        std::to_string(s.num_heads) + "/" + std::to_string(s.num_kv_heads) + " head_dim=" +
        std::to_string(s.head_dim));
  }
  const int64_t q_size = s.num_heads * s.head_dim;
  const int64_t width = q_size + 2 * s.num_kv_heads * s.head_dim;
  // a projection's type and its k (a K-quant's a multiple of 256: kquant_row_bytes says so)
  auto check_weight = [](PackedWeight w, int64_t k) {
    if (is_kquant(w.qtype)) {
      kquant_row_bytes(w.qtype, k);
    } else {
      check_qtype(w.qtype);
    }
  };
  auto check_shards = [&](const auto& shards, int64_t k, int64_t n, const char* name) {
    int64_t rows = 0;
    for (const PackedShard& shard : shards) {
      if (shard.rows < 0) bad(std::string(name) + ": a shard of negative rows");
      if (shard.rows > 0) check_weight(shard.weight, k);
      rows += shard.rows;
    }
    if (rows != n) {
      bad(std::string(name) + ": shards of " + std::to_string(rows) + " rows in all, expected " +
          std::to_string(n));
    }
  };
  for (const LayerParams& l : layers) {
    check_shards(l.qkv, s.hidden, width, "qkv");
    check_weight(l.o, q_size);
    check_shards(l.gate_up, s.hidden, 2 * s.intermediate, "gate_up");
    check_weight(l.down, s.intermediate);
  }
}

// Checks ids against the cache and tables; fills each query row's table row and context length.
void plan_rows(const StepInputs& st, Workspace& ws) {
  if (st.num_seqs < 0 || st.query_start_loc[0] != 0 ||
      st.query_start_loc[st.num_seqs] > st.num_tokens || st.block_size <= 0) {
    bad("query_start_loc must start at 0 and end within num_tokens " +
        std::to_string(st.num_tokens));
  }
  ws.row_table.assign(st.query_start_loc[st.num_seqs], 0);
  ws.row_ctx.assign(st.query_start_loc[st.num_seqs], 0);
  for (int64_t s = 0; s < st.num_seqs; ++s) {
    const int64_t begin = st.query_start_loc[s], q_len = st.query_start_loc[s + 1] - begin;
    const int64_t ctx = st.seq_lens[s];
    if (q_len < 0 || ctx < q_len || (ctx > 0 && (ctx - 1) / st.block_size >= st.table_stride)) {
      bad("sequence " + std::to_string(s) + " has " + std::to_string(q_len) +
          " new tokens and seq_len " + std::to_string(ctx) + " (table of " +
          std::to_string(st.table_stride) + " blocks)");
    }
    for (int64_t i = 0; ctx > 0 && i <= (ctx - 1) / st.block_size; ++i) {
      const int32_t blk = st.block_tables[s * st.table_stride + i];
      if (blk < 0 || blk >= st.num_blocks) {
        throw std::out_of_range("decoder_layers: block id " + std::to_string(blk) +
                                " outside the cache's " + std::to_string(st.num_blocks));
      }
    }
    for (int64_t i = 0; i < q_len; ++i) {
      ws.row_table[begin + i] = static_cast<int32_t>(s);
      ws.row_ctx[begin + i] = static_cast<int32_t>(ctx - q_len + 1 + i);
    }
  }
  for (int64_t j = 0; j < st.num_tokens; ++j) {
    if (st.positions[j] < 0 || st.positions[j] >= st.max_position ||
        st.slot_mapping[j] >= st.num_blocks * st.block_size) {
      throw std::out_of_range("decoder_layers: token " + std::to_string(j) + " has position " +
                              std::to_string(st.positions[j]) + " and slot " +
                              std::to_string(st.slot_mapping[j]) + " beyond the rotary table "
                              "or the cache");
    }
  }
}

void layer_forward(const Kernels& kern, ThreadPool& workers, Workspace& ws, float* residual,
                   const LayerParams& l, const DecoderShape& s, const StepInputs& st) {
  const int64_t T = st.num_tokens, H = s.hidden, I = s.intermediate;
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  const int64_t width = q_size + 2 * kv_size;
  const int64_t num_rows = st.query_start_loc[st.num_seqs];
  rms_norm(workers, residual, l.input_norm, ws.normed.data(), T, H, s.eps);
  project_shards(kern, workers, ws, ws.normed.data(), H, l.qkv, l.qkv_bias, ws.qkv.data(), width,
                 T);
  for_rows(workers, T, [&](int64_t begin, int64_t end) {
    rotary_and_cache(kern, s, st, ws.qkv.data(), width, l.kv_cache, begin, end);
  });
  const PagedRows rows{ws.attn.data(), ws.qkv.data(), width, l.kv_cache, st.kv_type,
                       st.num_blocks, st.block_size, s.num_kv_heads, s.head_dim, s.num_heads,
                       st.block_tables, st.table_stride, ws.row_table.data(),
                       ws.row_ctx.data(), num_rows, s.scale};
  attend_rows(rows, kern, workers);
  std::fill(ws.attn.begin() + num_rows * q_size, ws.attn.begin() + T * q_size, 0.0f);
  project(kern, workers, ws, ws.attn.data(), q_size, l.o, nullptr, residual, H, H, T, true);
  rms_norm(workers, residual, l.post_norm, ws.normed.data(), T, H, s.eps);
  project_shards(kern, workers, ws, ws.normed.data(), H, l.gate_up, nullptr, ws.gate_up.data(),
                 2 * I, T);
  silu_and_mul(kern, workers, ws.gate_up.data(), ws.act.data(), T, I);
  project(kern, workers, ws, ws.act.data(), I, l.down, nullptr, residual, H, H, T, true);
}

}  // namespace

void decoder_layers(float* residual, float* out, const std::vector<LayerParams>& layers,
                    const float* final_norm, const DecoderShape& shape, const StepInputs& step,
                    const std::string& isa) {
  check_shape(shape, layers);
  const Kernels& kern = select_kernels(isa);
  if (step.num_tokens <= 0) return;
  std::lock_guard<std::mutex> lock(kernel_mutex());
  Workspace& ws = workspace();
  plan_rows(step, ws);
  const int64_t T = step.num_tokens, H = shape.hidden, I = shape.intermediate;
  const int64_t q_size = shape.num_heads * shape.head_dim;
  const int64_t width = q_size + 2 * shape.num_kv_heads * shape.head_dim;
  ws.normed.resize(T * H);
  ws.qkv.resize(T * width);
  ws.attn.resize(T * q_size);
  ws.gate_up.resize(T * 2 * I);
  ws.act.resize(T * I);
  ws.xq.resize(T * std::max({H, I, q_size}) / kBlock);
  ThreadPool& workers = pool();
  for (const LayerParams& l : layers) layer_forward(kern, workers, ws, residual, l, shape, step);
  rms_norm(workers, residual, final_norm, out, T, H, shape.eps);
}

}  // namespace tinyvllm::cpu
