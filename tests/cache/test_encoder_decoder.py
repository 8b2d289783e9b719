"""Encoder-decoder models (T5, BART, Marian, Whisper) through ``generate(cache=PagedCache(model))``: the decoder's
self-attention keys and values in blocks, the cross-attention ones once per request in a pool of their own, read
by every beam and sample of it; exact against the model's default `EncoderDecoderCache`."""

import copy

import pytest
import torch
from encoder_decoder_models import ENCODER_DECODER_CONFIGS, encoder_inputs, tiny_seq2seq
from transformers import DynamicCache, EncoderDecoderCache

from hf_paged_cache import PagedCache, PagedEncoderDecoderCache, PoolExhaustedError

MODEL_TYPES = list(ENCODER_DECODER_CONFIGS)
PADS = [0, 3, 6]
MODES = {
    "greedy": dict(do_sample=False),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "samples": dict(do_sample=True, num_return_sequences=2, top_k=20),
}


def generate(model, inputs, cache=None, seed=0, **settings):
    torch.manual_seed(seed)
    extra = {} if cache is None else {"cache": cache}
    return model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, return_dict_in_generate=True,
                          output_logits=True, **settings, **extra)


def assert_same(reference, paged):
    torch.testing.assert_close(paged.sequences, reference.sequences, rtol=0, atol=0)
    for step, (ours, theirs) in enumerate(zip(paged.logits, reference.logits, strict=True)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=f"logits differ at step {step}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tokens_and_logits_equal_the_default_cache(model_type, mode):
    model = tiny_seq2seq(model_type)
    inputs = encoder_inputs(model_type, PADS)
    reference = generate(model, inputs, **MODES[mode])
    with PagedCache(model) as cache:
        assert isinstance(cache, PagedEncoderDecoderCache) and isinstance(cache, EncoderDecoderCache)
        assert_same(reference, generate(model, inputs, cache, **MODES[mode]))
    assert cache.pool.blocks.num_used == 0 and cache.cross_attention_cache.pool.blocks.num_used == 0


def test_past_key_values_is_the_same_cache():
    model = tiny_seq2seq("bart")
    inputs = encoder_inputs("bart", PADS)
    with PagedCache(model) as cache:
        paged = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, return_dict_in_generate=True, output_logits=True)
        assert cache.self_attention_cache.get_seq_length() > 0
    assert_same(generate(model, inputs, **MODES["greedy"]), paged)


