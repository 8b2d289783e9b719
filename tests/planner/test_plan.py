"""The KV-memory planner (hf_paged_cache.planner) against bytes measured in real caches.

Each measured run prefills a left-padded ragged batch, then feeds `new_tokens` greedy tokens one at a time,
so every row stores prompt + new tokens: the planner's convention. `test_generate_stores_one_token_fewer`
shows what `generate` itself stores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from repo_paths import DATA, ROOT
from encoder_decoder_models import tiny_seq2seq
from tiny_models import VOCAB, ragged_batch, tiny_config, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

import hf_paged_cache.planner.cli as planner_cli
from hf_paged_cache import ContinuousBatcher, PagedCache
from hf_paged_cache.bench.kv_bytes import cache_tensor_bytes
from hf_paged_cache.models import resolve_model_path
from hf_paged_cache.planner import (
    format_bytes,
    format_plan,
    load_config_and_weight_bytes,
    main,
    plan_memory,
    rows_that_fit,
    weights_from_config,
)

LLAMA2_7B = DATA / "llama2_7b_config.json"  # meta-llama/Llama-2-7b-hf's config.json
TOLERANCE = 0.02


def run_forwards(model, cache, prompt_lens: list[int], new_tokens: int) -> None:
    """Prefill the ragged batch, then feed `new_tokens` greedy tokens: each row stores prompt + new tokens."""
    width = max(prompt_lens)
    batch = ragged_batch([width - p for p in prompt_lens], width)
    mask = batch["attention_mask"]
    with torch.no_grad():
        out = model(**batch, cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(new_tokens):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, cache=cache, use_cache=True)


def measure(model, prompt_lens: list[int], new_tokens: int, block_size: int) -> dict[str, int]:
    """Bytes each cache holds after `run_forwards`."""
    measured = {}
    for name, cache in (
        ("DynamicCache", DynamicCache(config=model.config)),
        ("StaticCache", StaticCache(config=model.config, max_cache_len=max(prompt_lens) + new_tokens)),
    ):
        run_forwards(model, cache, prompt_lens, new_tokens)
        measured[name] = cache_tensor_bytes(cache)
    with PagedCache(model, block_size=block_size, num_blocks=256) as paged:
        run_forwards(model, paged, prompt_lens, new_tokens)
        measured["PagedCache"] = paged.stats().bytes_reserved
    return measured


def assert_close(planned: dict[str, int], measured: dict[str, int]) -> None:
    for name, value in measured.items():
        assert abs(planned[name] - value) <= TOLERANCE * value, (name, planned[name], value)


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return resolve_model_path(None)


def test_smollm2_plan_matches_measured_caches(smollm2_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt_lens, new_tokens, block_size = [21, 4, 11], 3, 8
    plan = plan_memory(model.config, prompt_lens=prompt_lens, new_tokens=new_tokens, dtype=torch.float32,
                       block_size=block_size, weight_bytes=0)
    assert plan.bytes_per_token == 30 * 3 * 64 * 2 * 4  # layers x KV heads x head dim x (K + V) x float32
    measured = measure(model, prompt_lens, new_tokens, block_size)
    assert_close(plan.kv_bytes, measured)
    assert measured["DynamicCache"] == 3 * 24 * plan.bytes_per_token  # every row padded to 21 + 3
    assert measured["PagedCache"] == (3 + 1 + 2) * plan.bytes_per_block  # ceil(24/8) + ceil(7/8) + ceil(14/8)


def test_smollm2_int8_plan_matches_the_measured_pool(smollm2_path):
    """``kv_dtype="int8"``: a block costs 64 + 8 bytes per head vector (a float16 minimum and step per 32
    elements), 0.28x of float32, and the planned pool holds the PagedCache's measured blocks; the dense caches
    keep their dtype."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    prompt_lens, new_tokens, block_size = [21, 4, 11], 3, 8
    plan = plan_memory(model.config, prompt_lens=prompt_lens, new_tokens=new_tokens, dtype=torch.float32,
                       kv_dtype="int8", block_size=block_size, weight_bytes=0, max_memory="64MiB")
    full = plan_memory(model.config, prompt_lens=prompt_lens, new_tokens=new_tokens, dtype=torch.float32,
                       block_size=block_size, weight_bytes=0, max_memory="64MiB")
    assert plan.kv_dtype == "int8" and plan.bytes_per_token == full.bytes_per_token  # the dense caches' per token
    assert plan.bytes_per_block == 30 * 3 * (64 + 8) * 2 * block_size
    assert plan.bytes_per_block / full.bytes_per_block == pytest.approx(72 / 256)
    assert plan.kv_bytes["DynamicCache"] == full.kv_bytes["DynamicCache"]
    assert plan.rows_that_fit["PagedCache"] >= 3.5 * full.rows_that_fit["PagedCache"]
    with PagedCache(model, block_size=block_size, num_blocks=64, kv_dtype="int8") as paged:
        run_forwards(model, paged, prompt_lens, new_tokens)
        assert paged.stats().bytes_reserved == plan.kv_bytes["PagedCache"] == 6 * plan.bytes_per_block
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        plan_memory(model.config, kv_dtype="int4", weight_bytes=0)


