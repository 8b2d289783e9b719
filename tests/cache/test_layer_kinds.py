"""Every layer kind transformers caches, through ``generate(cache=PagedCache(model))``: exact against the model's
own default cache, conv / recurrent states kept per sequence in the pool's state slots with the guarantees of
blocks (shared by forks and beams until written, nothing changed by a failed forward, nothing leaked)."""

import pytest
import torch
from layer_kind_models import LAYER_KIND_CONFIGS
from tiny_models import TINY_CONFIGS, ragged_batch, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

from hf_paged_cache import KVLayout, PagedCache, PoolExhaustedError, bytes_per_block, set_paged_attention
from hf_paged_cache.cache.state_probe import state_bytes_per_sequence
from hf_paged_cache.kinds import KINDS, keeps_states

# What PagedCache refuses, at PagedCache(model), with the reason
REFUSED = {
    "minimax": "MiniMaxForCausalLM keeps its own cache class \\(MiniMaxCache\\)",
    "inkling2_loop_text": "runs some of its layers 2 times per forward",
    "dots3_note_text": "has layers of different attention shapes \\(per-layer configs\\)",
    "deepseek_v4": "has layers of type \\['compressed_sparse_attention', 'heavily_compressed_attention'\\]",
}
# What PagedCache refuses at the model's first forward, with the reason (the model's code shows it only then)
REFUSED_AT_FIRST_FORWARD = {"qwen4_exp_text": "keeps its indexer's position ids on the cache layer"}
SUPPORTED = [t for t in LAYER_KIND_CONFIGS if t not in REFUSED and t not in REFUSED_AT_FIRST_FORWARD]
# the models with state layers whose attention layers dispatch through transformers' AttentionInterface (most
# hybrids keep an attention of their own, which reads the dense keys and values: exact too)
PAGED_SDPA = ["lfm2", "lfm3", "granitemoehybrid", "zaya"]
NOT_STORED_YET = {"compressed_sparse_attention", "heavily_compressed_attention"}
PADS = [0, 3, 5]
GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)


class Injected(Exception):
    """The failure a test injects in the middle of a forward."""


def layer_types(model_type: str) -> set[str]:
    return set(get_layer_types_and_kwargs(tiny_model(model_type).config.get_text_config(decoder=True))[0])


def assert_same(reference, paged):
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    assert len(paged.logits) == len(reference.logits)
    for step, (ours, theirs) in enumerate(zip(paged.logits, reference.logits)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=f"logits differ at step {step}")


def test_every_kind_of_transformers_is_stored_or_refused_and_tested():
    # transformers' own table (models register more kinds when their modules load: DeepSeek-V4's)
    assert set(KINDS) <= set(DYNAMIC_LAYER_TYPE_MAPPING) <= set(KINDS) | NOT_STORED_YET
    tested = set().union(*(layer_types(t) for t in [*SUPPORTED, *TINY_CONFIGS]))
    assert tested >= set(KINDS)
    assert len(SUPPORTED) >= 25


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_greedy_tokens_and_logits_equal_the_default_cache(model_type):
    model = tiny_model(model_type)
    batch = ragged_batch(PADS, 12)
    reference = model.generate(**batch, **GREEDY)  # the model's own default cache
    with PagedCache(model) as cache:
        assert_same(reference, model.generate(**batch, cache=cache, **GREEDY))
        stats = cache.stats()
        assert stats.state_slots_in_use == (len(PADS) if keeps_states(model.config) else 0)
    pool = cache.pool
    assert pool.states.ids.num_used == 0 and all(blocks.num_used == 0 for blocks in pool.groups)


@pytest.mark.parametrize("model_type", PAGED_SDPA)
def test_paged_attention_beside_state_layers(model_type):
    model = tiny_model(model_type)
    batch = ragged_batch(PADS, 12)
    reference = model.generate(**batch, **GREEDY)
    set_paged_attention(model)
    with PagedCache(model) as cache:
        paged = model.generate(**batch, cache=cache, **GREEDY)
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.logits, reference.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_paged_attention_refuses_layers_that_reuse_other_layers_keys_and_values(model_type):
    with pytest.raises(NotImplementedError, match="has dummy \\(KV sharing\\) layers, which 'paged_sdpa' cannot"):
        set_paged_attention(tiny_model(model_type))


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "deepseek_v32"])
@pytest.mark.parametrize(
    "settings",
    [dict(num_beams=3, num_return_sequences=2, do_sample=False), dict(do_sample=True, num_return_sequences=3)],
    ids=["beams", "samples"],
)
def test_beams_and_samples_fork_states_as_the_default_cache_does(model_type, settings):
    model = tiny_model(model_type)
    batch = ragged_batch(PADS, 12)
    torch.manual_seed(7)
    reference = model.generate(**batch, max_new_tokens=10, **settings)
    torch.manual_seed(7)
    with PagedCache(model) as cache:
        paged = model.generate(**batch, cache=cache, max_new_tokens=10, **settings)
        rows = len(PADS) * settings["num_return_sequences"]
        assert cache.stats().state_slots_in_use <= rows * settings.get("num_beams", 1)
    torch.testing.assert_close(paged, reference, rtol=0, atol=0)
    assert cache.pool.states.ids.num_used == 0


