// quantized_linear: y = x @ dequant(w).T + bias with x quantized per 32-value block on the fly.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "kernels.h"
#include "thread_pool.h"

namespace tinyvllm::cpu {

// The kernels for `isa`: "auto" (the best this CPU runs), "avx2" or "scalar". The environment
// variable TINYVLLM_CPU_ISA, when set, replaces "auto". Raises std::invalid_argument for an
// unknown name or an instruction set this CPU (or this build) lacks.
const Kernels& select_kernels(const std::string& isa);
std::string best_isa();

// Serialises kernel calls and pool changes (the GIL is released while a kernel runs).
std::mutex& kernel_mutex();

// Shape: x [m, x_stride] float (k used), w [n, k / 32 * block_bytes(qtype)] bytes (K-quants:
// [n, k / 256 * super-block bytes]), bias [n] or null, out [m, out_stride] float (n written).
// The K-quant types (Q4_K, Q5_K, Q6_K) go to kquant_linear.
void quantized_linear(const float* x, int64_t x_stride, const uint8_t* w, int qtype,
                      const float* bias, float* out, int64_t out_stride, int64_t m, int64_t n,
                      int64_t k, const std::string& isa);

// W8A8 int8 (ops/w8a8_linear.py): each row of x quantized to int8 with its own scale
// (max(max|row|, 1e-10) / scale_divisor, an IEEE float32 division; or *input_scale, static),
// clamped to [-128, 127], rounded half to even, as the torch reference does; then
// out = (float(xq @ w.T) * x_scale) * w_scale + bias. scale_divisor is the checkpoint's
// convention: 127 (vLLM's) or 127.5 (compressed-tensors').
// Shape: x [m, x_stride] float (k used), w [n, k] int8, w_scale [n], input_scale [] or null,
// bias [n] or null, out [m, out_stride] (n written).
void int8_linear(const float* x, int64_t x_stride, const int8_t* w, const float* w_scale,
                 const float* input_scale, float scale_divisor, const float* bias, float* out,
                 int64_t out_stride, int64_t m, int64_t n, int64_t k, const std::string& isa);

// Rows `row_ids` of a packed [num_rows, k] matrix as float (embedding lookup). Shape:
// w [num_rows, k / 32 * block_bytes], row_ids [num_ids], out [num_ids, k].
void dequantize_rows(const uint8_t* w, int qtype, int64_t num_rows, int64_t k,
                     const int64_t* row_ids, int64_t num_ids, float* out);

QType check_qtype(int qtype);

// K-quants (kquants.cpp): whether qtype is Q4_K / Q5_K / Q6_K; the bytes of one packed row of k
// values (raises std::invalid_argument unless k is a positive multiple of 256).
bool is_kquant(int qtype);
int64_t kquant_row_bytes(int qtype, int64_t k);
// quantized_linear for the K-quants: activations int8 per 256 values, integer dot products over
// the packed super-blocks (kquants.h). Shapes as quantized_linear's.
void kquant_linear(const float* x, int64_t x_stride, const uint8_t* w, int qtype,
                   const float* bias, float* out, int64_t out_stride, int64_t m, int64_t n,
                   int64_t k, const std::string& isa);
// out[m, n] (+= with accumulate) x @ dequant(w).T + bias over K-quant rows, on the pool, the
// caller holding kernel_mutex(): kquant_linear's work, and the fused decoder step's projections.
void kquant_project(const Kernels& kern, ThreadPool& workers, const float* x, int64_t x_stride,
                    const uint8_t* w, int qtype, const float* bias, float* out,
                    int64_t out_stride, int64_t m, int64_t n, int64_t k, bool accumulate);
// dequantize_rows for the K-quants, row ids already checked.
void kquant_dequantize_rows(const uint8_t* w, int qtype, int64_t k, const int64_t* row_ids,
                            int64_t num_ids, float* out);

// The steps of quantized_linear, for callers that hold kernel_mutex() (the fused decoder):
// x [m, x_stride] -> xq [m, nb] activation blocks; then args' n output rows split by worker.
void quantize_rows(const Kernels& kern, const float* x, int64_t x_stride, int64_t m, int64_t nb,
                   ActBlock* xq, ThreadPool& workers);
void gemm_parallel(const Kernels& kern, GemmArgs args, int64_t n, ThreadPool& workers);

}  // namespace tinyvllm::cpu
