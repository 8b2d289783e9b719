"""``/v1/responses`` through the real server and the official client's ``client.responses.create``: plain text,
message lists with instructions, streamed events, a JSON schema (``text.format``), a function tool, and the
400s of a stateless server. The tiny random model writes noise, so answers are checked against a chat
completion of the same conversation (the same tokens, greedy) or against their schema."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import KEY, NAME

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["answer", "score"], "additionalProperties": False}
TOOL = {"type": "function", "name": "lookup", "description": "find a word",
        "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}},
                       "required": ["word"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(json_server):
    """The JSON-capable tiny model's server, shared with other modules (`tests/server/conftest.py`)."""
    return json_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_text(client, messages, max_tokens):
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content, answer.choices[0].finish_reason


def test_plain_text_is_the_chat_answer(client):
    response = client.responses.create(model=NAME, input="hello there", max_output_tokens=12, temperature=0)
    text, reason = chat_text(client, [{"role": "user", "content": "hello there"}], 12)
    assert response.output_text == text
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == ("incomplete" if reason == "length" else "completed")
    assert response.usage.output_tokens <= 12 and response.usage.input_tokens > 0


def test_message_list_with_instructions(client):
    items = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
             {"role": "user", "content": [{"type": "input_text", "text": "three"}]}]
    response = client.responses.create(model=NAME, input=items, instructions="be brief", max_output_tokens=8,
                                       temperature=0)
    text, _ = chat_text(client, [{"role": "system", "content": "be brief"}, *items[:2],
                                 {"role": "user", "content": "three"}], 8)
    assert response.output_text == text


def test_streamed_events_join_to_the_response(client):
    whole = client.responses.create(model=NAME, input="stream me", max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=NAME, input="stream me", max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == whole.output_text


def test_json_schema_format(client):
    response = client.responses.create(
        model=NAME, input="rate it", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "rating", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool(client, stream):
    kwargs = dict(model=NAME, input="look up cat", tools=[TOOL], max_output_tokens=120, temperature=0,
                  tool_choice={"type": "function", "name": "lookup"})
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        output = events[-1].response.output
        arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert arguments == [output[-1].arguments]
    else:
        output = client.responses.create(**kwargs).output
    call = output[-1]
    assert call.type == "function_call" and call.name == "lookup" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])


def test_a_function_call_output_continues_the_conversation(client):
    items = [{"role": "user", "content": "look up cat"},
             {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"word": "cat"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "a small animal"}]
    response = client.responses.create(model=NAME, input=items, tools=[TOOL], max_output_tokens=5, temperature=0)
    assert response.status in ("completed", "incomplete")


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "frob"}}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "reasoning"}]}, "input"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
])
def test_refusals_are_400s_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                          json={"input": "hi", "max_output_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
