"""The allocator alone: ids, free list, reference counts, the null block."""

import pytest

from hf_paged_cache import BlockPool


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
