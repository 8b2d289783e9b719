"""Layer groups: sliding-window layers keep only the blocks their window can still see, results unchanged.

The tiny models slide over 12 positions; with blocks of 4 tokens a sliding group row holds at most
ceil(12 / 4) + 1 = 4 blocks, while prompts of 40 tokens make every prefill longer than the window (its
first tokens get no slot at all: attention takes them from the layer's own states).
"""

import math

import pytest
import torch
from tiny_models import VOCAB, ragged_batch, tiny_model
from transformers import DynamicCache, StoppingCriteria

from hf_paged_cache import PagedCache, set_paged_attention
from hf_paged_cache.models.gemma3 import GEMMA3_DIRNAME
from hf_paged_cache.models.offline import default_cache_dir

SLIDING_MODELS = ["mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2"]
WINDOW, BLOCK = 12, 4
MAX_SLIDING_BLOCKS = math.ceil(WINDOW / BLOCK) + 1
PADS, PROMPT = [0, 5, 17], 40


def sliding_groups(cache: PagedCache) -> list[int]:
    return [g for g, group in enumerate(cache.pool.layer_groups) if group.window is not None]


class WatchBlocks(StoppingCriteria):
    """Records, after every forward, the most blocks any row holds in each sliding group."""

    def __init__(self, cache: PagedCache):
        self.cache, self.most = cache, 0

    def __call__(self, input_ids, scores, **kwargs):
        for g in sliding_groups(self.cache):
            tables = self.cache.batch.groups[g].tables
            self.most = max(self.most, *(sum(b != 0 for b in row) for row in tables))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def model_with(model_type: str, attention: str):
    model = tiny_model(model_type)
    if attention == "paged_sdpa":
        set_paged_attention(model)
    return model


def generate_both(model, batch, cache_kwargs=None, seed=0, watch=False, **kwargs):
    """(DynamicCache result, PagedCache result, most sliding blocks per row seen) from the same seed."""
    results, most = [], None
    for cache in (DynamicCache(config=model.config), PagedCache(model, block_size=BLOCK, **(cache_kwargs or {}))):
        torch.manual_seed(seed)
        extra = {}
        if watch and isinstance(cache, PagedCache):
            watcher = WatchBlocks(cache)
            extra["stopping_criteria"] = [watcher]
        results.append(
            model.generate(**batch, **kwargs, **extra, cache=cache, return_dict_in_generate=True, output_scores=True)
        )
        if watch and isinstance(cache, PagedCache):
            most = watcher.most
    return results[0], results[1], most


def assert_same(reference, paged):
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attention", ["default", "paged_sdpa"])
@pytest.mark.parametrize("model_type", SLIDING_MODELS)
def test_greedy_ragged_batch_beyond_the_window(model_type, attention):
    model = model_with(model_type, attention)
    reference, paged, most = generate_both(
        model, ragged_batch(PADS, PROMPT), watch=True, max_new_tokens=30, do_sample=False
    )
    assert_same(reference, paged)
    assert 0 < most <= MAX_SLIDING_BLOCKS  # during the whole decode, never more than the window's blocks
    cache = paged.cache
    stats = cache.stats()
    full = [g for g in stats.groups if g.name == "full attention"]
    for g in sliding_groups(cache):
        assert stats.groups[g].max_blocks_per_row <= MAX_SLIDING_BLOCKS
    for group in full:  # full attention keeps every token: 69, 64 and 52 tokens -> 18 + 16 + 13 blocks
        assert group.blocks_in_use == sum(math.ceil((PROMPT + 29 - pad) / BLOCK) for pad in PADS)
    cache.release()
    assert all(blocks.num_free == blocks.capacity for blocks in cache.pool.groups)


MODES = {
    "sampling": dict(do_sample=True, temperature=0.7, top_k=20),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3),
    "beam_search": dict(num_beams=4, num_return_sequences=2),
    "chunked_prefill": dict(do_sample=False, prefill_chunk_size=16),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
}


@pytest.mark.parametrize("attention", ["default", "paged_sdpa"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_generate_modes_on_hybrid_models(model_type, mode, attention):
    """Hybrid sliding and full layers: every mode gives DynamicCache's tokens and logits."""
    model = model_with(model_type, attention)
    batch = ragged_batch([0], PROMPT) if mode == "prompt_lookup" else ragged_batch(PADS, PROMPT)
    reference, paged, _ = generate_both(model, batch, max_new_tokens=20, **MODES[mode])
    assert_same(reference, paged)


@pytest.mark.parametrize("model_type", SLIDING_MODELS)
def test_multi_turn_chat_passes_the_cache_back(model_type):
    """Turn 2 feeds turn 1's cache back with a longer ragged prompt, past the window: only the new tokens run."""
    model = model_with(model_type, "paged_sdpa")
    turn1 = ragged_batch(PADS, PROMPT)
    user2 = torch.randint(3, VOCAB, (len(PADS), 9), generator=torch.Generator().manual_seed(7))
    results = []
    for cache in (DynamicCache(config=model.config), PagedCache(model, block_size=BLOCK)):
        first = model.generate(**turn1, max_new_tokens=8, do_sample=False, cache=cache, return_dict_in_generate=True)
        ids = torch.cat([first.sequences, user2], dim=1)
        mask = torch.cat([turn1["attention_mask"], torch.ones(len(PADS), 17, dtype=torch.long)], dim=1)
        results.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      cache=first.cache, return_dict_in_generate=True, output_scores=True))
    assert_same(*results)


