"""paged_sdpa attends straight from the block tables: no dense gather, every real position exact."""

import pytest
import torch
from call_counters import count_calls
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache

import hf_paged_cache.cache.layer_io as layer_io
import hf_paged_cache.attention.decode as decode_module
import hf_paged_cache.attention.reading as reading
import hf_paged_cache.cache.forward as forward_module
from hf_paged_cache import PagedCache, set_paged_attention
from hf_paged_cache.attention import paged_sdpa, softmax
from hf_paged_cache.cache.block_table import RowsView
from hf_paged_cache.pool.kv_format import StoredStates


def count_dense_gathers(monkeypatch):
    calls = []
    original = layer_io.gather

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(layer_io, "gather", counting)
    return calls


@pytest.mark.parametrize("attention, gathers", [("paged_sdpa", False), ("sdpa", True)])
def test_paged_sdpa_skips_the_dense_gather(monkeypatch, attention, gathers):
    model = tiny_model("llama", attn_implementation=attention)
    calls = count_dense_gathers(monkeypatch)
    with PagedCache(model, num_blocks=32) as cache:
        model.generate(**ragged_batch([0, 5], 20), cache=cache, max_new_tokens=5, do_sample=False)
    assert bool(calls) == gathers


@pytest.mark.parametrize(
    "model_type",
    [
        "gpt_neox",  # calls cache.update without the attention kwargs
        "deepseek_v3",  # MLA: attention expands the cached latent after update
    ],
)
def test_models_that_attention_cannot_serve_from_the_pool_keep_the_dense_path(monkeypatch, model_type):
    model = tiny_model(model_type)
    set_paged_attention(model)
    calls = count_dense_gathers(monkeypatch)
    batch = ragged_batch([0, 5], 20)
    reference = model.generate(**batch, cache=DynamicCache(config=model.config), max_new_tokens=5, do_sample=False)
    with PagedCache(model, num_blocks=32) as cache:
        paged = model.generate(**batch, cache=cache, max_new_tokens=5, do_sample=False)
    assert calls and torch.equal(paged, reference)


def test_config_built_cache_uses_the_dense_path(monkeypatch):
    model = tiny_model("llama", attn_implementation="paged_sdpa")
    calls = count_dense_gathers(monkeypatch)
    with PagedCache(model.config, num_blocks=32) as cache, torch.no_grad():
        model(**ragged_batch([0, 0], 8), cache=cache, use_cache=True)
    assert calls