def test_smollm2_weights_from_safetensors_match_the_parameter_count(smollm2_path):
    config, weights = load_config_and_weight_bytes(smollm2_path, "float32")
    assert weights.num_bytes == 134_515_008 * 4  # tied embeddings stored once
    assert weights_from_config(config, "float32").num_bytes == weights.num_bytes  # meta model: tied counted once
    _, half = load_config_and_weight_bytes(smollm2_path, "bfloat16")
    assert half.num_bytes == weights.num_bytes // 2 and "rescaled to bfloat16" in half.source


def test_sliding_layers_of_gemma3_match_measured_caches():
    model = tiny_model("gemma3_text")  # window 12; layers sliding, sliding, full
    prompt_lens, new_tokens, block_size = [30, 9, 17], 6, 4
    plan = plan_memory(model.config, prompt_lens=prompt_lens, new_tokens=new_tokens, dtype=torch.float32,
                       block_size=block_size, weight_bytes=0)
    assert [(g.name, g.num_layers) for g in plan.groups] == [("full attention", 1), ("sliding window 12", 2)]
    per_layer = 2 * 16 * 2 * 4  # KV heads x head dim x (K + V) x float32
    full, sliding = plan.groups
    assert sliding.kv_bytes["DynamicCache"] == 2 * 3 * 11 * per_layer  # keeps the last window - 1 positions
    assert sliding.kv_bytes["StaticCache"] == 2 * 3 * 12 * per_layer  # allocates min(window, max_cache_len)
    assert full.kv_bytes["DynamicCache"] == full.kv_bytes["StaticCache"] == 3 * 36 * per_layer
    # rows store 36, 15 and 23 tokens: 9 + 4 + 6 blocks of 4 tokens with full attention; the sliding layers keep
    # the blocks holding each row's last 11 tokens (tokens 25-35: blocks 6-8; 4-14: 1-3; 12-22: 3-5)
    assert full.kv_bytes["PagedCache"] == (9 + 4 + 6) * block_size * per_layer
    assert sliding.kv_bytes["PagedCache"] == 2 * (3 + 3 + 3) * block_size * per_layer
    measured = measure(model, prompt_lens, new_tokens, block_size)
    assert_close(plan.kv_bytes, measured)
    assert any("W - 1" in note for note in plan.assumptions)


def test_generate_stores_one_token_fewer():
    model = tiny_model("gemma3_text")
    prompt_lens, max_new_tokens, block_size = [30, 9, 17], 6, 4
    width = max(prompt_lens)
    batch = ragged_batch([width - p for p in prompt_lens], width)
    plan = plan_memory(model.config, prompt_lens=prompt_lens, new_tokens=max_new_tokens - 1, dtype=torch.float32,
                       block_size=block_size, weight_bytes=0)
    generate = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                    return_dict_in_generate=True)
    for implementation in ("dynamic", "static"):
        out = model.generate(**batch, cache_implementation=implementation, **generate)
        name = f"{implementation.capitalize()}Cache"
        assert cache_tensor_bytes(out.past_key_values) == plan.kv_bytes[name], name
    with PagedCache(model, block_size=block_size, num_blocks=64) as cache:
        model.generate(**batch, cache=cache, **generate)
        assert cache.stats().bytes_reserved == plan.kv_bytes["PagedCache"]


