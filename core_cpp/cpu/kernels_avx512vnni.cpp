// The AVX2 kernels with AVX-512 VNNI block dots (vpdpbusd on 256-bit vectors, AVX-512 VL): this
// file is compiled with -mavx512f -mavx512vl -mavx512bw -mavx512vnni besides the AVX2 flags, and
// is called only when the running CPU reports those features. The results are bit-identical to
// the AVX2 and scalar kernels (one block dot contract, kernels_avx2.cpp).
#define TINYVLLM_KERNELS_VNNI 1
#include "kernels_avx2.cpp"