def test_assisted_decoding_with_a_draft_model_keeps_what_crop_needs():
    """The draft's rejected tokens are cropped: the cache records the past until the crop, then trims."""
    model = model_with("gemma3_text", "paged_sdpa")
    draft = tiny_model("gemma3_text", seed=1)
    batch = ragged_batch([0], PROMPT)
    reference, paged, _ = generate_both(model, batch, max_new_tokens=24, do_sample=False, assistant_model=draft)
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for g in sliding_groups(paged.cache):
        assert paged.cache.stats().groups[g].max_blocks_per_row <= MAX_SLIDING_BLOCKS  # trimmed by the last crop


def test_crop_beyond_what_the_window_kept_is_refused_unless_recording():
    model = tiny_model("mistral")
    batch = ragged_batch([0], PROMPT)
    with PagedCache(model, block_size=BLOCK) as cache, torch.no_grad():
        model(**batch, cache=cache)  # the next query (position 40) sees tokens 29-39: blocks 7-9 are kept
        before = cache.stats()
        for remove in (10, 2):  # position 38 would see tokens 27-37, and block 6 (tokens 24-27) is gone
            with pytest.raises(ValueError, match="sliding window of 12 already gave back.*activate_past_recording"):
                cache.crop(-remove)
            assert cache.get_seq_length() == PROMPT and cache.stats() == before  # nothing changed
        cache.crop(-1)  # position 39 sees tokens 28-38: all kept
        assert cache.get_seq_length() == PROMPT - 1

    recorded = DynamicCache(config=model.config)
    with PagedCache(model, block_size=BLOCK) as cache, torch.no_grad():
        cache.activate_past_recording()
        recorded.activate_past_recording()
        for c in (cache, recorded):
            model(**batch, cache=c)
        assert cache.stats().groups[0].max_blocks_per_row == 10  # recording: every block kept until the crop
        for c in (cache, recorded):
            c.crop(-10)
        assert cache.get_seq_length() == recorded.get_seq_length() == PROMPT - 10
        assert cache.stats().groups[0].max_blocks_per_row == 4  # the crop trims to the window: tokens 16-29
        step = {"input_ids": torch.tensor([[5]])}
        ours, theirs = model(**step, cache=cache).logits, model(**step, cache=recorded).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_prompt_repeated_for_samples_is_stored_once():
    """generate(num_return_sequences=8) repeats the prompt 8 times; its blocks are stored once and shared."""
    model = tiny_model("llama")
    batch = ragged_batch([0], 64)
    reference, paged, _ = generate_both(model, batch, max_new_tokens=6, do_sample=True, num_return_sequences=8)
    assert_same(reference, paged)
    stats = paged.cache.stats()
    # 64 + 5 tokens per row: the prompt's 16 full blocks once, then each row's 2 own blocks (tokens 64-68)
    assert stats.blocks_in_use == 16 + 8 * 2
    assert len({tuple(row[:16]) for row in paged.cache.block_tables.tables}) == 1


def test_prefix_reuse_needs_the_window_blocks():
    """A sliding group's prefix hit needs only the blocks its window sees; the reused cache computes the rest."""
    model = tiny_model("gemma3_text")
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with PagedCache(model, block_size=BLOCK, num_blocks=64) as first, torch.no_grad():
        model(input_ids=prompt, cache=first)  # stores 10 full blocks in the full group, the last 3-4 in sliding ones
        longer = torch.cat([prompt, torch.tensor([[7, 8, 9]])], dim=1)
        reused = PagedCache(model, pool=first.pool)
        assert reused.reuse_prefix(longer) == PROMPT  # all 10 blocks: the sliding groups still hold 7-9 (28-39)
        ours = model(input_ids=longer[:, PROMPT:], cache=reused).logits
        theirs = model(input_ids=longer, cache=DynamicCache(config=model.config)).logits[:, PROMPT:]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        shorter = PagedCache(model, pool=first.pool)
        # a 24-token prefix would need the sliding groups' tokens 13-23 (blocks 3-5), which they never stored;
        # every shorter prefix needs some of blocks 0-6 too: nothing is reused
        assert shorter.reuse_prefix(prompt[:, :25]) == 0
        reused.release()
        shorter.release()


