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


def test_a_preferred_block_is_taken_out_of_turn_unless_protected():
    """`prefer` (a growing row's next block after its last) is honoured for the next never-used id and for empty or
    probation blocks, never for a protected one, and never changes how many blocks are free."""
    pool = BlockPool(num_blocks=9, block_size=1)  # 8 usable
    protected = cache_blocks(pool, [5])  # block 1
    pool.free(pool.match_prefix([5, 0], max_blocks=1))  # reused: protected
    cache_blocks(pool, [6, 7])  # blocks 2, 3, freed tail first: on probation
    [empty] = pool.allocate(1)  # block 4, never registered
    pool.free([empty])
    # the free list's own order would give 5, 6, 7, 8 (never used), then 4 (empty), then 3, 2 (probation)
    assert pool.allocate(3, prefer=[3, None, 1]) == [3, 5, 6]  # 3 out of turn; 1 is protected: not taken
    assert pool.allocate(2, prefer=[4, 7]) == [4, 7]  # the empty block, and the next never-used id
    assert pool.allocate(1, prefer=[6]) == [8]  # a held block is not free: the free list's turn
    assert pool.prefix_stats().evictions == 1  # block 3's contents ([6, 7]'s second block)
    assert pool.match_prefix([5, 0], max_blocks=1) == protected


def test_a_row_growing_on_a_recycled_pool_keeps_consecutive_blocks():
    """A row's blocks follow one another where the pool allows it: after the free list's first block, a new row
    takes the block after it, and a growing row the block after its last one, so its keys sit in consecutive
    slots (decode steps read them as one view)."""
    from hf_paged_cache.cache.block_table import BlockTables

    pool = BlockPool(num_blocks=12, block_size=2)  # 11 usable
    earlier = BlockTables(pool)
    earlier.add_rows(1)
    earlier.append([8])  # 4 blocks: 1, 2, 3, 4
    earlier.commit()
    pool.free(reversed(earlier.tables[0]))  # tail first: the free list is 4, 3, 2, 1 (never-used 5..11 before)
    assert pool.allocate(7) == list(range(5, 12))
    pool.free([5, 6])  # the free list is now 4, 3, 2, 1, 5, 6
    tables = BlockTables(pool)
    tables.add_rows(1)
    tables.append([4])  # 2 blocks: the free list's first, 4, then 5 out of turn (3 was next in line)
    tables.commit()
    assert tables.tables[0] == [4, 5]
    tables.append([1])  # a third: 6 follows 5
    tables.commit()
    assert tables.tables[0] == [4, 5, 6]
    tables.append([2])  # a fourth: 7 is held elsewhere, so the free list's turn: 3
    tables.commit()
    assert tables.tables[0] == [4, 5, 6, 3] and pool.num_free == 2
