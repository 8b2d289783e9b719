"""Smoke test of ``scripts/bench/serving/bench_http.py``: our server (a real subprocess on a free port) against the in-process
`ContinuousBatcher`, on a tiny random Llama with the character tokenizer of ``tests/data/char_tokenizer``.

The test checks the JSON fields, the accounting and that the two contenders answer alike, never a timing; the
``transformers`` contender is left out to keep it short (the script runs it the same way).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from repo_paths import DATA
from tiny_models import tiny_model
from transformers import AutoConfig, AutoTokenizer

pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the server needs its extra: pip install -e '.[serve]'")
if importlib.util.find_spec("hf_paged_cache.serve") is None:
    pytest.skip("the server module hf_paged_cache.serve is not there yet", allow_module_level=True)

from script_loading import load_script  # noqa: E402

from hf_paged_cache.bench import kv_bytes_per_token  # noqa: E402
from hf_paged_cache.bench.http_contenders import running_server  # noqa: E402
from hf_paged_cache.bench.http_load import request_body  # noqa: E402
from hf_paged_cache.bench.http_report import schema_valid  # noqa: E402



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-http")
    tiny_model("llama").save_pretrained(path)
    AutoTokenizer.from_pretrained(DATA / "char_tokenizer").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results-http")


@pytest.fixture(scope="module")
def http_result(model_dir: Path, results_dir: Path) -> dict[str, Any]:
    out = results_dir / "bench_http.json"
    args = ["--model", str(model_dir), "--contenders", "ours,batcher", "--num-requests", "4", "--concurrency", "2",
            "--max-prompt", "24", "--max-new", "6", "--output-scale", "0.05", "--repeats", "1", "--threads", "1",
            "--start-timeout", "120", "--out", str(out)]
    payload = load_script("bench_http").main(args)
    assert json.loads(out.read_text())["benchmark"] == payload["benchmark"] == "http"
    return payload


def test_bench_http_fields(http_result: dict[str, Any], model_dir: Path) -> None:
    res = http_result
    assert set(res["contenders"]) == {"ours", "batcher"} and res["num_requests"] == 4
    assert all(1 <= n <= 6 for n in res["max_tokens"]) and res["output_tokens"] == sum(res["max_tokens"])
    for name, c in res["contenders"].items():
        (round_,) = c["rounds"]
        assert round_["lengths_as_requested"] == round_["usage_reported"] == 4, name  # EOS ignored, usage sent
        assert round_["output_tokens"] == res["output_tokens"], name
        assert round_["prompt_tokens"] == res["prompt_tokens"], name  # the server tokenized the text as we did
        assert c["tokens_per_s"] == pytest.approx(res["output_tokens"] / round_["seconds"]), name
        assert 0 < c["ttft_p50_s"] <= c["ttft_p95_s"] <= round_["seconds"], name
        assert 0 <= c["itl_p50_s"] <= c["itl_p95_s"], name
        assert len(c["texts"]) == 4 and c["texts_same_every_round"] == 4, name
    assert res["contenders"]["ours"]["rounds"][0]["startup_seconds"] > 0
    assert res["contenders"]["batcher"]["rounds"][0]["startup_seconds"] is None
    # the batcher's timed round: its 4 prompts computed (no prefix in common), each other token in some step
    steps = res["contenders"]["batcher"]["rounds"][0]["steps"]
    assert 1 <= steps["prompt_steps"] <= 4 and steps["prompt_seconds"] > 0 and 0 <= steps["decode_share"] < 1
    assert steps["decode_steps"] <= res["output_tokens"] - 4 and res["contenders"]["ours"]["rounds"][0]["steps"] is None
    assert res["identical_texts"] == {"ours/batcher": 4}  # both greedy and exact: the same answers
    assert res["speed_ratios"]["ours/batcher"]["per_round"] == [
        res["contenders"]["ours"]["tokens_per_s"] / res["contenders"]["batcher"]["tokens_per_s"]
    ]
    # 2 clients' longest requests (at most 24 + 6 tokens) in whole 256-token transformers blocks, + 1
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), torch.float32)
    assert res["budget_bytes"] == (2 * math.ceil(30 / 256) + 1) * 256 * per_token
    assert res["cb_num_blocks"] == 3
    assert set(res["commands"]) == {"ours"} and "--max-memory" in res["commands"]["ours"]


def test_bench_http_leaves_no_process(http_result: dict[str, Any]) -> None:
    assert psutil.Process().children(recursive=True) == []


def test_server_that_cannot_start_is_reported_and_gone(tmp_path: Path) -> None:
    bench = load_script("bench_http")
    settings = bench.ServerSettings(str(tmp_path / "no-model-here"), budget=2**20, cb_num_blocks=1, cb_page_size=None,
                                    threads=1, start_timeout=120)
    with pytest.raises(RuntimeError, match="exited with code"):
        with running_server("ours", settings, tmp_path):
            pass
    assert psutil.Process().children(recursive=True) == []


def test_vllm_without_its_python_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(SystemExit, match=r"the vllm contender needs vLLM: --vllm-python .*no-venv.* is no Python"):
        load_script("bench_http").main(["--model", str(tmp_path / "no-model-here"), "--contenders", "ours,vllm",
                                        "--vllm-python", str(missing), "--out", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()  # refused before any model was loaded or server started


def test_vllm_is_not_a_default_contender() -> None:
    args = load_script("bench_http").parse_args([])
    assert args.contenders.split(",") == ["ours", "transformers", "batcher"] and args.dtype == "float32"


def test_preloaded_contenders_run_theirs_with_the_library_preloaded(tmp_path: Path, monkeypatch) -> None:
    script = load_script("bench_http")
    with pytest.raises(SystemExit):  # no library to preload
        script.parse_args(["--contenders", "ours,ours-preloaded"])
    library = tmp_path / "libmkl_any_cpu.so"
    library.write_bytes(b"")
    args = script.parse_args(["--contenders", "ours,ours-preloaded,vllm-preloaded", "--preload", str(library)])
    monkeypatch.setenv("LD_PRELOAD", "libjemalloc.so")
    settings = script.ServerSettings("m", 1 << 20, 1, None, threads=2, start_timeout=1.0, preload=args.preload)
    assert settings.command("ours-preloaded", 1) == settings.command("ours", 1)
    assert settings.command("vllm-preloaded", 1) == settings.command("vllm", 1)
    assert "LD_PRELOAD" not in settings.own_env("ours")
    assert settings.own_env("ours-preloaded") == {"LD_PRELOAD": f"{library} libjemalloc.so"}
    assert settings.own_env("vllm-preloaded") == settings.own_env("vllm") | {"LD_PRELOAD": f"{library} libjemalloc.so"}
    assert request_body("vllm-preloaded", script.Job("x", [1], 2))["ignore_eos"]


def test_ray_mode_compares_routers_on_shared_system_prompts() -> None:
    script = load_script("bench_http")
    args = script.parse_args(["--ray", "--prefixes", "3", "--prefix-tokens", "20", "--max-prompt", "16"])
    assert args.contenders.split(",") == ["ray-prefix", "ray-pow2", "ray-single"] and args.replicas == 2
    assert script.parse_args([]).prefixes == 0  # the plain run's workload is unchanged
    model, tokenizer = tiny_model("llama"), AutoTokenizer.from_pretrained(DATA / "char_tokenizer")
    jobs = script.make_jobs(model, tokenizer, args, count=12, seed=0, max_new=4)
    heads = {job.text[:20] for job in jobs}  # one character per token
    assert len(heads) == 3 and all(len(job.prompt_ids) > 20 for job in jobs)
    assert script.make_jobs(model, tokenizer, args, count=12, seed=0, max_new=4) == jobs  # seeded
    settings = script.ServerSettings("m", 1 << 20, 1, None, threads=2, start_timeout=1.0, replicas=2)
    assert settings.command("ray-pow2", 1)[-11:] == ["--ray", "--replicas", "2", "--replica-cpus", "0",
                                                     "--replica-threads", "1", "--router", "pow2", "--speculative",
                                                     "off"]
    assert settings.command("ray-single", 1)[-10:-8] == ["--replicas", "1"]
    assert request_body("ray-prefix", jobs[0])["ignore_eos"]  # every answer as long as asked


def test_json_contenders_send_the_schema_the_others_do_not() -> None:
    """The json workload: seeded chat requests whose schema the -json contenders send as response_format to the
    same servers; answers are judged by the schema."""
    script = load_script("bench_http")
    tokenizer = AutoTokenizer.from_pretrained(DATA / "char_tokenizer")
    jobs = script.make_json_jobs(tokenizer, count=6, seed=0)
    assert jobs == script.make_json_jobs(tokenizer, count=6, seed=0) and len({j.text for j in jobs}) == 6
    assert {j.response_format["json_schema"]["name"] for j in jobs} == {"person", "book", "city"}
    settings = script.ServerSettings("m", 1 << 20, 1, None, threads=2, start_timeout=1.0)
    assert settings.command("ours-json", 1) == settings.command("ours", 1)
    assert settings.command("vllm-json", 1) == settings.command("vllm", 1) and script.is_vllm("vllm-json")
    held, free = request_body("ours-json", jobs[0]), request_body("ours", jobs[0])
    assert held["response_format"]["json_schema"]["strict"] and "response_format" not in free
    assert {k: v for k, v in held.items() if k != "response_format"} == free
    person = {"name": "Ka", "age": 40, "city": "Lo", "job": "farmer", "hobbies": ["a", "b", "c"]}
    assert schema_valid(json.dumps(person), jobs[0])
    assert not schema_valid(json.dumps(person | {"age": 200}), jobs[0])
    assert not schema_valid('{"name": "Ka"', jobs[0])


def test_prefix_hit_ceiling_counts_each_shared_block_once() -> None:
    script = load_script("bench_http")
    a, b = list(range(40)), list(range(33)) + [99] * 7  # share 2 blocks of 16, then differ
    jobs = [script.Job("", ids, 1) for ids in (a, b, a, list(range(16)))]
    # b finds 2 blocks of a; a again finds 2 (its last token is computed); the 16-token prompt finds none
    assert script.prefix_hit_ceiling(jobs) == (32 + 32 + 0) / (40 + 40 + 40 + 16)


def test_plot_bench_draws_http(http_result: dict[str, Any], results_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = load_script("plot_bench").main(["--results-dir", str(results_dir), "--out-dir", str(tmp_path)])
    assert {Path(p).name for p in written["written"]} == {"bench_http.png"}
    assert (tmp_path / "bench_http.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
