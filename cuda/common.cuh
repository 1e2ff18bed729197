// Shared by every kernel of tinyvllm._cuda: element types, conversions, checks. Framework-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "dtype.h"

namespace tinyvllm {

// Bytes per element of a 16/32-bit dtype code (dtype.h); throws on any other code.
inline int dtype_size(int code) {
  if (code == kFloat32) return 4;
  if (code == kFloat16 || code == kBFloat16) return 2;
  throw std::invalid_argument(std::string("unsupported dtype ") + dtype_name(code) + " (code " +
                              std::to_string(code) + ")");
}

inline cudaStream_t as_stream(std::uintptr_t handle) {
  return reinterpret_cast<cudaStream_t>(handle);
}

// Raise (pybind11 maps std::invalid_argument to ValueError) with the parameter named.
inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

// After each launch: a bad configuration shows up here, not at the next sync.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15) == 0; }

// ---- conversions (device) ---------------------------------------------------------------------

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Rounds through T and back: reproduces the reference's intermediate roundings.
template <typename T> __device__ __forceinline__ float round_to(float x) {
  return to_float<T>(from_float<T>(x));
}

// Eight 16-bit elements live in one 16-byte vector (uint4): unpack / pack to floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&out)[8]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // A bf16 is the top half of its float: one instruction per element (a shift or a mask).
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_float<T>(e[i]);
  }
}

// Two floats -> one register of two 16-bit elements (lo in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T> struct HalfPair;
template <> struct HalfPair<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct HalfPair<__half> { using type = __half2; };

// f (a pair intrinsic: __hsub2, __hmul2) over the two T lanes of a and b, as one register.
template <typename T, typename F>
__device__ __forceinline__ uint32_t pair_op(uint32_t a, uint32_t b, F f) {
  using P = typename HalfPair<T>::type;
  P r = f(*reinterpret_cast<P*>(&a), *reinterpret_cast<P*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <typename T>
__device__ __forceinline__ uint32_t sub_pair(uint32_t a, uint32_t b) {
  return pair_op<T>(a, b, [](auto x, auto y) { return __hsub2(x, y); });
}
template <typename T>
__device__ __forceinline__ uint32_t mul_pair(uint32_t a, uint32_t b) {
  return pair_op<T>(a, b, [](auto x, auto y) { return __hmul2(x, y); });
}

// (a & mask) | bits in one lop3 (written as two operations, the compiler emits two).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(in[i]);
  return v;
}

// Named barrier ID (1..15; 0 is __syncthreads) for `threads` threads, the id an immediate:
// ptxas then reserves the barriers up to the highest id a kernel names (with an id in a
// register, as wgmma.cuh's named_barrier_sync(id, threads) for the sm_90a kernels takes it,
// `ptxas -v` reports all 16 used).
template <int ID>
__device__ __forceinline__ void named_barrier_sync(int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "r"(threads) : "memory");
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Zeroes a warp-per-rows GEMV's per-row sums (acc, dot) or its per-x-row sums (sx).
template <int R, int M>
__device__ __forceinline__ void zero_sums(float (&a)[R][M]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < M; ++i) a[r][i] = 0.f;
}

template <int M>
__device__ __forceinline__ void zero_sums(float (&a)[M]) {
#pragma unroll
  for (int i = 0; i < M; ++i) a[i] = 0.f;
}

// The end of a warp-per-rows GEMV: sums each lane's acc[r][i] over the warp and has lane 0 write
// out[i, row0 + r] (+ bias[row0 + r]) for the rows i < m and row0 + r < n.
template <typename T, int R, int M>
__device__ __forceinline__ void write_warp_rows(const float (&acc)[R][M], int lane, int row0, int m,
                                                int n, const T* __restrict__ bias,
                                                T* __restrict__ out, int64_t out_stride) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float total = warp_sum(acc[r][i]);
      const int row = row0 + r;
      if (lane == 0 && i < m && row < n) {
        const float b = bias != nullptr ? to_float<T>(bias[row]) : 0.f;
        out[i * out_stride + row] = from_float<T>(total + b);
      }
    }
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// Programmatic dependent launch (sm_90; compiled out for older architectures, where the waits
// below are no-ops and launch_pdl launches plainly). A kernel launched by launch_pdl may start while the
// previous kernel in the stream drains: it must call wait_for_previous_grid() before reading
// anything that kernel wrote (the wait returns once it has completed and its writes are visible;
// without a PDL launch it returns at once). allow_next_grid() lets the next PDL-launched kernel
// start early; it changes nothing about what that kernel may read.
// Asks L2 for the line holding p (no registers, no wait): for data a kernel will read soon.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for `bytes` (a multiple of 16) from the 16-byte aligned p on, in one instruction (the
// SM's bulk copy unit issues the reads; sm_90).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// L2 cache policy for a decode step's weights: each byte is read once a step, and a step streams
// far more weight than L2 holds, so weight lines go first and the lines read again soon stay (the
// kernels' code, activations, norm weights, the partitions of a split decode).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether this build holds an sm_90a image (CMAKE_CUDA_ARCHITECTURES lists 90a, as by default).
inline bool built_with_sm90a() {
#ifdef TINYVLLM_CUDA_ARCHS
  return std::string(TINYVLLM_CUDA_ARCHS).find("90a") != std::string::npos;
#else
  return false;
#endif
}

