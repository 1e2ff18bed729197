"""BlockPool through the tinyvllm._core binding: exact block ids and free-queue order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm._core import BlockHasher, BlockPool

NUM_BLOCKS = 8  # block 0 is the null block, so 7 usable blocks
BLOCK_SIZE = 4


def _hashes(num_blocks: int, seed: int = 0, salt: bytes = b"") -> list[bytes]:
    tokens = list(range(num_blocks * BLOCK_SIZE))
    return BlockHasher(BLOCK_SIZE, seed=seed).hash_blocks(tokens, extra_key=salt)


def _cached_pool(num_cached: int) -> tuple[BlockPool, list[int], list[bytes]]:
    """A pool whose first num_cached blocks are published, then freed in reverse (request done)."""
    pool = BlockPool(NUM_BLOCKS)
    block_ids = pool.allocate(num_cached)
    hashes = _hashes(num_cached)
    pool.cache_blocks(block_ids, hashes)
    pool.free(block_ids[::-1])
    return pool, block_ids, hashes


# --- construction -------------------------------------------------------------------------------


def test_initial_state() -> None:
    pool = BlockPool(NUM_BLOCKS)
    assert pool.num_blocks == NUM_BLOCKS
    assert pool.num_free_blocks == NUM_BLOCKS - 1
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.usage == 0.0
    assert pool.num_cached_blocks == 0
    assert pool.num_evictions == 0
    assert pool.ref_count(0) == 0
    assert pool.block_hash(0) is None


@pytest.mark.parametrize("num_blocks", [-1, 0, 1])
def test_too_few_blocks(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_read_only_properties() -> None:
    pool = BlockPool(NUM_BLOCKS)
    with pytest.raises(AttributeError):
        pool.num_blocks = 3  # type: ignore[misc]


# --- allocate / free ----------------------------------------------------------------------------


def test_allocate_exact_ids_and_usage() -> None:
    pool = BlockPool(NUM_BLOCKS)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    assert pool.free_block_ids() == [6, 7]
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(5 / 7)
    assert [pool.ref_count(b) for b in range(NUM_BLOCKS)] == [0, 1, 1, 1, 1, 1, 0, 0]


def test_allocate_zero_and_negative() -> None:
    pool = BlockPool(NUM_BLOCKS)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError, match="-1"):
        pool.allocate(-1)
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    pool, _, hashes = _cached_pool(2)
    before = pool.free_block_ids()
    assert pool.allocate(NUM_BLOCKS) is None
    assert pool.free_block_ids() == before
    assert pool.num_cached_blocks == 2
    assert pool.num_evictions == 0
    assert pool.lookup(hashes, max_hit_blocks=2) == [1, 2]
    assert pool.allocate(NUM_BLOCKS - 1) is not None
    assert pool.allocate(1) is None
    assert pool.usage == 1.0


def test_free_in_reverse_puts_tail_blocks_first() -> None:
    pool = BlockPool(NUM_BLOCKS)
    request_a = pool.allocate(3)  # [1, 2, 3]
    request_b = pool.allocate(2)  # [4, 5]
    pool.free(request_a[::-1])
    assert pool.free_block_ids() == [6, 7, 3, 2, 1]
    pool.free(request_b[::-1])
    assert pool.free_block_ids() == [6, 7, 3, 2, 1, 5, 4]
    # Least recently freed first.
    assert pool.allocate(4) == [6, 7, 3, 2]


def test_shared_block_freed_only_at_zero() -> None:
    pool = BlockPool(NUM_BLOCKS)
    pool.allocate(2)
    pool.touch([1])
    assert pool.ref_count(1) == 2
    pool.free([1])
    assert pool.ref_count(1) == 1
    assert 1 not in pool.free_block_ids()
    pool.free([1, 2])
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 1, 2]


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(NUM_BLOCKS)
    pool.allocate(3)
    pool.free([3])
    with pytest.raises(ValueError, match="double free of block 3"):
        pool.free([2, 3])
    assert pool.ref_count(2) == 1
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]


def test_duplicate_in_one_free_list_is_a_double_free() -> None:
    pool = BlockPool(NUM_BLOCKS)
    pool.allocate(2)
    with pytest.raises(ValueError, match="double free of block 2"):
        pool.free([1, 2, 2])
    assert [pool.ref_count(b) for b in (1, 2)] == [1, 1]
    assert pool.num_free_blocks == 5
    # A block held twice may appear twice.
    pool.touch([2])
    pool.free([2, 2])
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2]


def test_free_null_block_raises() -> None:
    pool = BlockPool(NUM_BLOCKS)
    pool.allocate(1)
    with pytest.raises(ValueError, match="block 0"):
        pool.free([1, 0])
    assert pool.ref_count(1) == 1


@pytest.mark.parametrize("block_id", [-1, NUM_BLOCKS, 1000])
def test_free_out_of_range_raises(block_id: int) -> None:
    pool = BlockPool(NUM_BLOCKS)
    pool.allocate(1)
    with pytest.raises(ValueError, match=f"block {block_id}"):
        pool.free([1, block_id])
    assert pool.ref_count(1) == 1


def test_ref_count_out_of_range() -> None:
    with pytest.raises(ValueError, match="block 8"):
        BlockPool(NUM_BLOCKS).ref_count(NUM_BLOCKS)


# --- touch --------------------------------------------------------------------------------------


def test_touch_revives_cached_free_block_from_middle_of_queue() -> None:
    pool, _, hashes = _cached_pool(3)  # queue: [4, 5, 6, 7, 3, 2, 1]
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    hits = pool.lookup(hashes, max_hit_blocks=3)
    assert hits == [1, 2, 3]
    pool.touch(hits[:2])
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]
    assert pool.ref_count(1) == 1 and pool.ref_count(2) == 1
    pool.touch([6])  # the very middle of what remains
    assert pool.free_block_ids() == [4, 5, 7, 3]
    assert pool.num_free_blocks == 4
    # Revived blocks keep their hashes: nothing was evicted.
    assert pool.num_evictions == 0
    assert pool.lookup(hashes, max_hit_blocks=3) == [1, 2, 3]


def test_touch_head_and_tail_of_queue() -> None:
    pool = BlockPool(NUM_BLOCKS)
    pool.touch([1, 7])
    assert pool.free_block_ids() == [2, 3, 4, 5, 6]
    assert pool.allocate(5) == [2, 3, 4, 5, 6]
    assert pool.free_block_ids() == []
    pool.free([7, 1])
    assert pool.free_block_ids() == [7, 1]


@pytest.mark.parametrize("block_id", [0, -1, NUM_BLOCKS])
def test_touch_invalid_raises_and_changes_nothing(block_id: int) -> None:
    pool = BlockPool(NUM_BLOCKS)
    with pytest.raises(ValueError, match=f"block {block_id}"):
        pool.touch([2, block_id])
    assert pool.ref_count(2) == 0
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]


# --- prefix cache -------------------------------------------------------------------------------


def test_lazy_eviction() -> None:
    pool, _, hashes = _cached_pool(2)  # queue: [3, 4, 5, 6, 7, 2, 1]
    assert pool.num_cached_blocks == 2
    assert pool.block_hash(1) == hashes[0]
    assert pool.lookup(hashes, max_hit_blocks=2) == [1, 2]  # freed, still hits

    assert pool.allocate(5) == [3, 4, 5, 6, 7]  # uncached blocks go first: no eviction
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [2]  # the request's tail block is evicted first
    assert pool.num_evictions == 1
    assert pool.block_hash(2) is None
    assert pool.num_cached_blocks == 1
    assert pool.lookup(hashes, max_hit_blocks=2) == [1]


def test_eviction_under_pressure_is_lru() -> None:
    pool = BlockPool(5)  # blocks 1..4
    old, new = pool.allocate(2), pool.allocate(2)  # [1, 2], [3, 4]
    old_hashes, new_hashes = _hashes(2, salt=b"old"), _hashes(2, salt=b"new")
    pool.cache_blocks(old, old_hashes)
    pool.cache_blocks(new, new_hashes)
    pool.free(old[::-1])
    pool.free(new[::-1])
    assert pool.free_block_ids() == [2, 1, 4, 3]

    assert pool.allocate(3) == [2, 1, 4]
    assert pool.num_evictions == 3
    assert pool.lookup(old_hashes, max_hit_blocks=2) == []
    # Block 3 (the newer request's first block) survives; block 4 was its tail and is gone.
    assert pool.lookup(new_hashes, max_hit_blocks=2) == [3]


def test_lookup_max_hit_blocks_cap() -> None:
    pool, block_ids, hashes = _cached_pool(3)
    assert pool.lookup(hashes, max_hit_blocks=5) == block_ids
    assert pool.lookup(hashes, max_hit_blocks=2) == block_ids[:2]
    assert pool.lookup(hashes, max_hit_blocks=0) == []
    # An empty prompt gives (0 - 1) // block_size == -1: no hit, no error.
    assert pool.lookup(hashes, max_hit_blocks=-1) == []
    # 9 prompt tokens fill 2 blocks of 4, but one token must still be computed: (9 - 1) // 4 == 2.
    assert pool.lookup(hashes, max_hit_blocks=(9 - 1) // BLOCK_SIZE) == block_ids[:2]


def test_lookup_stops_at_first_miss_and_changes_nothing() -> None:
    pool, block_ids, hashes = _cached_pool(3)
    other = _hashes(3, seed=99)
    assert pool.lookup([hashes[0], other[1], hashes[2]], max_hit_blocks=3) == [block_ids[0]]
    assert pool.lookup([], max_hit_blocks=3) == []
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert all(pool.ref_count(b) == 0 for b in block_ids)


def test_cache_blocks_first_writer_wins() -> None:
    pool = BlockPool(NUM_BLOCKS)
    first, second = pool.allocate(2), pool.allocate(2)
    hashes = _hashes(2)
    pool.cache_blocks(first, hashes)
    pool.cache_blocks(second, hashes)  # same content computed twice: the copy stays uncached
    assert pool.lookup(hashes, max_hit_blocks=2) == first
    assert pool.num_cached_blocks == 2
    assert pool.block_hash(second[0]) is None
    # A block that already has a hash keeps it.
    pool.cache_blocks([first[0]], _hashes(1, seed=5))
    assert pool.block_hash(first[0]) == hashes[0]
    assert pool.num_cached_blocks == 2
    # Freeing the uncached copy evicts nothing when it is reallocated.
    pool.free(second[::-1])
    pool.allocate(5)
    assert pool.num_evictions == 0


def test_cache_blocks_validation() -> None:
    pool = BlockPool(NUM_BLOCKS)
    block_ids = pool.allocate(2)
    with pytest.raises(ValueError, match="2 block ids but 1 hashes"):
        pool.cache_blocks(block_ids, _hashes(1))
    with pytest.raises(ValueError, match="16 bytes"):
        pool.cache_blocks(block_ids[:1], [b"too short"])
    with pytest.raises(ValueError, match="block 0"):
        pool.cache_blocks([0], _hashes(1))
    with pytest.raises(TypeError):
        pool.cache_blocks(block_ids[:1], ["not bytes"])  # type: ignore[list-item]
    assert pool.num_cached_blocks == 0


def test_caching_disabled() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=False)
    block_ids = pool.allocate(2)
    hashes = _hashes(2)
    pool.cache_blocks(block_ids, hashes)
    assert pool.num_cached_blocks == 0
    assert pool.block_hash(block_ids[0]) is None
    assert pool.lookup(hashes, max_hit_blocks=2) == []


def test_reset_prefix_cache() -> None:
    pool = BlockPool(NUM_BLOCKS)
    block_ids = pool.allocate(2)
    hashes = _hashes(2)
    pool.cache_blocks(block_ids, hashes)
    assert pool.reset_prefix_cache() is False  # blocks still in use: nothing changes
    assert pool.lookup(hashes, max_hit_blocks=2) == block_ids

    pool.free(block_ids[::-1])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.block_hash(block_ids[0]) is None
    assert pool.lookup(hashes, max_hit_blocks=2) == []
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]  # queue order untouched
    pool.allocate(NUM_BLOCKS - 1)
    assert pool.num_evictions == 0


# --- property test ------------------------------------------------------------------------------

_ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "free", "touch"]), st.integers(0, 6), st.randoms()),
    max_size=60,
)


def _check_invariants(pool: BlockPool) -> None:
    free_ids = pool.free_block_ids()
    num_zero_ref = sum(pool.ref_count(b) == 0 for b in range(1, pool.num_blocks))
    assert pool.num_free_blocks == len(free_ids) == num_zero_ref
    assert len(set(free_ids)) == len(free_ids)
    assert all(pool.ref_count(b) == 0 for b in free_ids)
    assert 0 not in free_ids and pool.ref_count(0) == 0


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_random_operations_keep_invariants(ops: list) -> None:
    pool = BlockPool(NUM_BLOCKS)
    held: list[int] = []  # one entry per reference we own
    for verb, n, rng in ops:
        if verb == "allocate":
            ref_before = {b: pool.ref_count(b) for b in range(1, NUM_BLOCKS)}
            got = pool.allocate(n)
            if got is None:
                assert n > sum(ref == 0 for ref in ref_before.values())  # "does not fit"
            else:
                assert all(ref_before[b] == 0 for b in got)  # never hand out a used block
                assert all(pool.ref_count(b) == 1 for b in got)
                held += got
        elif verb == "free" and held:
            rng.shuffle(held)
            to_free, held = held[:n], held[n:]
            pool.free(to_free)
        elif verb == "touch":
            to_touch = [rng.randrange(1, NUM_BLOCKS) for _ in range(n)]
            pool.touch(to_touch)
            held += to_touch
        _check_invariants(pool)
    assert sorted(b for b in range(1, NUM_BLOCKS) for _ in range(pool.ref_count(b))) == sorted(held)
