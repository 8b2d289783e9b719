"""Rows that share their keys (beams, samples of one prompt) attend them once: the shared prefix in decode steps
(cascade), and a repeated prompt in the first forward."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.attention.reading import CASCADE_MIN_SHARED, ZERO_COPY_MAX_ROWS
from hf_paged_cache.attention.softmax import attention_with_lse, merge_attention
from hf_paged_cache.cache.block_table import RowsView
from hf_paged_cache.cache.forward import SlotIndex
from call_counters import count_strategy
from tiny_models import VOCAB, tiny_model

PROMPT = CASCADE_MIN_SHARED + 36  # long enough for the beams to share CASCADE_MIN_SHARED keys and more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_two_halves_gives_attention_over_both(dtype):
    torch.manual_seed(0)
    query = torch.randn(2, 3, 4, 16, dtype=dtype)  # [B, H, q, D]
    keys, values = torch.randn(2, 3, 40, 16, dtype=dtype), torch.randn(2, 3, 40, 16, dtype=dtype)
    seen = torch.rand(2, 1, 1, 15) > 0.3
    seen[..., 0] = True  # every query sees a key of the second part
    whole_mask = torch.cat([torch.ones(2, 1, 1, 25, dtype=torch.bool), seen], dim=-1)
    whole = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=whole_mask)
    first = attention_with_lse(query, keys[:, :, :25], values[:, :, :25], None, 16**-0.5)
    additive = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))  # as a step builds its tail mask
    second = attention_with_lse(query, keys[:, :, 25:], values[:, :, 25:], additive, 16**-0.5)
    merged = merge_attention(*first, *second)
    assert merged.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(merged.float(), whole, rtol=0, atol=tolerance)


def _decode_index(slots: torch.Tensor, is_real: torch.Tensor) -> SlotIndex:
    """A decode step's index whose rows' real tokens sit at `slots` ``[B, L]`` (blocks of one slot each)."""
    tables = [row[real].tolist() for row, real in zip(slots, is_real)]
    rows = RowsView(tables, [len(table) for table in tables], block_size=1)
    return SlotIndex(torch.zeros(0, dtype=torch.long), None, rows, is_real, past_length=is_real.shape[1] - 1)


def test_a_decode_step_finds_the_keys_its_rows_share():
    shared = torch.arange(100, 100 + 80).expand(3, 80)  # 80 positions in consecutive slots, all rows alike
    own = torch.tensor([[500, 501], [600, 601], [700, 701]])  # then each row's own
    slots = torch.cat([shared, own], dim=1)  # [3, 82]
    plan = _decode_index(slots, torch.ones(3, 82, dtype=torch.bool)).decode_reads(0, window=None)
    assert plan.runs is None and plan.shared is not None
    assert (plan.shared.first, plan.shared.count) == (100, 80)
    assert plan.shared.tail_slots.tolist() == own.reshape(-1).tolist()
    assert plan.shared.tail_mask.shape == (3, 1, 1, 2)


def test_the_shared_keys_stop_at_a_gap_in_the_slots_and_never_take_the_new_token():
    slots = torch.arange(100, 100 + 90).expand(2, 90).clone()
    slots[:, 70:] += 1000  # rows alike, but the run of consecutive slots breaks at position 70
    plan = _decode_index(slots, torch.ones(2, 90, dtype=torch.bool)).decode_reads(0, None)
    assert plan.shared.count == 70
    # rows alike to the end, too many to attend each from a view: the new token stays a tail
    rows = ZERO_COPY_MAX_ROWS + 1
    identical = torch.arange(100, 100 + 90).expand(rows, 90)
    plan = _decode_index(identical, torch.ones(rows, 90, dtype=torch.bool)).decode_reads(0, None)
    assert plan.runs is None and plan.shared.count == 89


def test_no_cascade_for_rows_that_share_too_little_padding_or_a_window():
    slots = torch.arange(100, 100 + 80).expand(2, 80).clone()
    slots[1, CASCADE_MIN_SHARED - 1 :] += 1000  # too little shared
    assert _decode_index(slots, torch.ones(2, 80, dtype=torch.bool)).decode_reads(0, None).shared is None
    padding = torch.ones(2, 80, dtype=torch.bool)
    padding[1, :4] = False  # left padding: the rows' first keys differ
    assert _decode_index(torch.arange(100, 180).expand(2, 80), padding).decode_reads(0, None).shared is None
    alike = torch.arange(100, 180).expand(2, 80)
    assert _decode_index(alike, torch.ones(2, 80, dtype=torch.bool)).decode_reads(0, window=40).shared is None


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """A list that gains an entry at every call of ``owner.name`` from now on (wrapped for the test)."""
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture
def cascades(monkeypatch):
    """Counts decode attentions that took the cascade."""
    return count_strategy(monkeypatch, "cascade")


MODES = {
    "beam_search": dict(num_beams=4, num_return_sequences=2, do_sample=False),
    "samples": dict(do_sample=True, num_return_sequences=3, temperature=0.8),
}


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("mode", list(MODES))
def test_generate_with_shared_prompts_matches_dynamic_cache(model_type, mode, cascades):
    model = tiny_model(model_type, attn_implementation="paged_sdpa")
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    outputs = []
    for cache in (DynamicCache(config=model.config), PagedCache(model, num_blocks=128)):
        torch.manual_seed(0)
        outputs.append(
            model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, cache=cache,
                output_scores=True, return_dict_in_generate=True, **MODES[mode],
            )
        )
    reference, paged = outputs
    assert cascades, "no decode step attended a shared prefix once"
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Counts SDPA calls made by attention from the pool."""
    return _count_calls(monkeypatch, F, "scaled_dot_product_attention")


