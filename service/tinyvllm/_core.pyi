"""tinyvllm._core: the C++ bookkeeping core (block pool, prefix-cache table, block hashes, prompt
lookup).

Pure bookkeeping, no tensors. Cross it once per step or per request with the batch verbs below,
never once per block or token. Every verb validates its whole input first: a call that raises
changes nothing.
"""

class BlockPool:
    """Fixed pool of KV-cache blocks with ref counts, an LRU free queue and the prefix-cache table.

    Block 0 is the reserved null block: never allocated, freed, touched or cached. A non-null block
    is in the free queue exactly when its ref count is 0. A freed block keeps its hash (lazy
    eviction) so a later prefix-cache hit can revive it; the hash is dropped only when `allocate`
    hands the block out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        """Create the pool; the free queue starts as [1, 2, ..., num_blocks - 1] (head first).

        Args:
            num_blocks: total blocks, including the null block.
            enable_caching: when False, `lookup` always misses and `cache_blocks` is a no-op.

        Raises:
            ValueError: num_blocks < 2.
        """

    @property
    def num_blocks(self) -> int:
        """Total blocks, including the null block."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (the free queue's length), cached-but-free ones included."""

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use: 1 - num_free_blocks / (num_blocks - 1)."""

    @property
    def num_cached_blocks(self) -> int:
        """Entries in the hash table (blocks that a lookup can hit, in use or free)."""

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose hash was dropped because `allocate` handed them out again."""

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks from the free-queue head (least recently freed first), each at ref count 1.

        A taken block that still holds a hash loses it (lazy eviction; counts in num_evictions).

        Returns:
            The block ids in queue order; [] for n == 0; None, with nothing changed, when fewer
            than n blocks are free.

        Raises:
            ValueError: n < 0.
        """

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per listed id; blocks reaching 0 join the queue tail in list order.

        Pass a request's blocks in reverse so that its tail blocks are evicted first. A block may
        appear as many times as references are held on it. Freed blocks keep their hash.

        Raises:
            ValueError: an id out of range, the null block, or more frees than references
                ("double free of block 7"); the message names the block and nothing changes.
        """

    def touch(self, block_ids: list[int]) -> None:
        """Add one reference per listed id (prefix-cache hit).

        A block at ref count 0 (free but cached) is first unlinked from the free queue in O(1).

        Raises:
            ValueError: an id out of range or the null block (named in the message); nothing
                changes.
        """

    def ref_count(self, block_id: int) -> int:
        """Current ref count of block_id (0 for the null block). ValueError if out of range."""

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to allocate) to tail. For tests and debugging."""

    def lookup(self, block_hashes: list[bytes], max_hit_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of block_hashes. Changes nothing.

        Args:
            block_hashes: chained 16-byte hashes of a prompt's full blocks, from BlockHasher.
            max_hit_blocks: cap on the hit length; pass (num_prompt_tokens - 1) // block_size so
                at least one token is computed. A negative cap means no hit.

        Returns:
            Up to max_hit_blocks ids, stopping at the first miss; always [] with caching disabled.
            The caller then `touch`es the ids it keeps.

        Raises:
            ValueError: a hash that is not 16 bytes.
        """

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Publish blocks whose KV has been written: map block_hashes[i] -> block_ids[i].

        A block that already has a hash is left alone. A hash already mapped to another block keeps
        that mapping (first writer wins) and the new block simply stays uncached. No-op when caching
        is disabled.

        Raises:
            ValueError: lists of different lengths, a hash that is not 16 bytes, an id out of range
                or the null block; nothing changes.
        """

    def reset_prefix_cache(self) -> bool:
        """Drop every hash. Only allowed when every block is free.

        Returns:
            True if the cache was cleared; False, with nothing changed, while any block is in use.
        """

    def block_hash(self, block_id: int) -> bytes | None:
        """The 16-byte hash block_id is published under, or None. For tests."""

class BlockHasher:
    """Chained, keyed 128-bit hashes of full KV blocks, the prefix-cache keys.

    h_i = SipHash-2-4-128(key, h_{i-1} (16 zero bytes for i == 0)
                               || token ids of block i as little-endian int32
                               || len(extra_key) as little-endian u32 || extra_key)
    """

    def __init__(self, block_size: int, seed: int | None = None) -> None:
        """Create a hasher for blocks of block_size tokens.

        Args:
            block_size: tokens per KV block.
            seed: 64-bit seed expanded deterministically (two splitmix64 draws) into the 128-bit
                key, for reproducible hashes across processes. None draws the key from
                std::random_device, so one tenant cannot craft collisions with another's blocks.

        Raises:
            ValueError: block_size <= 0.
        """

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    def hash_blocks(
        self, token_ids: list[int], parent_hash: bytes | None = None, extra_key: bytes = b""
    ) -> list[bytes]:
        """One 16-byte hash per FULL block of token_ids; a trailing partial block is ignored.

        Args:
            token_ids: token ids (int32 range); a list, or any sequence of ints.
            parent_hash: hash of the block before token_ids[0], to continue a chain; None starts
                one.
            extra_key: everything besides the tokens that changes the KV: the request's
                cache_salt, LoRA id, KV-cache dtype. Different extra keys never share blocks.

        Returns:
            len(token_ids) // block_size hashes, each chained on the previous one.

        Raises:
            ValueError: parent_hash is not 16 bytes.
        """

def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output of data under a raw 16-byte key (reference-vector hook).

    Raises:
        ValueError: key is not 16 bytes.
    """

def ngram_propose(token_ids: "numpy.ndarray", min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: up to k tokens that followed an earlier occurrence of the sequence's last n
    tokens, n as long as matches go (from max_n down to min_n); among the matches of that length
    the latest with k tokens after it, else the earliest. [] when nothing of min_n tokens matches,
    k <= 0 or the sequence has at most min_n tokens. O(len(token_ids) * max_n), no allocation but
    the result. `scheduling.spec_decode.ngram_propose_ref` is the numpy statement of the rule.

    Args:
        token_ids: 1-D int64 (other integer arrays are converted), the prompt + output.

    Raises:
        ValueError: token_ids is not 1-D, or not 1 <= min_n <= max_n.
    """
