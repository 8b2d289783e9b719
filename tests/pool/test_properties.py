"""Property tests: random allocate / append / fork / reorder / crop / release keep the allocator consistent."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache import BlockPool, PoolExhaustedError
from hf_paged_cache.cache.block_table import BlockTables

BLOCK_SIZE = 4

operation = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    st.tuples(st.just("fork"), st.integers(0, 3)),
    st.tuples(st.just("reorder"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=5)),
    st.tuples(st.just("crop"), st.integers(0, 3), st.integers(0, 12)),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 3), st.lists(st.integers(0, 9), min_size=1, max_size=4),
              st.lists(st.integers(0, 3), max_size=6)),
)


def fork(tables: BlockTables) -> BlockTables:
    twin = BlockTables(tables.blocks)
    twin.tables = [list(t) for t in tables.tables]
    twin.num_tokens = list(tables.num_tokens)
    twin.token_ids = [None] * len(twin.tables)
    twin.hashes = [[] for _ in twin.tables]
    tables.blocks.incref(b for t in twin.tables for b in t)
    return twin


def check_invariants(pool: BlockPool, caches: list[BlockTables]) -> None:
    held: dict[int, int] = {}
    for cache in caches:
        for table, stored in zip(cache.tables, cache.num_tokens):
            assert len(table) == -(-stored // BLOCK_SIZE)  # exactly the blocks its tokens need
            for block in table:
                held[block] = held.get(block, 0) + 1
    assert 0 not in held  # the null block is never handed out
    for block in range(1, pool.num_blocks):
        assert pool.refcount(block) == held.get(block, 0)
    assert pool.num_free + pool.num_used == pool.capacity
    assert pool.num_used == len(held)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 24), operations=st.lists(operation, max_size=40))
def test_random_operations_keep_the_invariants(num_blocks, operations):
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    caches = [BlockTables(pool)]
    for op, target, *args in operations:
        cache = caches[target % len(caches)]
        if op == "append":
            (counts,) = args
            if cache.batch_size == 0:
                cache.add_rows(len(counts))
            counts = (counts * cache.batch_size)[: cache.batch_size]
            before = [list(t) for t in cache.tables], list(cache.num_tokens), pool.num_free
            starts = list(cache.num_tokens)
            try:
                cache.append(counts)
            except PoolExhaustedError as error:
                assert error.needed > error.free
                assert ([list(t) for t in cache.tables], list(cache.num_tokens), pool.num_free) == before
                continue
            cache.commit()
            for table, start, n in zip(cache.tables, starts, counts):
                if n:  # every block written to is private: no one else sees the new tokens
                    assert all(pool.refcount(b) == 1 for b in table[start // BLOCK_SIZE :])
        elif op == "abort":  # a step that fails after taking blocks (and maybe reordering rows) leaves no trace
            counts, rows = args
            before = [list(t) for t in cache.tables], list(cache.num_tokens), pool.num_free
            refcounts = [pool.refcount(b) for b in range(pool.num_blocks)]
            savepoint = cache.savepoint()
            if rows and cache.batch_size:  # a step may repeat rows (generate's expansion), never drop one
                cache.select([r for r in range(cache.batch_size) for _ in range(1 + rows[0] % 3)])
            if cache.batch_size:
                try:
                    cache.append((counts * cache.batch_size)[: cache.batch_size])
                except PoolExhaustedError:
                    pass
            cache.rollback(savepoint)
            assert ([list(t) for t in cache.tables], list(cache.num_tokens), pool.num_free) == before
            assert [pool.refcount(b) for b in range(pool.num_blocks)] == refcounts
        elif op == "fork":
            caches.append(fork(cache))
        elif op == "reorder" and cache.batch_size:
            (rows,) = args
            cache.select([r % cache.batch_size for r in rows])
        elif op == "crop" and cache.batch_size:
            (n,) = args
            cache.truncate([min(n, stored) for stored in cache.num_tokens])
        elif op == "release":
            cache.release()
        check_invariants(pool, caches)
    for cache in caches:
        cache.release()
    assert pool.num_free == pool.capacity
