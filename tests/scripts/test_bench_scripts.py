"""Smoke tests of the benchmark scripts on a tiny random-weight Llama, plus one real-model parity check.

Each script's ``main([...])`` runs once (module-scoped fixtures) on a tiny model saved with a tiny
WordLevel tokenizer; the tests check the JSON fields and the accounting identities, never a timing.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, DynamicCache, PreTrainedTokenizerFast, StaticCache

from hf_paged_cache import PagedCache
from hf_paged_cache.bench import (
    cache_tensor_bytes,
    in_fresh_thread,
    kv_bytes_per_token,
    left_pad,
    narrowed,
    paged_blocks,
    sharegpt_workload,
    static_cache_reserved_bytes,
    stored_tokens,
    uniform_workload,
)
from hf_paged_cache.bench.narrow import NARROW_HEAD_DIM
from hf_paged_cache.kernels.packed_linear import packed_linears_supported
from script_loading import load_script
from tiny_models import VOCAB, tiny_model



@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Run this module single-threaded (restored afterwards): on a small shared CPU, two intra-op threads
    competing with other processes make generate several times slower, never faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama (2 layers, 2 KV heads of 16, context 256) and a 96-word tokenizer, saved to disk."""
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results")


def run_script(name: str, args: list[str], out: Path) -> dict[str, Any]:
    payload = load_script(name).main([*args, "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["benchmark"] == payload["benchmark"]
    for key in ("cpu", "cpu_count", "torch", "transformers", "mkl_fast_path", "device_name", "date"):
        assert key in on_disk["machine"], key
    return payload


@pytest.fixture(scope="module")
def memory_result(tiny_dir: str, results_dir: Path) -> dict[str, Any]:
    args = ["--model", tiny_dir, "--num-requests", "5", "--new-tokens", "6", "--max-prompt", "200",
            "--budget", "512KiB", "--candidates", "64"]
    return run_script("bench_memory", args, results_dir / "bench_memory.json")


@pytest.fixture(scope="module")
def decode_result(tiny_dir: str, results_dir: Path) -> dict[str, Any]:
    args = ["--model", tiny_dir, "--batch-sizes", "1,3", "--max-prompt", "40", "--new-tokens", "5",
            "--repeats", "1", "--warmup-tokens", "2", "--beam-batch-size", "2", "--sample-batch-size", "2",
            "--num-return-sequences", "3"]
    return run_script("bench_decode", args, results_dir / "bench_decode.json")


@pytest.fixture(scope="module")
def beam_result(tiny_dir: str, results_dir: Path) -> dict[str, Any]:
    args = ["--model", tiny_dir, "--prompt-len", "40", "--new-tokens", "12", "--repeats", "1"]
    return run_script("bench_beam", args, results_dir / "bench_beam.json")


@pytest.fixture(scope="module")
def cb_result(tiny_dir: str, results_dir: Path) -> dict[str, Any]:
    args = ["--model", tiny_dir, "--num-requests", "4", "--max-prompt", "40", "--new-tokens", "8",
            "--outputs", "sharegpt", "--output-scale", "0.02", "--budget", "1MiB", "--cb-page-size", "16",
            "--cb-max-batch-tokens", "256", "--repeats", "1"]
    return run_script("bench_cb", args, results_dir / "bench_cb.json")


# ------------------------------------------------------------------------------------------ bench helpers


def test_workload_is_seeded_capped_and_prefix_stable() -> None:
    long = sharegpt_workload(50, seed=3, max_prompt=200, max_output=100, token_range=(3, 96))
    short = sharegpt_workload(10, seed=3, max_prompt=200, max_output=100, token_range=(3, 96))
    assert long.head(10) == short
    assert long != sharegpt_workload(50, seed=4, max_prompt=200, max_output=100, token_range=(3, 96))
    assert all(1 <= p <= 200 for p in long.prompt_lens) and all(1 <= o <= 100 for o in long.output_lens)
    assert all(3 <= t < 96 for r in long.requests for t in r.prompt_ids)
    assert len(set(long.prompt_lens)) > 10  # ragged
    summary = long.summary()
    assert summary["distribution"]["input"]["mean"] == pytest.approx(161.31)
    assert summary["distribution"]["output"]["mean"] == pytest.approx(337.99)


def test_uniform_workload_draws_within_its_ranges_and_is_seeded() -> None:
    workload = uniform_workload(200, seed=1, prompt_lens=(5, 9), output_lens=(2, 4), token_range=(3, 96))
    assert workload == uniform_workload(200, seed=1, prompt_lens=(5, 9), output_lens=(2, 4), token_range=(3, 96))
    assert workload != uniform_workload(200, seed=2, prompt_lens=(5, 9), output_lens=(2, 4), token_range=(3, 96))
    assert set(workload.prompt_lens) == set(range(5, 10)) and set(workload.output_lens) == {2, 3, 4}  # both ends
    assert all(3 <= t < 96 for r in workload.requests for t in r.prompt_ids)
    assert workload.head(7).requests == workload.requests[:7]
    assert workload.summary()["distribution"]["input"] == {"uniform": [5, 9]}
    with pytest.raises(ValueError, match="length ranges"):
        uniform_workload(1, prompt_lens=(9, 5), output_lens=(2, 4), token_range=(3, 96))


def test_in_fresh_thread_returns_and_raises_on_the_caller() -> None:
    caller = threading.get_ident()
    assert in_fresh_thread(lambda a, b=0: (a + b, threading.get_ident()), 2, b=3)[0] == 5
    assert in_fresh_thread(threading.get_ident) != caller

    def fail() -> None:
        raise KeyError("from the thread")

    with pytest.raises(KeyError, match="from the thread"):
        in_fresh_thread(fail)


def test_dense_byte_formulas_match_real_caches() -> None:
    model = tiny_model("llama")
    per_token = kv_bytes_per_token(model.config, torch.float32)
    assert per_token == 2 * 2 * 2 * 16 * 4  # 2 x layers x kv_heads x head_dim x float32 bytes
    prompts = [[5] * 7, [6] * 3, [7] * 10]
    batch = left_pad(prompts, 0, "cpu")
    assert batch["attention_mask"].sum(dim=1).tolist() == [7, 3, 10]
    caches = {
        "dynamic": DynamicCache(config=model.config),
        "static": StaticCache(config=model.config, max_cache_len=32),
    }
    for cache in caches.values():
        model.generate(**batch, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert cache_tensor_bytes(caches["dynamic"]) == 3 * (10 + 4 - 1) * per_token
    assert cache_tensor_bytes(caches["static"]) == static_cache_reserved_bytes(model.config, 32, 3, torch.float32)
    with PagedCache(model) as paged:
        model.generate(**batch, cache=paged, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        real = stored_tokens([7, 3, 10], 4)
        assert paged.stats().tokens_stored == sum(real)
        assert paged.stats().blocks_in_use == paged_blocks(real, 16) == 3


# --------------------------------------------------------------------------------------- bench_memory


def test_bench_memory_accounting(memory_result: dict[str, Any]) -> None:
    res = memory_result
    per_token, rows, new = res["bytes_per_token"], res["workload"]["num_requests"], res["new_tokens"]
    prompts = res["workload"]["prompt_lens"]
    real = sum(stored_tokens(prompts, new))
    caches = {c["cache"]: c for c in res["caches"]}
    assert set(caches) == {"dynamic", "static_context", "static_workload_max", "paged"}
    for c in caches.values():
        assert c["used_bytes"] <= c["reserved_bytes"]
        assert c["utilization"] == pytest.approx(c["used_bytes"] / c["reserved_bytes"])
        assert c["waste_bytes"] == c["reserved_bytes"] - c["used_bytes"]
        assert c["tokens_match_dynamic"] is True
    assert caches["dynamic"]["reserved_bytes"] == rows * (max(prompts) + new - 1) * per_token
    assert caches["dynamic"]["used_bytes"] == real * per_token
    for name in ("static_context", "static_workload_max"):
        assert caches[name]["reserved_bytes"] == caches[name]["reserved_bytes_formula"]
        assert caches[name]["reserved_bytes"] == rows * caches[name]["max_cache_len"] * per_token
    assert caches["static_context"]["max_cache_len"] == res["context"] == 256
    paged = caches["paged"]
    assert paged["blocks_in_use"] == paged["blocks_predicted"] == paged_blocks(stored_tokens(prompts, new), 16)
    assert paged["reserved_bytes"] == paged["blocks_in_use"] * res["bytes_per_block"]
    assert paged["used_bytes"] == real * per_token
    assert paged["reserved_bytes"] <= caches["static_workload_max"]["reserved_bytes"]


def test_bench_memory_admission_fits_budget(memory_result: dict[str, Any]) -> None:
    b = memory_result["budget"]
    budget, new, per_token = b["budget_bytes"], b["new_tokens"], memory_result["bytes_per_token"]
    stream = sharegpt_workload(
        b["candidates"], seed=0, max_prompt=memory_result["workload"]["max_prompt"], max_output=1, token_range=(3, 96)
    ).prompt_lens
    assert stream[: memory_result["workload"]["num_requests"]] == memory_result["workload"]["prompt_lens"]
    rows = {r["cache"]: r for r in b["rows"]}
    for r in rows.values():
        assert r["reserved_bytes"] <= budget and not r["limited_by_stream"]
    k = rows["static_context"]["admitted"]
    assert k == budget // (per_token * memory_result["context"])

    def dense(k: int) -> int:
        return k * (max(stream[:k]) + new) * per_token

    k = rows["static_batch_max"]["admitted"]
    assert dense(k) <= budget < dense(k + 1)
    capacity = budget // memory_result["bytes_per_block"] - 1
    k = rows["paged"]["admitted"]
    blocks = [-(-t // 16) for t in stored_tokens(stream, new)]
    assert sum(blocks[:k]) <= capacity < sum(blocks[: k + 1])
    assert k >= rows["dynamic"]["admitted"] >= 1
    proof = b["proof"]
    assert proof["ok"] and proof["requests"] == k
    assert proof["blocks_in_use"] == proof["blocks_predicted"] == sum(blocks[:k])
    assert proof["pool_capacity_blocks"] == capacity
    assert b["paged_vs_static_batch_max"] == pytest.approx(k / rows["static_batch_max"]["admitted"])


# --------------------------------------------------------------------------------------- bench_decode


def test_bench_decode_fields(decode_result: dict[str, Any]) -> None:
    scenarios = {s["scenario"]: s for s in decode_result["scenarios"]}
    assert set(scenarios) == {"greedy_b1", "greedy_b3", "beam4_b2", "sample3_b2"}
    for s in scenarios.values():
        assert {r["variant"] for r in s["runs"]} == {"dynamic", "paged", "paged_sdpa"}
        for run in s["runs"]:
            assert run["steps"] == s["new_tokens"] == 5
            assert run["generated_tokens"] == s["returned_rows"] * 5
            assert run["tokens_per_s"] > 0 and run["decode_tokens_per_s"] > 0
            assert 0 < run["ttft_seconds"] <= run["seconds"] and run["decode_seconds"] <= run["seconds"]
            assert run["kv_high_water_bytes"] > 0
        for variant in ("paged", "paged_sdpa"):
            summary = s["summary"][variant]
            assert summary["ratio_tokens_per_s"] > 0 and summary["ratio_decode_tokens_per_s"] > 0
            if s["mode"] != "sample":
                assert summary["same_tokens_as_dynamic"] is True
    assert scenarios["sample3_b2"]["returned_rows"] == 6 and scenarios["beam4_b2"]["rows_in_generate"] == 8
    assert set(decode_result["targets"]) == {f"{s}/{v}" for s in ("greedy_b1", "greedy_b3", "beam4_b2")
                                             for v in ("paged", "paged_sdpa")}


# ---------------------------------------------------------------------------- bench_decode --per-step


def test_bench_decode_per_step_alternates_the_same_steps(tiny_dir: str, results_dir: Path) -> None:
    args = ["--model", tiny_dir, "--prompt-lens", "30,12x2", "--steps", "4", "--warmup-steps", "1",
            "--variants", "dynamic,paged_sdpa,paged"]
    result = run_script("bench_decode", ["--per-step", *args], results_dir / "bench_steps.json")
    assert result["prompt_lens"] == [30, 12, 12] and result["reference"] == "dynamic"
    assert list(result["variants"]) == ["dynamic", "paged_sdpa", "paged"] and result["max_abs_logit"] > 0
    for variant, r in result["variants"].items():
        assert len(r["step_seconds"]) == 4 and all(s > 0 for s in r["step_seconds"])
        low, high = r["step_ms_quartiles"]
        assert 0 < low <= r["step_ms"] <= high
        if variant != "dynamic":
            low, high = r["speed_quartiles"]
            assert 0 < low <= r["speed"] <= high
            assert r["same_greedy_tokens"] is True and r["max_abs_logit_diff"] < 1e-5


def test_bench_decode_per_step_fixed_cost_times_the_narrowed_architecture(tiny_dir: str, results_dir: Path) -> None:
    args = ["--model", tiny_dir, "--prompt-lens", "20,9", "--steps", "3", "--warmup-steps", "1", "--fixed-cost"]
    result = run_script("bench_decode", ["--per-step", *args], results_dir / "bench_steps_fixed_cost.json")
    heads = tiny_model("llama").config.num_attention_heads
    assert result["args"]["fixed_cost"] is True and result["hidden_size"] == heads * NARROW_HEAD_DIM
    paged = result["variants"]["paged_sdpa"]
    assert len(paged["step_seconds"]) == 3 and paged["same_greedy_tokens"] is True
    assert paged["max_abs_logit_diff"] < 1e-5


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_narrowed_keeps_the_architecture_and_cuts_its_widths(arch: str) -> None:
    model = tiny_model(arch)
    before = torch.random.get_rng_state()
    narrow = narrowed(model, head_dim=4, intermediate_size=8, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random stream is untouched
    config, cut = model.config, narrow.config
    assert type(narrow) is type(model) and cut.num_hidden_layers == config.num_hidden_layers
    assert (cut.num_attention_heads, cut.num_key_value_heads) == (config.num_attention_heads, config.num_key_value_heads)
    assert cut.vocab_size == config.vocab_size and getattr(cut, "layer_types", None) == getattr(config, "layer_types", None)
    assert (cut.head_dim, cut.hidden_size, cut.intermediate_size) == (4, config.num_attention_heads * 4, 8)
    assert not narrow.training and narrow.dtype == model.dtype
    same_seed = narrowed(model, head_dim=4, intermediate_size=8, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(narrow.state_dict().values(), same_seed.state_dict().values()))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert narrow(input_ids=ids).logits.shape == (1, 4, config.vocab_size)


def test_narrowed_refuses_a_config_without_widths() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel: its text config has no intermediate_size"):
        narrowed(tiny_model("gpt2"))  # GPT-2 names its MLP width n_inner


def test_bench_decode_reads_its_batch_and_refuses_one_per_step_variant() -> None:
    script = load_script("bench_decode")
    assert script.parse_prompt_lens("60,300x3, 7") == [60, 300, 300, 300, 7]
    with pytest.raises(SystemExit):
        script.parse_args(["--per-step", "--variants", "dynamic"])
    with pytest.raises(SystemExit):
        script.parse_args(["--per-step", "--variants", "dynamic,paged_nope"])
    assert script.parse_args(["--per-step"]).prompt_lens == [512] and script.parse_args([]).prompt_lens is None
    assert script.parse_args(["--per-step"]).out == "results/bench_steps.json"


# -------------------------------------------------------------------------------------- bench_kernels


def test_bench_kernels_fields(tiny_dir: str, results_dir: Path) -> None:
    args = ["--model", tiny_dir, "--batch-sizes", "1,3", "--context", "20", "--repeats", "2"]
    result = run_script("bench_kernels", args, results_dir / "bench_kernels.json")
    assert result["packed_linears"] == sum(type(m) is torch.nn.Linear for m in tiny_model("llama").modules())
    assert [r["batch_size"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        for part in ("decode", "head"):
            timing = row[part]
            for variant in ("stock", "packed"):
                low, high = timing[f"{variant}_ms_range"]
                assert 0 < low <= timing[f"{variant}_ms"] <= high
            assert timing["speedup"] > 0
        assert 0 <= row["max_abs_logit_diff"] < 1e-4 and row["greedy_tokens_agree"] is True
        assert row["decode"]["packed_over_floor"] == row["decode"]["packed_ms"] / result["floor"]["read_ms"]
    floor = result["floor"]
    assert floor["weight_bytes"] == 4 * sum(p.numel() for p in tiny_model("llama").parameters())  # float32
    assert 0 < floor["read_ms_range"][0] <= floor["read_ms"] <= floor["read_ms_range"][1]
    assert floor["read_gb_s"] == pytest.approx(floor["weight_bytes"] / floor["read_ms"] / 1e6)


@pytest.mark.parametrize("kind", ["decode", "prompt"])
def test_profile_steps_times_the_parts_of_a_kind_of_step_and_uninstalls_its_timers(tiny_dir: str, results_dir: Path,
                                                                                   kind: str) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_paged_cache.attention.paged_sdpa import ATTENTION_NAME, paged_sdpa_attention
    from hf_paged_cache.kernels.packed_linear import PackedLinear
    from hf_paged_cache.engine import forwards

    forward, packed_forward = PackedLinear.forward, forwards.packed_forward
    args = ["--model", tiny_dir, "--num-requests", "6", "--concurrency", "3", "--max-prompt", "40", "--max-new", "8",
            "--output-scale", "1", "--repeats", "1", "--steps", kind]
    result = run_script("profile_steps", args, results_dir / f"profile_steps_{kind}.json")
    assert result["kind"] == kind and result["steps"] > 0
    if kind == "decode":  # one token a row, at most one row a client
        assert 1 <= result["tokens_per_step"] <= 3
    else:  # every prompt token of the timed requests (random prompts: no prefix hits), and any decode rows
        workload = sharegpt_workload(6, seed=0, max_prompt=40, max_output=10**6, token_range=(0, 2))
        assert result["tokens"] >= sum(len(request.prompt_ids) for request in workload.requests)
    parts = result["parts"]
    assert parts["linear"]["median_ms"] > 0 and parts["sdpa"]["median_ms"] > 0
    assert parts["gather"]["share"] + parts["sdpa"]["share"] <= parts["attention"]["share"]  # nested parts
    assert parts["writes"]["share"] <= parts["cache update"]["share"]
    assert sum(parts[p]["share"] for p in ("linear", "attention", "cache update", "other")) == pytest.approx(1.0)
    assert PackedLinear.forward is forward and forwards.packed_forward is packed_forward  # the timers are gone
    assert ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] is paged_sdpa_attention


# -------------------------------------------------------------------------------------- bench_prompt_attention


@pytest.mark.skipif(not packed_linears_supported(), reason="no oneDNN linear operators in this PyTorch build")
def test_bench_prompt_attention_times_each_variant_against_a_float64_reference(results_dir: Path) -> None:
    args = ["--lengths", "8,21", "--dtypes", "float32", "--variants", "sdpa,products", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--repeats", "2", "--threads", "1"]
    result = run_script("bench_prompt_attention", args, results_dir / "bench_prompt_attention.json")
    rows = result["rows"]
    assert [(row["length"], row["variant"]) for row in rows] == [(8, "sdpa"), (8, "products"), (21, "sdpa"),
                                                                  (21, "products")]
    assert all(row["max_abs_error"] < 1e-5 and row["median_us"] > 0 for row in rows)  # the same attention
    assert all(row["speedup_vs_sdpa"] == 1.0 for row in rows if row["variant"] == "sdpa")


def test_bench_prompt_attention_refuses_a_run_without_sdpa() -> None:
    with pytest.raises(SystemExit):
        load_script("bench_prompt_attention").parse_args(["--variants", "products"])


# -------------------------------------------------------------------------------------- bench_mkl_dispatch


@pytest.mark.skipif(not (torch.backends.mkl.is_available() and sys.platform == "linux"), reason="needs MKL on Linux")
def test_bench_mkl_dispatch_times_every_call_with_and_without_the_override(results_dir: Path, tmp_path: Path) -> None:
    from mkl_override import build_override, report_in_a_fresh_process

    args = ["--preload", str(build_override(tmp_path)), "--rounds", "1", "--calls", "1", "--threads", "1"]
    result = run_script("bench_mkl_dispatch", args, results_dir / "bench_mkl_dispatch.json")
    # the stock children drop any LD_PRELOAD of this process: MKL's own check, as a fresh process has it
    assert result["fast_path"] == {"stock": [report_in_a_fresh_process(None)], "preloaded": ["True"]}
    assert [row["call"] for row in result["rows"]] == [
        "linear float32", "prompt sdpa float32", "decode sdpa float32", "prompt sdpa bfloat16", "decode sdpa bfloat16"]
    assert all(row["stock_us"] > 0 and row["preloaded_us"] > 0 and row["speedup"] > 0 for row in result["rows"])


def test_bench_mkl_dispatch_needs_a_library_to_preload() -> None:
    with pytest.raises(SystemExit):
        load_script("bench_mkl_dispatch").parse_args([])


# -------------------------------------------------------------------------------------- bench_kv_dtype


def test_bench_kv_dtype_fields(tiny_dir: str, results_dir: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"t{3 + i % (VOCAB - 3)}" for i in range(400)))
    args = ["--model", tiny_dir, "--corpus", str(corpus), "--fidelity-lens", "5,9,14", "--fidelity-tokens", "4",
            "--decode-steps", "2", "--repeats", "1", "--threads", "1", "--num-requests", "3", "--min-prompt", "4",
            "--max-prompt", "12", "--min-new", "2", "--max-new", "4", "--kv-dtypes", "float32,int8,bfloat16"]
    result = run_script("bench_kv_dtype", args, results_dir / "bench_kv_dtype.json")
    per_token = {row["kv_dtype"]: row["bytes_per_token"] for row in result["bytes"]}
    assert per_token == {"float32": 2 * 2 * 2 * 16 * 4, "int8": 2 * 2 * 2 * (16 + 4), "bfloat16": 2 * 2 * 2 * 16 * 2}
    fidelity = {row["kv_dtype"]: row for row in result["fidelity"]}
    assert fidelity["float32"]["rows_identical"] == fidelity["float32"]["rows"] == 3  # the reference against itself
    assert [row["kv_dtype"] for row in result["decode"]] == ["float32", "int8", "bfloat16"]
    assert all(row["ms_per_step"] > 0 for row in result["decode"])
    batcher = {row["kv_dtype"]: row for row in result["batcher"]}
    assert set(batcher) == {"float32", "int8"} and batcher["int8"]["blocks"] > 3 * batcher["float32"]["blocks"]
    assert all(1 <= row["most_in_flight"] <= 3 and row["tokens_per_s"] > 0 for row in batcher.values())


# ----------------------------------------------------------------------------------------- bench_beam


def test_bench_beam_memory(beam_result: dict[str, Any]) -> None:
    res = beam_result
    per_token = 2 * 2 * 2 * 16 * 4
    dynamic, paged = res["summary"]["dynamic"], res["summary"]["paged"]
    assert dynamic["kv_bytes_end"] == 4 * (40 + 12 - 1) * per_token  # every beam a private copy
    # Beams share the prompt's blocks: at most the 3 prompt blocks once plus each beam's own tail.
    assert paged["kv_bytes_end"] <= (3 + 4 * math.ceil(12 / 16 + 1)) * 16 * per_token
    assert res["kv_bytes_ratio"] == pytest.approx(paged["kv_bytes_end"] / dynamic["kv_bytes_end"])
    assert res["kv_bytes_ratio"] < 1 and res["same_tokens"] is True
    assert res["speed_ratio"] > 0 and {"kv_bytes_ratio", "speed_ratio"} <= set(res["targets"])


# ------------------------------------------------------------------------------------------- bench_cb


def test_bench_cb_fields(cb_result: dict[str, Any]) -> None:
    s = cb_result["summary"]
    assert set(s) == {"dynamic", "paged", "cb"}
    useful = sum(cb_result["outputs"])
    assert all(1 <= o <= 8 for o in cb_result["outputs"])
    assert s["cb"]["computed_tokens"] == useful  # CB stops each request at its own length
    assert s["dynamic"]["computed_tokens"] == 4 * max(cb_result["outputs"]) >= useful  # one padded batch
    layout = cb_result["cb_cache"]
    assert layout["page_size"] == 16
    assert s["cb"]["kv_allocated_bytes"] == (layout["num_sectors"] + 2) * layout["bytes_per_sector"]
    assert s["cb"]["kv_allocated_bytes"] <= 2**20 + 2 * layout["bytes_per_sector"]
    assert s["paged"]["kv_high_water_bytes"] <= s["paged"]["kv_allocated_bytes"]
    assert s["paged"]["requests_with_same_tokens_as_dynamic"] == "4/4"


# ----------------------------------------------------------------------------------------- plot_bench


def test_plot_bench_writes_pngs(
    memory_result: dict[str, Any],
    decode_result: dict[str, Any],
    beam_result: dict[str, Any],
    cb_result: dict[str, Any],
    serving_result: dict[str, Any],
    results_dir: Path,
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    written = load_script("plot_bench").main(["--results-dir", str(results_dir), "--out-dir", str(tmp_path)])
    names = {Path(p).name for p in written["written"]}
    assert names == {"bench_memory.png", "bench_concurrency.png", "bench_throughput.png", "bench_beam.png",
                     "bench_cb.png", "bench_serving.png"}
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ the real default model


def test_default_model_ragged_chat_batch_paged_matches_dynamic(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_paged_cache.models.default_model import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no Hub probe: the offline copy, deterministically
    model, tokenizer = load_model_and_tokenizer()
    questions = [
        "What is the capital of France?",
        "Write one sentence about the sea, the wind and the sky, then name three colours of the sunset.",
        "2 + 2 =",
    ]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    assert len(set(inputs["attention_mask"].sum(dim=1).tolist())) == 3  # ragged
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with torch.inference_mode():
        reference = model.generate(**inputs, cache=DynamicCache(config=model.config), **kwargs)
        with PagedCache(model) as cache:
            paged = model.generate(**inputs, cache=cache, **kwargs)
    assert torch.equal(paged, reference)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Gemma 3 (two layers sliding over 12 positions, one full) with the tiny tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-gemma3")
    tiny_model("gemma3_text").save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(path)
    return str(path)


def test_bench_layer_groups(tiny_gemma3_dir: str, results_dir: Path) -> None:
    args = ["--model", tiny_gemma3_dir, "--long", "40", "--short", "10", "--new-tokens", "4", "--decode-prompt",
            "20", "--decode-tokens", "30", "--samples-prompt", "30", "--block-size", "4"]
    results = run_script("bench_layer_groups", args, results_dir / "layer_groups.json")
    scenarios = results["scenarios"]
    assert set(scenarios) == {"one_prompt", "ragged", "long_decode", "samples"}
    for name, r in scenarios.items():
        assert r["tokens_identical"], name
        assert 0 < r["paged"]["sliding_blocks_peak"] <= math.ceil(12 / 4) + 1, name
    # one prompt of 40 + 3 fed tokens: 11 blocks of the full layer, the sliding layers' last 11 tokens (32-42)
    per_layer_block = 2 * 16 * 2 * 4 * 4  # KV heads x head dim x (K + V) x float32 x 4 tokens
    paged = scenarios["one_prompt"]["paged"]
    assert paged["held_end"] == 11 * per_layer_block + 3 * 2 * per_layer_block
    assert scenarios["one_prompt"]["dynamic"]["held_end"] == (43 + 2 * 11) * per_layer_block // 4
    assert scenarios["samples"]["copies_ratio"] < 8 / 2  # the prompt is stored once, not 8 times


@pytest.fixture(scope="module")
def serving_result(tiny_dir: str, results_dir: Path) -> dict[str, Any]:
    args = ["--model", tiny_dir, "--num-requests", "6", "--max-prompt", "24", "--max-new", "6", "--output-scale",
            "0.05", "--batch-size", "3", "--repeats", "1", "--block-size", "4"]
    return run_script("bench_serving", args, results_dir / "bench_serving.json")


def test_bench_serving_uniform_workload(tiny_dir: str, results_dir: Path) -> None:
    args = ["--model", tiny_dir, "--workload", "uniform", "--num-requests", "4", "--min-prompt", "5", "--max-prompt",
            "12", "--min-new", "2", "--max-new", "5", "--batch-size", "4", "--repeats", "1", "--block-size", "4",
            "--contenders", "dynamic,batcher"]
    results = run_script("bench_serving", args, results_dir / "bench_serving_uniform.json")
    assert results["workload"] == "uniform" and set(results["contenders"]) == {"dynamic", "batcher"}
    assert all(5 <= n <= 12 for n in results["prompt_lens"]) and all(2 <= n <= 5 for n in results["output_lens"])
    assert results["output_tokens"] == sum(results["output_lens"])
    for name, r in results["contenders"].items():
        assert r["tokens_identical"], name


def test_bench_serving(serving_result: dict[str, Any], tiny_dir: str) -> None:
    results = serving_result
    assert set(results["contenders"]) == {"dynamic", "paged", "generate_batch", "batcher", "batcher_unpacked"}
    for name, r in results["contenders"].items():
        assert r["tokens_identical"] is not False, name
        assert r["tokens_per_s"] > 0 and 0 <= r["ttft_p50_s"] <= r["ttft_p95_s"], name
    for name in ("dynamic", "paged", "batcher", "batcher_unpacked"):  # generate_batch's float rounding may differ
        assert results["contenders"][name]["tokens_identical"], name
    assert results["contenders"]["batcher_unpacked"]["packed_steps"] == [0]
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(tiny_dir), torch.float32)
    assert results["budget_bytes"] == (3 * math.ceil((24 + 6) / 4) + 1) * 4 * per_token


def test_bench_serving_compares_model_dtypes(tiny_dir: str, results_dir: Path) -> None:
    args = ["--model", tiny_dir, "--dtypes", "float32,bfloat16", "--packed-linears", "--contenders", "batcher",
            "--num-requests", "4", "--max-prompt", "24", "--max-new", "6", "--output-scale", "0.05", "--repeats", "2",
            "--budget", "1MiB", "--batch-size", "2", "--skip-check"]
    results = run_script("bench_serving", args, results_dir / "bench_serving_model_dtype.json")
    assert set(results["contenders"]) == {"batcher@float32", "batcher@bfloat16"}
    full, half = results["contenders"]["batcher@float32"], results["contenders"]["batcher@bfloat16"]
    assert (full["dtype"], half["dtype"]) == ("float32", "bfloat16")
    assert full["ratio_per_round"] == [1.0, 1.0] and len(half["ratio_per_round"]) == 2
    assert full["requests_identical_to_reference"] == 4 and full["mean_first_difference"] is None
    assert 0 <= half["requests_identical_to_reference"] <= 4
    assert full["same_tokens_every_round"] and half["same_tokens_every_round"]  # each dtype is deterministic
    assert results["output_tokens"] == sum(min(max(round(n * 0.05), 1), 6)
                                           for n in sharegpt_workload(4, max_prompt=24, max_output=10**6,
                                                                      token_range=(3, VOCAB)).output_lens)