// Whether the current device runs the sm_90a code, the only image with the griddepcontrol
// instructions and the Hopper prefill attention: other GPUs, and a compute capability 9.0 GPU
// under a build without sm_90a, run sm_80/sm_89 code or PTX compiled for them, whose kernels
// never wait for the previous grid, so they must not be launched early. Asked once per device.
inline bool device_has_pdl_code() {
  if (!built_with_sm90a()) return false;
  constexpr int kMaxDevices = 64;
  static int8_t known[kMaxDevices] = {};  // 0 not asked yet, 1 yes, 2 no (a race writes alike)
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= kMaxDevices) return false;
  if (known[device] == 0) {
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "compute capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
               "compute capability");
    known[device] = (major == 9 && minor == 0) ? 1 : 2;
  }
  return known[device] == 1;
}

// The dynamic shared memory a CTA of `kernel` may take on the current device: the opt-in limit
// per block less the kernel's static shared memory (`what` names the kernel in errors).
template <typename... Params>
int dynamic_smem_cap(void (*kernel)(Params...), const char* what) {
  int device = 0, optin = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             what);
  cudaFuncAttributes attr{};
  check_cuda(cudaFuncGetAttributes(&attr, kernel), what);
  return optin - int(attr.sharedSizeBytes);
}

// kernel<<<grid, block, smem, stream>>>(args...) with the programmatic-serialization attribute
// where the device runs the code that honours it (device_has_pdl_code), plainly elsewhere.
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = device_has_pdl_code() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "launch_pdl");
}

// f(std::integral_constant<int, M>{}) with M the first of Ms that is at least m (the last if
// none is): the instantiation a launcher picks for m rows.
template <int M, int... Ms, typename F>
void dispatch_rows(int m, F&& f) {
  if constexpr (sizeof...(Ms) == 0) {
    f(std::integral_constant<int, M>{});
  } else if (m <= M) {
    f(std::integral_constant<int, M>{});
  } else {
    dispatch_rows<Ms...>(m, std::forward<F>(f));
  }
}

// Multiprocessors of the current device (asked once).
inline int num_sms() {
  static const int value = [] {
    int device = 0, sms = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sm count");
    return sms;
  }();
  return value;
}

// Grid of persistent CTAs over `units` units of work (bands of weight rows), each CTA taking
// ceil(units / resident slots) of them, strided: all CTAs resident at once, none with a unit more
// than the others but the last few. With `copies` > 1 the launch runs that many such grids side
// by side (gridDim.y: each over its own part of every unit), sharing the resident slots. `what`
// names the kernel in errors.
template <typename... Params>
int resident_grid(void (*kernel)(Params...), int threads, int smem, int units,
                  const char* what, int copies = 1) {
  int resident = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, smem),
             what);
  const int slots = std::max(1, num_sms() * (resident > 1 ? resident : 1) / copies);
  const int per_cta = (units + slots - 1) / slots;
  return (units + per_cta - 1) / per_cta;
}

}  // namespace tinyvllm

// Calls F<T>(...) with T the element type of a dtype code (16-bit types only).
#define TINYVLLM_DISPATCH_HALF(code, name, ...)                                            \
  do {                                                                                     \
    if ((code) == ::tinyvllm::kFloat16) {                                                  \
      using scalar_t = __half;                                                             \
      __VA_ARGS__;                                                                         \
    } else if ((code) == ::tinyvllm::kBFloat16) {                                          \
      using scalar_t = __nv_bfloat16;                                                      \
      __VA_ARGS__;                                                                         \
    } else {                                                                               \
      throw std::invalid_argument(std::string(name) + ": unsupported dtype " +             \
                                  ::tinyvllm::dtype_name(code) + " (float16, bfloat16)");  \
    }                                                                                      \
  } while (0)

// As above, float32 included.
#define TINYVLLM_DISPATCH_FLOAT(code, name, ...)                                           \
  do {                                                                                     \
    if ((code) == ::tinyvllm::kFloat32) {                                                  \
      using scalar_t = float;                                                              \
      __VA_ARGS__;                                                                         \
    } else {                                                                               \
      TINYVLLM_DISPATCH_HALF(code, name, __VA_ARGS__);                                     \
    }                                                                                      \
  } while (0)
