"""Chunked attention (Llama 4): a chunked layer is stored as a sliding window of its chunk size and attends with
the chunked mask transformers builds, on the model's default attention. Exact against `DynamicCache` in every
mode; the paged attentions, which would mask by window instead, are refused before anything changes."""

import pytest
import torch
from batcher_helpers import alone, assert_pool_empty, requests
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache

from hf_paged_cache import ContinuousBatcher, PagedCache, set_paged_attention
from hf_paged_cache.speculative import Speculator

CHUNK = 8  # TINY_CONFIGS["llama4_text"]["attention_chunk_size"]


def test_the_paged_attentions_refuse_chunked_layers():
    model = tiny_model("llama4_text")
    with pytest.raises(NotImplementedError, match="'llama4_text' has chunked_attention layers"):
        set_paged_attention(model)
    assert model.config._attn_implementation == "sdpa"  # left on its own attention

    model.config._attn_implementation = "paged_sdpa"  # set by hand, past the check: the forward is refused
    with PagedCache(model, num_blocks=32) as cache, torch.no_grad():
        with pytest.raises(NotImplementedError, match="cannot attend chunked_attention layers"):
            model(**ragged_batch([0, 3], 20), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 0 and cache.pool.blocks.num_used == 0


def test_a_read_from_inside_the_forward_does_not_roll_it_back():
    """Llama 4's layers without RoPE ask the cache for its length in the middle of the forward: the forward
    goes on and is kept (a read after an interrupted forward still rolls it back: tests/cache/test_hardening.py)."""
    model = tiny_model("llama4_text")
    assert not all(layer.self_attn.use_rope for layer in model.model.layers)  # a layer asks mid-forward
    with PagedCache(model, num_blocks=32, block_size=4) as cache, torch.no_grad():
        model(**ragged_batch([0, 3], 20), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 20 and all(layer.length == 20 for layer in cache.layers)
        windows = [group.window for group in cache.pool.layer_groups]
        assert sorted(windows, key=str) == sorted([CHUNK, None], key=str)  # chunks held as windows of 8


@pytest.mark.parametrize("mode", [dict(num_beams=3), dict(do_sample=True, num_return_sequences=2, top_k=20)])
def test_beams_and_samples_match_dynamic_cache(mode):
    model = tiny_model("llama4_text")
    batch = ragged_batch([0, 5, 11], 24, seed=2)
    kwargs = dict(**batch, max_new_tokens=20, min_new_tokens=20, output_scores=True, return_dict_in_generate=True,
                  **mode)
    torch.manual_seed(0)
    reference = model.generate(**kwargs, cache=DynamicCache(config=model.config))
    torch.manual_seed(0)
    with PagedCache(model, block_size=4) as cache:
        paged = model.generate(**kwargs, cache=cache)
    assert torch.equal(paged.sequences, reference.sequences)
    for ours, theirs in zip(paged.scores, reference.scores):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_the_batcher_serves_chunked_layers_as_generate_alone():
    """The batcher keeps the model's own attention (its steps run apart, not packed) and verifies n-gram drafts
    on it: every request's tokens are those of `generate` alone."""
    model = tiny_model("llama4_text")
    work = requests(12, seed=4)
    expected = [alone(model, prompt, max_new_tokens=new) for prompt, new in work]
    with ContinuousBatcher(model, num_blocks=96, block_size=4, max_step_tokens=16,
                           speculative=Speculator(3, adaptive=False)) as batcher:
        assert not batcher.pack_steps and model.config._attn_implementation == "sdpa"
        handles = [batcher.submit(prompt, max_new_tokens=new) for prompt, new in work]
        assert [handle.result() for handle in handles] == expected
        assert batcher.stats().speculation.steps > 0  # drafts were verified on the model's own attention
        assert_pool_empty(batcher)