@pytest.mark.parametrize("model_type", ["bart", "whisper"])
def test_beams_and_samples_read_one_copy_of_each_requests_cross_attention(model_type):
    model = tiny_seq2seq(model_type)
    inputs = encoder_inputs(model_type, PADS)
    encoder_length = 16 if model_type == "whisper" else 10
    per_request = -(-encoder_length // 16)  # blocks of 16 positions
    for settings in (MODES["beams"], MODES["samples"]):
        with PagedCache(model) as cache:
            generate(model, inputs, cache, **settings)
            cross = cache.cross_attention_cache
            assert cross.batch_size >= 6 and len(cross.sources) == 3  # 3 requests, each with its beams or samples
            assert cross.pool.blocks.num_used == 3 * per_request  # one copy a request, whatever its rows
            stats = cache.stats()
            assert stats.cross_attention_bytes == 3 * per_request * cross.pool.bytes_per_block
            assert stats.bytes_reserved == stats.cross_attention_bytes + sum(g.bytes_reserved for g in stats.groups)
            keys = cross.layers[0].keys  # [B, heads, S, dim], gathered for this read: no copy is kept
            assert keys.shape[0] == cross.batch_size and cross.layers[0].keys is not keys


def test_greedy_rows_read_the_pool_without_a_copy():
    model = tiny_seq2seq("whisper")
    inputs = encoder_inputs("whisper", PADS)
    with PagedCache(model) as cache:
        generate(model, inputs, cache, **MODES["greedy"])
        cross = cache.cross_attention_cache
        keys = cross.layers[0].keys  # [B, heads, S, dim]
        stored = cross.pool.stored(0)[0].plain  # [heads, slots, dim]
        assert keys.shape == (3, 2, 16, 16)  # 2 decoder heads of 16 over 16 encoder positions
        assert keys.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()
        assert cross.nbytes() == cross.pool.blocks.num_used * cross.pool.bytes_per_block  # no copy held


def test_rows_that_leave_give_their_requests_blocks_back():
    model = tiny_seq2seq("t5")
    inputs = encoder_inputs("t5", PADS)
    with PagedCache(model) as cache:
        generate(model, inputs, cache, **MODES["greedy"])
        cross = cache.cross_attention_cache
        cache.batch_select_indices(torch.tensor([2, 2]))  # request 2 twice: its blocks only
        assert (len(cross.sources), cross.pool.blocks.num_used, cross.batch_size) == (1, 1, 2)
        assert cache.self_attention_cache.batch_size == 2
    assert cross.pool.blocks.num_used == 0 and cache.pool.blocks.num_used == 0


def test_a_config_built_cache_of_an_encoder_decoder_model_is_refused():
    with pytest.raises(ValueError, match="an encoder-decoder model's PagedCache \\('bart'\\) is built from the model"):
        PagedCache(tiny_seq2seq("bart").config)



def test_blocks_reused_out_of_order_are_gathered_exactly():
    """A cache reset and used again takes its blocks back from the free list, last freed first: no longer one run,
    so each read gathers them; the answers stay the default cache's."""
    model = tiny_seq2seq("t5")
    first, second = encoder_inputs("t5", PADS, length=40), encoder_inputs("t5", PADS, length=40, seed=1)
    with PagedCache(model) as cache:
        generate(model, first, cache, **MODES["greedy"])
        cache.reset()
        assert_same(generate(model, second, **MODES["greedy"]), generate(model, second, cache, **MODES["greedy"]))
        cross = cache.cross_attention_cache
        assert [len(blocks) for blocks in cross.sources] == [3, 3, 3]  # 40 encoder positions: 3 blocks a request
        stored = cross.pool.stored(0)[0].plain
        assert cross.layers[0].keys.untyped_storage().data_ptr() != stored.untyped_storage().data_ptr()


def test_a_deepcopy_forks_both_caches_and_continues_exactly():
    """A prefilled cache copied (``copy.deepcopy``, as one reuses a prefilled cache) shares both pools' blocks; each
    copy then continues as the model's own cache continues."""
    model = tiny_seq2seq("bart")
    inputs = encoder_inputs("bart", PADS)
    start = torch.full((3, 1), model.config.decoder_start_token_id)
    reference = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    with torch.no_grad(), PagedCache(model) as cache:
        encoded = model.get_encoder()(**inputs)
        for target in (reference, cache):
            model(encoder_outputs=encoded, attention_mask=inputs["attention_mask"], decoder_input_ids=start,
                  cache=target, use_cache=True)
        twin = copy.deepcopy(cache)
        cross = cache.cross_attention_cache
        assert twin.cross_attention_cache.pool is cross.pool and cross.pool.blocks.num_used == 3  # shared, not copied
        follow = torch.tensor([[7], [8], [9]])
        expected = model(encoder_outputs=encoded, attention_mask=inputs["attention_mask"], decoder_input_ids=follow,
                         cache=reference, use_cache=True).logits
        for target in (twin, cache):
            logits = model(encoder_outputs=encoded, attention_mask=inputs["attention_mask"], decoder_input_ids=follow,
                           cache=target, use_cache=True).logits
            torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        twin.release()
        assert cross.pool.blocks.num_used == 3  # the original still holds its sources


def test_a_budget_holds_both_pools_and_exhaustion_changes_nothing():
    """``max_memory`` is split between the decoder's pool and the cross-attention's (Whisper: 16 encoder positions
    against 64 decoder ones, a fifth for the cross-attention); a batch whose cross-attention does not fit raises
    `PoolExhaustedError` naming it, holding nothing, and a smaller one then runs exactly."""
    model = tiny_seq2seq("whisper")
    per_block = 3 * 2 * 16 * 2 * 4 * 16  # 3 layers x 2 heads x 16 dims x (K + V) x 4 bytes x 16 positions
    with PagedCache(model, max_memory=20 * per_block) as cache:
        cross = cache.cross_attention_cache
        assert cross.pool.blocks.capacity == 3 and cache.pool.blocks.capacity == 15  # 4 + 16 blocks, null included
        assert (cache.pool.storage_bytes() + cross.pool.storage_bytes()) <= 20 * per_block
        with pytest.raises(PoolExhaustedError, match="cross attention"):
            generate(model, encoder_inputs("whisper", [0] * 4), cache, **MODES["greedy"])
        assert cross.pool.blocks.num_used == 0 and cache.pool.blocks.num_used == 0 and cross.batch_size == 0
        cache.reset()
        inputs = encoder_inputs("whisper", [0] * 3)
        assert_same(generate(model, inputs, **MODES["greedy"]), generate(model, inputs, cache, **MODES["greedy"]))


def test_a_running_caches_reads_follow_rows_that_join_and_leave():
    """A batcher's running cache keeps its cross-attention reads dense between steps (``keep_reads``) and moves
    rows as they join and leave: every read equals a fresh gather of the same rows on their own positions."""
    model = tiny_seq2seq("bart")
    running = PagedCache(model)
    cross = running.cross_attention_cache
    cross.keep_reads = True

    def join(length: int) -> None:
        request = running.empty_like()
        with torch.no_grad():
            model(input_ids=torch.arange(3, 3 + length)[None], decoder_input_ids=torch.tensor([[2]]), cache=request,
                  use_cache=True)
        running.add_rows_from(request)

    def assert_reads_are_the_rows() -> None:
        fresh = cross.fork()
        fresh.keep_reads = False
        for layer in range(cross.pool.layout.num_layers):
            for which in (0, 1):
                kept, gathered = cross.dense(layer, which), fresh.dense(layer, which)  # [B, heads, S, dim]
                assert kept.shape == gathered.shape
                for row, source in enumerate(cross.rows):
                    own = cross.lengths[source]
                    assert torch.equal(kept[row, :, :own], gathered[row, :, :own])
        fresh.release()

    for length in (3, 11, 7, 5):
        join(length)
    assert_reads_are_the_rows()
    running.batch_select_indices(torch.tensor([0, 2, 3]))  # the 11-position row leaves: the rows after it move up
    assert_reads_are_the_rows()
    join(13)  # longer than any: the reads are made anew
    assert_reads_are_the_rows()
    running.batch_select_indices(torch.tensor([3, 0, 1]))  # another order
    assert_reads_are_the_rows()
    running.release()
    assert cross.pool.blocks.num_used == 0
