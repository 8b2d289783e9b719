"""PagedCache bookkeeping: block accounting, pool exhaustion, bad input, the Cache contract."""

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from hf_paged_cache import KVPool, PagedCache, PoolExhaustedError
from tiny_models import ragged_batch, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def prefill(model, cache, pads=(0, 3), length=10, seed=0):
    batch = ragged_batch(list(pads), length, seed=seed)
    with torch.no_grad():
        return model(**batch, cache=cache, use_cache=True)


def snapshot(cache):
    return [list(t) for t in cache.block_tables.tables], list(cache.block_tables.num_tokens), cache.get_seq_length()


def held_blocks(*caches):
    return [b for c in caches for t in c.block_tables.tables for b in t]


def test_block_tables_of_a_ragged_prefill(llama):
    with PagedCache(llama, block_size=4, num_blocks=32) as cache:
        prefill(llama, cache, pads=(0, 3, 9), length=10)
        # 10, 7 and 1 real tokens -> 3, 2 and 1 blocks of 4; padding takes none
        assert cache.block_tables.num_tokens == [10, 7, 1]
        assert [len(t) for t in cache.block_tables.tables] == [3, 2, 1]
        assert cache.get_seq_length() == 10  # logical length counts padding, as DynamicCache does
        assert cache.stats().blocks_in_use == 6
        assert cache.pool.blocks.num_free == 31 - 6
    assert cache.pool.blocks.num_free == 31


def test_stats(llama):
    with PagedCache(llama, block_size=4, num_blocks=32) as cache:
        prefill(llama, cache, pads=(0, 3), length=10)  # 10 + 7 tokens in 3 + 2 blocks
        stats = cache.stats()
        per_token = cache.pool.bytes_per_block // 4
        assert stats.tokens_stored == 17
        assert stats.bytes_reserved == 5 * cache.pool.bytes_per_block
        assert stats.bytes_used == 17 * per_token
        assert stats.utilization == pytest.approx(17 / 20)


def test_caches_sharing_a_pool_never_share_blocks_by_accident(llama):
    pool = KVPool.for_config(llama.config, num_blocks=40, block_size=4)
    a, b = PagedCache(llama, pool=pool), PagedCache(llama, pool=pool)
    prefill(llama, a, seed=1)
    prefill(llama, b, seed=2)
    assert not set(held_blocks(a)) & set(held_blocks(b))
    assert pool.blocks.num_used == len(held_blocks(a, b))
    a.release()
    b.release()
    assert pool.blocks.num_free == pool.blocks.capacity


def test_exhaustion_raises_and_changes_nothing(llama):
    pool = KVPool.for_config(llama.config, num_blocks=8, block_size=4)  # 7 usable blocks
    bystander, victim = PagedCache(llama, pool=pool), PagedCache(llama, pool=pool)
    prefill(llama, bystander, pads=(0, 3), length=10)  # takes 3 + 2 blocks
    prefill(llama, victim, pads=(0,), length=4)  # takes 1 block
    before = snapshot(bystander), snapshot(victim), pool.blocks.num_free
    with pytest.raises(PoolExhaustedError, match=r"needs 3 blocks .* only 1 of 7 are free") as info:
        prefill(llama, victim, pads=(0,), length=9)  # 4 + 9 tokens -> 4 blocks, 3 more
    assert (info.value.needed, info.value.free) == (3, 1)
    assert (snapshot(bystander), snapshot(victim), pool.blocks.num_free) == before
    # the failed cache is still usable for what fits
    prefill(llama, victim, pads=(0,), length=4)
    assert victim.block_tables.num_tokens == [8]


def test_exhaustion_during_generate_keeps_the_cache_consistent(llama):
    with PagedCache(llama, block_size=4, num_blocks=6) as cache:  # 5 blocks = 20 tokens
        with pytest.raises(PoolExhaustedError):
            llama.generate(**ragged_batch([0], 8), max_new_tokens=30, do_sample=False, cache=cache)
        assert cache.block_tables.num_tokens == [20]
        assert cache.get_seq_length() == 20
        assert cache.pool.blocks.num_free == 0


def test_release_and_context_manager_return_every_block(llama):
    with PagedCache(llama, num_blocks=16) as cache:
        llama.generate(**ragged_batch([0, 2], 12), max_new_tokens=10, do_sample=False, cache=cache)
        assert cache.pool.blocks.num_used > 0
    assert cache.pool.blocks.num_used == 0
    assert cache.get_seq_length() == 0
    assert len(llama._forward_pre_hooks) == 1  # the model's one input hook, shared by all its caches