@pytest.mark.parametrize("attention", ["sdpa", "paged_sdpa"])
def test_chunks_that_end_inside_a_block_register_only_written_blocks(attention):
    """A chunked prefill whose chunk ends inside a block: the next chunk's first tokens land in that block, and
    the sliding group must write them there, since a later request that shares the prefix reads that block."""
    model = model_with("gemma3_text", attention)
    prompt = torch.randint(3, VOCAB, (1, 28), generator=torch.Generator().manual_seed(2))
    with PagedCache(model, block_size=BLOCK, num_blocks=64) as first, torch.no_grad():
        # chunk 1: tokens 0-13 (block 3 holds 12-13); chunk 2: tokens 14-27, of which the window keeps 17-27:
        # 14 and 15 fall in block 3, before the first block the window keeps, yet block 3 is held and full
        model(input_ids=prompt[:, :14], position_ids=torch.arange(14).unsqueeze(0), cache=first)
        model(input_ids=prompt[:, 14:], position_ids=torch.arange(14, 28).unsqueeze(0), cache=first)
        second = torch.cat([prompt[:, :20], torch.tensor([[7, 8, 9, 10, 11, 12]])], dim=1)
        with PagedCache(model, pool=first.pool) as reused:
            # 5 blocks (20 tokens): the sliding groups read tokens 9-19 from blocks 2-4, block 3 included
            assert reused.reuse_prefix(second) == 20
            ours = model(input_ids=second[:, 20:], position_ids=torch.arange(20, 26).unsqueeze(0), cache=reused)
        theirs = model(input_ids=second, cache=DynamicCache(config=model.config)).logits[:, 20:]
    torch.testing.assert_close(ours.logits, theirs, rtol=0, atol=1e-5)


def test_a_sliding_group_out_of_blocks_changes_nothing():
    """The full group has room, a sliding group does not: the step fails whole, every group as it was."""
    from hf_paged_cache import KVPool, PoolExhaustedError
    from hf_paged_cache.pool.memory import KVLayout

    model = tiny_model("gemma3_text")
    layout = KVLayout.from_config(model.config)
    pool = KVPool(layout, num_blocks=[64, 4], block_size=BLOCK, dtype=torch.float32)  # 3 sliding blocks usable
    with PagedCache(model, pool=pool) as cache, torch.no_grad():
        with pytest.raises(PoolExhaustedError, match="needs 9 blocks of 4 tokens for its sliding window 12 layers but only 3 of 3 are free"):
            model(**ragged_batch(PADS, PROMPT), cache=cache)  # 3 rows x 3 window blocks
        assert [blocks.num_used for blocks in pool.groups] == [0, 0]
        assert cache.get_seq_length() == 0 and cache.batch_size == 0
        model(**ragged_batch([0], PROMPT), cache=cache)  # one row fits
        assert [blocks.num_used for blocks in pool.groups] == [10, 3]


GEMMA3_DIR = default_cache_dir() / GEMMA3_DIRNAME


@pytest.mark.skipif(
    not (GEMMA3_DIR / "config.json").is_file(),
    reason="Gemma-3-270m is not converted on this machine (python scripts/bench/generate/bench_layer_groups.py --model "
    "gemma-3-270m converts it, about 100 s)",
)
@pytest.mark.parametrize("attention, dtype, tolerance", [
    ("sdpa", torch.float32, 0.0),  # the dense path reads what DynamicCache holds: bit for bit
    ("paged_sdpa", torch.float32, 1e-3),
    ("paged_sdpa", torch.float64, 1e-9),
])
def test_gemma3_270m_ragged_batch_beyond_the_window(attention, dtype, tolerance):
    """Real weights: 15 of 18 layers slide over 512 tokens; prompts of 700, 530 and 90 tokens.

    paged_sdpa attends each row over its real keys only, and SDPA's float32 CPU kernel splits its softmax by
    the key length, so float32 scores differ by float32 noise (2.4e-4 to 4.9e-4 measured on an AVX-512
    Xeon; eager and sdpa attention differ by 9e-5 on the same DynamicCache). In float64 they are exact.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(GEMMA3_DIR, dtype=dtype, attn_implementation="sdpa").eval()
    if attention == "paged_sdpa":
        set_paged_attention(model)
    lengths = [700, 530, 90]
    ids = torch.zeros(3, 700, dtype=torch.long)
    mask = torch.zeros_like(ids)
    generator = torch.Generator().manual_seed(0)
    for row, length in enumerate(lengths):
        ids[row, 700 - length :] = torch.randint(1000, 200_000, (length,), generator=generator)
        mask[row, 700 - length :] = 1
    results = []
    for cache in (DynamicCache(config=model.config), PagedCache(model)):
        results.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      cache=cache, return_dict_in_generate=True, output_scores=True))
    reference, paged = results
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for ours, theirs in zip(paged.scores, reference.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=tolerance)
    blocks = paged.cache.stats().groups
    assert [g.name for g in blocks] == ["full attention", "sliding window 512"]
    assert blocks[1].max_blocks_per_row <= math.ceil(512 / 16) + 1