def paged_logits(model, batch, spans: list[tuple[int, int]], num_blocks: int) -> torch.Tensor:
    """``[B, T, V]``: the logits of forwards over `spans` of `batch` on one PagedCache, concatenated."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), PagedCache(model, num_blocks=num_blocks) as cache:
        return torch.cat([
            model(input_ids=batch["input_ids"][:, start:end], attention_mask=mask[:, :end],
                  position_ids=positions[:, start:end], cache=cache, use_cache=True).logits
            for start, end in spans
        ], dim=1)


def assert_pieces_match_one_forward(model, batch, spans: list[tuple[int, int]], num_blocks: int) -> None:
    """Forwards over `spans` of `batch` with a PagedCache give one uncached forward's logits at every real position."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        reference = model(**batch, position_ids=positions).logits  # [B, T, V]
    pieces = paged_logits(model, batch, spans, num_blocks)
    real = mask.bool()
    torch.testing.assert_close(pieces[real], reference[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gemma2", "gpt_oss"])
def test_chunked_prefill_from_the_pool_matches_one_uncached_forward_at_every_real_position(model_type):
    # windows of 12 slide across 16-token chunks; left padding of 0, 7 and 21 tokens (21 spans a whole chunk)
    model = tiny_model(model_type)
    set_paged_attention(model)
    batch = ragged_batch([0, 7, 21], 48, seed=2)
    assert_pieces_match_one_forward(model, batch, [(start, start + 16) for start in range(0, 48, 16)], num_blocks=32)


@pytest.mark.parametrize("decode", ["sdpa", "products"], ids=["paged_sdpa", "paged_bmm"])
@pytest.mark.parametrize("call_cost, most_groups", [(reading.DECODE_CALL_COST, 1), (10, 2), (0, 3)])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gemma2", "gpt_oss"])
def test_decode_steps_match_one_uncached_forward(monkeypatch, model_type, call_cost, most_groups, decode):
    # a 20-token prefill, then one token per forward past the window of 12 (soft-capping on gemma2, sinks on
    # gpt_oss): the logits of one plain forward, whether the full-attention layers' decode steps attend the
    # rows (left padding 0, 7 and 13) in one padded call, in two groups or row by row, by SDPA or by products
    monkeypatch.setattr(reading, "DECODE_CALL_COST", call_cost)
    model = tiny_model(model_type)
    set_paged_attention(model, decode=decode)
    calls = count_calls(monkeypatch, paged_sdpa, "attend_decode")
    products = count_calls(monkeypatch, decode_module, "product_attention")
    grouping = []
    original = reading.length_groups
    monkeypatch.setattr(reading, "length_groups", lambda *args: grouping.append(original(*args)) or grouping[-1])
    batch = ragged_batch([0, 7, 13], 40, seed=3)
    assert_pieces_match_one_forward(model, batch, [(0, 20), *((t, t + 1) for t in range(20, 40))], num_blocks=48)
    assert len(calls) == 20 * model.config.num_hidden_layers  # every decode step, every layer
    assert max(len(groups) for groups in grouping) == most_groups
    # paged_bmm: float32 groups by batched products, unless soft-capping or sinks need the explicit softmax
    assert bool(products) == (decode == "products" and model_type in ("llama", "gemma3_text"))
    # the sliding layers' rows all read their last 12 columns: one group whatever the cost
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        assert min(len(groups) for groups in grouping) == 1


@pytest.mark.parametrize("call_cost", [reading.DECODE_CALL_COST, 10, 0])
def test_decode_steps_gathering_rows_give_the_same_logits(monkeypatch, call_cost):
    # at two threads a decode step gathers rows of the storage seen as [H * slots, D] instead of selecting along
    # its slots: the same keys in another layout, so the same logits to the last bit, in 1, 2 or 3 groups of rows
    monkeypatch.setattr(reading, "DECODE_CALL_COST", call_cost)
    model = tiny_model("llama")
    set_paged_attention(model)
    batch = ragged_batch([0, 7, 13], 40, seed=3)
    spans = [(0, 20), *((t, t + 1) for t in range(20, 40))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gathers = count_calls(monkeypatch, decode_module, "_gather_row_major")
        by_rows = paged_logits(model, batch, spans, num_blocks=48)
        assert gathers  # the decode steps after the rows' first new blocks (the ones before read views)
        monkeypatch.setattr(decode_module, "gathers_rows", lambda: False)
        along_slots = paged_logits(model, batch, spans, num_blocks=48)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(by_rows, along_slots)


@pytest.mark.parametrize("call_cost", [reading.DECODE_CALL_COST, 0])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_decode_steps_splitting_query_heads_match_one_uncached_forward(monkeypatch, model_type, call_cost):
    # at two threads a decode step hands SDPA its query heads one by one ([n, Hq, 1, D], enable_gqa) instead of
    # as the query rows of their key/value head: from views (the first steps) and from gathered groups alike
    assert decode_module.splits_query_heads() is False  # the suite runs at one thread
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert decode_module.splits_query_heads() is True
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(decode_module, "splits_query_heads", lambda: True)
    monkeypatch.setattr(reading, "DECODE_CALL_COST", call_cost)
    split_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, *args, **kwargs):
        split_calls.append(kwargs.get("enable_gqa", False) and query.shape[2] == 1)
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    model = tiny_model(model_type)
    set_paged_attention(model)
    batch = ragged_batch([0, 7, 13], 40, seed=3)
    assert_pieces_match_one_forward(model, batch, [(0, 20), *((t, t + 1) for t in range(20, 40))], num_blocks=48)
    assert sum(split_calls) >= 20 * model.config.num_hidden_layers  # every decode step's layers split the heads


@pytest.mark.parametrize("groups", [1, 3])
def test_product_attention_matches_sdpa(groups):
    # 5 rows of 1 to 9 seen keys (left padding masked), 2 key/value heads of `groups` query heads each
    generator = torch.Generator().manual_seed(groups)
    rows, heads, length, dim = 5, 2, 9, 8
    query = torch.randn(rows, heads, groups, dim, generator=generator)
    keys = torch.randn(rows, heads, length, dim, generator=generator)
    values = torch.randn(rows, heads, length, dim + 2, generator=generator)
    seen = torch.arange(length) >= torch.tensor([8, 0, 3, 5, 0]).unsqueeze(1)  # [n, kv]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=seen[:, None, None, :], scale=0.3
    )  # [n, H, g, Dv]
    got = softmax.product_attention(query, keys, values, seen[:, None, None, :], 0.3)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    unmasked = softmax.product_attention(query, keys, values, None, 0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=0.3)
    torch.testing.assert_close(unmasked, expected, atol=1e-6, rtol=1e-6)


def _grouping_cost(lengths: list[int], groups: list[list[int]], call_cost: int) -> int:
    return sum(len(rows) * max(lengths[row] for row in rows) + call_cost for rows in groups)


def _every_grouping(rows: list[int]):
    """Every way to split `rows` into groups (set partitions)."""
    if not rows:
        yield []
        return
    first, rest = rows[0], rows[1:]
    for grouping in _every_grouping(rest):
        yield [[first], *grouping]
        for i in range(len(grouping)):
            yield [*grouping[:i], sorted([first, *grouping[i]]), *grouping[i + 1 :]]


def test_length_groups_finds_the_cheapest_grouping():
    assert reading.length_groups([1000, 60, 150, 1000], 0) == [[1], [2], [0, 3]]
    assert reading.length_groups([1000, 60, 150, 1000], 10_000) == [[0, 1, 2, 3]]
    assert reading.length_groups([5], 256) == [[0]]
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):  # against every set partition of up to 6 rows
        lengths = torch.randint(1, 400, (int(torch.randint(1, 7, (1,), generator=generator)),), generator=generator)
        lengths, call_cost = lengths.tolist(), int(torch.randint(0, 300, (1,), generator=generator))
        groups = reading.length_groups(lengths, call_cost)
        assert sorted(row for rows in groups for row in rows) == list(range(len(lengths)))
        cheapest = min(_grouping_cost(lengths, g, call_cost) for g in _every_grouping(list(range(len(lengths)))))
        assert _grouping_cost(lengths, groups, call_cost) == cheapest


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gemma2", "gpt_oss"])
def test_decode_from_views_of_consecutive_slots_matches_one_uncached_forward(monkeypatch, model_type):
    # rows whose keys fill consecutive slots attend from views of the pool (no gather) while they do; once a row
    # takes a block that is not next to its last one, the step gathers as before: the logits never change
    monkeypatch.setattr(reading, "ZERO_COPY_MAX_ROWS", 3)
    model = tiny_model(model_type)
    set_paged_attention(model)
    views = count_calls(monkeypatch, StoredStates, "run")
    batch = ragged_batch([0, 7, 13], 40, seed=3)
    assert_pieces_match_one_forward(model, batch, [(0, 20), *((t, t + 1) for t in range(20, 40))], num_blocks=48)
    assert views  # some steps read views


