// The 128-bit block hash shared by BlockHasher (which produces it) and BlockPool (which keys its
// prefix-cache table by it).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tinyvllm {

constexpr std::size_t kBlockHashBytes = 16;

struct BlockHash {
  std::array<uint8_t, kBlockHashBytes> bytes{};

  bool operator==(const BlockHash& other) const { return bytes == other.bytes; }
  bool operator!=(const BlockHash& other) const { return !(*this == other); }
};

// The hash is the output of a keyed PRF, so its first 8 bytes are already uniform: folding them
// into size_t is all the mixing std::unordered_map needs.
struct BlockHashHasher {
  std::size_t operator()(const BlockHash& h) const noexcept {
    uint64_t word;
    std::memcpy(&word, h.bytes.data(), sizeof(word));
    return static_cast<std::size_t>(word);
  }
};

}  // namespace tinyvllm
