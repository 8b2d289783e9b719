"""Pool sizes: integers of any integer type, never bools, never more than the machine holds."""

import time
import tracemalloc

import numpy as np
import psutil
import pytest
import torch
from tiny_models import tiny_model

from hf_paged_cache import BlockPool, KVLayout, KVPool, PagedCache, parse_memory
from hf_paged_cache.pool.memory import LayerShape

PER_BLOCK = 2 * 2 * 2 * 16 * 16 * 4  # tiny llama: 2 layers x 2 KV heads x (16 + 16) dims x 16 tokens x 4 bytes


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint32, int])
def test_sizes_accept_numpy_integers(llama, integer):
    pool = BlockPool(integer(8), block_size=integer(4))
    assert (pool.num_blocks, pool.block_size) == (8, 4) and type(pool.num_blocks) is int
    cache = PagedCache(llama, num_blocks=integer(10), block_size=integer(16))
    assert (cache.pool.num_blocks, cache.pool.block_size) == (10, 16)
    assert type(cache.pool.block_size) is int
    by_budget = KVPool.for_config(llama.config, max_memory=integer(10 * PER_BLOCK))
    assert by_budget.num_blocks == 10 and parse_memory(integer(1024)) == 1024


@pytest.mark.parametrize("flag", [True, False, np.True_])
@pytest.mark.parametrize("name", ["num_blocks", "block_size"])
def test_sizes_refuse_booleans(llama, name, flag):
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        PagedCache(llama, **{name: flag})
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        BlockPool(**{"num_blocks": 8, name: flag})


@pytest.mark.parametrize("flag", [True, np.True_])
def test_max_memory_refuses_booleans(llama, flag):
    with pytest.raises(TypeError, match="max_memory"):
        PagedCache(llama, max_memory=flag)


@pytest.mark.parametrize("bad", [2.0, "16", None])
def test_block_size_refuses_non_integers(bad):
    with pytest.raises(ValueError, match="block_size must be an integer"):
        BlockPool(8, block_size=bad)


def test_a_budget_the_machine_cannot_hold_is_refused_with_numbers(llama):
    machine = psutil.virtual_memory().total
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        PagedCache(llama, max_memory="100TB")
    assert time.perf_counter() - start < 2
    message = str(info.value)
    assert "max_memory='100TB'" in message
    blocks = 100 * 10**12 // PER_BLOCK
    assert f"{blocks * PER_BLOCK:,} bytes" in message and f"{blocks:,} blocks x {PER_BLOCK:,} bytes" in message
    assert f"{machine:,}" in message or "cuda" in message  # the RAM (plus any accelerator)
    assert "grows as the sequences need it" in message


def test_a_block_count_the_machine_cannot_hold_is_refused_with_numbers(llama):
    expected = rf"num_blocks=1000000000000 asks for a KV pool of {10**12 * PER_BLOCK:,} bytes"
    with pytest.raises(ValueError, match=expected):
        KVPool.for_config(llama.config, num_blocks=10**12)


def test_a_large_legitimate_pool_costs_nothing_until_used():
    layout = KVLayout((LayerShape(num_heads=1, key_dim=1, value_dim=1),))  # 2 bytes a token in int8
    tracemalloc.start()
    try:
        pool = KVPool(layout, num_blocks=10**8, block_size=1, dtype=torch.int8)  # 200 MB: fits any machine
        huge = BlockPool(10**12, block_size=16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000  # no O(num_blocks) free list or reference counts
    assert pool.num_blocks == 10**8 and pool.storage_bytes() == 0
    assert pool.blocks.num_free == 10**8 - 1 and huge.num_free == 10**12 - 1
    assert huge.allocate(3) == [1, 2, 3] and huge.refcount(10**12 - 1) == 0
