"""paged_flex: a decode step's rows read their blocks in place through a compiled flex_attention, no gather."""

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from call_counters import count_calls, count_strategy
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache

import hf_paged_cache.attention.decode as decode_module
import hf_paged_cache.attention.reading as reading
from hf_paged_cache import ContinuousBatcher, PagedCache, set_paged_attention
from hf_paged_cache.attention import flex_decode
from hf_paged_cache.attention.flex_decode import (
    FLEX_KERNEL,
    attend_flex,
    balanced_order,
    build_flex_decode_reads,
    warm_up,
)
from hf_paged_cache.cache.block_table import RowsView


needs_compiler = pytest.mark.skipif(
    not any(shutil.which(name) for name in ("g++", "c++", "clang++")),
    reason="paged_flex's kernel is compiled by inductor, which needs a C++ compiler",
)


@pytest.fixture
def rows_in_groups(monkeypatch):
    """Every decode step's rows in groups of their own (no call cost): the steps ``paged_flex`` reads in place."""
    monkeypatch.setattr(reading, "DECODE_CALL_COST", 0)


def test_rows_go_to_the_kernel_long_and_short_in_turn():
    # lengths 60, 1000, 150, 850, 250: the longest (row 1), the shortest (row 0), then row 3, row 2, row 4
    assert balanced_order([60, 1000, 150, 850, 250]) == [1, 0, 3, 2, 4]
    assert balanced_order([7]) == [0]


def test_the_plan_names_each_rows_full_blocks_and_its_partly_filled_last_block():
    # row 0: 40 tokens in blocks 5, 2, 9 (2 full, 8 tokens in block 9); row 1: 32 tokens in blocks 3, 4 (2 full)
    rows = RowsView(tables=[[5, 2, 9], [3, 4]], num_tokens=[40, 32], block_size=16)
    plan = build_flex_decode_reads(rows, groups=2, capacity=16 * 12, device=torch.device("cpu"))
    # row 0 is the longer: the kernel takes the rows as they are
    assert plan.order is None and plan.restore is None
    mask = plan.block_mask
    assert mask.full_kv_num_blocks.flatten().tolist() == [2, 2]
    assert mask.full_kv_indices[0, 0, 0, :2].tolist() == [5, 2]
    assert mask.full_kv_indices[1, 0, 0, :2].tolist() == [3, 4]
    assert mask.kv_num_blocks.flatten().tolist() == [1, 0]  # row 1 fills its last block: nothing masked
    assert mask.kv_indices[0, 0, 0, 0].item() == 9
    # in block 9 (slots 144..159) row 0 sees its 8 tokens, slots 144..151
    seen = [bool(mask.mask_mod(torch.tensor(0), 0, 0, torch.tensor(slot))) for slot in (144, 151, 152, 159)]
    assert seen == [True, True, False, False]
    assert mask.shape[-1] == 16 * 12  # the mask spans the whole storage


def scattered_rows(lengths: list[int], capacity_blocks: int, seed: int) -> RowsView:
    generator = torch.Generator().manual_seed(seed)
    free = (torch.randperm(capacity_blocks - 1, generator=generator) + 1).tolist()  # block 0 is the null block
    tables = []
    for length in lengths:
        count = -(-length // 16)
        tables.append(free[:count])
        free = free[count:]
    return RowsView(tables=tables, num_tokens=list(lengths), block_size=16)


@needs_compiler
def test_attention_read_in_place_equals_sdpa_over_each_rows_gathered_keys():
    # 5 rows of 1 to 70 keys in blocks scattered over a 40-block storage; 2 key/value heads of 3 query heads
    heads, groups, dim, lengths = 2, 3, 8, [1, 16, 70, 33, 47]
    rows = scattered_rows(lengths, 40, seed=0)
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(heads, 40 * 16, dim, generator=generator) for _ in range(2))  # [H, slots, D]
    query = torch.randn(len(lengths), heads * groups, 1, dim, generator=generator)  # [B, Hq, 1, D]
    plan = build_flex_decode_reads(rows, groups, keys.shape[1], torch.device("cpu"))
    assert plan.order.tolist() == [2, 0, 4, 1, 3]  # 70, 1, 47, 16, 33 keys
    out = attend_flex(query, keys, values, plan, scale=dim**-0.5)  # [B, 1, Hq, D]
    expected = []
    for b, (table, count) in enumerate(zip(rows.tables, lengths)):
        slots = (torch.tensor(table)[:, None] * 16 + torch.arange(16)).flatten()[:count]  # [count]
        row_query = query[b : b + 1].view(1, heads, groups, dim)
        expected.append(F.scaled_dot_product_attention(row_query, keys[None, :, slots], values[None, :, slots]))
    expected = torch.cat(expected).reshape(len(lengths), 1, heads * groups, dim)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def flex_runs(monkeypatch) -> list[bool]:
    """Per call of the compiled kernel, whether it ran (False: it could not, and the step gathered)."""
    runs: list[bool] = []
    original = flex_decode.FlexKernel.__call__
    monkeypatch.setattr(flex_decode.FlexKernel, "__call__",
                        lambda self, *args: runs.append(True) or original(self, *args))
    return runs


