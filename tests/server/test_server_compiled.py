"""`serve --compile` through the `openai` client: the same answers as the eager server, alone and amid concurrent
requests, streamed or not, with log-probabilities equal to float32 rounding."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import KEY, NAME

PROMPTS = [f"Request {i}: " + "abc " * i for i in range(10)]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(client, prompt: str, stream: bool = False) -> tuple[str, list[float]]:
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.logprobs.token_logprobs
    text, logprobs = "", []
    for chunk in client.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].text
        logprobs += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    return text, logprobs


def _all(server, stream_every: int) -> list[tuple[str, list[float]]]:
    client = _client(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_complete, client, prompt, i % stream_every == 0) for i, prompt in enumerate(PROMPTS)]
        return [future.result() for future in futures]


def test_compiled_server_answers_as_the_eager_one(tiny_servers):
    eager = [_complete(_client(tiny_servers["main"]), prompt) for prompt in PROMPTS]
    compiled_alone = [_complete(_client(tiny_servers["compiled"]), prompt) for prompt in PROMPTS]
    compiled_together = _all(tiny_servers["compiled"], stream_every=2)
    for (text, logprobs), alone, together in zip(eager, compiled_alone, compiled_together, strict=True):
        assert alone[0] == text and together[0] == text
        assert alone[1] == pytest.approx(logprobs, abs=1e-4)
        assert together[1] == pytest.approx(logprobs, abs=1e-4)


def test_compiled_server_refuses_a_bad_request_and_goes_on(tiny_servers):
    client = _client(tiny_servers["compiled"])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", max_tokens=-1)
    text, logprobs = _complete(client, PROMPTS[3])
    eager_text, eager_logprobs = _complete(_client(tiny_servers["main"]), PROMPTS[3])
    assert text == eager_text
    assert logprobs == pytest.approx(eager_logprobs, abs=1e-4)
