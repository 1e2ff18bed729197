// Launcher of the sampling kernel: check sizes, choose how many CTAs share a row, merge partials.
//
// One instantiation (float32 logits, 512 threads, ~88 KiB of dynamic shared memory, 2 CTAs per
// SM). Rows that need only one pass over the vocabulary (greedy, no filter) are split over up to
// kMaxSplits CTAs while the batch is too small to fill the GPU; the split count depends only on
// the batch shape, and the merge takes the lowest index among equal scores, so a row's token does
// not depend on it.
#include <algorithm>
#include <string>

#include "launchers.h"
#include "sampling.cuh"

namespace tinyvllm {
namespace {

using sampling::kMaxSplits;
using sampling::kThreads;

// Enough four-token groups per CTA that one CTA's loop runs at least once at full width.
constexpr int kMinGroupsPerSplit = sampling::kThreads * sampling::kUnroll;
constexpr int kCtasPerSm = 2;  // __launch_bounds__(kThreads, 2)
constexpr int kMergeRowsPerBlock = 4;

int num_splits(int64_t num_rows, int64_t vocab_size, int64_t max_splits) {
  int device = 0, num_sms = 0;
  check_cuda(cudaGetDevice(&device), "sample: cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
             "sample: cudaDeviceGetAttribute");
  const int64_t num_groups = (vocab_size + 3) / 4;
  int64_t splits = std::min<int64_t>(max_splits, kCtasPerSm * num_sms / num_rows);
  splits = std::min<int64_t>(splits, num_groups / kMinGroupsPerSplit);
  return int(std::max<int64_t>(1, splits));
}

}  // namespace

void sample(ptr_t out,            // [num_rows] int64
            ptr_t workspace,      // workspace_bytes of device memory for the partials
            int64_t workspace_bytes,
            ptr_t logits,         // [num_rows, logits_stride] float32, vocab_size used
            int64_t logits_stride, int64_t num_rows, int64_t vocab_size,
            ptr_t temperature,    // [num_rows] float32
            ptr_t top_k,          // [num_rows] int64 or 0
            ptr_t top_p,          // [num_rows] float32 or 0
            ptr_t min_p,          // [num_rows] float32 or 0
            ptr_t seed,           // [num_rows] int64 or 0 (with noise)
            ptr_t offset,         // [num_rows] int64 or 0 (with noise)
            ptr_t noise,          // [num_rows, noise_stride] float32 or 0
            int64_t noise_stride, stream_t stream) {
  require(vocab_size > 0 && vocab_size <= sampling::kMaxVocab,
          "sample: vocab_size=" + std::to_string(vocab_size) + " must be in [1, " +
              std::to_string(sampling::kMaxVocab) + "]");
  require(num_rows >= 0 && num_rows <= INT32_MAX,
          "sample: num_rows=" + std::to_string(num_rows) + " out of range");
  require(logits_stride == 0 || logits_stride >= vocab_size,
          "sample: logits_stride=" + std::to_string(logits_stride) + " below vocab_size");
  require(out && logits && temperature, "sample: out, logits and temperature are required");
  require(noise || (seed && offset), "sample: seed and offset are required without noise");
  require(!noise || noise_stride == 0 || noise_stride >= vocab_size,
          "sample: noise_stride=" + std::to_string(noise_stride) + " below vocab_size");
  require(workspace_bytes >= 0, "sample: workspace_bytes must not be negative");
  if (num_rows == 0) return;
  const int64_t partial_bytes = num_rows * int64_t(sizeof(sampling::Partial));
  const int64_t max_splits = workspace ? std::min<int64_t>(kMaxSplits, workspace_bytes / partial_bytes) : 1;
  const int splits = num_splits(num_rows, vocab_size, std::max<int64_t>(1, max_splits));

  const cudaStream_t s = as_stream(stream);
  const size_t smem = sizeof(sampling::SharedStorage);
  check_cuda(cudaFuncSetAttribute(sampling::sample_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "sample: cudaFuncSetAttribute");
  auto* partials = reinterpret_cast<sampling::Partial*>(workspace);
  sampling::sample_kernel<<<dim3(unsigned(num_rows), unsigned(splits)), kThreads, smem, s>>>(
      reinterpret_cast<int64_t*>(out), partials, reinterpret_cast<const float*>(logits),
      logits_stride, int(vocab_size), reinterpret_cast<const float*>(temperature),
      reinterpret_cast<const int64_t*>(top_k), reinterpret_cast<const float*>(top_p),
      reinterpret_cast<const float*>(min_p), reinterpret_cast<const int64_t*>(seed),
      reinterpret_cast<const int64_t*>(offset), reinterpret_cast<const float*>(noise),
      noise_stride);
  check_launch("sample_kernel");
  if (splits > 1) {
    const unsigned blocks = unsigned((num_rows + kMergeRowsPerBlock - 1) / kMergeRowsPerBlock);
    sampling::merge_partials_kernel<<<blocks, 32 * kMergeRowsPerBlock, 0, s>>>(
        reinterpret_cast<int64_t*>(out), partials, int(num_rows), splits);
    check_launch("merge_partials_kernel");
  }
}

}  // namespace tinyvllm