@needs_compiler
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_generate_on_paged_flex_equals_dynamic_cache(monkeypatch, rows_in_groups, model_type):
    # 3 ragged rows (left padding 0, 7 and 13), 20 new tokens: the tokens of DynamicCache, scores within 1e-5;
    # every decode step's full-attention layers read in place (gemma3's sliding layers gather, as paged_sdpa)
    model = tiny_model(model_type)
    batch = ragged_batch([0, 7, 13], 30, seed=4)
    options = dict(max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    reference = model.generate(**batch, cache=DynamicCache(config=model.config), **options)
    set_paged_attention(model, decode="flex")
    runs = flex_runs(monkeypatch)
    views = count_strategy(monkeypatch, "views")
    gathers = count_calls(monkeypatch, decode_module, "_group_parts")
    with PagedCache(model, num_blocks=32) as cache:
        paged = model.generate(**batch, cache=cache, **options)
    assert torch.equal(paged.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(paged.scores), torch.stack(reference.scores), atol=1e-5, rtol=0)
    full_layers = model.config.layer_types.count("full_attention") if model_type == "gemma3_text" else 2
    # every decode step after the prefill: from views of their blocks while every row's blocks follow each other
    # (the first steps), then in place
    assert len(runs) + len(views) == 19 * full_layers and len(runs) > len(views)
    # keys and values of the sliding layers only
    assert len(gathers) == 2 * 19 * (model.config.num_hidden_layers - full_layers)


def test_rows_sharing_a_prompt_keep_the_cascade_on_paged_flex(monkeypatch, rows_in_groups):
    # 3 beams of one 80-token prompt: the prompt's blocks are read once for all (cascade attention), not once per
    # row in place (rows sharing their first keys hold as many: one group, which paged_flex leaves as it is)
    model = tiny_model("llama")
    batch = ragged_batch([0], 80, seed=6)
    reference = model.generate(**batch, cache=DynamicCache(config=model.config), max_new_tokens=6, num_beams=3,
                               do_sample=False)
    set_paged_attention(model, decode="flex")
    runs = flex_runs(monkeypatch)
    cascades = count_strategy(monkeypatch, "cascade")
    with PagedCache(model, num_blocks=64) as cache:
        paged = model.generate(**batch, cache=cache, max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(paged, reference)
    assert cascades and runs == []


@needs_compiler
def test_what_a_blocks_earlier_holder_left_in_it_does_not_leak_into_a_row(rows_in_groups):
    # every slot of the pool but the null block's holds NaN, as the garbage of fresh memory or a failed request's
    # keys might; the kernel multiplies a row's last block whole, its slots past the row's keys by a zero weight
    model = tiny_model("llama")
    batch = ragged_batch([0, 7, 13], 30, seed=4)
    reference = model.generate(**batch, cache=DynamicCache(config=model.config), max_new_tokens=20, do_sample=False)
    set_paged_attention(model, decode="flex")
    with PagedCache(model, num_blocks=32) as first:
        model.generate(**ragged_batch([0], 3), cache=first, max_new_tokens=1, do_sample=False)  # makes the storage
        for tensor in first.pool.keys + first.pool.values:
            tensor[:, 16:].fill_(float("nan"))  # [H, slots, D]: all but block 0
        with PagedCache(model, pool=first.pool) as cache:
            paged = model.generate(**batch, cache=cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(paged, reference)


def test_paged_flex_leaves_rows_alike_a_row_alone_and_bfloat16_to_paged_sdpa(monkeypatch):
    model = tiny_model("llama")
    set_paged_attention(model, decode="flex")
    runs = flex_runs(monkeypatch)
    with PagedCache(model, num_blocks=32) as cache:  # rows 7 tokens apart: one group, one SDPA call
        model.generate(**ragged_batch([0, 7], 20), cache=cache, max_new_tokens=20, do_sample=False)
    monkeypatch.setattr(reading, "DECODE_CALL_COST", 0)  # in groups of their own from here on
    with PagedCache(model, num_blocks=32) as cache:  # one row: it attends from a view of its blocks
        model.generate(**ragged_batch([0], 20), cache=cache, max_new_tokens=5, do_sample=False)
    model.to(torch.bfloat16)
    batch = ragged_batch([0, 5], 20)
    with PagedCache(model, num_blocks=32) as cache:
        flex = model.generate(**batch, cache=cache, max_new_tokens=5, do_sample=False)
    assert runs == []
    set_paged_attention(model)
    with PagedCache(model, num_blocks=32) as cache:
        assert torch.equal(flex, model.generate(**batch, cache=cache, max_new_tokens=5, do_sample=False))


def test_a_kernel_that_fails_to_compile_falls_back_to_the_gather_once_and_for_all(monkeypatch, rows_in_groups, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("C++ compile error\ng++: not found")

    monkeypatch.setattr(FLEX_KERNEL, "_compiled", no_compiler)
    monkeypatch.setattr(FLEX_KERNEL, "_failed", False)
    model = tiny_model("llama")
    batch = ragged_batch([0, 7], 20, seed=5)
    reference = model.generate(**batch, cache=DynamicCache(config=model.config), max_new_tokens=20,
                               do_sample=False)
    set_paged_attention(model, decode="flex")
    runs = flex_runs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=flex_decode.__name__), PagedCache(model, num_blocks=32) as cache:
        paged = model.generate(**batch, cache=cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(paged, reference)
    assert not FLEX_KERNEL.available
    assert len(runs) == 1  # tried once: later layers and steps gather without asking again
    assert [r.message for r in caplog.records] == [
        "paged_flex: the compiled flex_attention failed (RuntimeError: C++ compile error); decode steps gather "
        "their keys as paged_sdpa does from now on"
    ]


@needs_compiler
def test_a_kernel_that_computes_wrong_is_never_used(monkeypatch, rows_in_groups, caplog):
    """A kernel that compiles but answers wrong (as inductor's can, reusing code compiled for another vector ISA)
    fails its check against SDPA before any step uses it: the steps gather, and the tokens stay exact."""
    compiled = torch.compile(flex_decode.flex_attention, dynamic=True)
    monkeypatch.setattr(FLEX_KERNEL, "_compiled", lambda *args, **kwargs: compiled(*args, **kwargs) * 1.01)
    monkeypatch.setattr(FLEX_KERNEL, "_failed", False)
    monkeypatch.setattr(FLEX_KERNEL, "_checked", set())
    model = tiny_model("llama")
    batch = ragged_batch([0, 7], 20, seed=5)
    reference = model.generate(**batch, cache=DynamicCache(config=model.config), max_new_tokens=20, do_sample=False)
    set_paged_attention(model, decode="flex")
    with caplog.at_level(logging.WARNING, logger=flex_decode.__name__), PagedCache(model, num_blocks=32) as cache:
        paged = model.generate(**batch, cache=cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(paged, reference)
    assert not FLEX_KERNEL.available
    [record] = caplog.records
    assert record.message.startswith("paged_flex: the compiled flex_attention failed (KernelMismatch: its output "
                                     "differs from SDPA's on a check of")


@needs_compiler
def test_the_batcher_on_paged_flex_answers_each_request_as_generate_alone(monkeypatch, rows_in_groups):
    # 4 requests of 5 to 40 prompt tokens decoding together, their blocks interleaved as they grow
    model = tiny_model("llama")
    prompts = [ragged_batch([0], length, seed=length)["input_ids"][0].tolist() for length in (5, 40, 17, 26)]
    expected = [
        model.generate(torch.tensor([p]), cache=DynamicCache(config=model.config), max_new_tokens=24,
                       do_sample=False)[0, len(p):].tolist()
        for p in prompts
    ]
    set_paged_attention(model, decode="flex")
    runs = flex_runs(monkeypatch)
    with ContinuousBatcher(model, num_blocks=64) as batcher:
        answers = batcher.generate(prompts, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert answers == expected
    assert runs


@needs_compiler
def test_warm_up_compiles_for_float32_on_a_cpu_only(monkeypatch):
    runs = flex_runs(monkeypatch)
    assert warm_up(2, 2, 16, 16, torch.float32, torch.device("cpu"))
    assert runs == [True]
    assert not warm_up(2, 2, 16, 16, torch.bfloat16, torch.device("cpu"))
    assert runs == [True]  # nothing compiled for bfloat16
