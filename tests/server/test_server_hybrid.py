"""The server on a model with linear-attention layers (a tiny Qwen3-Next: gated DeltaNet and full attention), as
users meet it: the official client, concurrent and streamed requests, log-probabilities, a cancelled stream; its
conv / recurrent states kept per request in the pool's state slots, a repeated prompt started from a snapshot of
them, speculation off by itself."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from server_process import CONTEXT, KEY, NAME, free_port, generate_alone, metric, metrics_text, run_server, token_ids
from repo_paths import DATA
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

openai = pytest.importorskip("openai")

PROMPTS = ["abcabcabc", "the sea, the sea", "xyz", "hello there, general", "0123456789" * 3, "q"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-next")
    model = tiny_model("qwen3_next")
    model.config.max_position_embeddings = CONTEXT
    tokenizer = AutoTokenizer.from_pretrained(DATA / "char_tokenizer")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hybrid-server") / "server.log"
    with run_server(model_dir, log, "--log-level", "info", "--max-step-tokens", "8") as running:
        running.log = log
        yield running


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_concurrent_answers_equal_generate_alone(server, reference):
    model, tokenizer = reference
    client = client_of(server)
    answers = {}

    def ask(prompt):  # prompts longer than --max-step-tokens are prefilled in chunks, beside others' decodes
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
        answers[prompt] = answer.choices[0].logprobs

    threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        expected = generate_alone(model, ids, 12)
        got = token_ids(answers[prompt].tokens)
        assert got == expected[: len(got)] and len(expected) - len(got) <= 1, (prompt, got, expected)
        assert len(answers[prompt].top_logprobs[0]) == 1


def test_streamed_chat_and_a_cancelled_stream_leave_the_server_answering(server, reference):
    model, tokenizer = reference
    client = client_of(server)
    stream = client.completions.create(model=NAME, prompt="abcdefgh", max_tokens=40, temperature=0, stream=True)
    for index, _ in enumerate(stream):
        if index == 2:
            stream.close()  # the client goes away mid-answer: its request is cancelled, its slot given back
            break
    chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert isinstance(text, str)
    answer = client.completions.create(model=NAME, prompt="xyz", max_tokens=6, temperature=0, logprobs=0,
                                       extra_body={"return_tokens_as_token_ids": True})
    expected = generate_alone(model, tokenizer("xyz").input_ids, 6)
    assert token_ids(answer.choices[0].logprobs.tokens) == expected[: len(answer.choices[0].logprobs.tokens)]


def test_speculation_is_off_by_itself_and_refused_when_asked_for(server, model_dir):
    assert "speculative decoding is off" in server.log.read_text()
    done = subprocess.run([sys.executable, "-m", "hf_paged_cache.serve", str(model_dir), "--speculative", "ngram",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "speculative decoding is not supported on Qwen3NextForCausalLM" in done.stderr


def test_a_repeated_prompt_starts_from_the_snapshot_of_its_states(server, reference):
    """A 40-token prompt is prefilled up to its last block boundary (32 tokens), where its states are kept: the
    same prompt again takes those 32 tokens from the prefix cache, and both answers are generate's alone."""
    model, tokenizer = reference
    client = client_of(server)
    prompt = "a snapshot of the states, please: " + "0123456789"[: 40 - 34]
    ids = tokenizer(prompt).input_ids
    assert 32 < len(ids) < 48
    expected = generate_alone(model, ids, 6)
    hits = metric(metrics_text(server), "hf_paged_cache_prefix_cache_hit_tokens_total")
    for _ in range(2):
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                           extra_body={"return_tokens_as_token_ids": True})
        got = token_ids(answer.choices[0].logprobs.tokens)
        assert got == expected[: len(got)] and len(expected) - len(got) <= 1
    assert metric(metrics_text(server), "hf_paged_cache_prefix_cache_hit_tokens_total") - hits == 32
