// Warpgroup matrix multiply-accumulate (wgmma, sm_90a only) and the shared-memory descriptors it
// reads: the helpers the Hopper prefill attention kernel needs. Framework-free device code.
//
// Operands in shared memory are tiles in the 128-byte swizzle layout: rows of 64 16-bit elements
// (128 bytes), 8 rows form a 1024-byte atom, and the 16-byte chunk c of row r sits at chunk
// c ^ (r % 8). A tile wider than 64 elements is stored as column blocks of 64, one after the
// other (`sw128_offset`). A wgmma reads such a tile through a descriptor (PTX ISA, "Matrix
// Descriptor Format"): start address, leading and stride byte offsets, swizzle mode.
// - K-major operand (rows along M or N, K contiguous; Q and K here): a k-step of 16 elements
//   starts 32 bytes further inside the 128-byte row; 8-row groups are SBO = 1024 bytes apart.
// - MN-major operand (rows along K, N contiguous; V here, with the transpose bit): 8-row groups
//   along K are SBO = 1024 bytes apart, 64-element column blocks along N are LBO apart.
// Only the sm_90a pass defines the MMA wrappers; other architectures never call them.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace tinyvllm {

// Byte offset of the 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile of `rows` rows.
__host__ __device__ constexpr uint32_t sw128_offset(int row, int chunk, int rows) {
  return uint32_t(chunk / 8) * rows * 128 + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
}

// Descriptor of a 128-byte-swizzled operand at shared address `addr` (atoms 1024-byte aligned).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lbo & 0x3FFFF) >> 4) << 16 |
         uint64_t((sbo & 0x3FFFF) >> 4) << 32 | uint64_t(1) << 62;
}

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Orders this thread's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's shared-memory writes (cp.async included) visible to the async proxy
// that wgmma reads through; before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// 2^x on the special-function unit (one instruction; -inf gives 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory barriers (mbarrier) for a producer/consumer pipeline inside one CTA. A phase
// completes when `count` threads have arrived; waiters name the parity of the phase they wait
// for, and waiting on parity 1 of a fresh barrier returns at once (the phase "before" phase 0).
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// The same where `pred` holds, by a predicated instruction: no branch splits the warp before its
// next wgmma (the .aligned instructions need the whole warp converged).
__device__ __forceinline__ void mbarrier_arrive_if(uint32_t bar, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
      "r"(int(pred))
      : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
  // Labels are local to the braces, so every inlined copy may reuse them.
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed (the barrier's count
// includes this arrival: .noinc). The copies are generic-proxy writes: a consumer fences
// (fence_proxy_async_smem) after its wait, before its wgmma reads them.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Named barriers 1..15 (0 is __syncthreads): sync waits for `threads` arrivals in all, arrive
// counts this warp's threads and goes on.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Moves registers between warpgroups (the kernel needs a register cap: __launch_bounds__(n, 1)).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Pins registers at this point of the program: the compiler neither reads accumulators a running
// wgmma still writes before the wait that precedes this, nor reuses A registers it still reads.
template <int K>
__device__ __forceinline__ void reg_fence(float (&r)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int K, int J>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[K][J]) {
#pragma unroll
  for (int i = 0; i < K; ++i) {
#pragma unroll
    for (int j = 0; j < J; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// d[64 x N] (+)= A[64 x 16] B[16 x N]; A and B K-major in shared memory; scale_d 0 overwrites d.
// Per thread d holds N / 2 floats in the mma.sync C layout of its warp's 16 rows.
template <typename T, int N>
__device__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d);
// d[64 x N] += A[64 x 16] B[16 x N]; A in registers (the mma.sync A fragment of the warp's 16
// rows), B in shared memory: MN-major (kTransB 1, a transposed read; V here) or K-major
// (kTransB 0; the rows of x of the W4A16 GEMM, quant_tile_gemm.cuh).
template <typename T, int N> struct WgmmaRs;  // run<kTransB>(d, a, desc_b), one per (type, N)
template <typename T, int N, int kTransB = 1>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  WgmmaRs<T, N>::template run<kTransB>(d, a, desc_b);
}

// The fixed-shape operand lists of m64nNk16 with float32 accumulators: N / 2 floats a thread,
// operands 0 .. N / 2 - 1 of the asm; X0 .. X5 number the operands after them.
#define TINYVLLM_WGMMA_REGS_32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TINYVLLM_WGMMA_REGS_64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define TINYVLLM_WGMMA_D_32                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),           \
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),           \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define TINYVLLM_WGMMA_D_64                                                                    \
  TINYVLLM_WGMMA_D_32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),      \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),           \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),           \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),           \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),           \
      "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// wgmma_ss<T, N> and WgmmaRs<T, N> for one (type, N): PTX type TY, F = N / 2 accumulators.
#define TINYVLLM_WGMMA_SHAPE(T, N, TY, F, X0, X1, X2, X3, X4, X5)                              \
  template <>                                                                                  \
  __device__ __forceinline__ void wgmma_ss<T, N>(float (&d)[F], uint64_t desc_a,               \
                                                 uint64_t desc_b, int scale_d) {               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #X2 ", 0;\n"                             \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY "\n"              \
                 TINYVLLM_WGMMA_REGS_##F ", %" #X0 ", %" #X1 ", p, 1, 1, 0, 0;\n}\n"          \
                 : TINYVLLM_WGMMA_D_##F                                                        \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d)                                      \
                 : "memory");                                                                  \
  }                                                                                            \
  template <>                                                                                  \
  struct WgmmaRs<T, N> {                                                                       \
    template <int kTransB>                                                                     \
    __device__ __forceinline__ static void run(float (&d)[F], const uint32_t (&a)[4],          \
                                               uint64_t desc_b) {                              \
      asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY "\n"            \
                   TINYVLLM_WGMMA_REGS_##F ", {%" #X0 ", %" #X1 ", %" #X2 ", %" #X3 "}, %" #X4 \
                   ", 1, 1, 1, %" #X5 ";\n"                                                    \
                   : TINYVLLM_WGMMA_D_##F                                                      \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB)    \
                   : "memory");                                                                \
    }                                                                                          \
  };

TINYVLLM_WGMMA_SHAPE(__nv_bfloat16, 64, "bf16", 32, 32, 33, 34, 35, 36, 37)
TINYVLLM_WGMMA_SHAPE(__half, 64, "f16", 32, 32, 33, 34, 35, 36, 37)
TINYVLLM_WGMMA_SHAPE(__nv_bfloat16, 128, "bf16", 64, 64, 65, 66, 67, 68, 69)
TINYVLLM_WGMMA_SHAPE(__half, 128, "f16", 64, 64, 65, 66, 67, 68, 69)

#undef TINYVLLM_WGMMA_SHAPE
#undef TINYVLLM_WGMMA_D_64
#undef TINYVLLM_WGMMA_D_32
#undef TINYVLLM_WGMMA_REGS_64
#undef TINYVLLM_WGMMA_REGS_32

#endif  // sm_90a

}  // namespace tinyvllm