def test_llama2_7b_config_gives_textbook_numbers():
    config, weights = load_config_and_weight_bytes(str(LLAMA2_7B), "bfloat16")
    assert weights.num_bytes == 6_738_415_616 * 2  # Llama-2-7B's parameter count, untied embeddings
    assert abs(weights.num_bytes - 6.7e9 * 2) <= 0.01 * 6.7e9 * 2
    plan = plan_memory(config, batch_size=32, prompt_lens=512, new_tokens=256, dtype="bfloat16",
                       max_memory="24GiB", weight_bytes=weights)
    assert plan.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert plan.bytes_per_block == 16 * 524_288
    per_row = 768 * 524_288
    assert plan.kv_bytes == {"DynamicCache": 32 * per_row, "StaticCache": 32 * per_row, "PagedCache": 32 * per_row}
    free = 24 * 2**30 - weights.num_bytes
    for name in ("DynamicCache", "StaticCache"):
        fit = plan.rows_that_fit[name]
        assert fit * per_row <= free < (fit + 1) * per_row
    usable_blocks = free // plan.bytes_per_block - 1  # block 0 is the pool's null block
    fit = plan.rows_that_fit["PagedCache"]
    assert fit * 48 <= usable_blocks < (fit + 1) * 48
    assert plan.rows_that_fit == {"DynamicCache": 30, "StaticCache": 30, "PagedCache": 30}

    ragged = plan_memory(config, prompt_lens=[512, 64, 128, 32], new_tokens=256, max_memory="24GiB",
                         weight_bytes=weights)  # rows padded to 512 in dense caches
    assert ragged.rows_that_fit["DynamicCache"] == 30  # 768 positions per row, as above
    # 1464 usable blocks / 110 per batch of 4 rows (48 + 20 + 24 + 18) = 13 batches, 34 blocks left < 48
    assert ragged.rows_that_fit["PagedCache"] == 52


def test_mla_caches_the_latent():
    config = AutoConfig.for_model(
        "deepseek_v3", num_hidden_layers=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, vocab_size=96, max_position_embeddings=256, pad_token_id=0,
    )
    plan = plan_memory(config, prompt_lens=[20, 9], new_tokens=3, dtype="bfloat16", weight_bytes=0)
    assert plan.bytes_per_token == 3 * (16 + 8) * 2  # layers x (kv_lora_rank + qk_rope_head_dim) x bf16
    assert any(note.startswith("MLA") for note in plan.assumptions)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    planned = plan_memory(config, prompt_lens=[20, 9], new_tokens=3, dtype="float32", block_size=4, weight_bytes=0)
    assert_close(planned.kv_bytes, measure(model, [20, 9], 3, block_size=4))


def test_dsa_indexer_keys_are_planned_with_their_blocks():
    config = tiny_config("deepseek_v32")  # 2 indexed layers: MLA latent (16 + 8) and an indexer key of 16
    plan = plan_memory(config, prompt_lens=[20, 9], new_tokens=3, dtype="bfloat16", weight_bytes=0)
    assert plan.bytes_per_token == 2 * (16 + 8 + 16) * 2
    model = tiny_model("deepseek_v32")
    with PagedCache(model, block_size=4) as cache, torch.no_grad():
        model(**ragged_batch([0], 20), cache=cache, use_cache=True)
        assert cache.pool.bytes_per_block == 4 * 2 * (16 + 8 + 16) * 4  # float32: the same layout


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "mamba2"])
def test_states_are_planned_as_the_caches_hold_them(model_type):
    """One sequence's conv / recurrent states, measured from the config on the meta device, are the bytes a
    PagedCache's slot and a DynamicCache's row hold; under a budget the pool sets aside max_sequences slots."""
    model = tiny_model(model_type)
    batch = ragged_batch([0, 3], 12)
    plan = plan_memory(model.config, prompt_lens=[12, 9], new_tokens=0, dtype="float32", block_size=4,
                       weight_bytes=0)
    with PagedCache(model, block_size=4) as cache, torch.no_grad():
        model(**batch, cache=cache, use_cache=True)
        stats = cache.stats()
    assert plan.state_bytes == stats.bytes_per_state_slot > 0
    assert plan.kv_bytes["PagedCache"] == stats.bytes_reserved
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**batch, cache=dynamic, use_cache=True)
    assert plan.kv_bytes["DynamicCache"] == cache_tensor_bytes(dynamic)
    budget = plan_memory(model.config, prompt_lens=[12, 9], new_tokens=0, dtype="float32", block_size=4,
                         weight_bytes=0, max_memory="2MiB", max_sequences=5)
    assert budget.max_sequences == budget.rows_that_fit["PagedCache"] == 5
    with PagedCache(model, block_size=4, max_memory="2MiB", max_sequences=5) as cache:
        assert cache.pool.states.ids.capacity == 5
        if budget.paged_pool is not None:  # mamba2 has no attention layer: its blocks hold nothing
            assert budget.paged_pool.num_blocks == cache.pool.num_blocks
    text = format_plan(budget)
    assert f"Conv / recurrent states: {format_bytes(plan.state_bytes)} per sequence" in text
    assert "sets aside 5 slots of them (max_sequences)" in text


