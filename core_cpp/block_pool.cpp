#include "block_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace tinyvllm {
namespace {

constexpr BlockId kNullBlockId = 0;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

}  // namespace

BlockPool::BlockPool(int num_blocks, bool enable_caching)
    : num_blocks_(num_blocks), enable_caching_(enable_caching) {
  if (num_blocks < 2) {
    fail("num_blocks must be at least 2 (block 0 is the null block), got " +
         std::to_string(num_blocks));
  }
  ref_cnt_.assign(num_blocks, 0);
  pending_frees_.assign(num_blocks, 0);
  hash_of_block_.assign(num_blocks, std::nullopt);
  prev_free_.assign(num_blocks + 1, sentinel());
  next_free_.assign(num_blocks + 1, sentinel());
  // The null block is never queued: the queue starts as [1, 2, ..., num_blocks - 1].
  for (BlockId b = 1; b < num_blocks; ++b) push_back_free(b);
}

double BlockPool::usage() const {
  return 1.0 - static_cast<double>(num_free_blocks_) / static_cast<double>(num_blocks_ - 1);
}

// --- free queue -----------------------------------------------------------------------------------

void BlockPool::push_back_free(BlockId block_id) {
  const BlockId tail = prev_free_[sentinel()];
  prev_free_[block_id] = tail;
  next_free_[block_id] = sentinel();
  next_free_[tail] = block_id;
  prev_free_[sentinel()] = block_id;
  ++num_free_blocks_;
}

void BlockPool::unlink_free(BlockId block_id) {
  const BlockId prev = prev_free_[block_id];
  const BlockId next = next_free_[block_id];
  next_free_[prev] = next;
  prev_free_[next] = prev;
  --num_free_blocks_;
}

BlockId BlockPool::pop_front_free() {
  const BlockId head = next_free_[sentinel()];
  unlink_free(head);
  return head;
}

std::vector<BlockId> BlockPool::free_block_ids() const {
  std::vector<BlockId> ids;
  ids.reserve(num_free_blocks_);
  for (BlockId b = next_free_[sentinel()]; b != sentinel(); b = next_free_[b]) ids.push_back(b);
  return ids;
}

// --- validation -----------------------------------------------------------------------------------

void BlockPool::check_real_block(BlockId block_id, const char* verb) const {
  if (block_id < 0 || block_id >= num_blocks_) {
    fail(std::string("cannot ") + verb + " block " + std::to_string(block_id) +
         ": out of range [0, " + std::to_string(num_blocks_) + ")");
  }
  if (block_id == kNullBlockId) {
    fail(std::string("cannot ") + verb + " block 0: it is the reserved null block");
  }
}

// Counts each id in pending_frees_ so that duplicates within one list are caught; on failure the
// scratch counts are rolled back and nothing else has changed.
void BlockPool::check_frees(const std::vector<BlockId>& block_ids) {
  for (std::size_t i = 0; i < block_ids.size(); ++i) {
    const BlockId b = block_ids[i];
    const bool in_range = b > kNullBlockId && b < num_blocks_;
    if (in_range && ++pending_frees_[b] <= ref_cnt_[b]) continue;
    for (std::size_t j = 0; j < i; ++j) pending_frees_[block_ids[j]] = 0;
    if (in_range) {
      pending_frees_[b] = 0;
      fail("double free of block " + std::to_string(b));
    }
    check_real_block(b, "free");
  }
}

// --- allocate / free / touch ----------------------------------------------------------------------

std::optional<std::vector<BlockId>> BlockPool::allocate(int n) {
  if (n < 0) fail("cannot allocate a negative number of blocks: " + std::to_string(n));
  if (n > num_free_blocks_) return std::nullopt;  // "does not fit" changes nothing
  std::vector<BlockId> ids(n);
  for (BlockId& b : ids) {
    b = pop_front_free();
    evict_hash(b);  // lazy eviction: the block's old content is about to be overwritten
    ref_cnt_[b] = 1;
  }
  return ids;
}

void BlockPool::evict_hash(BlockId block_id) {
  std::optional<BlockHash>& hash = hash_of_block_[block_id];
  if (!hash) return;
  cached_block_ids_.erase(*hash);  // invariant: the table maps *hash to this block
  hash.reset();
  ++num_evictions_;
}

void BlockPool::free(const std::vector<BlockId>& block_ids) {
  check_frees(block_ids);
  // Callers pass a request's blocks in reverse, so its tail blocks (least likely to be shared as a
  // prefix) reach the queue head first and are evicted first.
  for (BlockId b : block_ids) {
    pending_frees_[b] = 0;
    if (--ref_cnt_[b] == 0) push_back_free(b);
  }
}

void BlockPool::touch(const std::vector<BlockId>& block_ids) {
  for (BlockId b : block_ids) check_real_block(b, "touch");
  for (BlockId b : block_ids) {
    if (ref_cnt_[b] == 0) unlink_free(b);  // revive a free cached block, O(1)
    ++ref_cnt_[b];
  }
}

int BlockPool::ref_count(BlockId block_id) const {
  if (block_id < 0 || block_id >= num_blocks_) {
    fail("block " + std::to_string(block_id) + " out of range [0, " +
         std::to_string(num_blocks_) + ")");
  }
  return ref_cnt_[block_id];
}

// --- prefix cache ---------------------------------------------------------------------------------

std::optional<BlockHash> BlockPool::block_hash(BlockId block_id) const {
  ref_count(block_id);  // range check
  return hash_of_block_[block_id];
}

std::vector<BlockId> BlockPool::lookup(const std::vector<BlockHash>& block_hashes,
                                       int max_hit_blocks) const {
  std::vector<BlockId> hits;
  if (!enable_caching_) return hits;
  // A negative cap (an empty prompt gives (0 - 1) // block_size == -1) means no hit.
  const std::size_t cap =
      std::min(block_hashes.size(), static_cast<std::size_t>(std::max(max_hit_blocks, 0)));
  for (std::size_t i = 0; i < cap; ++i) {
    const auto it = cached_block_ids_.find(block_hashes[i]);
    if (it == cached_block_ids_.end()) break;  // chained hashes: a miss ends the prefix
    hits.push_back(it->second);
  }
  return hits;
}

void BlockPool::cache_blocks(const std::vector<BlockId>& block_ids,
                             const std::vector<BlockHash>& block_hashes) {
  if (block_ids.size() != block_hashes.size()) {
    fail("cache_blocks got " + std::to_string(block_ids.size()) + " block ids but " +
         std::to_string(block_hashes.size()) + " hashes");
  }
  for (BlockId b : block_ids) check_real_block(b, "cache");
  if (!enable_caching_) return;
  for (std::size_t i = 0; i < block_ids.size(); ++i) {
    std::optional<BlockHash>& hash = hash_of_block_[block_ids[i]];
    if (hash) continue;  // already published under its own hash
    // First writer wins: emplace leaves an existing mapping alone, and the block stays uncached.
    if (cached_block_ids_.emplace(block_hashes[i], block_ids[i]).second) hash = block_hashes[i];
  }
}

bool BlockPool::reset_prefix_cache() {
  if (num_free_blocks_ != num_blocks_ - 1) return false;  // a running request may still hit
  cached_block_ids_.clear();
  std::fill(hash_of_block_.begin(), hash_of_block_.end(), std::nullopt);
  return true;
}

}  // namespace tinyvllm
