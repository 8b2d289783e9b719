"""A first forward whose rows repeat each other (generate's beams and samples) computes each distinct row once."""

import pytest
import torch
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from tiny_models import VOCAB, tiny_model

PROMPT = 40


def _rows_computed(model) -> list[int]:
    """A list that gains, at every forward of the model's decoder, the rows it computes."""
    rows = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append((args[0] if args else kwargs["input_ids"]).shape[0]),
        with_kwargs=True,
    )
    return rows


def _repeated_prompts() -> torch.Tensor:
    """``[4, PROMPT]``: rows 2 and 3 repeat row 0, row 1 differs."""
    prompt, other = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    return torch.stack([prompt, other, prompt, prompt])


MODES = {
    "beam_search": dict(num_beams=4, num_return_sequences=2, do_sample=False),
    "samples": dict(do_sample=True, num_return_sequences=3, temperature=0.8),
}


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("attention", [None, "paged_sdpa"])
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_prefills_each_prompt_once_and_matches_dynamic_cache(model_type, attention, mode):
    model = tiny_model(model_type, attn_implementation=attention)
    prompts = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    rows = _rows_computed(model)
    outputs, first_rows = [], []
    for cache in (DynamicCache(config=model.config), PagedCache(model, num_blocks=128)):
        torch.manual_seed(0)
        rows.clear()
        outputs.append(
            model.generate(
                prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, cache=cache,
                output_scores=True, return_dict_in_generate=True, **MODES[mode],
            )
        )
        first_rows.append(rows[0])
    reference, paged = outputs
    repeats = MODES[mode].get("num_beams") or MODES[mode]["num_return_sequences"]
    assert first_rows == [2 * repeats, 2]  # DynamicCache's prefill computes every repeat, ours each prompt once
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_forward_cut_to_its_distinct_rows_gives_every_row_and_shares_their_blocks():
    model = tiny_model("llama")
    batch = _repeated_prompts()
    rows = _rows_computed(model)
    with PagedCache(model, num_blocks=64) as cache, PagedCache(model, num_blocks=64) as distinct:
        logits = model(batch, cache=cache).logits
        assert rows == [2] and logits.shape[0] == 4 and cache.batch_size == 4
        torch.testing.assert_close(logits[2:], logits[:1].expand(2, -1, -1), rtol=0, atol=0)
        reference = model(batch, cache=DynamicCache(config=model.config)).logits
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
        model(batch[:2], cache=distinct)
        assert cache.stats().blocks_in_use == distinct.stats().blocks_in_use  # the repeats hold no block of their own
        # the next step runs on all four rows, each continuing its own sequence
        step = torch.tensor([[5], [6], [7], [8]])
        after = model(step, cache=cache).logits
        dense = DynamicCache(config=model.config)
        model(batch, cache=dense)
        torch.testing.assert_close(after, model(step, cache=dense).logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_cut_forward_that_raises_leaves_the_cache_empty_and_usable():
    model = tiny_model("llama")
    batch = _repeated_prompts()

    def fail(module, args, output):
        raise RuntimeError("a layer failed")

    with PagedCache(model, num_blocks=64) as cache:
        handle = model.model.layers[1].register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="a layer failed"):
            model(batch, cache=cache)
        handle.remove()
        assert cache.batch_size == 0 and cache.stats().blocks_in_use == 0 and cache.get_seq_length() == 0
        logits = model(batch, cache=cache).logits
        assert cache.batch_size == 4
    torch.testing.assert_close(logits, model(batch, cache=DynamicCache(config=model.config)).logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_forwards_that_ask_for_more_than_logits_or_continue_a_cache_stay_whole():
    model = tiny_model("llama")
    batch = _repeated_prompts()
    rows = _rows_computed(model)
    with PagedCache(model, num_blocks=64) as cache:
        out = model(batch, cache=cache, output_hidden_states=True)
        assert rows == [4] and out.hidden_states[-1].shape[0] == 4
        model(batch[:, -1:], cache=cache)  # a cache holding rows: its forwards are never cut
        assert rows == [4, 4]
    with PagedCache(model, num_blocks=64, manual_commit=True) as cache:
        model(batch, cache=cache)
        cache.commit()
        assert rows[-1] == 4 and cache.batch_size == 4
    with PagedCache(model, num_blocks=64) as cache:
        model(batch[:2], cache=cache)  # no row repeats another
        assert rows[-1] == 2
    with PagedCache(model, num_blocks=64) as cache:
        logits = model(batch, cache=cache, return_dict=False)[0]  # a tuple comes back
        assert rows[-1] == 4 and logits.shape[0] == 4