def test_dropped_cache_gives_its_blocks_back(llama):
    pool = KVPool.for_config(llama.config, num_blocks=16)
    cache = PagedCache(llama, pool=pool)
    prefill(llama, cache)
    assert pool.blocks.num_used > 0
    del cache
    import gc

    gc.collect()
    assert pool.blocks.num_used == 0


def test_crop_frees_tail_blocks(llama):
    with PagedCache(llama, block_size=4, num_blocks=32) as cache:
        prefill(llama, cache, pads=(0, 3), length=10)
        cache.crop(-5)  # positions 5..9 go: 5 real tokens of row 0, 5 of row 1
        assert cache.get_seq_length() == 5
        assert cache.block_tables.num_tokens == [5, 2]
        assert [len(t) for t in cache.block_tables.tables] == [2, 1]
        with pytest.raises(ValueError, match="negative"):
            cache.crop(3)


def test_crop_then_continue_matches_dynamic_cache(llama):
    batch = ragged_batch([0, 3], 10)
    results = []
    for cache in (DynamicCache(config=llama.config), PagedCache(llama, block_size=4, num_blocks=32)):
        with torch.no_grad():
            llama(**batch, cache=cache, use_cache=True)
            cache.crop(-4)
            out = llama(
                input_ids=batch["input_ids"][:, 6:],
                attention_mask=batch["attention_mask"],
                cache=cache,
                use_cache=True,
            )
        results.append(out.logits[:, -1])
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-5)


def test_reorder_shares_blocks_without_copying(llama):
    with PagedCache(llama, block_size=4, num_blocks=32) as cache:
        prefill(llama, cache, pads=(0, 3), length=10)
        row0 = list(cache.block_tables.tables[0])
        cache.reorder_cache(torch.tensor([0, 0]))
        assert cache.block_tables.tables == [row0, row0]
        assert all(cache.pool.blocks.refcount(b) == 2 for b in row0)
        assert cache.pool.blocks.num_used == 3  # row 1's two blocks went back


def test_batch_size_change_is_an_error(llama):
    with PagedCache(llama, num_blocks=32) as cache:
        prefill(llama, cache, pads=(0, 3), length=10)
        with pytest.raises(ValueError, match="holds 2 sequences but the forward has batch size 3"):
            prefill(llama, cache, pads=(0, 0, 0), length=2)


def test_cache_for_another_model_is_an_error(llama):
    other = tiny_model("qwen3")  # 2 layers too, but 16-dim heads and another shape of K/V
    cache = PagedCache(tiny_model("gpt2"))  # 4 heads of 16 dims vs llama's 2 KV heads of 16
    with pytest.raises(ValueError, match="built for 4 KV heads"):
        prefill(llama, cache)
    deeper = tiny_model("gemma3_text")  # 3 layers
    with pytest.raises(ValueError, match="pool was built for 2 layers"):
        PagedCache(deeper, pool=PagedCache(other).pool)


def test_dtype_mismatch_is_an_error(llama):
    pool = KVPool.for_config(llama.config, num_blocks=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"float32 keys and torch.float32 values but the pool stores torch.bfloat16"):
        prefill(llama, PagedCache(llama, pool=pool))
    assert pool.blocks.num_used == 0


def test_autocast_is_refused_with_a_clear_error(llama):
    with PagedCache(llama, num_blocks=8) as cache, torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="autocast is not supported"):
            prefill(llama, cache)


def test_not_a_model_or_config():
    with pytest.raises(TypeError, match="needs a transformers model or config"):
        PagedCache("llama")


@pytest.mark.parametrize(
    "model_type, message",
    [
        ("deepseek_v4", "'deepseek_v4' has layers of type \\['compressed_sparse_attention', "  # its own layers
                        "'heavily_compressed_attention'\\]"),
        # states and indexer keys are kept per forward, which only the model's hooks delimit
        ("qwen3_next", "'qwen3_next' has layers with conv / recurrent states or indexer keys, which a PagedCache "
                       "keeps only when built from the model"),
        ("deepseek_v32", "'deepseek_v32' has layers with conv / recurrent states or indexer keys"),
    ],
)
def test_unsupported_architectures_are_named(model_type, message):
    with pytest.raises(NotImplementedError, match=message):
        PagedCache(AutoConfig.for_model(model_type))