def test_consecutive_runs():
    def runs(tables, num_tokens):
        return reading.consecutive_runs(RowsView(tables, num_tokens, block_size=4))

    # the blocks holding each row's tokens follow each other (a partly filled last block included)
    assert runs([[7, 8, 9], [4, 5]], [9, 5]) == [(28, 9), (16, 5)]
    assert runs([[7, 8, 3]], [8]) == [(28, 8)]  # a block past the row's tokens is not read
    assert runs([[4, 10]], [6]) is None  # a gap between blocks
    assert runs([[5, 4]], [6]) is None  # blocks out of order
    assert runs([[0, 1]], [6]) is None  # a null entry (a sliding window's given-back block)
    assert runs([[]], [0]) is None  # a row with nothing stored


def test_a_row_alone_decodes_from_views_at_every_step(monkeypatch):
    # generate at batch size 1: the row's blocks are consecutive from the prefill on, so every decode step reads
    # views of the pool (and returns before the gather), planned from the block lists alone
    model = tiny_model("llama")
    set_paged_attention(model)
    inputs = torch.tensor([[5, 9, 3, 7] * 6])  # 24 tokens: the decode steps cross into a third block
    expected = model.generate(inputs, max_new_tokens=20, do_sample=False, cache=DynamicCache(config=model.config))
    views = count_calls(monkeypatch, StoredStates, "run")
    slot_maps = count_calls(monkeypatch, forward_module, "position_slots")
    paged = model.generate(inputs, max_new_tokens=20, do_sample=False, cache=PagedCache(model))
    assert torch.equal(paged, expected)
    assert len(views) == 2 * 19 * model.config.num_hidden_layers  # keys and values, 19 decode steps, every layer
    assert len(slot_maps) == 1  # the prefill's: no decode step maps every position to its slot
