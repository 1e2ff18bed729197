// The GGUF block GEMV's RMSNorm-prologue instantiations (gguf_gemv_launch.cuh), compiled beside
// gguf_gemv.cu's.
#include "gguf_gemv_launch.cuh"

namespace tinyvllm {

template void gguf_gemv_prologue<__half, kGemvRmsNorm>(const GgufGemvArgs<__half>&, int,
                                                       cudaStream_t);
template void gguf_gemv_prologue<__nv_bfloat16, kGemvRmsNorm>(const GgufGemvArgs<__nv_bfloat16>&,
                                                              int, cudaStream_t);

}  // namespace tinyvllm
