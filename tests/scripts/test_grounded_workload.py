"""The input-grounded workload (`hf_paged_cache.bench.grounded`): seeded, built from the standard library's text,
and every request's answer to be found in its own prompt; and how ``scripts/bench/serving/bench_http.py`` sends it
and starts the speculating contenders. No model runs here."""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import pytest

from hf_paged_cache.bench.grounded import (
    KINDS,
    MAX_TOKENS_EXTRA,
    default_count_tokens,
    grounded_workload,
    misspell,
    prose,
    rename,
    sentences,
)
from hf_paged_cache.bench.http_load import Stream, chunk_text, endpoint, request_body
from hf_paged_cache.bench.http_report import acceptance, generated_tokens
from hf_paged_cache.bench.http_rounds import SPEC_COUNTER


@pytest.fixture(scope="module")
def workload():
    return grounded_workload(48, seed=0)


def test_seeded_and_each_request_independent_of_the_count(workload) -> None:
    assert grounded_workload(48, seed=0) == workload
    assert grounded_workload(10, seed=0).requests == workload.requests[:10]  # a head of the same stream
    other = grounded_workload(10, seed=1)
    assert other.requests != workload.requests[:10] and other.fingerprint() != workload.fingerprint()


def test_kinds_cycle_and_nothing_is_used_twice(workload) -> None:
    assert len(workload) == 48
    assert [r.kind for r in workload.requests] == [KINDS[i % len(KINDS)] for i in range(48)]
    assert len({r.source for r in workload.requests}) == 48
    assert len({r.prompt for r in workload.requests}) == 48
    summary = workload.summary()
    assert sum(summary["kinds"].values()) == 48 and summary["fingerprint"] == workload.fingerprint()


def test_every_answer_is_grounded_in_its_prompt(workload) -> None:
    for r in workload.requests:
        assert len(r.messages) == 1 and r.messages[0]["role"] == "user", r.source
        assert r.grounding in r.prompt, r.source
        reference = r.expected if r.expected is not None else r.grounding
        assert r.max_tokens >= default_count_tokens(reference) + MAX_TOKENS_EXTRA, r.source
        if r.kind == "repeat":
            assert r.expected == r.grounding
        elif r.kind == "quote":
            assert r.expected in r.grounding and r.expected in sentences(r.grounding)
            (word,) = re.findall(r'contains the word "(\w+)"', r.prompt)
            hits = [s for s in sentences(r.grounding) if word in s.lower()]
            assert hits == [r.expected], r.source  # the word names one sentence only
        elif r.kind == "correct":
            right, wrong = r.expected.split(), r.grounding.split()
            assert len(right) == len(wrong)
            changed = [(a, b) for a, b in zip(right, wrong, strict=True) if a != b]
            assert 0 < len(changed) <= len(right) // 2, r.source
            assert all(sorted(a) == sorted(b) for a, b in changed)  # letters swapped, none added
        elif r.kind == "rename":
            old, new = re.findall(r"rename the variable `(\w+)` to `(\w+)`", r.prompt)[0]
            assert old != new and new not in r.grounding
            assert r.expected == rename(r.grounding, old, new) and r.expected != r.grounding
            assert ast.dump(ast.parse(r.expected)) != ast.dump(ast.parse(r.grounding))  # still Python
            assert rename(r.expected, new, old) == r.grounding  # only that name changed
        else:
            assert r.kind == "summarise" and r.expected is None


