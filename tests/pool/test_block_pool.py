"""The allocator alone: ids, free list, reference counts, the null block, what eviction keeps."""

import pytest

from hf_paged_cache import BlockPool
from hf_paged_cache.pool.block_pool import block_keys


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.capacity == 3
    assert sorted(pool.allocate(3)) == [1, 2, 3]  # block 0 stays reserved
    assert pool.allocate(1) is None


def test_allocation_is_all_or_nothing():
    pool = BlockPool(num_blocks=5)
    assert pool.allocate(5) is None  # only 4 allocatable
    assert pool.num_free == 4
    assert pool.can_allocate(4) and not pool.can_allocate(5)


def test_shared_block_is_freed_by_its_last_holder():
    pool = BlockPool(num_blocks=3)
    [block] = pool.allocate(1)
    pool.incref([block])  # a second table now holds it
    pool.free([block])
    assert pool.refcount(block) == 1 and pool.num_free == 1
    pool.free([block])
    assert pool.refcount(block) == 0 and pool.num_free == 2


def test_freed_blocks_are_reused_in_free_order():
    pool = BlockPool(num_blocks=6)
    first = pool.allocate(3)  # [1, 2, 3]
    pool.free(reversed(first))  # tail first: 3, 2, 1 join the back of the free list
    assert pool.allocate(5) == [4, 5, 3, 2, 1]


@pytest.mark.parametrize("bad", [[0], [7]])
def test_double_free_and_foreign_ids_raise(bad):
    pool = BlockPool(num_blocks=8)
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.free(bad)


def test_double_free_raises():
    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


@pytest.mark.parametrize("kwargs", [dict(num_blocks=8, block_size=0), dict(num_blocks=1), dict(num_blocks=8, block_size=2.5)])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        BlockPool(**kwargs)


def cache_blocks(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Take blocks for `tokens` (whole blocks), register each under its chained key, release them tail first."""
    blocks = pool.allocate(len(tokens) // pool.block_size)
    for block, key, start in zip(blocks, block_keys(tokens, pool.block_size), range(0, len(tokens), pool.block_size)):
        pool.register(block, key, tokens[start : start + pool.block_size])
    pool.free(reversed(blocks))
    return blocks


def test_blocks_holding_nothing_findable_are_taken_before_cached_ones():
    pool = BlockPool(num_blocks=5, block_size=2)
    cached = cache_blocks(pool, [1, 2, 3, 4])  # blocks 1, 2: findable
    [empty] = pool.allocate(1)  # block 3: a partial block, never registered
    pool.free([empty])  # freed last, yet taken first: it holds nothing
    assert pool.allocate(2) == [4, empty]  # the never-used id first, then the empty block
    assert pool.match_prefix([1, 2, 3, 4, 5], max_blocks=2) == cached  # nothing evicted


def test_a_reused_prefix_outlives_one_off_blocks_freed_after_it():
    pool = BlockPool(num_blocks=9, block_size=2)  # 8 usable blocks
    system = [7, 7, 8, 8]  # 2 blocks every request starts with
    prefix = cache_blocks(pool, system)  # blocks 1, 2
    assert pool.match_prefix(system + [9], max_blocks=2) == prefix  # a second request hits them...
    pool.free(reversed(prefix))  # ...and releases them: reused, so protected
    one_off = cache_blocks(pool, [1, 2, 3, 4, 5, 6])  # blocks 3, 4, 5: freed after the prefix, never reused
    taken = pool.allocate(5)  # room for a big request: 6, 7, 8 never used, then 2 recycled blocks
    assert taken == [6, 7, 8, one_off[2], one_off[1]]  # LRU would have taken the prefix (freed first)
    assert pool.prefix_stats().evictions == 2
    assert pool.match_prefix(system + [9], max_blocks=2) == prefix  # the shared prompt is still cached


def test_protected_blocks_are_bounded_by_half_the_capacity():
    pool = BlockPool(num_blocks=7, block_size=1)  # 6 usable: at most 3 free blocks stay protected
    prompts = [[10 + i, 0] for i in range(4)]  # 4 one-block prefixes (the second token is never cached)
    blocks = [cache_blocks(pool, p[:1])[0] for p in prompts]  # blocks 1, 2, 3, 4
    for prompt in prompts:  # each is hit once and released: reused
        pool.free(pool.match_prefix(prompt, max_blocks=1))
    # the first one was demoted to the back of probation when the fourth joined the protected three
    assert pool.allocate(3) == [5, 6, blocks[0]]  # so it is evicted first, before the 3 protected ones
    assert [pool.match_prefix(p, max_blocks=1) for p in prompts] == [[], [blocks[1]], [blocks[2]], [blocks[3]]]


def test_an_evicted_block_starts_over_in_probation():
    pool = BlockPool(num_blocks=3, block_size=1)  # 2 usable
    [old] = cache_blocks(pool, [5])
    pool.free(pool.match_prefix([5, 0], max_blocks=1))  # reused: protected
    other, again = pool.allocate(2)  # block 2 never used, then the protected block: nothing else is free
    assert again == old and pool.prefix_stats().evictions == 1
    pool.register(other, next(block_keys([7], 1)), [7])
    pool.register(old, next(block_keys([6], 1)), [6])  # new contents
    pool.free([other])
    pool.free(pool.match_prefix([7, 0], max_blocks=1))  # [7] is reused: protected
    pool.free([old])  # freed last, but its new contents were never reused
    assert pool.allocate(1) == [old]