def test_cli_plans_a_model_with_states(capsys, tmp_path):
    tiny_config("qwen3_next").save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path / "config.json"), "--prompt-len", "12,9", "--new-tokens", "0",
                 "--block-size", "4", "--dtype", "float32", "--max-memory", "64MiB", "--max-sequences", "7"]) == 0
    text = capsys.readouterr().out
    assert "Conv / recurrent states: 6 KiB per sequence" in text  # qwen3_next's tiny linear-attention layer
    assert "Its 7 state slots (max_sequences) hold 7 of them." in text


# tiny Gemma 3 (window 12; layers sliding, sliding, full) in float32, blocks of 4 tokens: a block of one layer is
# 2 KV heads x 16 dims x (K + V) x 4 bytes x 4 tokens = 1 KiB, so one block in every group costs 3 KiB
GEMMA3_BLOCK = 3 * 2 * 16 * 2 * 4 * 4


def test_a_fixed_pool_holds_the_rows_its_binding_group_holds():
    config = tiny_model("gemma3_text").config
    plan = plan_memory(config, batch_size=8, prompt_lens=20, new_tokens=60, dtype="float32", block_size=4,
                       max_memory=61 * GEMMA3_BLOCK, weight_bytes=0)
    # max_memory buys 61 blocks in EVERY group (block 0 is the null block): 60 usable in each. A row stores 80
    # tokens: 20 blocks of full attention, and at most ceil(12 / 4) + 1 = 4 of the sliding group during a step
    assert plan.paged_pool.num_blocks == 61
    assert plan.paged_pool.rows_per_group == {"full attention": 3, "sliding window 12": 15}
    assert plan.paged_pool.binding_group == "full attention"
    assert plan.rows_that_fit["PagedCache"] == 3  # a byte total (26 KiB a row in 180 KiB) said 6
    by_blocks = plan_memory(config, batch_size=8, prompt_lens=20, new_tokens=60, dtype="float32", block_size=4,
                            num_blocks=61, weight_bytes=0)
    assert by_blocks.rows_that_fit == {"PagedCache": 3}  # DynamicCache and StaticCache need max_memory
    assert by_blocks.paged_pool.rows_per_group == plan.paged_pool.rows_per_group
    text = format_plan(plan)
    assert "61 blocks of 4 tokens in every layer group (what the free memory buys" in text
    assert "| full attention | 160 | 3 (binds) |" in text  # 8 rows x 20 blocks
    assert "| sliding window 12 | 32 | 15 |" in text  # 8 rows x 4 blocks
    assert "(needs --max-memory)" in format_plan(by_blocks)


