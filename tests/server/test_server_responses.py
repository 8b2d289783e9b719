"""``/v1/responses`` through the real server and the official client's ``client.responses.create``: plain text,
message lists with instructions, streamed events, a JSON schema (``text.format``), a function tool, and the
400s of a stateless server. The tiny random model writes noise, so answers are checked against a chat
completion of the same conversation (the same tokens, greedy) or against their schema."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import KEY, NAME

from hf_paged_cache.server.http.responses import StreamedOutput
from hf_paged_cache.server.http.tool_deltas import ToolDeltas
from hf_paged_cache.server.http.tools import tool_request

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


def test_a_streamed_function_call_comes_in_pieces(client):
    """The call's item opens (empty arguments) as soon as its name is written, its arguments follow in pieces,
    and the events join into the unstreamed answer's call; the official client's stream helper, which builds
    the response from the events, agrees."""
    kwargs = dict(model=NAME, input="look up cat", tools=[TOOL], max_output_tokens=120, temperature=0,
                  tool_choice={"type": "function", "name": "lookup"})
    whole = client.responses.create(**kwargs).output[-1]
    events = list(client.responses.create(stream=True, **kwargs))
    call = events[-1].response.output[-1]
    index = len(events[-1].response.output) - 1
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(added) == 1 and (added[0].item.arguments, added[0].item.status) == ("", "in_progress")
    assert events.index(added[0]) < events.index(pieces[0])
    assert len(pieces) > 3 and all((e.item_id, e.output_index) == (call.id, index) for e in pieces)
    assert "".join(e.delta for e in pieces) == call.arguments == whole.arguments
    assert (call.name, call.status) == (whole.name, "completed")
    done = [e.type for e in events[events.index(pieces[-1]) + 1 :]]
    assert done == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert (final.output[-1].name, final.output[-1].arguments) == (whole.name, whole.arguments)


def _stream_items(text: str, cut: bool = False):
    """`text`, a hermes answer with tools, streamed a character at a time: its events and the items it closes."""
    numbers = iter(range(1000))
    chat_tool = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}
    tools = tool_request([chat_tool], "auto", None, "hermes")
    output = StreamedOutput("msg_1", lambda kind, **fields: {"type": kind, "n": next(numbers), **fields})
    deltas = ToolDeltas(tools)
    events = [e for end in range(1, len(text) + 1) for e in output.deltas(deltas.update(text[:end]))]
    ending, calls = deltas.end(text)
    events += output.deltas(ending)
    events += output.close(cut=cut, calls=len(calls))
    return events, output.items


def test_streamed_items_open_as_written_and_join_into_the_answer():
    """Text, then two calls: the message opens first and its text comes before any call opens; each call's
    arguments come in pieces at its own output index; the items close in order. Cut inside a call, that call ends
    incomplete."""
    text = ('Sure. <tool_call>\n{"name": "lookup", "arguments": {"word": "c}a\\"t"}}\n</tool_call>'
            '<tool_call>\n{"name": "lookup", "arguments": {"word": "dog"}}\n</tool_call>')
    events, items = _stream_items(text)
    assert [(i.type, i.status) for i in items] == [("message", "completed"), ("function_call", "completed"),
                                                   ("function_call", "completed")]
    assert items[0].content[0].text == "Sure."
    assert [(i.name, json.loads(i.arguments)) for i in items[1:]] == [("lookup", {"word": 'c}a"t'}),
                                                                      ("lookup", {"word": "dog"})]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.function_call_arguments.delta") > max(
        n for n, k in enumerate(kinds) if k == "response.output_text.delta")
    for index, item in enumerate(items[1:], start=1):
        pieces = [e for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == index]
        assert len(pieces) > 3 and "".join(e["delta"] for e in pieces) == item.arguments
        assert all(e["item_id"] == item.id for e in pieces)
    closing = [(e["type"], e["output_index"]) for e in events if e["type"].endswith(".done")]
    assert closing == [("response.output_text.done", 0), ("response.content_part.done", 0),
                       ("response.output_item.done", 0), ("response.function_call_arguments.done", 1),
                       ("response.output_item.done", 1), ("response.function_call_arguments.done", 2),
                       ("response.output_item.done", 2)]
    assert [e["n"] for e in events] == list(range(len(events)))
    _, cut = _stream_items(text[: text.index("dog")], cut=True)
    assert [(i.type, i.status) for i in cut] == [("message", "incomplete"), ("function_call", "completed"),
                                                 ("function_call", "incomplete")]


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
