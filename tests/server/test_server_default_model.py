"""The server on the real default model (SmolLM2-135M-Instruct, offline from PyPI): what a user of
``python -m hf_paged_cache.serve default`` gets is what ``generate`` with ``DynamicCache`` gives."""

from __future__ import annotations

import json

import pytest
import torch
from server_process import KEY, NAME, chat_ids, generate_alone, metric, run_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hf_paged_cache.models import load_model_and_tokenizer  # noqa: E402
from hf_paged_cache.models.default_model import DEFAULT_MODEL, resolve_model_path  # noqa: E402


@pytest.fixture(scope="module")
def default_model(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")  # the offline copy, whether or not the Hub is reachable
    model, tokenizer = load_model_and_tokenizer()
    return model, tokenizer, resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    """One server on the default model for the module (starting it loads the real model)."""
    _, _, folder = default_model
    with run_server(folder, tmp_path_factory.mktemp("server-log") / "server.log", "--max-memory", "64MiB") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_on_the_default_model_equals_generate(default_model, server, client):
    model, tokenizer, _ = default_model
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=NAME, messages=conversation, max_tokens=8, temperature=0)
    ids = chat_ids(tokenizer, conversation)
    expected = generate_alone(model, ids, 8)
    assert answer.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.usage.prompt_tokens == len(ids)
    assert "Paris" in answer.choices[0].message.content  # the real weights, not a random model
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "hf_paged_cache_blocks_used") == 0
    assert metric(text, "hf_paged_cache_requests_total", 'finish_reason="error"') == 0


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_structured_answers_on_the_default_model(client):
    """The default model's byte-level BPE tokenizer (llguidance reads it from its JSON): a JSON-schema answer that
    validates, a required tool call whose arguments validate, and a choice, through the official client."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0},
                                               "tags": {"type": "array", "items": {"enum": ["big", "old", "wet"]},
                                                        "minItems": 1, "maxItems": 2}},
              "required": ["city", "population", "tags"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
        "additionalProperties": False}}}
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    answer = client.chat.completions.create(
        model=NAME, messages=ask, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    assert answer.choices[0].finish_reason == "stop"
    call = client.chat.completions.create(model=NAME, messages=ask, max_tokens=80, temperature=0, tools=[tool],
                                          tool_choice="required").choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    choice = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is Paris in "
                                            "France? Answer yes or no."}], max_tokens=5, temperature=0,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
