"""A packed forward (several caches' new tokens in one sequence) gives what each would get in its own forward."""

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from hf_paged_cache import PagedCache, PoolExhaustedError, set_paged_attention
from hf_paged_cache.cache.packed_caches import PackingUnsupported, Segment
from hf_paged_cache.cache.packed_forward import packed_forward

# sliding and full layers (gemma3_text), logit soft-capping (gemma2), attention sinks (gpt_oss)
ARCHITECTURES = ["llama", "qwen2", "gemma3_text", "gemma2", "gpt_oss"]


def prompts(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, n), generator=generator) for n in (20, 33, 50)]


def prefilled(model, pool, prompt: torch.Tensor) -> PagedCache:
    cache = PagedCache(model, pool=pool)
    model(input_ids=prompt, position_ids=torch.arange(prompt.shape[1]).unsqueeze(0), cache=cache, use_cache=True)
    return cache


def running(model, pool, first: torch.Tensor, second: torch.Tensor) -> PagedCache:
    """A cache of two decoding rows of different lengths (the shorter one left-padded)."""
    cache = prefilled(model, pool, first)
    cache.add_rows_from(prefilled(model, pool, second))
    return cache


def decode_segment(cache: PagedCache, ids: list[int], positions: list[int]) -> Segment:
    input_ids = torch.tensor([[i] for i in ids])  # [B, 1]
    mask = torch.cat([cache.is_real, torch.ones(len(ids), 1, dtype=torch.bool)], dim=1).long()  # [B, L + 1]
    return Segment(cache, input_ids, torch.tensor([[p] for p in positions]), mask)


def chunk_segment(cache: PagedCache, prompt: torch.Tensor, start: int, end: int) -> Segment:
    return Segment(cache, prompt[:, start:end], torch.arange(start, end).unsqueeze(0))


def own_forward(model, segment: Segment) -> torch.Tensor:
    """``[rows * length, vocab]``: the segment's logits from a forward of its own cache alone."""
    out = model(input_ids=segment.input_ids, attention_mask=segment.attention_mask,
                position_ids=segment.position_ids, cache=segment.cache, use_cache=True)
    return out.logits.reshape(-1, out.logits.shape[-1])


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@torch.no_grad()
def test_packed_logits_match_each_cache_alone(model_type):
    """Two packed steps: decode rows beside a prompt's first chunk (from empty), then beside its second."""
    model = tiny_model(model_type)
    set_paged_attention(model)
    first, second, third = prompts()
    pool = PagedCache(model).pool
    alone_run, alone_chunk = running(model, pool, first, second), PagedCache(model, pool=pool)
    packed_run, packed_chunk = running(model, pool, first, second), PagedCache(model, pool=pool)
    for ids, positions, (start, end) in [([5, 7], [20, 33], (0, 30)), ([9, 11], [21, 34], (30, 50))]:
        expected = torch.cat([
            own_forward(model, decode_segment(alone_run, ids, positions)),
            own_forward(model, chunk_segment(alone_chunk, third, start, end)),
        ])  # [2 + chunk, vocab]
        segments = [decode_segment(packed_run, ids, positions), chunk_segment(packed_chunk, third, start, end)]
        logits = packed_forward(model, segments, list(range(2 + end - start)))
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert packed_run.get_seq_length() == alone_run.get_seq_length()
    assert torch.equal(packed_run.is_real, alone_run.is_real)
    assert packed_chunk.get_seq_length() == alone_chunk.get_seq_length() == 50


@torch.no_grad()
def test_a_packed_forward_that_runs_out_of_blocks_leaves_every_cache_as_it_was():
    model = tiny_model("llama")
    set_paged_attention(model)
    first, second, third = prompts(seed=1)
    run = PagedCache(model, block_size=4, num_blocks=16)
    pool = run.pool
    run.add_rows_from(running(model, pool, first[:, :10], second[:, :12]))
    used, length, is_real = pool.groups[0].num_used, run.get_seq_length(), run.is_real.clone()
    chunk = PagedCache(model, pool=pool)
    segments = [decode_segment(run, [5, 7], [10, 12]), chunk_segment(chunk, third, 0, 50)]  # 13 blocks: too many
    with pytest.raises(PoolExhaustedError):
        packed_forward(model, segments, [0, 1])
    assert pool.groups[0].num_used == used
    assert (run.get_seq_length(), chunk.get_seq_length()) == (length, 0)
    assert torch.equal(run.is_real, is_real)
    # and the same step, with a chunk that fits, runs as if nothing had happened
    segments = [decode_segment(run, [5, 7], [10, 12]), chunk_segment(chunk, third, 0, 8)]
    logits = packed_forward(model, segments, [0, 1])
    alone = running(model, PagedCache(model, block_size=4).pool, first[:, :10], second[:, :12])
    torch.testing.assert_close(logits, own_forward(model, decode_segment(alone, [5, 7], [10, 12])))


@pytest.mark.parametrize("model_type, attention", [
    ("llama", "sdpa"),  # attention over dense K/V: nothing to read from the pool
    ("gpt_neox", None),  # calls cache.update() without the attention kwargs
    ("deepseek_v3", None),  # MLA: the cache stores a latent that attention expands itself
])
@torch.no_grad()
def test_models_that_cannot_pack_raise_and_keep_nothing(model_type, attention):
    model = tiny_model(model_type, attn_implementation=attention)
    if attention is None:
        set_paged_attention(model)
    first, second, third = prompts()
    pool = PagedCache(model).pool
    run, chunk = running(model, pool, first, second), PagedCache(model, pool=pool)
    used, length = [group.num_used for group in pool.groups], run.get_seq_length()
    with pytest.raises(PackingUnsupported):
        packed_forward(model, [decode_segment(run, [5, 7], [20, 33]), chunk_segment(chunk, third, 0, 9)], [0, 1])
    assert [group.num_used for group in pool.groups] == used
    assert (run.get_seq_length(), chunk.get_seq_length()) == (length, 0)
