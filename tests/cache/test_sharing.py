"""Sharing blocks instead of copying them: beams, forks, prefix caching."""

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_paged_cache import KVPool, PagedCache
from hf_paged_cache.pool.block_pool import hash_block
from tiny_models import VOCAB, ragged_batch, tiny_model

MODEL = tiny_model("llama")


def user_tokens(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def generate(cache, input_ids, **kwargs):
    return MODEL.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        cache=cache,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )


def assert_same(reference, paged):
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def assert_refcounts_match_tables(pool, *caches):
    held = {}
    for cache in caches:
        for table in cache.block_tables.tables:
            for block in table:
                held[block] = held.get(block, 0) + 1
    for block in range(1, pool.num_blocks):
        assert pool.blocks.refcount(block) == held.get(block, 0), f"block {block}"
    assert pool.blocks.num_used == len(held)


def test_beam_search_shares_the_prompt_blocks():
    prompt = ragged_batch([0], 40)["input_ids"]  # 2 full blocks + 8 tokens
    with PagedCache(MODEL, num_blocks=64) as cache:
        out = generate(cache, prompt, max_new_tokens=20, num_beams=4)
        tables = cache.block_tables.tables
        assert len(tables) == 4
        assert all(table[:2] == tables[0][:2] for table in tables)  # the prompt's full blocks, stored once
        assert cache.stats().blocks_in_use < sum(len(t) for t in tables)
        assert_refcounts_match_tables(cache.pool, cache)
    reference = generate(DynamicCache(config=MODEL.config), prompt, max_new_tokens=20, num_beams=4)
    assert_same(reference, out)


def test_fork_shares_a_prefilled_system_prompt():
    system = ragged_batch([0], 40)["input_ids"]
    reference_cache = DynamicCache(config=MODEL.config)
    with torch.no_grad():
        MODEL(input_ids=system, cache=reference_cache, use_cache=True)
    with PagedCache(MODEL, num_blocks=64) as base:
        with torch.no_grad():
            MODEL(input_ids=system, cache=base, use_cache=True)
        forks = [base.fork() for _ in range(3)]
        assert all(base.pool.blocks.refcount(b) == 4 for b in base.block_tables.tables[0])
        assert_refcounts_match_tables(base.pool, base, *forks)
        for seed, fork in enumerate(forks):
            question = torch.cat([system, user_tokens(5 + seed, seed)], dim=1)
            paged = generate(fork, question, max_new_tokens=12)
            reference = generate(copy.deepcopy(reference_cache), question, max_new_tokens=12)
            assert_same(reference, paged)
        # each fork copied the shared, partly filled last block before writing into it; base is untouched
        assert base.block_tables.num_tokens == [40]
        assert_refcounts_match_tables(base.pool, base, *forks)
        for fork in forks:
            fork.release()
        assert_refcounts_match_tables(base.pool, base)
        # and base still continues exactly
        question = torch.cat([system, user_tokens(4, 9)], dim=1)
        assert_same(generate(copy.deepcopy(reference_cache), question, max_new_tokens=8), generate(base, question, max_new_tokens=8))


def test_deepcopy_is_a_fork():
    with PagedCache(MODEL, num_blocks=64) as base:
        with torch.no_grad():
            MODEL(input_ids=ragged_batch([0], 20)["input_ids"], cache=base, use_cache=True)
        twin = copy.deepcopy(base)
        assert twin.pool is base.pool  # the pool is shared, not copied
        assert twin.block_tables.tables == base.block_tables.tables
        assert_refcounts_match_tables(base.pool, base, twin)
        twin.release()


def test_prefix_cache_reuses_the_previous_turn():
    pool = KVPool.for_config(MODEL.config, num_blocks=64)
    turn1 = ragged_batch([0], 37)["input_ids"]
    with PagedCache(MODEL, pool=pool) as cache:
        answer1 = generate(cache, turn1, max_new_tokens=12).sequences  # stores 37 + 11 = 48 tokens
    assert pool.blocks.num_used == 0  # released, but the 3 full blocks stay findable
    assert pool.blocks.prefix_stats().cached_blocks == 3

    turn2 = torch.cat([answer1, user_tokens(6, 1)], dim=1)  # 55 tokens
    with PagedCache(MODEL, pool=pool) as cache:
        assert cache.reuse_prefix(turn2) == 48
        assert cache.get_seq_length() == 48
        paged = generate(cache, turn2, max_new_tokens=10)
        stats = cache.stats()
        assert (stats.prefix_hits, stats.prefix_misses) == (3, 0)
    reference = generate(DynamicCache(config=MODEL.config), turn2, max_new_tokens=10)
    assert_same(reference, paged)


def test_prefix_cache_always_leaves_a_token_to_compute():
    pool = KVPool.for_config(MODEL.config, num_blocks=64)
    prompt = ragged_batch([0], 33)["input_ids"]
    with PagedCache(MODEL, pool=pool) as cache:
        generate(cache, prompt, max_new_tokens=1)  # stores 33 tokens: 2 full blocks
    with PagedCache(MODEL, pool=pool) as cache:
        assert cache.reuse_prefix(prompt[:, :32]) == 16  # 32 tokens cached, but one must be computed


def test_prefix_cache_evicts_least_recently_used_when_the_pool_needs_room():
    pool = KVPool.for_config(MODEL.config, num_blocks=9)  # 8 usable blocks
    first = ragged_batch([0], 50, seed=1)["input_ids"]
    with PagedCache(MODEL, pool=pool) as cache:
        generate(cache, first, max_new_tokens=1)  # 50 tokens in blocks [1, 2, 3, 4]; 1-3 full, so cached
        assert cache.block_tables.tables == [[1, 2, 3, 4]]
    # released tail first: the free list is now 5 6 7 8 | 4 3 2 1
    with PagedCache(MODEL, pool=pool) as cache:
        generate(cache, ragged_batch([0], 90, seed=2)["input_ids"], max_new_tokens=1)  # 90 tokens: 6 blocks
        assert cache.block_tables.tables == [[5, 6, 7, 8, 4, 3]]
        stats = cache.stats()
    assert stats.prefix_evictions == 1  # block 3 (first's third block) gave up its contents
    with PagedCache(MODEL, pool=pool) as cache:
        assert cache.reuse_prefix(first) == 32  # blocks 1 and 2 survived: prefix blocks are evicted last


def test_reuse_prefix_refuses_padded_rows():
    batch = ragged_batch([0, 3], 40)
    with PagedCache(MODEL, num_blocks=16) as cache:
        with pytest.raises(ValueError, match="unpadded rows"):
            cache.reuse_prefix(batch["input_ids"], batch["attention_mask"])


def test_a_hash_hit_is_confirmed_by_comparing_tokens():
    pool = KVPool.for_config(MODEL.config, num_blocks=8, block_size=4)
    [block] = pool.blocks.allocate(1)
    pool.blocks.register(block, hash_block(b"", [5, 6, 7, 8]), [9, 9, 9, 9])  # a forged collision
    assert pool.blocks.match_prefix([5, 6, 7, 8, 1], max_blocks=1) == []
    assert pool.blocks.match_prefix([9, 9, 9, 9, 1], max_blocks=1) == []  # its key is not that of 9 9 9 9
    pool.blocks.free([block])


def test_hash_is_stable_and_chained():
    assert hash_block(b"", [1, 2, 3]) == hash_block(b"", [1, 2, 3])
    assert hash_block(b"", [1, 2, 3]).hex() == hash_block(b"", (1, 2, 3)).hex()
    assert hash_block(hash_block(b"", [1]), [2]) != hash_block(hash_block(b"", [3]), [2])
