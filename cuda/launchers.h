// Launchers of tinyvllm._cuda: plain C++ signatures (device pointers and streams as integers) so that
// bindings.cpp needs neither torch nor CUDA headers. Each launcher checks its sizes, picks the
// template instantiation and throws std::invalid_argument naming the parameter it cannot serve.
#pragma once

#include <cstdint>

#include "dtype.h"  // the codes of every `dtype` / `cache_dtype` argument

namespace tinyvllm {

// The interface version of these launchers. bindings.cpp exports it as `abi_version` and
// ops/_dispatch.py refuses a module whose version is not its CUDA_ABI_VERSION: bump both when a
// launcher's arguments change or a function is added, removed or renamed.
constexpr int kAbiVersion = 13;

using ptr_t = std::uintptr_t;  // a device pointer, as torch's data_ptr() gives it
using stream_t = std::uintptr_t;  // a cudaStream_t, as torch's cuda_stream gives it

// kv_cache.cu: write new K/V rows into the paged cache (KV_CACHE_LAYOUT in ops/kv_cache.py).
// cache_dtype: dtype (a copy) or kFloat8E4M3 (quantised with the float32 scales k_scale /
// v_scale, device pointers; ignored otherwise). The attention launchers take the same trio.
void reshape_and_cache(ptr_t key, ptr_t value, ptr_t key_cache, ptr_t value_cache,
                       ptr_t slot_mapping, int64_t num_tokens, int num_kv_heads, int head_dim,
                       int block_size, int64_t key_stride, int64_t value_stride, int dtype,
                       int cache_dtype, ptr_t k_scale, ptr_t v_scale, stream_t stream);

// attention_decode.cu: one query per sequence, split along the context, then reduced. With cos_sin_cache != 0 the step's new token is fused in: q
// (the query argument) and new_key are rotated at `positions`, new_key / new_value written to
// their cache slots and attended with.
void paged_attention_decode(ptr_t out, ptr_t query, ptr_t key_cache, ptr_t value_cache,
                            ptr_t block_tables, ptr_t seq_lens, ptr_t split_out,
                            ptr_t split_max, ptr_t split_sum, int num_seqs, int num_heads,
                            int num_kv_heads, int head_dim, int block_size,
                            int64_t q_stride_token, int64_t q_stride_head,
                            int max_num_blocks_per_seq, int num_splits, int partition_size,
                            float scale, ptr_t k_scale, ptr_t v_scale, ptr_t new_key,
                            ptr_t new_value, int64_t new_kv_stride, ptr_t positions,
                            ptr_t slot_mapping, ptr_t cos_sin_cache, int merge_splits,
                            int heads_per_cta, int dtype, int cache_dtype, stream_t stream);

// attention_decode.cu: the merge of a split decode's partitions (what paged_attention_decode does
// itself when merge_splits is set): out [num_seqs, num_heads, head_dim].
void paged_decode_merge(ptr_t out, ptr_t split_out, ptr_t split_max, ptr_t split_sum,
                        ptr_t seq_lens, int num_seqs, int num_heads, int head_dim,
                        int num_splits, int partition_size, int dtype, stream_t stream);

// attention_prefill.cu: any number of new queries per sequence, causal over cached + new keys.
void paged_attention_prefill(ptr_t out, ptr_t query, ptr_t key_cache, ptr_t value_cache,
                             ptr_t block_tables, ptr_t seq_lens, ptr_t query_start_loc,
                             int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                             int block_size, int64_t q_stride_token, int64_t q_stride_head,
                             int max_num_blocks_per_seq, int max_query_len, float scale,
                             ptr_t k_scale, ptr_t v_scale, int dtype, int cache_dtype,
                             int prefill_kernel, stream_t stream);

// quant_act.cu: each row of x (dtype) to int8 or fp8 e4m3 (qdtype) with one float32 scale,
// as ops/w8a8_linear.py `quantize_rows`: dynamic (static_scale 0: max(max|row|, min_absmax) /
// scale_divisor) or the static scale at static_scale; values clamped to [qmin, qmax], qmin -qmax
// (fp8) or -qmax - 1 (int8).
void quantize_rows(ptr_t out, ptr_t scales, ptr_t x, ptr_t static_scale, int64_t num_tokens, int k,
                   int64_t x_stride, int64_t out_stride, float qmax, float scale_divisor,
                   float min_absmax, int dtype, int qdtype, stream_t stream);

// quant_act.cu: quantize_rows fused into the op that makes the rows, which are never stored:
// rms_norm_quant is rms_norm (residual <- x + residual where residual != 0) then quantize_rows of
// the normalised rows; silu_and_mul_quant is silu_and_mul of x = [gate | up] then quantize_rows.
// The 8-bit values and scales are those of the two launches bit for bit.
void rms_norm_quant(ptr_t out, ptr_t scales, ptr_t x, ptr_t residual, ptr_t weight,
                    ptr_t static_scale, int64_t num_tokens, int hidden, int64_t x_stride,
                    int64_t residual_stride, int64_t out_stride, float eps, float qmax,
                    float scale_divisor, float min_absmax, int dtype, int qdtype,
                    stream_t stream);
void silu_and_mul_quant(ptr_t out, ptr_t scales, ptr_t x, ptr_t static_scale, int64_t num_tokens,
                        int d, int64_t x_stride, int64_t out_stride, float qmax,
                        float scale_divisor, float min_absmax, int dtype, int qdtype,
                        stream_t stream);

// quant_act.cu: the int8 GEMM's epilogue, out = dtype(float(acc) * x_scale * w_scale (+ bias)).
void rescale_int32(ptr_t out, ptr_t acc, ptr_t x_scale, ptr_t w_scale, ptr_t bias, int64_t m,
                   int n, int64_t acc_stride, int64_t out_stride, int dtype, stream_t stream);

// layers.cu
void rms_norm(ptr_t out, ptr_t x, ptr_t residual, ptr_t weight, int64_t num_tokens, int hidden,
              int64_t x_stride, int64_t residual_stride, int64_t out_stride, float eps, int dtype,
              stream_t stream);
void silu_and_mul(ptr_t out, ptr_t x, int64_t num_tokens, int d, int64_t x_stride,
                  int64_t out_stride, int dtype, stream_t stream);
void rotary_embedding(ptr_t positions, ptr_t query, ptr_t key, ptr_t cos_sin_cache,
                      int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                      int64_t query_stride, int64_t key_stride, int dtype, stream_t stream);
// Rotary on q and k (in place) fused with writing k and v into the paged cache (one launch).
void rotary_embedding_and_cache(ptr_t positions, ptr_t query, ptr_t key, ptr_t value,
                                ptr_t key_cache, ptr_t value_cache, ptr_t slot_mapping,
                                ptr_t cos_sin_cache, int64_t num_tokens, int num_heads,
                                int num_kv_heads, int head_dim, int64_t query_stride,
                                int64_t key_stride, int64_t value_stride, int dtype,
                                int cache_dtype, ptr_t k_scale, ptr_t v_scale, stream_t stream);

// gemv.cu: out[m, n] = act(x) . weight^T (+ bias) (+ residual, in place) for m <= 2 (decode);
// prologue 0 none, 1 rmsnorm(x) * norm_weight, 2 silu(x[:, :k]) * x[:, k:]. silu_mul_out: out
// [m, n / 2] = silu(y[:, :n/2]) * y[:, n/2:] of y = act(x) . weight^T (+ bias). prefetch_weight:
// the whole weight is requested into L2 while the previous kernel runs (for a projection after a
// kernel that leaves the memory bus idle, such as decode attention). mma 1: the tensor-core
// kernel (gemv_mma.cuh) for m <= 16, k a multiple of 64 and (silu_mul_out) n of 16; it prefetches
// nothing ahead. mma 2: the same kernel over any m, in chunks of 16, 8 or 4 rows (the most whose
// activations its staging holds), one row of CTAs per chunk: batch-invariant steps, where every
// row must be computed as it would be alone.
void gemv(ptr_t out, ptr_t x, ptr_t weight, ptr_t bias, ptr_t residual, ptr_t norm_weight,
          int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride,
          int64_t residual_stride, float eps, int prologue, int silu_mul_out, int prefetch_weight,
          int mma, int dtype, stream_t stream);

// gemv.cu: the same with a split decode's partitions, merged in the prologue, as x (o_proj after
// paged_attention_decode with merge_splits = 0): k = num_heads * head_dim. It always follows
// the attention, so it always prefetches its weight.
void gemv_merge(ptr_t out, ptr_t split_out, ptr_t split_max, ptr_t split_sum, ptr_t seq_lens,
                ptr_t weight, ptr_t bias, ptr_t residual, int64_t m, int64_t n, int num_heads,
                int head_dim, int num_splits, int partition_size, int64_t out_stride,
                int64_t residual_stride, int mma, int dtype, stream_t stream);

// quant_gemv.cu: weight-only quantized linear layers over the integer-group layout of
// ops/quant_linear.py (qweight int32 [n, k / (32 / bits)], scales / zeros [n, k / group_size]).
// quant_gemv: out[m, n] = x . w^T (+ bias), the weight dequantized in registers, for m <= 8 (SIMT
// kernel) or m <= 16 (tensor cores: bits 4, k % 64 == 0). method: 0 auto (tensor cores from three
// rows where they fit), 1 SIMT, 2 tensor cores.
void quant_gemv(ptr_t out, ptr_t x, ptr_t qweight, ptr_t scales, ptr_t zeros, ptr_t bias,
                int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride, int bits,
                int group_size, int method, int dtype, stream_t stream);
// quant_dequantize: the weight as dtype [n, k] (for prefill-sized batches and a cuBLAS GEMM).
void quant_dequantize(ptr_t out, ptr_t qweight, ptr_t scales, ptr_t zeros, int64_t n, int64_t k,
                      int bits, int group_size, int dtype, stream_t stream);

// quant_tiles.cu: W4A16 over the tile layout of ops/quant_tiles.py (tiles uint4 [bands][k / 64]
// [32], tile_scales uint2 [bands][k / group_size][8]; group_size k or a power of two >= 64;
// interleaved: band b holds gate rows 8b .. 8b + 7 and up rows n / 2 + 8b ..). quant_tile_gemv:
// out[m, n] = act(x) . w^T (+ bias) on tensor cores for m <= quant_tile_rows(k, rms_norm) (at
// most 16), with gemv's prologues (prologue, norm_weight, eps) and epilogues (residual in place;
// silu_mul_out over an interleaved layout: out[m, n / 2]). Where m rows of the whole k do not fit
// a CTA's shared memory, k is split across `splits` CTAs a band (0: the fewest that fit; not with
// rmsnorm), which add their sums through split_sums (float32, split_sums_len of them; at most
// ceil(n / 16) * splits * 256) and split_counts (uint32 [split_counts_len >= ceil(n / 16)], zero
// before the first launch; each launch leaves them zero).
void quant_tile_gemv(ptr_t out, ptr_t x, ptr_t tiles, ptr_t tile_scales, ptr_t bias,
                     ptr_t residual, ptr_t norm_weight, int64_t m, int64_t n, int64_t k,
                     int64_t x_stride, int64_t out_stride, int64_t residual_stride, float eps,
                     int group_size, int interleaved, int prologue, int silu_mul_out,
                     int splits, ptr_t split_sums, int64_t split_sums_len, ptr_t split_counts,
                     int64_t split_counts_len, int dtype, stream_t stream);
// quant_tile_gemm: out[m, n] = x . w^T (+ bias) on tensor cores for any m (quant_tile_gemm.cuh),
// block_rows (32, 64, 128) rows of x a CTA; k split `splits` ways, each split's float32 sums into
// partial [splits, m, n] (given exactly when splits > 1, with no bias) for the caller to add.
// kernel: 1 the mma.sync kernel, 2 / 4 the wgmma kernel with that many warpgroups a CTA (sm_90a
// image only, block_rows 64 or 128); ops/quant_tiles.gemm_plan names it.
void quant_tile_gemm(ptr_t out, ptr_t partial, ptr_t x, ptr_t tiles, ptr_t tile_scales,
                     ptr_t bias, int64_t m, int64_t n, int64_t k, int64_t x_stride,
                     int64_t out_stride, int group_size, int interleaved, int block_rows,
                     int splits, int kernel, int dtype, stream_t stream);
// quant_tile_rows: the most rows of x (16, 8, 4, 2 or 1; 0 for none) one quant_tile_gemv launch
// serves at k on the current device (rms_norm: with the RMSNorm prologue, k unsplit).
int quant_tile_rows(int64_t k, int rms_norm);
// quant_tile_dequantize: the weight as dtype [n, k] in logical row order (prefill-sized batches).
void quant_tile_dequantize(ptr_t out, ptr_t tiles, ptr_t tile_scales, int64_t n, int64_t k,
                           int group_size, int interleaved, int dtype, stream_t stream);

// gguf_gemv.cu: GGUF Q4_0 / Q4_1 / Q8_0 rows read as stored (qweight uint8 [n, k / 32 * block
// bytes], 4-byte aligned), and Q4_K / Q5_K / Q6_K ones ([n, k / 256 * block bytes], 16-byte
// aligned). gguf_gemv: out[m, n] = act(x) . w^T (+ bias) for m <= 8, with gemv's fusions:
// prologue none (0) or rms_norm (1, norm_weight [k]); residual: out = residual + y in place (0:
// none); silu_mul_out: out[m, n / 2] = silu(gate) * up of gate rows [0, n / 2) and up rows after.
void gguf_gemv(ptr_t out, ptr_t x, ptr_t qweight, ptr_t bias, ptr_t residual, ptr_t norm_weight,
               int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride,
               int64_t residual_stride, float eps, int prologue, int silu_mul_out, int qtype,
               int dtype, stream_t stream);
// gguf_dequantize: rows `rows` (int64 [num_rows]; 0: rows 0 .. num_rows - 1) as dtype
// [num_rows, k], with gguf-py's arithmetic (prefill-sized batches, embedding lookups).
void gguf_dequantize(ptr_t out, ptr_t qweight, ptr_t rows, int64_t num_rows, int64_t k, int qtype,
                     int dtype, stream_t stream);

// sampling.cu: one token per row after penalties (greedy, temperature, top-k, top-p, min-p, the
// exponential race with Philox or given noise), no sort, no host sync. 0 = absent for top_k,
// top_p, min_p; seed and offset only without noise. workspace: partials of split rows.
void sample(ptr_t out, ptr_t workspace, int64_t workspace_bytes, ptr_t logits,
            int64_t logits_stride, int64_t num_rows, int64_t vocab_size, ptr_t temperature,
            ptr_t top_k, ptr_t top_p, ptr_t min_p, ptr_t seed, ptr_t offset, ptr_t noise,
            int64_t noise_stride, stream_t stream);

// spec_decode.cu: speculative decoding's acceptance sampling, one CTA per request (see
// ops/spec_decode.py for the layout). 0 = absent for draft_probs, noise, uniform, seed, offset.
void rejection_sample(ptr_t out, int64_t out_stride, ptr_t target_probs, ptr_t draft_probs,
                      ptr_t draft_token_ids, ptr_t cu_num_draft, int64_t num_reqs,
                      int64_t vocab_size, ptr_t noise, ptr_t uniform, ptr_t seed, ptr_t offset,
                      stream_t stream);

}  // namespace tinyvllm
