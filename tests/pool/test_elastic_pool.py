"""Elastic pools: a pool given no size grows as the sequences need it; a sized pool stays a hard cap."""

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import PAD, TINY_CONFIGS, VOCAB, ragged_batch, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_paged_cache import (
    BlockPool,
    KVMemoryError,
    KVPool,
    PagedCache,
    PoolExhaustedError,
)
from hf_paged_cache.pool.block_pool import hash_block
from hf_paged_cache.pool.locks import SharedExclusiveLock
from hf_paged_cache.pool.memory import KVLayout


@pytest.fixture(scope="module")
def model_512():
    """The tiny Llama with a 512-token context: a default pool starts at 512 / 16 + 1 = 33 blocks."""
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=None, **TINY_CONFIGS["llama"],
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def elastic_pool(model, num_blocks=2, block_size=4) -> KVPool:
    return KVPool(KVLayout.from_config(model.config), num_blocks=num_blocks, block_size=block_size,
                  dtype=model.dtype, max_blocks=None)


# ---------------------------------------------------------------------- BlockPool growth


def test_elastic_block_pool_grows_geometrically_and_keeps_ids_in_order():
    pool = BlockPool(4, block_size=2, max_blocks=None)
    assert pool.allocate(3) == [1, 2, 3] and pool.grow_count == 0
    assert pool.allocate(1) == [4]  # 1 short: doubles to 8
    assert (pool.num_blocks, pool.grow_count) == (8, 1)
    assert pool.allocate(20) == list(range(5, 25))  # 17 short: 8 + 17 = 25 > 2 x 8
    assert (pool.num_blocks, pool.grow_count) == (25, 2)
    assert pool.capacity == 24 and pool.num_free == 0 and pool.num_used == 24
    assert pool.can_allocate(10**6)  # an elastic pool can always grow


def test_free_blocks_and_cached_ones_are_used_before_growing():
    pool = BlockPool(4, block_size=2, max_blocks=None)
    blocks = pool.allocate(3)
    pool.register(blocks[0], hash_block(b"", [7, 7]), [7, 7])
    pool.free(reversed(blocks))
    assert pool.allocate(3) == [3, 2, 1]  # recycled in free order, the cached block evicted last
    assert pool.prefix_stats().evictions == 1 and pool.grow_count == 0 and pool.num_blocks == 4


def test_capped_block_pool_grows_up_to_its_cap_and_then_refuses():
    pool = BlockPool(3, max_blocks=10)
    assert pool.capacity == 9 and pool.num_free == 9  # the room to grow counts as free
    assert pool.allocate(4) == [1, 2, 3, 4] and pool.num_blocks == 6  # 2 x 3
    assert pool.allocate(6) is None  # 5 free up to the cap: nothing taken, nothing grown
    assert (pool.num_blocks, pool.num_free, pool.grow_count) == (6, 5, 1)
    assert pool.allocate(5) == [5, 6, 7, 8, 9] and pool.num_blocks == 10  # capped at 10, not 12
    assert not pool.can_allocate(1)


def test_a_fixed_pool_never_grows():
    pool = BlockPool(4)
    assert pool.max_blocks == 4
    assert pool.allocate(4) is None
    assert (pool.num_blocks, pool.grow_count, pool.num_free) == (4, 0, 3)


def test_a_failing_grow_hook_leaves_the_pool_unchanged():
    asked = []

    def on_grow(num_blocks):
        asked.append(num_blocks)
        if num_blocks > 8:
            raise MemoryError("no room")

    pool = BlockPool(4, max_blocks=None, on_grow=on_grow)
    held = pool.allocate(5)  # grows to 8 through the hook
    assert asked == [8] and pool.num_blocks == 8
    with pytest.raises(MemoryError, match="no room"):
        pool.allocate(5)  # needs 16
    assert asked == [8, 16]
    assert (pool.num_blocks, pool.grow_count, pool.num_used) == (8, 1, len(held))
    assert pool.allocate(2) == [6, 7]  # what exists is still handed out