def _repeated_prompts() -> torch.Tensor:
    """``[4, PROMPT]``: rows 2 and 3 repeat row 0, row 1 differs."""
    generator = torch.Generator().manual_seed(2)
    prompt, other = torch.randint(3, VOCAB, (2, PROMPT), generator=generator)
    return torch.stack([prompt, other, prompt, prompt])


def _whole_forward(model, batch: torch.Tensor, cache) -> torch.Tensor:
    """The logits of a first forward that computes every row: asking for hidden states keeps the model's hooks
    from cutting it to its distinct rows (`tests/attention/test_first_forward_repeats.py`), so attention sees the repeats."""
    return model(batch, cache=cache, output_hidden_states=True).logits


@torch.no_grad()
def test_a_first_forward_attends_a_repeated_prompt_once(sdpa_calls):
    model = tiny_model("llama", attn_implementation="paged_sdpa")
    batch = _repeated_prompts()
    paged = _whole_forward(model, batch, PagedCache(model, num_blocks=64))
    assert len(sdpa_calls) == 2 * model.config.num_hidden_layers  # rows 0 and 1; rows 2 and 3 reuse row 0's
    reference = model(batch, cache=DynamicCache(config=model.config)).logits
    torch.testing.assert_close(paged, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(paged[2:], paged[:1].expand(2, -1, -1), rtol=0, atol=0)


@torch.no_grad()
def test_a_repeated_prompt_whose_queries_differ_is_attended_on_its_own(sdpa_calls):
    model = tiny_model("llama", attn_implementation="paged_sdpa")
    last = model.model.layers[-1].self_attn.q_proj

    def nudge_row_2(module, args, output):  # its keys stay row 0's: only the last layer's queries differ
        output[2] += 0.01
        return output

    last.register_forward_hook(nudge_row_2)
    batch = _repeated_prompts()
    paged = _whole_forward(model, batch, PagedCache(model, num_blocks=64))
    assert len(sdpa_calls) == 2 * model.config.num_hidden_layers + 1  # row 2 in the last layer
    reference = model(batch, cache=DynamicCache(config=model.config)).logits
    torch.testing.assert_close(paged, reference, rtol=0, atol=1e-5)
    assert not torch.equal(paged[2], paged[0])
    torch.testing.assert_close(paged[3], paged[0], rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")])
@torch.no_grad()
def test_attending_a_repeated_prompt_once_changes_no_output(monkeypatch, sdpa_calls, model_type, dtype, kv_dtype):
    model = tiny_model(model_type, attn_implementation="paged_sdpa").to(dtype)
    batch = _repeated_prompts()
    reused = _whole_forward(model, batch, PagedCache(model, num_blocks=64, kv_dtype=kv_dtype))
    calls_reused = len(sdpa_calls)
    original = SlotIndex.queries

    def without_repeats(self):
        queries = original(self)
        return dataclasses.replace(queries, repeats=None)

    monkeypatch.setattr(SlotIndex, "queries", without_repeats)
    computed = _whole_forward(model, batch, PagedCache(model, num_blocks=64, kv_dtype=kv_dtype))
    assert calls_reused < len(sdpa_calls) - calls_reused  # the repeats were attended once
    torch.testing.assert_close(reused, computed, rtol=0, atol=0)
