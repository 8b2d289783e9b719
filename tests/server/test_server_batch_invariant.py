"""`serve --batch-invariant` through the `openai` client and lm-eval: a request's log-probabilities are the same
bits alone and amid concurrent requests, scoring its text (``echo``) gives the numbers it was generated with, and
lm-eval's per-sample loglikelihoods are the same at every batch size, with the contexts' scores reused or not.

The model is wider than the other server tests' (hidden size 256): at their hidden size of 64 the CPU kernels give
every row the same bits anyway (tests/cache/test_batch_invariance.py shows the default mode moving at this width).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from repo_paths import DATA
from server_process import CONTEXT, KEY, NAME, Server, metric, metrics_text, run_servers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

PROMPT = "The quick brown fox jumps over"
NEW_TOKENS = 8
OTHERS = [f"Request {i} of the crowd: " + "abc " * i for i in range(11)]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wide-llama")
    tokenizer = AutoTokenizer.from_pretrained(DATA / "char_tokenizer")
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=CONTEXT, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def servers(wide_model_dir, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """Started side by side: ``reuse`` (the default: scored prompts' log-probabilities kept by block) and ``cold``
    (``--no-reuse-prompt-scores``: every scored prompt computed whole)."""
    logs = tmp_path_factory.mktemp("invariant-server-logs")
    options = ("--num-blocks", "256", "--batch-invariant")
    with run_servers([(wide_model_dir, logs / "reuse.log", *options),
                      (wide_model_dir, logs / "cold.log", *options, "--no-reuse-prompt-scores")]) as running:
        yield dict(zip(("reuse", "cold"), running))


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["reuse"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(client, prompt: str | list[int] = PROMPT, **kwargs):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=5,
                                     extra_body={"return_tokens_as_token_ids": True}, **kwargs).choices[0]


def ids_of(tokens: list[str]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in tokens]


def test_logprobs_alone_equal_logprobs_amid_concurrent_requests(client):
    alone = complete(client)
    with ThreadPoolExecutor(12) as pool:
        crowd = [pool.submit(complete, client, prompt, stream=False) for prompt in OTHERS]
        amid = pool.submit(complete, client)
        results = [amid.result()] + [future.result() for future in crowd]
    together = results[0]
    assert together.text == alone.text
    assert together.logprobs.token_logprobs == alone.logprobs.token_logprobs  # floats, compared exactly
    assert together.logprobs.top_logprobs == alone.logprobs.top_logprobs


def test_scoring_the_text_gives_the_logprobs_it_was_generated_with(client):
    prompt = list(range(3, 40))
    generated = complete(client, prompt)
    new = ids_of(generated.logprobs.tokens)
    scored = client.completions.create(model=NAME, prompt=prompt + new, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    # the echoed prompt's last tokens are the generated ones (and one more token was generated after them)
    assert ids_of(scored.logprobs.tokens[len(prompt) : -1]) == new
    assert scored.logprobs.token_logprobs[len(prompt) : -1] == generated.logprobs.token_logprobs


def loglikelihoods(server: Server, model_dir: Path, batch_size: int, requests: list[tuple[str, str]]):
    """lm-eval's ``local-completions`` on `server`: each (context, continuation)'s loglikelihood and is_greedy."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    args = ",".join([f"base_url={server.url}/v1/completions", f"model={NAME}", "tokenized_requests=True",
                     f"tokenizer={model_dir}", "tokenizer_backend=huggingface", f"max_length={CONTEXT}",
                     f"batch_size={batch_size}", "num_concurrent=1", "max_retries=1"])
    instances = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(requests)]
    return get_model("local-completions").create_from_arg_string(args).loglikelihood(instances)


def test_lm_eval_scores_are_the_same_bits_at_every_batch_size(servers, wide_model_dir, monkeypatch):
    """A multiple-choice set (8 contexts x 4 endings) at batch sizes 1, 8 and 32 on the server that computes every
    scored prompt whole: the same per-sample loglikelihoods, bit for bit; and on the one that keeps the contexts'
    log-probabilities (each context computed once for its 4 endings, the prefix hits counted) the same again."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (optional extra: pip install -e '.[lm-eval]')")
    pytest.importorskip("tenacity", reason="lm-eval's API models need its api extra: pip install 'lm-eval[api]'")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    contexts = [f"Question {i}: which of these comes next after " + "xyz" * (i + 4) for i in range(8)]
    requests = [(context, f" answer {ending}{'!' * ending}") for context in contexts for ending in range(4)]
    cold = [loglikelihoods(servers["cold"], wide_model_dir, size, requests) for size in (1, 8, 32)]
    assert cold[0] == cold[1] == cold[2]
    hits = metric(metrics_text(servers["reuse"]), "hf_paged_cache_prefix_cache_hit_tokens_total")
    assert loglikelihoods(servers["reuse"], wide_model_dir, 8, requests) == cold[0]
    assert metric(metrics_text(servers["reuse"]), "hf_paged_cache_prefix_cache_hit_tokens_total") - hits > 8 * 3 * 16