def test_block_ids_outside_the_pool():
    pool = BlockPool(4, max_blocks=None)
    assert pool.refcount(3) == 0  # in the pool, never used
    with pytest.raises(IndexError):
        pool.refcount(4)
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.free([3])


operation = st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 12)),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("incref"), st.integers(0, 10**6)),
    st.tuples(st.just("register"), st.integers(0, 10**6), st.integers(0, 3)),
    st.tuples(st.just("match"), st.integers(0, 3)),
    st.tuples(st.just("fail_growth"), st.integers(1, 12)),
)


@settings(max_examples=150, deadline=None)
@given(
    start=st.integers(2, 6),
    cap=st.one_of(st.none(), st.integers(0, 20)),
    operations=st.lists(operation, max_size=50),
)
def test_random_operations_on_a_growing_pool_keep_the_invariants(start, cap, operations):
    failing = [False]

    def on_grow(num_blocks):
        if failing[0]:
            raise MemoryError

    max_blocks = None if cap is None else start + cap
    pool = BlockPool(start, block_size=2, max_blocks=max_blocks, on_grow=on_grow)
    held: dict[int, int] = {}  # block -> holders, as the pool should count them
    ever_used = 0
    for op, *args in operations:
        before = pool.num_blocks, pool.grow_count, dict(held)
        if op in ("allocate", "fail_growth"):
            n = args[0]
            failing[0] = op == "fail_growth"
            free_now = pool.num_blocks - 1 - len(held)
            try:
                blocks = pool.allocate(n)
            except MemoryError:
                assert failing[0] and n > free_now
                assert (pool.num_blocks, pool.grow_count, held) == before
                continue
            finally:
                failing[0] = False
            if blocks is None:
                assert max_blocks is not None and n > max_blocks - 1 - len(held)
                assert (pool.num_blocks, pool.grow_count) == before[:2]
                continue
            assert len(blocks) == n and len(set(blocks)) == n
            assert all(0 < b < pool.num_blocks and b not in held for b in blocks)
            fresh = [b for b in blocks if b > ever_used]
            assert fresh == list(range(ever_used + 1, ever_used + 1 + len(fresh)))  # never-used ids, in order
            assert blocks[: len(fresh)] == fresh  # and before recycled ones
            ever_used += len(fresh)
            if n > free_now:  # grew once, geometrically, within the cap
                old = before[0]
                expected = max(old + n - free_now, 2 * old)
                assert pool.num_blocks == (expected if max_blocks is None else min(expected, max_blocks))
                assert pool.grow_count == before[1] + 1
            else:
                assert (pool.num_blocks, pool.grow_count) == before[:2]
            held.update(dict.fromkeys(blocks, 1))
        elif op in ("free", "incref") and held:
            block = sorted(held)[args[0] % len(held)]
            if op == "free":
                pool.free([block])
                held[block] -= 1
                if not held[block]:
                    del held[block]
            else:
                pool.incref([block])
                held[block] += 1
        elif op == "register" and held:
            block = sorted(held)[args[0] % len(held)]
            pool.register(block, hash_block(b"", [args[1]] * 2), [args[1]] * 2)
        elif op == "match":
            for block in pool.match_prefix([args[0]] * 2, 1):
                held[block] = held.get(block, 0) + 1
        assert 0 not in held
        assert all(pool.refcount(b) == held.get(b, 0) for b in range(pool.num_blocks))
        assert pool.num_used == len(held) and pool.num_free + pool.num_used == pool.capacity
        assert max_blocks is None or pool.num_blocks <= max_blocks
    for block, count in held.items():
        pool.free([block] * count)
    assert pool.num_used == 0


# ---------------------------------------------------------------------- the lock


