"""Greedy generation through PagedCache is token-identical to DynamicCache, with float32 logits within 1e-5."""

import math

import pytest
import torch
from transformers import DynamicCache

from hf_paged_cache import PagedCache, set_paged_attention
from tiny_models import TINY_CONFIGS, ragged_batch, tiny_model

PADS = [0, 4, 9]  # three rows, three different amounts of left padding
PROMPT = 20
NEW_TOKENS = 40  # crosses several 16-token block boundaries


def generate(model, cache, **overrides):
    kwargs = dict(
        **ragged_batch(PADS, PROMPT),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return model.generate(**kwargs, **overrides, cache=cache)


def assert_same_generation(reference, paged):
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    assert len(paged.scores) == len(reference.scores) == NEW_TOKENS
    for step, (ours, theirs) in enumerate(zip(paged.scores, reference.scores)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=f"logits differ at step {step}")


@pytest.mark.parametrize("attention", ["default", "paged_sdpa"])
@pytest.mark.parametrize("model_type", list(TINY_CONFIGS))
def test_greedy_matches_dynamic_cache(model_type, attention):
    model = tiny_model(model_type)
    if attention == "paged_sdpa":
        if model_type == "falcon":
            pytest.skip("Falcon cannot run paged_sdpa (see test_falcon_refuses_paged_sdpa)")
        if model_type == "llama4_text":
            pytest.skip("chunked attention keeps the model's own mask (see tests/cache/test_chunked_attention.py)")
        set_paged_attention(model)
        assert model.config._attn_implementation == "paged_sdpa"
    reference = generate(model, DynamicCache(config=model.config))
    with PagedCache(model) as cache:
        paged = generate(model, cache)
        assert_same_generation(reference, paged)

        # Padding takes no blocks: each row holds ceil(real tokens / block_size) blocks, + 1 at most.
        fed = PROMPT + NEW_TOKENS - 1  # generate never feeds back its last token
        for row, pad in enumerate(PADS):
            assert cache.block_tables.num_tokens[row] == fed - pad
            assert len(cache.block_tables.tables[row]) <= math.ceil((fed - pad) / 16) + 1
    assert cache.pool.blocks.num_free == cache.pool.blocks.capacity


def test_falcon_refuses_paged_sdpa():
    model = tiny_model("falcon")
    with pytest.raises(NotImplementedError, match="FalconForCausalLM.*AttentionInterface"):
        set_paged_attention(model)


def test_load_with_paged_sdpa_by_name():
    model = tiny_model("llama", attn_implementation="paged_sdpa")
    assert model.config._attn_implementation == "paged_sdpa"
    reference = generate(tiny_model("llama"), DynamicCache(config=model.config))
    with PagedCache(model) as cache:
        assert_same_generation(reference, generate(model, cache))


def test_set_attn_implementation_by_name():
    model = tiny_model("qwen3")
    reference = generate(model, DynamicCache(config=model.config))
    model.set_attn_implementation("paged_sdpa")
    with PagedCache(model) as cache:
        assert_same_generation(reference, generate(model, cache))


def test_eager_attention():
    model = tiny_model("llama", attn_implementation="eager")
    reference = generate(model, DynamicCache(config=model.config))
    with PagedCache(model) as cache:
        assert_same_generation(reference, generate(model, cache))


def test_past_key_values_spelling():
    model = tiny_model("llama")
    reference = generate(model, DynamicCache(config=model.config))
    with PagedCache(model) as cache:
        paged = model.generate(
            **ragged_batch(PADS, PROMPT),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            past_key_values=cache,
        )
        assert_same_generation(reference, paged)


def test_cache_from_config_stores_padding_but_stays_exact():
    model = tiny_model("mistral")
    reference = generate(model, DynamicCache(config=model.config))
    with PagedCache(model.config) as cache:
        assert_same_generation(reference, generate(model, cache))
        # without the model there is no view of the attention mask: every position is stored
        assert cache.block_tables.num_tokens == [PROMPT + NEW_TOKENS - 1] * len(PADS)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_chunked_prefill_then_decode_with_plain_forwards(model_type):
    """Forward a ragged prompt in chunks, then decode token by token; compare to DynamicCache."""
    model = tiny_model(model_type)
    batch = ragged_batch(PADS, PROMPT)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    for name, cache in [("dynamic", DynamicCache(config=model.config)), ("paged", PagedCache(model))]:
        steps = []
        with torch.no_grad():
            for start, end in [(0, 7), (7, 16), (16, PROMPT)]:  # uneven chunks that straddle blocks
                out = model(
                    input_ids=ids[:, start:end],
                    attention_mask=mask[:, :end],
                    position_ids=positions[:, start:end],
                    cache=cache,
                    use_cache=True,
                )
                steps.append(out.logits)
            next_ids, next_mask, next_pos = ids[:, -1:], mask, positions[:, -1:]
            for _ in range(20):
                next_ids = out.logits[:, -1:].argmax(-1)
                next_mask = torch.cat([next_mask, torch.ones_like(next_ids)], dim=1)
                next_pos = next_pos + 1
                out = model(
                    input_ids=next_ids, attention_mask=next_mask, position_ids=next_pos, cache=cache, use_cache=True
                )
                steps.append(out.logits)
        logits[name] = steps
        if name == "paged":
            assert cache.block_tables.num_tokens == [PROMPT + 20 - pad for pad in PADS]
            cache.release()
    real = [mask[:, start:end].bool() for start, end in [(0, 7), (7, 16), (16, PROMPT)]]  # chunk positions to compare
    real += [torch.ones(len(PADS), 1, dtype=torch.bool)] * 20
    for ours, theirs, keep in zip(logits["paged"], logits["dynamic"], real, strict=True):
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=0, atol=1e-5)
