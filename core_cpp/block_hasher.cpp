#include "block_hasher.h"

#include <random>
#include <stdexcept>

namespace tinyvllm {
namespace {

// --- SipHash-2-4-128, written from the reference algorithm ----------------------------------------
constexpr int kCompressionRounds = 2;
constexpr int kFinalizationRounds = 4;
// Domain-separation constants of the 128-bit variant (the 64-bit one uses 0xff and no 0xee/0xdd).
constexpr uint64_t kOutput128Init = 0xee;
constexpr uint64_t kOutput128Second = 0xdd;

inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

// Explicit byte assembly: the hash must be identical on every host, whatever its endianness.
inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline void store_le64(uint64_t v, uint8_t* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

struct SipState {
  uint64_t v0, v1, v2, v3;

  explicit SipState(const SipKey& key)
      : v0(0x736f6d6570736575ULL ^ key.k0),
        v1(0x646f72616e646f6dULL ^ key.k1 ^ kOutput128Init),
        v2(0x6c7967656e657261ULL ^ key.k0),
        v3(0x7465646279746573ULL ^ key.k1) {}

  void rounds(int n) {
    for (int i = 0; i < n; ++i) {
      v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);
      v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;
      v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;
      v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);
    }
  }

  void absorb(uint64_t m) {
    v3 ^= m;
    rounds(kCompressionRounds);
    v0 ^= m;
  }

  uint64_t finalize_word() {
    rounds(kFinalizationRounds);
    return v0 ^ v1 ^ v2 ^ v3;
  }
};

// The last word holds the tail bytes plus the message length (mod 256) in its top byte.
uint64_t last_word(const uint8_t* tail, std::size_t num_tail_bytes, std::size_t num_bytes) {
  uint64_t b = static_cast<uint64_t>(num_bytes) << 56;
  for (std::size_t i = 0; i < num_tail_bytes; ++i) b |= static_cast<uint64_t>(tail[i]) << (8 * i);
  return b;
}

// --- key derivation -------------------------------------------------------------------------------
// splitmix64: a fixed, well-mixed expansion of a 64-bit seed into the two key words.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

SipKey key_from_seed(uint64_t seed) {
  SipKey key;
  key.k0 = splitmix64(seed);
  key.k1 = splitmix64(seed);
  return key;
}

SipKey random_key() {
  std::random_device rd;  // 32 bits per draw
  auto draw64 = [&rd] { return (static_cast<uint64_t>(rd()) << 32) | rd(); };
  SipKey key;
  key.k0 = draw64();
  key.k1 = draw64();
  return key;
}

void append_le32(std::vector<uint8_t>& buf, uint32_t v) {
  for (int i = 0; i < 4; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace

BlockHash siphash128(const SipKey& key, const uint8_t* data, std::size_t num_bytes) {
  SipState s(key);
  const std::size_t num_full_bytes = num_bytes - num_bytes % 8;
  for (std::size_t i = 0; i < num_full_bytes; i += 8) s.absorb(load_le64(data + i));
  s.absorb(last_word(data + num_full_bytes, num_bytes - num_full_bytes, num_bytes));

  BlockHash out;
  s.v2 ^= kOutput128Init;
  store_le64(s.finalize_word(), out.bytes.data());
  s.v1 ^= kOutput128Second;  // the second output word continues from the first one's state
  store_le64(s.finalize_word(), out.bytes.data() + 8);
  return out;
}

SipKey sip_key_from_bytes(const uint8_t* key_bytes) {
  return SipKey{load_le64(key_bytes), load_le64(key_bytes + 8)};
}

BlockHasher::BlockHasher(int block_size, std::optional<uint64_t> seed)
    : block_size_(block_size), key_(seed ? key_from_seed(*seed) : random_key()) {
  if (block_size <= 0) {
    throw std::invalid_argument("block_size must be positive, got " + std::to_string(block_size));
  }
}

std::vector<BlockHash> BlockHasher::hash_blocks(const std::vector<int32_t>& token_ids,
                                                const std::optional<BlockHash>& parent_hash,
                                                const std::string& extra_key) const {
  const std::size_t num_full_blocks = token_ids.size() / block_size_;
  std::vector<BlockHash> hashes;
  hashes.reserve(num_full_blocks);
  BlockHash parent = parent_hash.value_or(BlockHash{});  // all zeros for the first block

  // One message buffer reused for every block: parent || tokens || len(extra) || extra.
  std::vector<uint8_t> msg;
  msg.reserve(kBlockHashBytes + 4 * block_size_ + 4 + extra_key.size());
  for (std::size_t b = 0; b < num_full_blocks; ++b) {
    msg.assign(parent.bytes.begin(), parent.bytes.end());
    const int32_t* block_tokens = token_ids.data() + b * block_size_;
    for (int t = 0; t < block_size_; ++t) append_le32(msg, static_cast<uint32_t>(block_tokens[t]));
    append_le32(msg, static_cast<uint32_t>(extra_key.size()));
    msg.insert(msg.end(), extra_key.begin(), extra_key.end());
    parent = siphash128(key_, msg.data(), msg.size());
    hashes.push_back(parent);
  }
  return hashes;
}

}  // namespace tinyvllm