def test_shared_holders_run_together_and_exclusive_waits_for_them():
    lock = SharedExclusiveLock()
    inside, release, log = threading.Barrier(3), threading.Event(), []

    def reader():
        with lock.shared():
            inside.wait(timeout=10)  # both readers are inside at once
            release.wait(timeout=10)
            log.append("reader out")

    def writer():
        with lock.exclusive():
            log.append("writer in")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in readers:
        thread.start()
    inside.wait(timeout=10)
    grower = threading.Thread(target=writer)
    grower.start()
    time.sleep(0.05)
    assert log == []  # the writer waits for both readers
    release.set()
    for thread in (*readers, grower):
        thread.join(timeout=10)
    assert log == ["reader out", "reader out", "writer in"]


def test_exceptions_release_the_lock_and_upgrades_are_refused():
    lock = SharedExclusiveLock()
    for make in (lock.shared, lock.exclusive):
        with pytest.raises(KeyboardInterrupt):
            with make():
                raise KeyboardInterrupt
    with lock.exclusive(), lock.exclusive(), lock.shared():  # reentrant for the writer
        pass
    with lock.shared():
        with pytest.raises(RuntimeError, match="upgrading would deadlock"):
            with lock.exclusive():
                pass
    done = threading.Event()
    threading.Thread(target=lambda: (lock.exclusive().__enter__(), done.set())).start()
    assert done.wait(timeout=10)  # nothing was left held


def test_a_reader_reenters_shared_while_a_writer_waits():
    lock = SharedExclusiveLock()
    writer_waiting, finished = threading.Event(), []

    def writer():
        writer_waiting.set()
        with lock.exclusive():
            finished.append("writer")

    with lock.shared():
        thread = threading.Thread(target=writer)
        thread.start()
        writer_waiting.wait(timeout=10)
        time.sleep(0.05)
        with lock.shared():  # would deadlock behind the waiting writer if shared() were not reentrant
            finished.append("reader")
    thread.join(timeout=10)
    assert finished == ["reader", "writer"]


# ---------------------------------------------------------------------- KVPool storage


def test_growth_resizes_storage_in_place_keeping_contents(llama):
    pool = elastic_pool(llama, num_blocks=2, block_size=4)
    states = torch.randn(1, 2, 1, 16)
    keys, values = (stored.data for stored in pool.layer(0, states, states))
    assert keys.shape[1] == 2 * 4 and not keys[:, :4].any()  # the null block is zero
    [block] = pool.blocks.allocate(1)
    keys[:, block * 4 : block * 4 + 4] = 1.5
    values[:, block * 4 : block * 4 + 4] = -2.0
    more = pool.blocks.allocate(9)  # grows to max(2 + 9, 4) = 11 blocks
    assert pool.num_blocks == 11 and pool.grow_count == 1
    same_keys, same_values = (stored.data for stored in pool.layer(0, states, states))
    assert same_keys is keys and same_values is values  # the same tensors, grown
    assert keys.shape[1] == 11 * 4 and values.shape[1] == 11 * 4
    assert not keys[:, :4].any() and (keys[:, 4:8] == 1.5).all() and (values[:, 4:8] == -2.0).all()
    assert pool.storage_bytes() == 2 * 11 * 4 * 2 * 16 * 4  # layer 1 has no storage yet
    new_keys = pool.layer(1, states, states)[0].data  # created at the current size
    assert new_keys.shape[1] == 11 * 4 and max(more) < 11