def test_caps_follow_the_given_token_counter() -> None:
    words = grounded_workload(5, seed=3, count_tokens=lambda text: len(text.split()))
    chars = grounded_workload(5, seed=3)
    assert [r.messages for r in words.requests] == [r.messages for r in chars.requests]
    for r in words.requests:
        reference = r.expected if r.expected is not None else r.grounding
        assert r.max_tokens == -(-len(reference.split()) * 5 // 4) + MAX_TOKENS_EXTRA


def test_kinds_can_be_chosen() -> None:
    only = grounded_workload(4, seed=0, kinds=("rename",))
    assert {r.kind for r in only.requests} == {"rename"}
    with pytest.raises(ValueError, match="kinds must be some of"):
        grounded_workload(1, kinds=("translate",))


def test_rename_leaves_attributes_strings_and_comments() -> None:
    code = 'def f(x, y):\n    x.x = x  # x\n    return "x" + y.x + x\n'
    assert rename(code, "x", "z") == 'def f(z, y):\n    z.x = z  # x\n    return "x" + y.x + z\n'


def test_misspell_swaps_inner_letters() -> None:
    text = "Returns the smallest element greater than the argument, or nothing."
    wrong, count = misspell(text, random.Random(0), every=1)
    assert count > 0 and wrong != text and len(wrong) == len(text)
    assert wrong.split()[1] == "the"  # short words are left alone


def test_prose_drops_code_and_cuts_at_a_sentence() -> None:
    doc = "First sentence here. Second one follows.\n\n>>> f(1)\n1\n\nExample::\n\n    code()\n\nLast words."
    assert prose(doc, 100) == "First sentence here. Second one follows.\n\nLast words."
    assert prose(doc, 4) == "First sentence here."


# ------------------------------------------------------------------ bench_http.py --workload grounded


@pytest.fixture(scope="module")
def bench():
    from test_bench_scripts import load_script

    return load_script("bench_http")


@pytest.fixture(scope="module")
def char_tokenizer():
    from transformers import AutoTokenizer

    data = next(p / "data" for p in Path(__file__).resolve().parents if (p / "data" / "char_tokenizer").is_dir())
    return AutoTokenizer.from_pretrained(data / "char_tokenizer")  # tests/data's, which has a chat template


def test_bench_http_grounded_jobs_are_chats_that_stop_at_eos(bench, char_tokenizer) -> None:
    jobs = bench.make_grounded_jobs(char_tokenizer, count=6, seed=0)
    requests = grounded_workload(6, seed=0).requests
    assert [j.messages for j in jobs] == [r.messages for r in requests]
    for job, request in zip(jobs, requests, strict=True):
        assert not job.ignore_eos and job.expected == request.expected
        assert job.text == char_tokenizer.apply_chat_template(list(job.messages), add_generation_prompt=True,
                                                              tokenize=False)
        assert job.prompt_ids == char_tokenizer(job.text, add_special_tokens=False).input_ids
        reference = request.expected if request.expected is not None else request.grounding
        assert job.max_tokens == -(-len(char_tokenizer(reference, add_special_tokens=False).input_ids) * 5 // 4) + 16
    assert all(j.max_tokens == 16 for j in bench.make_grounded_jobs(char_tokenizer, count=3, seed=0, max_new=16))


def test_bench_http_sends_grounded_jobs_as_streamed_chats(bench, char_tokenizer) -> None:
    (job,) = bench.make_grounded_jobs(char_tokenizer, count=1, seed=0)
    for contender in ("ours", "ours-spec", "vllm", "vllm-spec"):
        body = request_body(contender, job)
        assert endpoint(body) == "/v1/chat/completions" and "prompt" not in body
        assert body["messages"] == [dict(m) for m in job.messages] and body["temperature"] == 0
        assert "ignore_eos" not in body and body["stream_options"] == {"include_usage": True}
    config = json.loads(request_body("transformers", job)["generation_config"])
    assert config == {"do_sample": False}  # its EOS kept
    standard = request_body("ours-spec", bench.Job("x", [1], 2))
    assert endpoint(standard) == "/v1/completions" and standard["ignore_eos"]
    assert chunk_text({"delta": {"content": "ab"}}) == "ab" and chunk_text({"delta": {}}) == ""
    assert chunk_text({"text": "cd"}) == "cd"


def test_bench_http_speculative_contenders(bench, tmp_path) -> None:
    args = bench.parse_args(["--contenders", "ours,ours-spec,vllm,vllm-spec", "--workload", "grounded",
                             "--speculative-tokens", "3"])
    settings = bench.ServerSettings("m", 1 << 20, 1, None, threads=2, start_timeout=1.0,
                                    speculative_tokens=args.speculative_tokens,
                                    prompt_lookup=(args.prompt_lookup_min, args.prompt_lookup_max))
    assert settings.command("ours", 1)[-2:] == ["--speculative", "off"]
    assert settings.command("ours-spec", 1) == settings.command("ours", 1)[:-2] + [
        "--speculative", "ngram", "--speculative-tokens", "3"]
    spec = settings.command("vllm-spec", 1)
    assert spec[:-2] == settings.command("vllm", 1) and spec[-2] == "--speculative-config"
    assert json.loads(spec[-1]) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2}
    assert settings.own_env("vllm-spec") == settings.own_env("vllm") and bench.is_vllm("vllm-spec")
    assert "'{\"method\": \"ngram\"" in settings.command_line("vllm-spec")  # quoted for a shell
    with pytest.raises(SystemExit, match="the vllm contender needs vLLM"):
        bench.main(["--model", str(tmp_path / "none"), "--contenders", "vllm-spec",
                    "--vllm-python", str(tmp_path / "no-python"), "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit):
        bench.parse_args(["--ray", "--workload", "grounded"])


def test_bench_http_reads_draft_counters(bench) -> None:
    metrics = "\n".join([
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.",
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0',
        "vllm:spec_decode_num_drafts_total 10.0",
    ])
    counters: dict[str, float] = {}
    for name, value in SPEC_COUNTER.findall(metrics):
        counters[name] = counters.get(name, 0.0) + float(value)
    assert counters == {"vllm:spec_decode_num_draft_tokens_total": 40.0,
                        "vllm:spec_decode_num_accepted_tokens_total": 30.0}
    assert acceptance(counters) == {"draft_tokens": 40.0, "accepted_tokens": 30.0, "acceptance": 0.75}
    assert acceptance(None) is None


def test_bench_http_counts_generated_tokens(bench) -> None:
    stream = Stream(0.0, [1.0, 2.0, 3.0], "abc", None, None, 3.5, "stop")
    assert generated_tokens(stream, bench.Job("x", [1], 10, ignore_eos=False)) == 3  # the chunks
    assert generated_tokens(stream, bench.Job("x", [1], 10)) == 10  # EOS ignored: as asked
    with_usage = Stream(0.0, [1.0], "abc", 7, 1, 1.0, "stop")
    assert generated_tokens(with_usage, bench.Job("x", [1], 10, ignore_eos=False)) == 7
