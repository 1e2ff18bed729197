// The pybind11 module tinyvllm._cuda: declarations only. Kernels live in the .cuh headers, size
// checks and instantiation choice in the launcher .cu files (signatures in launchers.h). Pointers
// are torch's data_ptr() values and streams torch's cuda_stream handles; Python wrappers with
// shapes live in service/tinyvllm/ops/*_cuda.py and name every argument they pass (see
// def_launcher). std::invalid_argument becomes ValueError.
#include <pybind11/pybind11.h>

#include "launchers.h"

namespace py = pybind11;

namespace {

// m.def(name, launcher) with its arguments named, and the names recorded in the module's
// `arg_names` (name -> tuple). ops/_dispatch.py wraps each launcher in a keyword-only Python
// function made from them, which calls the binding positionally: Python checks the names, and
// the call stays cheap (pybind11's own keyword matching made a 32-argument call ~6x slower).
template <typename Launcher, typename... Names>
void def_launcher(py::module_& m, const char* name, Launcher* launcher, Names... names) {
  m.def(name, launcher, py::arg(names)...);
  m.attr("arg_names")[name] = py::make_tuple(names...);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "tinyvllm CUDA kernels (raw device pointers, sizes and stream handles)";
#ifdef TINYVLLM_CUDA_ARCHS
  // CMAKE_CUDA_ARCHITECTURES of this build, comma-separated: ops/_dispatch.py checks the GPU.
  m.attr("cuda_archs") = TINYVLLM_CUDA_ARCHS;
#endif
  // What ops/_dispatch.py checks before any kernel runs (a stale build is refused).
  m.attr("abi_version") = tinyvllm::kAbiVersion;
  py::enum_<tinyvllm::DTypeCode> dtypes(
      m, "DType", "Codes of the dtype / cache_dtype arguments, named as torch's dtypes");
  for (tinyvllm::DTypeCode code : tinyvllm::kAllDTypes) {
    dtypes.value(tinyvllm::dtype_name(code), code);
  }
  m.attr("arg_names") = py::dict();

  def_launcher(m, "reshape_and_cache", &tinyvllm::reshape_and_cache, "key", "value", "key_cache",
               "value_cache", "slot_mapping", "num_tokens", "num_kv_heads", "head_dim",
               "block_size", "key_stride", "value_stride", "dtype", "cache_dtype", "k_scale",
               "v_scale", "stream");

  // `paged_attention` serves any query lengths (prefill, chunked prefill, mixed batches).
  def_launcher(m, "paged_attention", &tinyvllm::paged_attention_prefill, "out", "query",
               "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc",
               "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size", "q_stride_token",
               "q_stride_head", "max_num_blocks_per_seq", "max_query_len", "scale", "k_scale",
               "v_scale", "dtype", "cache_dtype", "prefill_kernel", "stream");

  def_launcher(m, "paged_attention_decode", &tinyvllm::paged_attention_decode, "out", "query",
               "key_cache", "value_cache", "block_tables", "seq_lens", "split_out", "split_max",
               "split_sum", "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size",
               "q_stride_token", "q_stride_head", "max_num_blocks_per_seq", "num_splits",
               "partition_size", "scale", "k_scale", "v_scale", "new_key", "new_value",
               "new_kv_stride", "positions", "slot_mapping", "cos_sin_cache", "merge_splits",
               "heads_per_cta", "dtype", "cache_dtype", "stream");

  def_launcher(m, "paged_decode_merge", &tinyvllm::paged_decode_merge, "out", "split_out",
               "split_max", "split_sum", "seq_lens", "num_seqs", "num_heads", "head_dim",
               "num_splits", "partition_size", "dtype", "stream");

  def_launcher(m, "rms_norm", &tinyvllm::rms_norm, "out", "x", "residual", "weight", "num_tokens",
               "hidden", "x_stride", "residual_stride", "out_stride", "eps", "dtype", "stream");

  def_launcher(m, "quantize_rows", &tinyvllm::quantize_rows, "out", "scales", "x", "static_scale",
               "num_tokens", "k", "x_stride", "out_stride", "qmax", "scale_divisor", "min_absmax",
               "dtype", "qdtype", "stream");
  def_launcher(m, "rms_norm_quant", &tinyvllm::rms_norm_quant, "out", "scales", "x", "residual",
               "weight", "static_scale", "num_tokens", "hidden", "x_stride", "residual_stride",
               "out_stride", "eps", "qmax", "scale_divisor", "min_absmax", "dtype", "qdtype",
               "stream");
  def_launcher(m, "silu_and_mul_quant", &tinyvllm::silu_and_mul_quant, "out", "scales", "x",
               "static_scale", "num_tokens", "d", "x_stride", "out_stride", "qmax",
               "scale_divisor", "min_absmax", "dtype", "qdtype", "stream");
  def_launcher(m, "rescale_int32", &tinyvllm::rescale_int32, "out", "acc", "x_scale", "w_scale",
               "bias", "m", "n", "acc_stride", "out_stride", "dtype", "stream");

  def_launcher(m, "silu_and_mul", &tinyvllm::silu_and_mul, "out", "x", "num_tokens", "d",
               "x_stride", "out_stride", "dtype", "stream");

  def_launcher(m, "rotary_embedding", &tinyvllm::rotary_embedding, "positions", "query", "key",
               "cos_sin_cache", "num_tokens", "num_heads", "num_kv_heads", "head_dim",
               "query_stride", "key_stride", "dtype", "stream");

  def_launcher(m, "rotary_embedding_and_cache", &tinyvllm::rotary_embedding_and_cache, "positions",
               "query", "key", "value", "key_cache", "value_cache", "slot_mapping", "cos_sin_cache",
               "num_tokens", "num_heads", "num_kv_heads", "head_dim", "query_stride", "key_stride",
               "value_stride", "dtype", "cache_dtype", "k_scale", "v_scale", "stream");

  def_launcher(m, "gemv", &tinyvllm::gemv, "out", "x", "weight", "bias", "residual", "norm_weight",
               "m", "n", "k", "x_stride", "out_stride", "residual_stride", "eps", "prologue",
               "silu_mul_out", "prefetch_weight", "mma", "dtype", "stream");

  def_launcher(m, "quant_gemv", &tinyvllm::quant_gemv, "out", "x", "qweight", "scales", "zeros",
               "bias", "m", "n", "k", "x_stride", "out_stride", "bits", "group_size", "method",
               "dtype", "stream");
  def_launcher(m, "quant_dequantize", &tinyvllm::quant_dequantize, "out", "qweight", "scales",
               "zeros", "n", "k", "bits", "group_size", "dtype", "stream");
  def_launcher(m, "quant_tile_gemv", &tinyvllm::quant_tile_gemv, "out", "x", "tiles",
               "tile_scales", "bias", "residual", "norm_weight", "m", "n", "k", "x_stride",
               "out_stride", "residual_stride", "eps", "group_size", "interleaved", "prologue",
               "silu_mul_out", "splits", "split_sums", "split_sums_len", "split_counts",
               "split_counts_len", "dtype", "stream");
  def_launcher(m, "quant_tile_gemm", &tinyvllm::quant_tile_gemm, "out", "partial", "x", "tiles",
               "tile_scales", "bias", "m", "n", "k", "x_stride", "out_stride", "group_size",
               "interleaved", "block_rows", "splits", "kernel", "dtype", "stream");
  def_launcher(m, "quant_tile_rows", &tinyvllm::quant_tile_rows, "k", "rms_norm");
  def_launcher(m, "quant_tile_dequantize", &tinyvllm::quant_tile_dequantize, "out", "tiles",
               "tile_scales", "n", "k", "group_size", "interleaved", "dtype", "stream");
  def_launcher(m, "gguf_gemv", &tinyvllm::gguf_gemv, "out", "x", "qweight", "bias", "residual",
               "norm_weight", "m", "n", "k", "x_stride", "out_stride", "residual_stride", "eps",
               "prologue", "silu_mul_out", "qtype", "dtype", "stream");
  def_launcher(m, "gguf_dequantize", &tinyvllm::gguf_dequantize, "out", "qweight", "rows",
               "num_rows", "k", "qtype", "dtype", "stream");
  def_launcher(m, "gemv_merge", &tinyvllm::gemv_merge, "out", "split_out", "split_max", "split_sum",
               "seq_lens", "weight", "bias", "residual", "m", "n", "num_heads", "head_dim",
               "num_splits", "partition_size", "out_stride", "residual_stride", "mma", "dtype",
               "stream");

  def_launcher(m, "sample", &tinyvllm::sample, "out", "workspace", "workspace_bytes", "logits",
               "logits_stride", "num_rows", "vocab_size", "temperature", "top_k", "top_p", "min_p",
               "seed", "offset", "noise", "noise_stride", "stream");
  def_launcher(m, "rejection_sample", &tinyvllm::rejection_sample, "out", "out_stride",
               "target_probs", "draft_probs", "draft_token_ids", "cu_num_draft", "num_reqs",
               "vocab_size", "noise", "uniform", "seed", "offset", "stream");
}