def test_a_growth_that_does_not_fit_the_device_raises_with_its_bytes_and_changes_nothing(llama, monkeypatch):
    from hf_paged_cache.pool import layer_storage

    pool = elastic_pool(llama, num_blocks=2, block_size=4)
    states = torch.randn(1, 2, 1, 16)
    keys = pool.layer(0, states, states)[0].data
    held = pool.blocks.allocate(1)
    storage = pool.storage_bytes()

    def out_of_memory(tensor, slots):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(layer_storage, "_grow_slots", out_of_memory)
    with pytest.raises(KVMemoryError, match=r"layer 0's keys need 2,560 bytes") as info:
        pool.blocks.allocate(3)  # 3 short: grows to 2 + 3 = 5 blocks = 20 slots x 2 heads x 16 x 4 bytes
    assert info.value.requested_bytes == 5 * 4 * 2 * 16 * 4 and isinstance(info.value, MemoryError)
    assert (pool.num_blocks, pool.grow_count, pool.blocks.num_used) == (2, 0, len(held))
    assert pool.storage_bytes() == storage and keys.shape[1] == 2 * 4
    monkeypatch.undo()
    assert len(pool.blocks.allocate(3)) == 3 and keys.shape[1] == 5 * 4  # it grows once memory allows


def test_storage_that_cannot_be_created_raises_with_its_bytes(llama, monkeypatch):
    from hf_paged_cache.pool import layer_storage

    pool = KVPool.for_config(llama.config, num_blocks=10, block_size=4)

    def out_of_memory(*args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 5120 bytes")

    monkeypatch.setattr(layer_storage, "_empty", out_of_memory)
    states = torch.randn(1, 2, 1, 16)
    with pytest.raises(KVMemoryError, match=r"needs 10,240 bytes .* on cpu"):
        pool.layer(0, states, states)
    assert pool.keys == [None, None] and pool.values == [None, None]


def test_a_grower_waits_for_a_layer_in_use(llama):
    """A thread writing under `storage_lock.shared()` never loses its write to a concurrent growth."""
    pool = elastic_pool(llama, num_blocks=2, block_size=4)
    states = torch.randn(1, 2, 1, 16)
    [block] = pool.blocks.allocate(1)
    entered, grown = threading.Event(), threading.Event()

    def grow():
        entered.wait(timeout=10)
        pool.blocks.allocate(5)
        grown.set()

    thread = threading.Thread(target=grow)
    thread.start()
    keys = pool.layer(0, states, states)[0].data
    with pool.storage_lock.shared():  # what PagedCache.update holds while it writes and gathers
        entered.set()
        assert not grown.wait(timeout=0.2)  # the growth waits for this block to end
        keys[:, block * 4 : block * 4 + 4] = 3.0
    thread.join(timeout=10)
    assert grown.is_set() and pool.num_blocks == 7
    assert (keys[:, block * 4 : block * 4 + 4] == 3.0).all() and keys.shape[1] == 7 * 4


def test_taking_blocks_while_holding_shared_is_refused_not_deadlocked(llama):
    pool = elastic_pool(llama, num_blocks=2, block_size=4)
    states = torch.randn(1, 2, 1, 16)
    pool.layer(0, states, states)
    with pool.storage_lock.shared():
        with pytest.raises(RuntimeError, match="holds storage_lock.shared"):
            pool.blocks.allocate(4)
    assert pool.num_blocks == 2 and pool.blocks.num_used == 0


# ---------------------------------------------------------------------- PagedCache on an elastic pool


def test_default_pool_grows_where_a_fixed_one_was_exhausted_and_matches_dynamic_cache(model_512):
    batch = ragged_batch([0, 3, 7, 1, 0, 5, 2, 9, 4, 0, 6, 8], 48, seed=3)  # 12 rows of 39 to 48 tokens
    kwargs = dict(max_new_tokens=12, do_sample=False)
    reference = model_512.generate(**batch, **kwargs, cache=DynamicCache(config=model_512.config))
    with PagedCache(model_512) as cache:
        assert (cache.pool.num_blocks, cache.pool.max_blocks) == (512 // 16 + 1, None)
        paged = model_512.generate(**batch, **kwargs, cache=cache)
        stats = cache.stats()
    torch.testing.assert_close(paged, reference, rtol=0, atol=0)
    assert stats.pool_grows >= 1 and stats.pool_max_blocks is None
    assert stats.pool_blocks == cache.pool.num_blocks > 33 and stats.blocks_in_use > 32
    assert stats.pool_bytes == stats.pool_blocks * cache.pool.bytes_per_block  # every layer has grown
    assert "elastic (grown" in repr(cache.pool)


def test_growth_keeps_earlier_keys_and_values(llama):
    """Decoding token by token through several growths gives the logits of a pool that never grows."""
    batch = ragged_batch([0, 2], 9, seed=5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tokens = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(6))
    caches = {
        "dynamic": DynamicCache(config=llama.config),
        "fixed": PagedCache(llama, block_size=4, num_blocks=64),
        "elastic": PagedCache(llama, pool=elastic_pool(llama, num_blocks=2, block_size=4)),
    }
    logits = {}
    with torch.no_grad():
        for name, cache in caches.items():
            steps = [llama(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]]
            step_mask = mask
            for t in range(tokens.shape[1]):
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
                out = llama(input_ids=tokens[:, t : t + 1], attention_mask=step_mask, cache=cache, use_cache=True)
                steps.append(out.logits[:, -1])
            logits[name] = torch.stack(steps)
    pool = caches["elastic"].pool
    assert pool.grow_count >= 3 and caches["fixed"].pool.grow_count == 0
    torch.testing.assert_close(logits["elastic"], logits["fixed"], rtol=0, atol=0)
    torch.testing.assert_close(logits["elastic"], logits["dynamic"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", [dict(num_blocks=8), dict(max_memory=8 * 2 * 2 * 2 * 16 * 4 * 4)])
def test_an_explicit_size_is_a_hard_cap(llama, size):
    pool = KVPool.for_config(llama.config, block_size=4, **size)
    assert pool.num_blocks == pool.max_blocks == 8 and not pool.is_elastic
    with PagedCache(llama, pool=pool) as cache:
        llama(**ragged_batch([0, 3], 10), cache=cache, use_cache=True)  # 3 + 2 blocks of 7
        before = pool.blocks.num_free, pool.storage_bytes(), [list(t) for t in cache.block_tables.tables]
        with pytest.raises(PoolExhaustedError, match="needs 5 blocks .* only 2 of 7 are free") as info:
            llama(**ragged_batch([0, 3], 10, seed=1), cache=PagedCache(llama, pool=pool), use_cache=True)
        assert (info.value.needed, info.value.free) == (5, 2)
        after = pool.blocks.num_free, pool.storage_bytes(), [list(t) for t in cache.block_tables.tables]
        assert after == before and (pool.num_blocks, pool.grow_count) == (8, 0)
        assert cache.stats().pool_max_blocks == 8 and cache.stats().pool_grows == 0


THREADS, CALLS = 6, 3


def thread_request(thread: int, call: int) -> dict:
    batch = ragged_batch([0, (thread + call) % 4], 5 + 3 * call + thread, seed=100 * thread + call)
    return dict(**batch, max_new_tokens=3 + (thread * 3 + call) % 7, do_sample=False)


def run_requests(model, pool: KVPool, thread: int) -> list[torch.Tensor]:
    outputs = []
    for call in range(CALLS):
        with PagedCache(model, pool=pool) as cache:
            outputs.append(model.generate(**thread_request(thread, call), cache=cache))
    return outputs


def test_concurrent_generates_on_a_growing_pool_match_sequential_ones(llama):
    sequential = [run_requests(llama, elastic_pool(llama), t) for t in range(THREADS)]
    pool = elastic_pool(llama, num_blocks=2, block_size=4)  # grows while the threads run
    concurrent: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            concurrent[t] = run_requests(llama, pool, t)
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "threads did not finish in time"
    assert not errors, errors
    for t in range(THREADS):
        for ours, theirs in zip(concurrent[t], sequential[t], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert pool.grow_count >= 2
    assert pool.blocks.num_used == 0 and pool.blocks.num_free == pool.blocks.capacity == pool.num_blocks - 1
