"""Bytes per block and pool sizing."""

import pytest
import torch

from hf_paged_cache import KVLayout, KVPool, PagedCache, bytes_per_block, parse_memory
from tiny_models import tiny_model


@pytest.mark.parametrize(
    "text, expected",
    [(1024, 1024), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("64 kib", 65536)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", ""])
def test_parse_memory_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory(bad)


def test_bytes_per_block_formula():
    # llama tiny: 2 layers, 2 KV heads of 16 dims; 16 tokens of float32
    layout = KVLayout.from_config(tiny_model("llama").config)
    assert bytes_per_block(layout, 16, torch.float32) == 2 * 2 * 2 * 16 * 16 * 4
    assert bytes_per_block(layout, 16, torch.bfloat16) == 2 * 2 * 2 * 16 * 16 * 2


def test_falcon_multi_query_has_one_kv_head():
    assert KVLayout.from_config(tiny_model("falcon").config).layers[0].num_heads == 1


def test_pool_sized_by_budget():
    model = tiny_model("llama")
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # 8 KiB
    cache = PagedCache(model, max_memory="80KiB")
    assert cache.pool.num_blocks == 80 * 1024 // per_block
    assert cache.pool.bytes_per_block == per_block


def test_default_pool_holds_one_full_context():
    cache = PagedCache(tiny_model("llama"))  # max_position_embeddings = 256
    assert cache.pool.num_blocks == 256 // 16 + 1


def test_max_memory_too_small_for_one_block():
    with pytest.raises(ValueError, match="too small"):
        PagedCache(tiny_model("llama"), max_memory=1000)


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ValueError, match="block_size"):
        PagedCache(tiny_model("llama"), block_size=block_size)


def test_storage_is_lazy_and_sized_as_documented():
    model = tiny_model("llama")
    pool = KVPool.for_config(model.config, num_blocks=10, block_size=4)
    assert pool.storage_bytes() == 0
    with PagedCache(model, pool=pool) as cache:
        model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    # [num_blocks, block_size, kv_heads, head_dim] for keys and values of 2 layers
    assert pool.storage_bytes() == 2 * 2 * (10 * 4 * 2 * 16) * 4
