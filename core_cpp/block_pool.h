// Fixed pool of KV-cache blocks: ref counts, an LRU free queue, and the prefix-cache table.
//
// Pure bookkeeping (no tensors). Callers cross into it once per step or per request with batch
// verbs; every verb validates its whole input before changing anything, so a failed call leaves
// the pool exactly as it was.
//
// Invariants (checked by tests/core/test_block_pool.py):
//   * Block 0 is the null block: never allocated, freed, touched or cached, never in the queue.
//   * A non-null block is in the free queue  <=>  its ref count is 0.
//   * num_free_blocks == length of the free queue.
//   * A block holds a hash h  <=>  table[h] == that block (one block per hash, one hash per block).
//     Free blocks keep their hash (lazy eviction) until allocate() hands them out again.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "block_hash.h"

namespace tinyvllm {

using BlockId = int32_t;

class BlockPool {
 public:
  // Throws std::invalid_argument if num_blocks < 2 (the null block plus at least one real block).
  explicit BlockPool(int num_blocks, bool enable_caching = true);

  int num_blocks() const { return num_blocks_; }
  int num_free_blocks() const { return num_free_blocks_; }
  double usage() const;
  int num_cached_blocks() const { return static_cast<int>(cached_block_ids_.size()); }
  int64_t num_evictions() const { return num_evictions_; }

  // n blocks from the free-queue head, each with ref count 1; std::nullopt if fewer are free.
  std::optional<std::vector<BlockId>> allocate(int n);
  // Blocks reaching ref count 0 join the queue tail in the order given.
  void free(const std::vector<BlockId>& block_ids);
  // Prefix-cache hit: ref count + 1, reviving free cached blocks out of the queue in O(1).
  void touch(const std::vector<BlockId>& block_ids);

  int ref_count(BlockId block_id) const;
  std::vector<BlockId> free_block_ids() const;
  std::optional<BlockHash> block_hash(BlockId block_id) const;

  // Longest cached prefix of block_hashes, at most max_hit_blocks long. Read-only.
  std::vector<BlockId> lookup(const std::vector<BlockHash>& block_hashes, int max_hit_blocks) const;
  // Publish written blocks; first writer of a hash wins.
  void cache_blocks(const std::vector<BlockId>& block_ids,
                    const std::vector<BlockHash>& block_hashes);
  // Drop every hash; refused (false) unless every block is free.
  bool reset_prefix_cache();

 private:
  // Free queue: intrusive circular doubly linked list over block ids with a sentinel node at
  // index num_blocks_, so unlinking from the middle is O(1) and needs no branches for the ends.
  BlockId sentinel() const { return num_blocks_; }
  void push_back_free(BlockId block_id);
  void unlink_free(BlockId block_id);
  BlockId pop_front_free();

  void check_real_block(BlockId block_id, const char* verb) const;
  void check_frees(const std::vector<BlockId>& block_ids);
  void evict_hash(BlockId block_id);

  int num_blocks_;
  bool enable_caching_;
  int num_free_blocks_ = 0;
  int64_t num_evictions_ = 0;

  std::vector<int32_t> ref_cnt_;        // [num_blocks]
  std::vector<BlockId> prev_free_;      // [num_blocks + 1], last entry is the sentinel
  std::vector<BlockId> next_free_;      // [num_blocks + 1]
  std::vector<int32_t> pending_frees_;  // [num_blocks], scratch for free(); all zero between calls
  std::vector<std::optional<BlockHash>> hash_of_block_;  // [num_blocks]
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> cached_block_ids_;
};

}  // namespace tinyvllm
