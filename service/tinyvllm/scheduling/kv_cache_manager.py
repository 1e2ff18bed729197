"""KVCacheManager: a thin facade over the C++ block pool and hasher (`tinyvllm._core`).

It counts; it never decides. The scheduler asks "can this request have n more tokens?" and gets
block ids or `None`. Every call crosses into C++ once per request per step with a batch of ids.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tinyvllm import _core
from tinyvllm.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 hash_seed: Optional[int] = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = _core.BlockPool(num_blocks, enable_caching)
        self.hasher = _core.BlockHasher(block_size, hash_seed)
        # Prefix-cache statistics, in tokens (what vLLM's metrics count).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that has nothing computed yet.

        Returns (block ids, number of tokens they hold). Hits are capped so that at least one token
        is left to compute: its logits are what the next token is sampled from.
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        self._extend_hashes(request, num_tokens)
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hits = self.pool.lookup(request.block_hashes, max_hit_blocks)
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> Optional[list[int]]:
        """Make room for `num_new_tokens` more tokens of `request`.

        ```
        | <- request.block_ids -> | <- new_computed_blocks -> | <- new blocks -> |
        |  num_computed_tokens    |  cached prefix hits        | num_new_tokens   |
        ```
        Returns the newly allocated block ids, or None (and nothing changes) when the pool cannot
        supply them.
        """
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(request.block_ids) - len(new_computed_blocks)
        if new_computed_blocks:
            # Touch first: a cached block may sit in the free queue and must not be evicted by the
            # allocation below.
            self.pool.touch(list(new_computed_blocks))
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        if new_blocks is None:
            if new_computed_blocks:
                self.pool.free(list(reversed(new_computed_blocks)))
            return None
        request.block_ids.extend(new_computed_blocks)
        request.block_ids.extend(new_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request, num_published: int) -> int:
        """Publish the request's full blocks whose KV is now written; returns how many are."""
        if not self.enable_caching:
            return num_published
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= num_published:
            return num_published
        self._extend_hashes(request, num_full * self.block_size)
        self.pool.cache_blocks(request.block_ids[num_published:num_full],
                               request.block_hashes[num_published:num_full])
        return num_full

    def trim(self, request: Request) -> None:
        """Free the request's blocks past its computed tokens (the slots of rejected draft
        tokens), tail first. They were never published: only computed blocks are."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:][::-1])
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so that its last blocks are evicted first."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
            request.block_ids = []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Hash the request's full blocks up to `num_tokens` that are not hashed yet."""
        have = len(request.block_hashes)
        want = num_tokens // self.block_size
        if want <= have:
            return
        tokens = request.all_token_ids[have * self.block_size:want * self.block_size]
        parent = request.block_hashes[-1] if have else None
        salt = request.cache_salt.encode() if request.cache_salt else b""
        request.block_hashes.extend(self.hasher.hash_blocks(tokens, parent, salt))
