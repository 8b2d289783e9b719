"""Tool calls through the real server and the official `openai` client: ``tool_choice`` required and named
(held to the tool's parameter schema by the mask, so even the tiny random model's arguments validate), ``auto``
parsed from an answer scripted with ``guided_regex``, streamed deltas (the arguments in pieces as they are
written) that join into the same call, and the 400s. The parsers and their grammars are also checked without a server, for both formats."""

from __future__ import annotations

import json

import httpx
import pytest
from json_tokenizer import json_tokenizer
from server_process import KEY, NAME

from hf_paged_cache.server.http.errors import APIError
from hf_paged_cache.server.http.tool_deltas import ToolDeltas
from hf_paged_cache.server.http.tools import tool_request
from hf_paged_cache.structured import Grammars

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
SCRIPTED = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(json_server):
    """The JSON-capable tiny model's server (`tests/server/conftest.py`), ``--tool-call-parser hermes``."""
    return json_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(client, **kwargs):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "help"}], tools=TOOLS,
                                          max_tokens=kwargs.pop("max_tokens", 200), temperature=0, **kwargs)


def assert_valid_call(call, names=("get_weather", "add")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_a_call_whose_arguments_validate(client):
    choice = ask(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_function_is_the_one_called(client, name):
    choice = ask(client, tool_choice={"type": "function", "function": {"name": name}}).choices[0]
    assert [call.function.name for call in choice.message.tool_calls] == [name]
    assert_valid_call(choice.message.tool_calls[0], names=(name,))


def test_auto_parses_the_calls_the_model_wrote(client):
    choice = ask(client, tool_choice="auto", extra_body={"guided_regex": _escaped("Sure. " + SCRIPTED)}).choices[0]
    assert choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})]
    assert choice.finish_reason == "tool_calls"
    # parallel_tool_calls=false: one call even when the model wrote two
    two = ask(client, parallel_tool_calls=False, extra_body={"guided_regex": _escaped(SCRIPTED + SCRIPTED)})
    assert len(two.choices[0].message.tool_calls) == 1
    plain = ask(client, extra_body={"guided_regex": "no tools"}).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("no tools", None, "stop")


def test_streamed_deltas_join_into_the_same_call(client):
    """The call opens with its id and name, then its arguments come in pieces as they are written."""
    whole = ask(client, tool_choice="required").choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    reasons, pieces = [], 0
    for chunk in ask(client, tool_choice="required", stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
                pieces += bool(delta.function and delta.function.arguments) and choice.finish_reason is None
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    assert pieces > 3  # streamed as written, not whole at the end
    assert reasons[-1] == "tool_calls"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"tools": TOOLS}, "tools"),
])
def test_bad_tool_requests_are_400s(server, path, body, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(server.url + path, headers={"Authorization": f"Bearer {KEY}"},
                          json={**base, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("parser, text, key", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "arguments"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "parameters"),
])
def test_each_parser_reads_what_its_grammar_allows(tmp_path, parser, text, key):
    tools = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, None, parser)
    tokenizer = json_tokenizer(tmp_path)
    matcher = Grammars(tokenizer, 96).compile(tools.grammar).matcher()
    compact = text.replace('", "', '","').replace('": ', '":').replace(', "', ',"')
    assert all(matcher.consume_token(t) for t in tokenizer.encode(compact, add_special_tokens=False)), compact
    assert matcher.is_accepting()
    content, calls = tools.calls(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert key in text


def test_unknown_tool_choice_is_refused():
    with pytest.raises(APIError, match="tool_choice"):
        tool_request(TOOLS, "sometimes", None, "hermes")


def _escaped(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text).replace("\n", "\\n")


def test_auto_streams_content_and_calls_as_they_come(client):
    """Text that cannot be a call is streamed token by token; then the call, its arguments in pieces."""
    regex = _escaped("Sure thing. " + SCRIPTED)
    contents, calls = [], []
    for chunk in ask(client, stream=True, extra_body={"guided_regex": regex}):
        for choice in chunk.choices:
            if choice.delta.content:
                contents.append(choice.delta.content)
            calls += choice.delta.tool_calls or []
    assert "".join(contents) == "Sure thing." and len(contents) > 3
    assert [c.function.name for c in calls if c.function.name] == ["add"]
    assert "".join(c.function.arguments or "" for c in calls) == '{"a": 1, "b": 2}'  # as the model wrote it
    assert len([c for c in calls if c.function.arguments]) > 3
    plain = [choice.delta.content for chunk in ask(client, stream=True, extra_body={"guided_regex": "no tools here"})
             for choice in chunk.choices if choice.delta.content]
    assert "".join(plain) == "no tools here" and len(plain) > 3


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Hi. <tool_call>\n{"name": "add", "arguments": {"a": "}\\"{", "b": [2]}}\n</tool_call>'
               '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": "}\\";{", "b": [2]}}; {"name": "f", "parameters": {}}'),
])
def test_streamed_pieces_of_any_prefix_join_into_the_whole_answer(parser, text):
    """Fed the answer a character at a time (strings holding braces, quotes and semicolons), the deltas join
    into the content and the calls of the whole answer; an answer cut inside a call sends no copy of it as text."""
    tools = tool_request(TOOLS, "auto", None, parser)
    stream = ToolDeltas(tools)
    deltas = [delta for end in range(1, len(text)) for delta in stream.update(text[:end])]
    ending, calls = stream.end(text)
    content, joined = "", {}
    for delta in deltas + ending:
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = joined.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    expected_content, expected = tools.calls(text)
    assert content == (expected_content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in joined.values()] == [
        (call.name, json.loads(call.arguments)) for call in expected] == [("add", {"a": '}"{' if parser == "hermes"
                                                                                 else '}";{', "b": [2]}), ("f", {})]
    assert sum(bool(d.tool_calls and d.tool_calls[0].function.arguments) for d in deltas) > 5  # in pieces
    cut, at = ToolDeltas(tools), text.index('"b"')  # inside the first call's arguments
    sent = [d for end in range(1, at) for d in cut.update(text[:end])] + cut.end(text[:at])[0]
    assert cut.calls and not any("add" in (d.content or "") for d in sent)
