"""Structured outputs through the real server and the official `openai` client: answers held to a JSON Schema,
any JSON object, a regular expression, a choice or a Lark grammar, streamed and not.

The model is a tiny random Llama whose character tokenizer can write JSON (`json_tokenizer`): left alone it
writes noise, so every valid answer here is the mask's doing. Each answer is checked with `jsonschema` (or
``re.fullmatch``), and ends with finish reason "stop" once the grammar is complete.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import JSON_MAX_SCHEMA_BYTES, KEY, NAME
from transformers import AutoTokenizer

from hf_paged_cache.structured import Grammars, GrammarSpec

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DEEP: dict = {}
for _ in range(70):
    DEEP = {"type": "array", "items": DEEP}


@pytest.fixture(scope="module")
def model_dir(json_model_dir):
    return json_model_dir


@pytest.fixture(scope="module")
def server(json_server):
    """The JSON-capable tiny model's server (`tests/server/conftest.py`), ``--max-schema-bytes`` 2048."""
    return json_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, content: str = "who?", **kwargs):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          max_tokens=kwargs.pop("max_tokens", 200), **kwargs)


def test_json_schema_answer_validates(client):
    answer = chat(client, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = answer.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"


def test_json_schema_sampled_with_top_p_and_n(client):
    # the mask comes before top-p: sampling's filters never leave only banned tokens
    answer = chat(client, temperature=1.0, top_p=0.5, seed=7, n=2, extra_body={"guided_json": PERSON})
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"


def test_json_schema_streamed_on_completions(client):
    stream = client.completions.create(model=NAME, prompt="a person: ", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"response_format": {"type": "json_schema",
                                                                       "json_schema": {"schema": PERSON}}})
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.text)
            reasons.append(choice.finish_reason)
    jsonschema.validate(json.loads("".join(parts)), PERSON)
    assert reasons[-1] == "stop"


def test_json_object(client, model_dir):
    """Any JSON object: the random model writes one long string, cut by max_tokens, that is still a prefix of one."""
    answer = chat(client, temperature=0, max_tokens=40, response_format={"type": "json_object"})
    text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        matcher = Grammars(tokenizer, 96).compile(GrammarSpec.json_object()).matcher()
        assert text.startswith("{") and reason == "length"
        assert all(matcher.consume_token(token) for token in tokenizer.encode(text, add_special_tokens=False))


def test_regex_choice_and_grammar(client):
    regex = chat(client, temperature=0, extra_body={"guided_regex": r"[A-Z][a-z]{2,5}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", regex.choices[0].message.content)
    choice = chat(client, temperature=0, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in {"yes", "no", "maybe"}
    assert choice.choices[0].finish_reason == "stop"
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/'
    lark = chat(client, temperature=0, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", lark.choices[0].message.content)


def test_cut_by_max_tokens_is_length(client):
    answer = chat(client, temperature=0, max_tokens=3, response_format={"type": "json_object"})
    assert answer.choices[0].finish_reason == "length"
    assert len(answer.choices[0].message.content) == 3  # one character per token


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}}, "response_format"),
    ({"guided_regex": "(["}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": {"type": "string", "maxLength": 3000, "description": "x" * JSON_MAX_SCHEMA_BYTES}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": DEEP}, "guided_json"),  # 70 levels, over MAX_SCHEMA_DEPTH (64)
])
def test_bad_constraint_is_a_400_naming_it(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_neighbours_unchanged_by_constraints_and_bad_schemas(client, server):
    """8 unconstrained greedy requests give the same answers beside constrained ones and rejected bad schemas."""
    prompts = [f"tell me {i}" for i in range(8)]
    alone = [chat(client, p, temperature=0, max_tokens=24).choices[0].message.content for p in prompts]

    def constrained(i: int):
        if i % 2:
            return chat(client, temperature=0, extra_body={"guided_json": PERSON})
        return httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "x"}], "guided_regex": "(["}).status_code

    with ThreadPoolExecutor(16) as pool:
        plain = [pool.submit(lambda p=p: chat(client, p, temperature=0, max_tokens=24)) for p in prompts]
        others = [pool.submit(constrained, i) for i in range(8)]
        together = [future.result().choices[0].message.content for future in plain]
        outcomes = [future.result() for future in others]
    assert together == alone
    assert outcomes[0::2] == [400] * 4
    for answer in outcomes[1::2]:
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)


def test_metrics_count_constrained_requests(client, server):
    chat(client, temperature=0, extra_body={"guided_choice": ["a", "b"]})
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'hf_paged_cache_structured_requests_total\{kind="choice"\} [1-9]', text)
    assert re.search(r"hf_paged_cache_grammar_mask_seconds_count [1-9]", text)


def test_logprobs_and_stop_are_those_of_the_model(client):
    """A regex that spells out the unconstrained greedy answer changes nothing: the same text, and the same
    log-probabilities (taken from the model's logits, not the masked ones); a stop string still cuts it."""
    free = chat(client, "spell", temperature=0, max_tokens=12, logprobs=True, top_logprobs=2).choices[0]
    pattern = re.escape(free.message.content)
    held = chat(client, "spell", temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
                extra_body={"guided_regex": pattern}).choices[0]
    assert held.message.content == free.message.content
    assert [t.logprob for t in held.logprobs.content] == pytest.approx([t.logprob for t in free.logprobs.content])
    assert [[a.token for a in t.top_logprobs] for t in held.logprobs.content] == \
        [[a.token for a in t.top_logprobs] for t in free.logprobs.content]
    stop = free.message.content[4:6]
    cut = chat(client, "spell", temperature=0, max_tokens=12, stop=[stop], extra_body={"guided_regex": pattern})
    assert cut.choices[0].message.content == free.message.content.split(stop)[0]
    assert cut.choices[0].finish_reason == "stop"
