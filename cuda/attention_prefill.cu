// Launcher for paged prefill attention: checks sizes, picks the kernel and its instantiation.
//
// Kernels: the wgmma kernel (attention_prefill_sm90.cuh) where the sm_90a image runs and the
// cache has the query's dtype; the mma.sync kernel (attention_prefill.cuh) everywhere else, or
// when asked for (prefill_kernel = 1: tests and benches compare the two).
// Instantiations: {float16, bfloat16} x cache {same, FP8 E4M3} x head_dim {64, 128} (8 kernels)
// of the mma.sync kernel, {float16, bfloat16} x head_dim {64, 128} of the wgmma one; block size
// 16 (the engine's shapes).
#include "attention_args.h"
#include "attention_prefill.cuh"
#include "attention_prefill_sm90.cuh"
#include "launchers.h"

namespace tinyvllm {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// One prefill kernel's launch: grid (heads, query tiles of kBlockM, sequences). Templated on the
// kernel itself so that each raises its shared-memory limit once.
template <auto kKernel, size_t kSmem, int kThreads, int kBlockM>
void launch(const PrefillParams& p, int num_seqs, int max_query_len, cudaStream_t stream,
            const char* name) {
  static const cudaError_t smem_ok = cudaFuncSetAttribute(
      kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  check_cuda(smem_ok, name);
  const dim3 grid(p.num_heads, (max_query_len + kBlockM - 1) / kBlockM, num_seqs);
  kKernel<<<grid, kThreads, kSmem, stream>>>(p);
  check_launch(name);
}

template <typename T, typename Cache, int HEAD_DIM>
void launch_prefill(const PrefillParams& p, int num_seqs, int max_query_len,
                    cudaStream_t stream) {
  launch<paged_prefill_kernel<T, Cache, HEAD_DIM>,
         PrefillSmem<HEAD_DIM, is_fp8_cache<Cache>()>::kBytes, kPrefillThreads, kPrefillBlockM>(
      p, num_seqs, max_query_len, stream, "paged_prefill_kernel");
}

template <typename T, int HEAD_DIM>
void launch_prefill_sm90(const PrefillParams& p, int num_seqs, int max_query_len,
                         cudaStream_t stream) {
  launch<paged_prefill_sm90_kernel<T, HEAD_DIM>, Sm90PrefillSmem<HEAD_DIM>::kBytes,
         kSm90Threads, kSm90BlockM>(p, num_seqs, max_query_len, stream,
                                    "paged_prefill_sm90_kernel");
}

template <typename T, typename Cache>
void dispatch_head_dim(const PrefillParams& p, int num_seqs, int head_dim, int max_query_len,
                       bool sm90, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, Cache>) {
    if (sm90) {
      if (head_dim == 64) {
        launch_prefill_sm90<T, 64>(p, num_seqs, max_query_len, stream);
      } else {
        launch_prefill_sm90<T, 128>(p, num_seqs, max_query_len, stream);
      }
      return;
    }
  }
  if (head_dim == 64) {
    launch_prefill<T, Cache, 64>(p, num_seqs, max_query_len, stream);
  } else {
    launch_prefill<T, Cache, 128>(p, num_seqs, max_query_len, stream);
  }
}

void check_prefill_args(const PrefillParams& p, int num_seqs, int head_dim, int block_size,
                        int max_query_len, int dtype, int cache_dtype, int prefill_kernel) {
  const std::string where = "paged_attention_prefill: ";
  check_attention_args(p, where, num_seqs, head_dim, block_size, dtype, cache_dtype);
  require(max_query_len > 0, where + "max_query_len=" + std::to_string(max_query_len) +
                                 " must be positive");
  require(prefill_kernel == 0 || prefill_kernel == 1,
          where + "prefill_kernel=" + std::to_string(prefill_kernel) +
              " must be 0 (the fastest for the device) or 1 (mma.sync)");
}

}  // namespace

void paged_attention_prefill(
    ptr_t out,              // [num_tokens, num_heads, head_dim] contiguous
    ptr_t query,            // [num_tokens, num_heads, head_dim] strides (q_stride_token, q_stride_head, 1)
    ptr_t key_cache,        // [num_blocks, block_size, num_kv_heads, head_dim]
    ptr_t value_cache,      // [num_blocks, block_size, num_kv_heads, head_dim]
    ptr_t block_tables,     // [num_seqs, max_num_blocks_per_seq] int32
    ptr_t seq_lens,         // [num_seqs] int32
    ptr_t query_start_loc,  // [num_seqs + 1] int32
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int64_t q_stride_token, int64_t q_stride_head, int max_num_blocks_per_seq, int max_query_len,
    float scale,
    ptr_t k_scale,          // [1] float32, read when cache_dtype is FP8
    ptr_t v_scale,          // [1] float32, read when cache_dtype is FP8
    int dtype, int cache_dtype,
    int prefill_kernel,     // 0: the wgmma kernel where it applies; 1: the mma.sync kernel
    stream_t stream) {
  PrefillParams p{};
  p.out = reinterpret_cast<void*>(out);
  p.query = reinterpret_cast<const void*>(query);
  p.key_cache = reinterpret_cast<const void*>(key_cache);
  p.value_cache = reinterpret_cast<const void*>(value_cache);
  p.k_scale = reinterpret_cast<const float*>(k_scale);
  p.v_scale = reinterpret_cast<const float*>(v_scale);
  p.block_tables = reinterpret_cast<const int*>(block_tables);
  p.seq_lens = reinterpret_cast<const int*>(seq_lens);
  p.query_start_loc = reinterpret_cast<const int*>(query_start_loc);
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group_size = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  p.q_stride_token = q_stride_token;
  p.q_stride_head = q_stride_head;
  p.max_num_blocks_per_seq = max_num_blocks_per_seq;
  p.scale_log2 = scale * kLog2e;
  check_prefill_args(p, num_seqs, head_dim, block_size, max_query_len, dtype, cache_dtype,
                     prefill_kernel);
  const cudaStream_t s = as_stream(stream);
  // The Hopper kernel exists only in the sm_90a image (its body traps in any other).
  const bool sm90 = prefill_kernel == 0 && device_has_pdl_code();
  TINYVLLM_DISPATCH_HALF(dtype, "paged_attention_prefill", {
    if (cache_dtype == kFloat8E4M3) {
      dispatch_head_dim<scalar_t, fp8_e4m3>(p, num_seqs, head_dim, max_query_len, false, s);
    } else {
      dispatch_head_dim<scalar_t, scalar_t>(p, num_seqs, head_dim, max_query_len, sm90, s);
    }
  });
}

}  // namespace tinyvllm
