"""KVCacheManager: a thin facade over the C++ block pool and hasher (`tinyvllm._core`).

It counts; it never decides. It owns every request's KV bookkeeping, keyed by request id: the
block ids, the chained hashes of its full blocks and how many leading blocks are published to the
prefix cache. The scheduler asks "can this request have n more tokens?" and gets the new block ids
or `None`; it never writes block fields. Every call crosses into C++ once per request per step
with a batch of ids.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tinyvllm import _core
from tinyvllm.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _RequestBlocks:
    """One request's blocks: ids in sequence order, hashes of its full blocks (chained), and
    the number of leading blocks already in the prefix cache."""

    __slots__ = ("block_ids", "block_hashes", "num_published")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_published = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 hash_seed: Optional[int] = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = _core.BlockPool(num_blocks, enable_caching)
        self.hasher = _core.BlockHasher(block_size, hash_seed)
        self._requests: dict[str, _RequestBlocks] = {}
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

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in sequence order (empty when it holds none). Read-only."""
        entry = self._requests.get(request_id)
        return entry.block_ids if entry is not None else []

    def num_published_blocks(self, request_id: str) -> int:
        entry = self._requests.get(request_id)
        return entry.num_published if entry is not None else 0

    def _entry(self, request: Request) -> _RequestBlocks:
        entry = self._requests.get(request.request_id)
        if entry is None:
            entry = self._requests[request.request_id] = _RequestBlocks()
        request.kv_blocks = entry  # what the scheduler's per-step loops read
        return entry

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that has nothing computed yet.

        Returns (block ids, number of tokens they hold). Hits are capped so that at least one token
        is left to compute: its logits are what the next token is sampled from.
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        entry = self._entry(request)
        self._extend_hashes(request, entry, num_tokens)
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hits = self.pool.lookup(entry.block_hashes, max_hit_blocks)
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> Optional[list[int]]:
        """Make room for `num_new_tokens` more tokens of `request`.

        ```
        | <- blocks it holds -> | <- new_computed_blocks -> | <- new blocks -> |
        |  num_computed_tokens  |  cached prefix hits        | num_new_tokens   |
        ```
        Returns the ids appended to the request's blocks (the hits, then the new ones), or None
        (and nothing changes) when the pool cannot supply them. The hits count as published.
        """
        entry = self._entry(request)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(entry.block_ids) - len(new_computed_blocks)
        if num_new_blocks <= 0 and not new_computed_blocks:  # most decode steps
            return []
        if new_computed_blocks:
            # Touch first: a cached block may sit in the free queue and must not be evicted by the
            # allocation below.
            self.pool.touch(list(new_computed_blocks))
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        if new_blocks is None:
            if new_computed_blocks:
                self.pool.free(list(reversed(new_computed_blocks)))
            return None
        if new_computed_blocks:
            entry.block_ids.extend(new_computed_blocks)
            entry.num_published = len(entry.block_ids)
            new_blocks = list(new_computed_blocks) + new_blocks
        entry.block_ids.extend(new_blocks[len(new_computed_blocks):])
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is now written (of its computed tokens
        whose ids are known)."""
        if not self.enable_caching:
            return
        entry = request.kv_blocks  # (this manager's entry, or None)
        if entry is None:
            return
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        num_full = min(request.num_computed_tokens, num_tokens) // self.block_size
        if num_full <= entry.num_published:  # (most steps: no block filled)
            return
        self._extend_hashes(request, entry, num_full * self.block_size)
        self.pool.cache_blocks(entry.block_ids[entry.num_published:num_full],
                               entry.block_hashes[entry.num_published:num_full])
        entry.num_published = num_full

    def trim(self, request: Request) -> None:
        """Free the request's blocks past its computed tokens (the slots of rejected draft
        tokens), tail first. They were never published: only computed blocks are."""
        entry = self._requests.get(request.request_id)
        if entry is None:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(entry.block_ids) > keep:
            self.pool.free(entry.block_ids[keep:][::-1])
            del entry.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so that its last blocks are evicted first.
        Its block hashes stay (a preempted request looks its prefix up again with them)."""
        entry = self._requests.get(request.request_id)
        if entry is not None and entry.block_ids:
            self.pool.free(entry.block_ids[::-1])
            entry.block_ids = []
        if entry is not None:
            entry.num_published = 0

    def forget(self, request: Request) -> None:
        """Free a finished request's blocks and drop its bookkeeping."""
        self.free(request)
        self._requests.pop(request.request_id, None)
        request.kv_blocks = None

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _extend_hashes(self, request: Request, entry: _RequestBlocks, num_tokens: int) -> None:
        """Hash the request's full blocks up to `num_tokens` that are not hashed yet."""
        have = len(entry.block_hashes)
        want = num_tokens // self.block_size
        if want <= have:
            return
        tokens = request.token_ids_between(have * self.block_size, want * self.block_size)
        parent = entry.block_hashes[-1] if have else None
        salt = request.cache_salt.encode() if request.cache_salt else b""
        entry.block_hashes.extend(self.hasher.hash_blocks(tokens, parent, salt))
