"""`serve --batch-invariant` through the `openai` client: a request's log-probabilities are the same bits alone and
amid concurrent requests, and scoring its text (``echo``) gives the numbers it was generated with.

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
from server_process import CONTEXT, KEY, NAME, Server, run_server
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
def server(wide_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("invariant-server-log") / "server.log"
    with run_server(wide_model_dir, log, "--num-blocks", "256", "--batch-invariant") as running:
        yield running


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
