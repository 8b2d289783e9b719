"""Prefix caching for models with conv / recurrent states: a forward that leaves a row at a block boundary keeps
its states as a snapshot, found by the prefix key of the row's last block, so a later prompt with that prefix
starts from the snapshot. A hit gives bit for bit what continuing on the cache that computed the prefix gives,
and the tokens of computing the whole prompt anew."""

import pytest
import torch
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache

from hf_paged_cache import KVPool, PagedCache

HYBRIDS = ["qwen3_next", "lfm2", "falcon_h1"]  # gated delta rule, short conv, mamba2 beside attention
GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)


class Injected(Exception):
    """The failure a test injects in the middle of a forward."""


def user_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(seed))


def ask(model, cache, input_ids: torch.Tensor, **settings):
    return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                          **(settings or GREEDY))


def snapshots(pool: KVPool) -> int:
    return pool.states.ids.prefix_stats().cached_blocks


def assert_identical(ours, theirs):
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        assert torch.equal(a, b), f"logits differ at step {step}"


def two_turns(model, pool: KVPool):
    """Turn 1 (37 + 11 = 48 tokens stored: its last decode step fills block 3) on a cache of `pool`, then turn 2
    (turn 1, its answer, 6 new tokens) continued on the same cache. Returns turn 2's ids and output."""
    turn1 = ragged_batch([0], 37)["input_ids"]
    with PagedCache(model, pool=pool) as cache:
        answer = ask(model, cache, turn1, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        turn2 = torch.cat([answer, user_tokens(6, 1)], dim=1)  # 55 tokens
        continued = ask(model, cache, turn2)
    return turn2, continued


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_a_prefix_hit_starts_from_the_snapshot_and_continues_exactly(model_type):
    model = tiny_model(model_type)
    pool = KVPool.for_config(model.config)
    turn2, continued = two_turns(model, pool)
    assert snapshots(pool) == 2  # after 48 tokens (turn 1) and 64 (turn 2); no row holds them
    assert pool.states.ids.num_used == 0
    with PagedCache(model, pool=pool) as cache:
        assert cache.reuse_prefix(turn2) == 48
        reused = ask(model, cache, turn2)
        stats = cache.stats()
        assert (stats.prefix_hits, stats.state_snapshot_hits, stats.state_snapshots) == (3, 1, 2)
    assert_identical(reused, continued)
    anew = ask(model, DynamicCache(config=model.config), turn2)  # the whole prompt computed in one forward
    assert torch.equal(reused.sequences, anew.sequences)
    for ours, theirs in zip(reused.logits, anew.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_a_snapshot_is_never_written_over_by_the_rows_that_start_from_it():
    model = tiny_model("qwen3_next")
    pool = KVPool.for_config(model.config)
    turn2, continued = two_turns(model, pool)
    with PagedCache(model, pool=pool) as first, PagedCache(model, pool=pool) as second:
        assert first.reuse_prefix(turn2) == second.reuse_prefix(turn2) == 48
        slot = first.batch.states.slots[0]
        assert second.batch.states.slots == [slot] and pool.states.ids.refcount(slot) == 2
        other = torch.cat([turn2[:, :48], user_tokens(9, 2)], dim=1)  # the same prefix, another question
        ask(model, first, other)
        assert first.batch.states.slots[0] != slot  # it wrote its states into a slot of its own
        assert_identical(ask(model, second, turn2), continued)
    with PagedCache(model, pool=pool) as third:  # and the snapshot is still there, unchanged
        assert third.reuse_prefix(turn2) == 48
        assert_identical(ask(model, third, turn2), continued)


def test_only_rows_that_never_computed_padding_keep_snapshots():
    model = tiny_model("lfm2")
    batch = ragged_batch([0, 4], 32)  # row 0: 32 tokens; row 1: 28 tokens after 4 pads
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # as generate gives: the keys are usable
    with PagedCache(model) as cache, torch.no_grad():
        model(**batch, position_ids=positions, cache=cache, use_cache=True)
        mask = torch.cat([batch["attention_mask"], torch.ones(2, 4, dtype=torch.long)], dim=1)  # [2, 36]
        model(input_ids=user_tokens(1, 3).repeat(2, 1), attention_mask=mask[:, :33],
              position_ids=positions[:, -1:] + 1, cache=cache, use_cache=True)
        assert cache.block_tables.num_tokens == [33, 29]
        model(input_ids=user_tokens(3, 4).repeat(2, 1), attention_mask=mask,
              position_ids=positions[:, -1:] + torch.arange(2, 5), cache=cache, use_cache=True)
        assert cache.batch.tables.boundaries()[1] is not None  # row 1 is at 32 tokens, its keys known...
        assert snapshots(cache.pool) == 1  # ...but only row 0 (at 32 after the prompt) kept a snapshot


def test_a_model_that_keeps_states_in_its_own_modules_keeps_no_snapshot():
    model = tiny_model("recurrent_gemma")
    prompt = ragged_batch([0], 32)["input_ids"]
    with PagedCache(model) as cache:
        ask(model, cache, prompt)
    assert snapshots(cache.pool) == 0
    with PagedCache(model, pool=cache.pool) as cache:
        assert cache.reuse_prefix(torch.cat([prompt, user_tokens(3, 1)], dim=1)) == 0


def test_without_a_free_slot_a_row_writes_over_its_snapshot():
    model = tiny_model("qwen3_next")
    pool = KVPool.for_config(model.config, num_blocks=16, max_sequences=1)  # one slot: no room for a snapshot
    turn1 = ragged_batch([0], 32)["input_ids"]
    with PagedCache(model, pool=pool) as cache:
        ask(model, cache, turn1, max_new_tokens=3, do_sample=False)
        slot = cache.batch.states.slots[0]
        assert pool.states.ids.num_used == 1 and snapshots(pool) == 0  # written over at 33 tokens
    assert pool.states.ids.num_free == 1 and slot == 1


@pytest.mark.parametrize("max_sequences", [None, 1], ids=["moves to a fresh slot", "writes over it"])
def test_a_failed_forward_leaves_the_snapshot_of_its_rows_as_it_was(max_sequences):
    model = tiny_model("lfm2")
    pool = KVPool.for_config(model.config, num_blocks=16, max_sequences=max_sequences)
    prompt = ragged_batch([0], 32)["input_ids"]

    def fail(*args):
        raise Injected("injected in the head")

    with PagedCache(model, pool=pool) as cache, torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
        slot = cache.batch.states.slots[0]
        assert snapshots(pool) == 1 and pool.states.ids.is_cached(slot)
        state = cache.committed_state(0, "conv", 0)
        handle = model.get_output_embeddings().register_forward_hook(fail)
        with pytest.raises(Injected):
            model(input_ids=user_tokens(1, 1), cache=cache, use_cache=True)
        handle.remove()
        assert cache.batch.states.slots == [slot] and pool.states.ids.num_used == 1
        assert snapshots(pool) == 1 and pool.states.ids.is_cached(slot)
        assert torch.equal(cache.committed_state(0, "conv", 0), state)
        model(input_ids=user_tokens(1, 1), cache=cache, use_cache=True)
        moved = max_sequences is None
        assert (cache.batch.states.slots[0] != slot) == moved and pool.states.ids.num_used == 1
        assert snapshots(pool) == int(moved) and pool.states.ids.is_cached(slot) == moved


def test_snapshots_are_evicted_least_recently_used_first():
    model = tiny_model("lfm2")
    pool = KVPool.for_config(model.config, num_blocks=32, max_sequences=3)  # 3 slots
    prompts = [ragged_batch([0], 32, seed=seed)["input_ids"] for seed in range(4)]
    for prompt in prompts:  # each leaves one snapshot; the fourth evicts the first
        with PagedCache(model, pool=pool) as cache, torch.no_grad():
            model(input_ids=prompt, cache=cache, use_cache=True)
    assert snapshots(pool) == 3 and pool.states.ids.prefix_stats().evictions == 1
    found = []
    for prompt in prompts:
        with PagedCache(model, pool=pool) as cache:
            found.append(cache.reuse_prefix(torch.cat([prompt, user_tokens(2, 0)], dim=1)))
    assert found == [0, 32, 32, 32]  # the first prompt's blocks are still cached, its states are not