@pytest.mark.parametrize("sized_by", ["num_blocks", "max_memory"])
def test_the_planned_rows_run_together_on_a_real_batcher_and_one_more_waits(sized_by):
    model = tiny_model("gemma3_text")
    prompt_len, new_tokens, block_size = 20, 60, 4
    pool_size = {"num_blocks": 61} if sized_by == "num_blocks" else {"max_memory": 61 * GEMMA3_BLOCK}
    plan = plan_memory(model.config, batch_size=1, prompt_lens=prompt_len, new_tokens=new_tokens, dtype="float32",
                       block_size=block_size, weight_bytes=0, **pool_size)
    rows = plan.rows_that_fit["PagedCache"]
    assert rows == 3  # full attention binds: 20 of its 60 usable blocks a row
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (prompt_len,), generator=generator).tolist() for _ in range(rows + 1)]
    with ContinuousBatcher(model, block_size=block_size, **pool_size) as batcher:
        # picking new_tokens + 1 tokens stores prompt + new_tokens (the last one is never fed back): the plan's rows
        handles = [batcher.submit(prompt, max_new_tokens=new_tokens + 1) for prompt in prompts]
        outputs = [handle.result(timeout=120) for handle in handles]
        assert batcher.preemptions == 0
    assert all(len(output) == new_tokens + 1 for output in outputs)
    first_done = min(handle.finish_time for handle in handles[:rows])
    assert all(handle.first_token_time < first_done for handle in handles[:rows])  # the planned rows ran together
    assert handles[rows].first_token_time > first_done  # one more did not fit beside them: it waited for blocks


def test_rows_that_fit_repeats_the_batch_mix():
    assert rows_that_fit(100, [10, 30]) == 5  # 2 whole batches (80), then the 10-row
    assert rows_that_fit(9, [10, 30]) == 0
    assert rows_that_fit(-5, [1]) == 0


def test_weights_from_a_sharded_index(tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path)  # float32 config
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4000},
                                                                       "weight_map": {}}))
    _, weights = load_config_and_weight_bytes(str(tmp_path), "float32")
    assert weights.num_bytes == 4000
    _, half = load_config_and_weight_bytes(str(tmp_path), "float16")
    assert half.num_bytes == 2000 and "rescaled" in half.source


def test_bad_inputs_are_refused():
    config = AutoConfig.from_pretrained(LLAMA2_7B)
    for kwargs, message in (
        (dict(batch_size=3, prompt_lens=[5, 6]), "batch_size=3"),
        (dict(prompt_lens=0), "prompt lengths"),
        (dict(prompt_lens=10, new_tokens=5, max_cache_len=14), "max_cache_len=14"),
        (dict(dtype="int8"), "floating-point"),
    ):
        with pytest.raises(ValueError, match=message):
            plan_memory(config, weight_bytes=0, **kwargs)
    numpy = pytest.importorskip("numpy")
    lengths = plan_memory(config, prompt_lens=numpy.array([5, 6]), new_tokens=numpy.int64(2), weight_bytes=0)
    assert lengths.prompt_lens == (5, 6) and type(lengths.prompt_lens[0]) is int  # numpy integers are counts too


