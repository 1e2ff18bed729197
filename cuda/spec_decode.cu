// Launcher of the acceptance-sampling kernel: check sizes, one CTA per request.
//
// One instantiation (float32 probabilities, 256 threads): a request's positions are sequential
// (each depends on the previous acceptance), and a row is read once per race, so the kernel is a
// few passes over (k + 1) * vocab floats per request.
#include <string>

#include "common.cuh"
#include "launchers.h"
#include "spec_decode.cuh"

namespace tinyvllm {

void rejection_sample(ptr_t out,              // [num_reqs, out_stride] int64
                      int64_t out_stride,     // >= max_k + 1
                      ptr_t target_probs,     // [num_draft_tokens + num_reqs, vocab_size] float32
                      ptr_t draft_probs,      // [num_draft_tokens, vocab_size] float32 or 0
                      ptr_t draft_token_ids,  // [num_draft_tokens] int64
                      ptr_t cu_num_draft,     // [num_reqs + 1] int64
                      int64_t num_reqs, int64_t vocab_size,
                      ptr_t noise,            // [num_draft_tokens + num_reqs, vocab_size] or 0
                      ptr_t uniform,          // [num_draft_tokens] float32 or 0
                      ptr_t seed,             // [num_reqs] int64 or 0 (with noise)
                      ptr_t offset,           // [num_reqs] int64 or 0 (with noise)
                      stream_t stream) {
  require(vocab_size > 0 && vocab_size <= INT32_MAX,
          "rejection_sample: vocab_size=" + std::to_string(vocab_size) + " out of range");
  require(num_reqs >= 0 && num_reqs <= INT32_MAX,
          "rejection_sample: num_reqs=" + std::to_string(num_reqs) + " out of range");
  require(out_stride >= 1, "rejection_sample: out_stride=" + std::to_string(out_stride) +
                               " must be at least 1");
  require(out && target_probs && cu_num_draft, "rejection_sample: out, target_probs and "
                                               "cu_num_draft are required");
  require(noise || (seed && offset),
          "rejection_sample: seed and offset are required without noise");
  require(!draft_probs || !noise || uniform,
          "rejection_sample: uniform is required with draft_probs and noise");
  if (num_reqs == 0) return;
  spec_decode::rejection_sample_kernel<<<unsigned(num_reqs), spec_decode::kThreads, 0,
                                         as_stream(stream)>>>(
      reinterpret_cast<int64_t*>(out), out_stride, reinterpret_cast<const float*>(target_probs),
      reinterpret_cast<const float*>(draft_probs),
      reinterpret_cast<const int64_t*>(draft_token_ids),
      reinterpret_cast<const int64_t*>(cu_num_draft), int(vocab_size),
      reinterpret_cast<const float*>(noise), reinterpret_cast<const float*>(uniform),
      reinterpret_cast<const int64_t*>(seed), reinterpret_cast<const int64_t*>(offset));
  check_launch("rejection_sample_kernel");
}

}  // namespace tinyvllm