def step_after(prompt: dict, token: int) -> dict:
    rows, length = prompt["input_ids"].shape
    return {"input_ids": torch.full((rows, 1), token),
            "attention_mask": torch.cat([prompt["attention_mask"], torch.ones(rows, 1, dtype=torch.long)], dim=1)}


def dense_logits(model, *forwards: dict) -> torch.Tensor:
    """The last of `forwards`' logits on a DynamicCache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for inputs in forwards:
            out = model(**inputs, cache=cache, use_cache=True)
    return out.logits


def test_a_fork_shares_its_states_until_either_side_writes():
    model = tiny_model("qwen3_next")
    prompt = ragged_batch([0, 2], 10)
    step = step_after(prompt, 7)
    with PagedCache(model) as cache, torch.no_grad():
        model(**prompt, cache=cache, use_cache=True)
        slots = cache.pool.states.ids
        assert slots.num_used == 2
        twin = cache.fork()
        assert slots.num_used == 2 and twin.stats().state_slots_in_use == 2  # shared, not copied
        forked = model(**step, cache=twin, use_cache=True)
        assert slots.num_used == 4  # the twin wrote: it took slots of its own
        original = model(**step, cache=cache, use_cache=True)
        assert slots.num_used == 4  # the original's slots are its own again: written in place
        expected = dense_logits(model, prompt, step)
        torch.testing.assert_close(forked.logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(original.logits, expected, rtol=0, atol=0)
        twin.release()
        assert slots.num_used == 2


def committed_states(cache: PagedCache) -> list[torch.Tensor]:
    states = []
    for layer in cache.pool.layout.state_layers:
        view = cache.layers[layer]
        states += [t for t in (*view.conv_states.values(), *view.recurrent_states.values()) if t is not None]
    return states


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "lfm2"])
@pytest.mark.parametrize("where", ["first layer", "last layer", "head"])
@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt])
def test_a_failed_forward_leaves_states_slots_and_blocks_as_they_were(model_type, where, error):
    model = tiny_model(model_type)
    prompt = ragged_batch([0, 3], 12)
    step = step_after(prompt, 9)
    layers = model.base_model.layers
    module = {"first layer": layers[0], "last layer": layers[-1], "head": model.get_output_embeddings()}[where]

    def fail(*args):
        raise error("injected")

    with PagedCache(model) as cache, torch.no_grad():
        model(**prompt, cache=cache, use_cache=True)
        before = committed_states(cache), cache.batch.states.slots[:], cache.pool.states.ids.num_used
        blocks = [b.num_used for b in cache.pool.groups]
        handle = module.register_forward_hook(fail)  # after the module ran: its states are written
        with pytest.raises(error):
            model(**step, cache=cache, use_cache=True)
        handle.remove()
        cache.get_seq_length()  # a read on this thread rolls back what a KeyboardInterrupt left
        after = committed_states(cache), cache.batch.states.slots, cache.pool.states.ids.num_used
        assert after[1:] == before[1:] and [b.num_used for b in cache.pool.groups] == blocks
        for ours, theirs in zip(after[0], before[0], strict=True):
            assert torch.equal(ours, theirs)
        out = model(**step, cache=cache, use_cache=True)
    torch.testing.assert_close(out.logits, dense_logits(model, prompt, step), rtol=0, atol=0)


def test_a_failed_first_forward_holds_no_slot_and_keeping_a_forward_allocates_nothing():
    model = tiny_model("qwen3_next")
    prompt = ragged_batch([0, 2], 10)

    def fail(*args):
        raise Injected("injected in the head")

    with PagedCache(model) as cache, torch.no_grad():
        handle = model.get_output_embeddings().register_forward_hook(fail)  # after every layer wrote its states
        with pytest.raises(Injected):
            model(**prompt, cache=cache, use_cache=True)
        handle.remove()
        assert cache.pool.states.ids.num_used == 0 and cache.batch_size == 0
        assert cache.pool.states.tensors  # the slots were made while the forward ran, not when it would be kept
        out = model(**prompt, cache=cache, use_cache=True)
    torch.testing.assert_close(out.logits, dense_logits(model, prompt), rtol=0, atol=0)


def test_pool_exhaustion_takes_no_state_slot():
    model = tiny_model("qwen3_next")
    with PagedCache(model, num_blocks=2) as cache, torch.no_grad():  # one usable block: 16 tokens
        with pytest.raises(PoolExhaustedError):
            model(**ragged_batch([0, 0], 12), cache=cache, use_cache=True)
        assert cache.pool.states.ids.num_used == 0 and cache.batch_size == 0


def test_a_memory_budget_holds_the_state_slots_and_the_blocks():
    model = tiny_model("qwen3_next")
    per_sequence = state_bytes_per_sequence(model)
    per_block = bytes_per_block(KVLayout.from_config(model.config), 16, torch.float32)
    budget = 3 * per_sequence + 20 * per_block  # two sequences' slots and the null slot, then 20 blocks
    with PagedCache(model, max_memory=budget, max_sequences=2) as cache, torch.no_grad():
        assert cache.pool.num_blocks == 20 and cache.pool.states.ids.capacity == 2
        with pytest.raises(PoolExhaustedError, match="needs 3 slots for sequence states .* only 2 of 2 are free"):
            model(**ragged_batch([0, 1, 2], 12), cache=cache, use_cache=True)
        assert cache.pool.states.ids.num_used == 0 and cache.pool.blocks.num_used == 0 and cache.batch_size == 0
        model(**ragged_batch([0, 1], 12), cache=cache, use_cache=True)
        assert cache.pool.storage_bytes() == budget  # every block and slot made: within the budget, exactly
    with pytest.raises(ValueError, match="does not hold the states of max_sequences=2"):
        PagedCache(model, max_memory=3 * per_sequence, max_sequences=2)


def test_stats_count_state_slots_with_the_blocks():
    model = tiny_model("qwen3_next")
    prompt = ragged_batch(PADS, 12)
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**prompt, cache=dense, use_cache=True)
    per_row = sum(t[0].numel() * t.element_size() for layer in dense.layers if hasattr(layer, "conv_states")
                  for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None)
    with PagedCache(model) as cache, torch.no_grad():
        model(**prompt, cache=cache, use_cache=True)
        stats = cache.stats()
        assert stats.state_slots_in_use == 3 and stats.bytes_per_state_slot == per_row
        blocks = sum(group.bytes_reserved for group in stats.groups)
        assert stats.bytes_reserved == blocks + 3 * per_row
        assert stats.pool_bytes >= cache.pool.states.nbytes() >= 4 * per_row  # the null slot too


def test_what_a_state_cannot_do_is_refused_by_name():
    model = tiny_model("lfm2")
    prompt = ragged_batch([0], 10)
    with PagedCache(model) as cache, torch.no_grad():
        model(**prompt, cache=cache, use_cache=True)
        with pytest.raises(NotImplementedError, match="cannot go back to an earlier position"):
            cache.crop(-1)
        cache.crop(0)  # removes nothing: fine
        with pytest.raises(NotImplementedError, match="states cannot give back rejected drafts"):
            cache.expect_drafts(2)


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_unsupported_models_are_refused_at_construction_with_the_reason(model_type):
    model = tiny_model(model_type)
    with pytest.raises(NotImplementedError, match=REFUSED[model_type]):
        PagedCache(model)


@pytest.mark.parametrize("model_type", list(REFUSED_AT_FIRST_FORWARD))
def test_what_the_model_code_shows_only_when_it_runs_is_refused_then_changing_nothing(model_type):
    model = tiny_model(model_type)
    with PagedCache(model) as cache:
        with pytest.raises(NotImplementedError, match=REFUSED_AT_FIRST_FORWARD[model_type]):
            model.generate(**ragged_batch(PADS, 12), cache=cache, max_new_tokens=2)
        assert cache.batch_size == 0 and all(blocks.num_used == 0 for blocks in cache.pool.groups)


def test_indexer_keys_share_the_blocks_of_their_tokens():
    model = tiny_model("deepseek_v32")
    prompt = ragged_batch([0, 3], 20)
    step = step_after(prompt, 11)
    with PagedCache(model) as cache, torch.no_grad():
        model(**prompt, cache=cache, use_cache=True)
        stats = cache.stats()
        layout = cache.pool.layout
        assert stats.groups[0].bytes_per_block == 16 * layout.bytes_per_token(torch.float32)
        assert layout.bytes_per_token(torch.float32) > KVLayout(layout.layers).bytes_per_token(torch.float32)
        twin = cache.fork()  # shares every block, indexer keys included; each side copies its partial last block
        forked = model(**step, cache=twin, use_cache=True)
        original = model(**step, cache=cache, use_cache=True)
    expected = dense_logits(model, prompt, step)
    torch.testing.assert_close(forked.logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(original.logits, expected, rtol=0, atol=0)



@pytest.mark.parametrize(
    "model_type, message",
    [("deepseek_v32", "indexed-attention \\(DSA\\) layers, which the continuous batcher does not run yet"),
     ("recurrent_gemma", "keeps the states of layers \\[0\\] in its own modules")],
)
def test_the_batcher_refuses_what_it_cannot_run_exactly(model_type, message):
    from hf_paged_cache import ContinuousBatcher

    model = tiny_model(model_type)
    with pytest.raises(NotImplementedError, match=message):
        ContinuousBatcher(model)