def test_cli_prints_the_table_and_json(capsys):
    assert main(["--model", str(LLAMA2_7B), "--batch", "32", "--prompt-len", "512", "--new-tokens", "256"]) == 0
    text = capsys.readouterr().out
    for needle in ("524,288 B", "| DynamicCache | 12 GiB |", "| PagedCache (1,536 blocks) |", "Assumptions:",
                   "meta device", "rows that fit in 24 GiB"):
        assert needle in text, needle
    main(["--model", str(LLAMA2_7B), "--prompt-len", "100,7,30", "--json", "--max-memory", "16GiB"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["prompt_lens"] == [100, 7, 30] and plan["batch_size"] == 3
    assert plan["paged_blocks"] == math.ceil(356 / 16) + math.ceil(263 / 16) + math.ceil(286 / 16)
    with pytest.raises(SystemExit):
        main(["--model", str(LLAMA2_7B), "--prompt-len", "100,7", "--batch", "3"])
    assert "batch_size=3 but 2 prompt lengths" in capsys.readouterr().err


def _one_line_error(stderr: str) -> str:
    """The message of an argparse-style one-line error; fails the test on anything else (a traceback, usage)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("python -m hf_paged_cache.planner: error: "), lines[0]
    return lines[0]


BAD_INPUT = [  # `python -m hf_paged_cache.planner` as a user runs it: one line on stderr, status 2
    (["--max-memory", "lots"], "cannot read 'lots' as a memory size"),
    (["--model", "{missing}/config.json"], "cannot read a config from"),
]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """The command-line runs of this module, each its own process, all at once (each imports torch): the bad
    inputs of `BAD_INPUT` and ``--help``, by ``python -m hf_paged_cache.planner``. ``{name: (status, stdout, stderr)}``, named by their arguments."""
    missing = tmp_path_factory.mktemp("cli") / "missing"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    commands = {" ".join(argv): ["hf_paged_cache.planner", *(a.format(missing=missing) for a in argv)]
                for argv, _ in BAD_INPUT}
    commands["--help"] = ["hf_paged_cache.planner", "--help"]
    runs = {name: subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for name, command in commands.items()}
    outputs = {name: run.communicate(timeout=120) for name, run in runs.items()}
    return {name: (runs[name].returncode, *outputs[name]) for name in runs}


def test_cli_bad_input_is_one_error_line_and_status_2(cli_runs):
    for argv, message in BAD_INPUT:
        status, out, err = cli_runs[" ".join(argv)]
        assert status == 2 and not out, (argv, status, out)
        assert message in _one_line_error(err), argv


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-len", "-5"], "prompt lengths (row 1) must be from 1 to 16,777,216; got -5"),
    (["--prompt-len", "12,x"], "expected a length or comma-separated lengths"),
    (["--new-tokens", "-1"], "new_tokens must be from 0 to 16,777,216; got -1"),
    (["--batch", "0"], "batch_size must be from 1 to 65,536; got 0"),
    (["--batch", "1000000000"], "batch_size must be from 1 to 65,536"),  # not a list of 10^9 rows
    (["--block-size", "0"], "block_size must be from 1 to 16,777,216; got 0"),
    (["--num-blocks", "1"], "num_blocks must be from 2 to 1,099,511,627,776 (block 0 is the reserved null block); got 1"),
    (["--max-memory", "24GiB", "--num-blocks", "100000"], "more than the"),  # 781 GiB of blocks
    (["--unknown"], "unrecognized arguments: --unknown"),
])
def test_cli_refuses_bad_numbers_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(LLAMA2_7B), *argv])
    assert exit_info.value.code == 2
    assert message in _one_line_error(capsys.readouterr().err)


def test_cli_refuses_broken_model_folders_in_one_line(capsys, tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path / "no_metadata")
    (tmp_path / "no_metadata" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp_path / "no_type").mkdir()
    (tmp_path / "no_type" / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (tmp_path / "no_layers").mkdir()
    (tmp_path / "no_layers" / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 0}')
    for folder, message in (("no_metadata", "cannot read the weight sizes"), ("no_type", "model_type None"),
                            ("cut", "not a valid JSON file"), ("no_layers", "0 attention layers"),
                            ("nowhere", "cannot read a config")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(tmp_path / folder)])
        assert exit_info.value.code == 2
        assert message in _one_line_error(capsys.readouterr().err), folder


def test_cli_keeps_the_traceback_of_a_real_bug(monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in the planner")

    monkeypatch.setattr(planner_cli, "plan_memory", broken)
    with pytest.raises(ZeroDivisionError, match="a bug in the planner"):  # not turned into "error: ..."
        main(["--model", str(LLAMA2_7B)])


def test_cli_default_model(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in text and "23,040 B" in text  # 30 x 3 x 64 x 2 x bf16


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("default") == 12  # one per option with a default (--json has none)
    for default in ("(default: 24GiB)", "(default: 32,", "(default: 512)", "(default: 256)", "(default: bfloat16)",
                    "(default: --dtype)",
                    "(default: 16)", "(default: what --max-memory minus the weights buys)",
                    "(default: longest prompt + new tokens)", "(default: HuggingFaceTB/SmolLM2-135M-Instruct,",
                    "(default: measured from the config", "(default: 64, as PagedCache"):
        assert text.count(default) == 1, default


def test_the_deprecated_module_paths_are_gone_and_the_planner_answers_help(cli_runs):
    """`hf_paged_cache.plan` and `hf_paged_cache.config_limits` warned for a release and are removed."""
    import importlib

    for old in ("hf_paged_cache.plan", "hf_paged_cache.config_limits"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    status, out, err = cli_runs["--help"]
    assert status == 0 and "--max-memory" in out and not err, err

def test_an_encoder_decoder_model_is_refused_rather_than_planned_without_its_cross_attention():
    with pytest.raises(NotImplementedError, match="'bart' is an encoder-decoder model: its cross-attention"):
        plan_memory(tiny_seq2seq("bart").config, prompt_lens=[10], new_tokens=5, weight_bytes=0)
