"""Every `generate` mode gives the same tokens through PagedCache as through DynamicCache."""

import threading

import pytest
import torch
from generate_modes import MODES
from tiny_models import VOCAB, ragged_batch, tiny_model, tiny_tokenizer
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from hf_paged_cache import PagedCache

PADS = [0, 4, 9]


@pytest.fixture(scope="module", params=["sdpa", "paged_sdpa"])
def model(request):
    """The tiny Llama with stock SDPA (dense K/V from the cache) and with paged_sdpa (K/V read from the pool)."""
    return tiny_model("llama", attn_implementation=request.param)


def run_both(model, seed=0, batch=None, **kwargs):
    """Generate with DynamicCache and PagedCache from the same seed; return both outputs."""
    batch = batch if batch is not None else ragged_batch(PADS, 20)
    outputs = []
    for cache in (DynamicCache(config=model.config), PagedCache(model, num_blocks=128)):
        torch.manual_seed(seed)
        outputs.append(
            model.generate(**batch, **kwargs, cache=cache, return_dict_in_generate=True, output_scores=True)
        )
        if isinstance(cache, PagedCache):
            cache.release()
    return outputs


def assert_same(reference, paged):
    assert paged.sequences.shape == reference.sequences.shape
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_matches_dynamic_cache(model, mode):
    reference, paged = run_both(model, max_new_tokens=30, **MODES[mode])
    assert_same(reference, paged)


def test_output_logits(model):
    reference, paged = run_both(model, max_new_tokens=20, output_logits=True, do_sample=False)
    for ours, theirs in zip(paged.logits, reference.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


class StopAfterToken(StoppingCriteria):
    """Stops the whole batch once any row generated `token`."""

    def __init__(self, token: int, prompt_length: int):
        self.token, self.prompt_length = token, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        seen = (input_ids[:, self.prompt_length :] == self.token).any()
        return seen.expand(input_ids.shape[0])


def test_custom_stopping_criteria(model):
    (full,) = run_both(model, max_new_tokens=30, do_sample=False)[:1]
    stop_token = int(full.sequences[0, 20 + 6])  # row 0's 7th new token
    criteria = StoppingCriteriaList([StopAfterToken(stop_token, 20)])
    reference, paged = run_both(model, max_new_tokens=30, do_sample=False, stopping_criteria=criteria, pad_token_id=0)
    assert paged.sequences.shape[1] < 50  # it really stopped early
    assert_same(reference, paged)


def test_stop_strings(model):
    tokenizer, batch = tiny_tokenizer(), ragged_batch([0], 20)
    (full,) = run_both(model, batch=batch, max_new_tokens=30, do_sample=False)[:1]
    stop = tokenizer.decode(full.sequences[0, 20 + 5 : 20 + 7])  # two characters generated mid-way
    kwargs = dict(batch=batch, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    reference, paged = run_both(model, **kwargs)
    assert paged.sequences.shape[1] < 50
    assert_same(reference, paged)


@pytest.mark.parametrize("assistant", ["draft_model", "prompt_lookup"])
def test_assisted_decoding(model, assistant):
    """Speculative decoding crops the cache after rejected draft tokens."""
    kwargs = {"assistant_model": tiny_model("llama", seed=1)} if assistant == "draft_model" else {"prompt_lookup_num_tokens": 3}
    batch = ragged_batch([0], 20)
    reference, paged = run_both(model, batch=batch, max_new_tokens=30, do_sample=False, **kwargs)
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)


def test_streamer(model):
    tokenizer = tiny_tokenizer()
    batch = ragged_batch([0], 12)
    with PagedCache(model) as cache:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        kwargs = dict(**batch, max_new_tokens=15, do_sample=False, cache=cache, streamer=streamer)
        thread = threading.Thread(target=model.generate, kwargs=kwargs)
        thread.start()
        streamed = "".join(streamer)
        thread.join(timeout=60)
    reference = model.generate(**batch, max_new_tokens=15, do_sample=False, cache=DynamicCache(config=model.config))
    assert streamed == tokenizer.decode(reference[0, 12:])


def test_multi_turn_conversation_reuses_the_returned_cache(model):
    """Turn 2 passes turn 1's cache back with a longer (ragged) prompt: only the new tokens are computed."""
    turn1 = ragged_batch(PADS, 12)
    user2 = torch.randint(3, VOCAB, (len(PADS), 5), generator=torch.Generator().manual_seed(7))
    results = []
    for cache in (DynamicCache(config=model.config), PagedCache(model)):
        first = model.generate(**turn1, max_new_tokens=10, do_sample=False, cache=cache, return_dict_in_generate=True)
        ids = torch.cat([first.sequences, user2], dim=1)
        mask = torch.cat([turn1["attention_mask"], torch.ones(len(PADS), 15, dtype=torch.long)], dim=1)
        length_before = cache.get_seq_length()
        second = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache=first.cache,
            return_dict_in_generate=True, output_scores=True,
        )
        assert length_before == 21  # turn 1's prompt + 9 fed-back tokens: turn 2 computed only the rest
        results.append(second)
    assert_same(*results)


def test_prefilled_prompt_sampled_8_times_shares_its_blocks(model):
    """Prefill once into B rows, then generate(num_return_sequences=8): rows are shared, not copied."""
    batch = ragged_batch([0, 3], 40)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    torch.manual_seed(3)
    reference = model.generate(
        **batch, max_new_tokens=12, do_sample=True, num_return_sequences=8, cache=DynamicCache(config=model.config),
        return_dict_in_generate=True, output_scores=True,
    )
    with PagedCache(model, num_blocks=64) as cache:
        with torch.no_grad():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them from the mask
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], cache=cache)
        assert cache.stats().blocks_in_use == 3 + 3  # 39 and 36 real tokens: 3 blocks each
        torch.manual_seed(3)
        paged = model.generate(
            **batch, max_new_tokens=12, do_sample=True, num_return_sequences=8, cache=cache,
            return_dict_in_generate=True, output_scores=True,
        )
        assert_same(reference, paged)
        # 16 rows, yet each prompt's 2 full blocks are stored once; every row owns its own tail blocks
        rows = cache.block_tables.tables
        assert len(rows) == 16
        assert all(row[:2] == rows[0][:2] for row in rows[:8])
        assert all(row[:2] == rows[8][:2] for row in rows[8:])
        # prompt 0: 40 + 11 fed tokens = 51 -> 2 shared + 2 private blocks per row
        # prompt 1: 37 + 11 fed tokens = 48 -> 2 shared + 1 private block per row
        assert cache.block_tables.num_tokens == [51] * 8 + [48] * 8
        assert cache.stats().blocks_in_use == 2 * 2 + 8 * 2 + 8 * 1  # vs 8 * 4 + 8 * 3 = 56 unshared


def test_other_batch_changes_stay_errors(model):
    with PagedCache(model) as cache:
        with torch.no_grad():
            model(**ragged_batch([0, 3], 10), cache=cache, use_cache=True)
            with pytest.raises(ValueError, match="holds 2 sequences but the forward has batch size 3"):
                model(**ragged_batch([0, 0, 0], 1), cache=cache, use_cache=True)


def test_use_cache_false_with_a_cache_is_an_error(model):
    with PagedCache(model) as cache:
        with pytest.raises(ValueError, match="use_cache=False"):
            model.generate(**ragged_batch(PADS, 20), max_new_tokens=3, use_cache=False, cache=cache)


def test_chunked_prefill_in_generate(model):
    reference, paged = run_both(model, max_new_tokens=12, do_sample=False, prefill_chunk_size=8)
    assert_same(reference, paged)
