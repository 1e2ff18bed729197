// Chained, keyed 128-bit hashes of full KV blocks (the prefix-cache keys).
//
//   h_i = SipHash-2-4-128(key, h_{i-1} (16 zero bytes for the first block)
//                              || token ids of block i as little-endian int32
//                              || len(extra_key) as little-endian u32 || extra_key)
//
// The key is random per process unless a seed is configured, so one tenant cannot craft a
// collision that would let it read another tenant's cached KV. extra_key carries the per-request
// cache_salt and anything else that changes the KV (LoRA id, KV-cache dtype).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "block_hash.h"

namespace tinyvllm {

struct SipKey {
  uint64_t k0 = 0;
  uint64_t k1 = 0;
};

// SipHash-2-4 with 128-bit output, as in the reference implementation (Aumasson & Bernstein).
BlockHash siphash128(const SipKey& key, const uint8_t* data, std::size_t num_bytes);

// Reads a 16-byte key as two little-endian words, the reference convention.
SipKey sip_key_from_bytes(const uint8_t* key_bytes);

class BlockHasher {
 public:
  // seed: expanded deterministically into the 128-bit key; std::nullopt draws the key from
  // std::random_device. Throws std::invalid_argument if block_size <= 0.
  explicit BlockHasher(int block_size, std::optional<uint64_t> seed = std::nullopt);

  int block_size() const { return block_size_; }

  // One hash per FULL block of token_ids; a trailing partial block is ignored.
  std::vector<BlockHash> hash_blocks(const std::vector<int32_t>& token_ids,
                                     const std::optional<BlockHash>& parent_hash,
                                     const std::string& extra_key) const;

 private:
  int block_size_;
  SipKey key_;
};

}  // namespace tinyvllm
