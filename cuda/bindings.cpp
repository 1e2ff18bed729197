// The pybind11 module tinyvllm._cuda: declarations only. Kernels live in the .cuh headers, size
// checks and instantiation choice in the launcher .cu files (signatures in launchers.h). Pointers
// are torch's data_ptr() values and streams torch's cuda_stream handles; Python wrappers with
// shapes live in service/tinyvllm/ops/*_cuda.py. std::invalid_argument becomes ValueError.
#include <pybind11/pybind11.h>

#include "launchers.h"

namespace py = pybind11;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "tinyvllm CUDA kernels (raw device pointers, sizes and stream handles)";
#ifdef TINYVLLM_CUDA_ARCHS
  // CMAKE_CUDA_ARCHITECTURES of this build, comma-separated: ops/_dispatch.py checks the GPU.
  m.attr("cuda_archs") = TINYVLLM_CUDA_ARCHS;
#endif

  m.def("reshape_and_cache", &tinyvllm::reshape_and_cache, py::arg("key"), py::arg("value"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("num_tokens"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("block_size"), py::arg("key_stride"), py::arg("value_stride"), py::arg("dtype"),
        py::arg("cache_dtype"), py::arg("k_scale"), py::arg("v_scale"), py::arg("stream"));

  // `paged_attention` serves any query lengths (prefill, chunked prefill, mixed batches).
  m.def("paged_attention", &tinyvllm::paged_attention_prefill, py::arg("out"), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("block_size"), py::arg("q_stride_token"), py::arg("q_stride_head"),
        py::arg("max_num_blocks_per_seq"), py::arg("max_query_len"), py::arg("scale"),
        py::arg("k_scale"), py::arg("v_scale"), py::arg("dtype"), py::arg("cache_dtype"),
        py::arg("stream"));

  m.def("paged_attention_decode", &tinyvllm::paged_attention_decode, py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("split_out"), py::arg("split_max"), py::arg("split_sum"),
        py::arg("num_seqs"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("block_size"), py::arg("q_stride_token"), py::arg("q_stride_head"),
        py::arg("max_num_blocks_per_seq"), py::arg("num_splits"), py::arg("partition_size"),
        py::arg("scale"), py::arg("k_scale"), py::arg("v_scale"), py::arg("new_key"),
        py::arg("new_value"), py::arg("new_kv_stride"), py::arg("positions"),
        py::arg("slot_mapping"), py::arg("cos_sin_cache"), py::arg("merge_splits"),
        py::arg("dtype"), py::arg("cache_dtype"), py::arg("stream"));

  m.def("paged_decode_merge", &tinyvllm::paged_decode_merge, py::arg("out"),
        py::arg("split_out"), py::arg("split_max"), py::arg("split_sum"), py::arg("seq_lens"),
        py::arg("num_seqs"), py::arg("num_heads"), py::arg("head_dim"), py::arg("num_splits"),
        py::arg("partition_size"), py::arg("dtype"), py::arg("stream"));

  m.def("rms_norm", &tinyvllm::rms_norm, py::arg("out"), py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("num_tokens"), py::arg("hidden"), py::arg("x_stride"),
        py::arg("residual_stride"), py::arg("out_stride"), py::arg("eps"), py::arg("dtype"),
        py::arg("stream"));

  m.def("silu_and_mul", &tinyvllm::silu_and_mul, py::arg("out"), py::arg("x"),
        py::arg("num_tokens"), py::arg("d"), py::arg("x_stride"), py::arg("out_stride"),
        py::arg("dtype"), py::arg("stream"));

  m.def("rotary_embedding", &tinyvllm::rotary_embedding, py::arg("positions"), py::arg("query"),
        py::arg("key"), py::arg("cos_sin_cache"), py::arg("num_tokens"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("query_stride"),
        py::arg("key_stride"), py::arg("dtype"), py::arg("stream"));

  m.def("rotary_embedding_and_cache", &tinyvllm::rotary_embedding_and_cache,
        py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("cos_sin_cache"), py::arg("num_tokens"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("query_stride"),
        py::arg("key_stride"), py::arg("value_stride"), py::arg("dtype"),
        py::arg("cache_dtype"), py::arg("k_scale"), py::arg("v_scale"), py::arg("stream"));

  m.def("gemv", &tinyvllm::gemv, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("residual"), py::arg("norm_weight"), py::arg("m"), py::arg("n"), py::arg("k"),
        py::arg("x_stride"), py::arg("out_stride"), py::arg("residual_stride"), py::arg("eps"),
        py::arg("prologue"), py::arg("silu_mul_out"), py::arg("prefetch_weight"),
        py::arg("dtype"), py::arg("stream"));

  m.def("gemv_merge", &tinyvllm::gemv_merge, py::arg("out"), py::arg("split_out"),
        py::arg("split_max"), py::arg("split_sum"), py::arg("seq_lens"), py::arg("weight"),
        py::arg("bias"), py::arg("residual"), py::arg("m"), py::arg("n"), py::arg("num_heads"),
        py::arg("head_dim"), py::arg("num_splits"), py::arg("partition_size"),
        py::arg("out_stride"), py::arg("residual_stride"), py::arg("dtype"), py::arg("stream"));

  m.def("sample", &tinyvllm::sample, py::arg("out"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("logits"), py::arg("logits_stride"),
        py::arg("num_rows"), py::arg("vocab_size"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("seed"), py::arg("offset"), py::arg("noise"),
        py::arg("noise_stride"), py::arg("stream"));
  m.def("rejection_sample", &tinyvllm::rejection_sample, py::arg("out"), py::arg("out_stride"),
        py::arg("target_probs"), py::arg("draft_probs"), py::arg("draft_token_ids"),
        py::arg("cu_num_draft"), py::arg("num_reqs"), py::arg("vocab_size"), py::arg("noise"),
        py::arg("uniform"), py::arg("seed"), py::arg("offset"), py::arg("stream"));
}
