"""Tool calls: how a model writes them (a parser per format), the grammar that makes it write one, and reading
them back from its answer.

The tools reach the model through the chat template (``tools=``); what it answers is plain text in the format of
its family, which a `ToolCallParser` reads into OpenAI's ``tool_calls``:

| parser | a call looks like |
| --- | --- |
| ``hermes`` (Hermes, Qwen 2.5 and 3, SmolLM) | ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` |
| ``llama3_json`` (Llama 3.1 and later) | ``{"name": "f", "parameters": {...}}`` |

With ``tool_choice: "required"`` or a named function, the answer is held (`ToolCallParser.grammar`) to one call in
that format whose arguments validate against the tool's ``parameters`` schema; with ``auto`` the model chooses,
and whatever calls its answer holds are parsed out of it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ...structured import GrammarSpec
from .errors import APIError


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text: as the model wrote it when it names the function first, else re-encoded
    id: str


@dataclass(frozen=True)
class PartialCall:
    """A call being written: its function's name and its arguments' text so far (`done` once they close)."""

    name: str
    arguments: str
    done: bool


_NAME_THEN = r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"%s"\s*:\s*'  # a call's opening: name, then KEY


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that opens at ``text[start]``; None while it is open."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        character = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
        elif character == '"':
            in_string = True
        elif character in "{[":
            depth += 1
        elif character in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def tool_function(tool: Any, number: int) -> dict[str, Any]:
    """The ``function`` of tool `number` of the request (400 unless it is ``{"type": "function", "function":
    {"name": ...}}``)."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict) \
            or not isinstance(tool["function"].get("name"), str):
        raise APIError(400, f"tools[{number}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                       param="tools", code="invalid_value")
    return tool["function"]


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


class ToolCallParser:
    """One format of tool calls: the grammar of a call, and reading calls out of text (whole, or as written)."""

    arguments_key = "arguments"

    def grammar(self, functions: list[dict[str, Any]]) -> GrammarSpec:
        """One call of one of `functions`, its arguments valid against that function's ``parameters``."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The answer's content (None when only calls) and the calls it holds (none: the text is all content)."""
        raise NotImplementedError

    def sure_content(self, text: str) -> int:
        """How much of `text`, an answer so far, is content whatever follows (streamed before the answer ends):
        nothing here; each format says more."""
        return 0

    def partial(self, text: str) -> list[PartialCall]:
        """The calls `text`, an answer so far, is writing, as far as each is known to be a call: from where its
        arguments open (streamed as they come). A call that names its function after its arguments is not
        among them (it is sent whole once the answer ends)."""
        raise NotImplementedError

    def _call(self, text: str) -> ParsedCall | None:
        """The call that the JSON text `text` holds (None when it is no call)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        written = self._partial_call(text.strip())
        if written is not None and written.done and written.name == data["name"]:
            return ParsedCall(data["name"], written.arguments, new_call_id())  # as streamed
        arguments = data.get(self.arguments_key, data.get("arguments", data.get("parameters", {})))
        return ParsedCall(data["name"], json.dumps(arguments), new_call_id())

    def _partial_call(self, body: str) -> PartialCall | None:
        """The call whose JSON object opens `body`, once its name is written and its arguments have opened."""
        found = re.match(_NAME_THEN % re.escape(self.arguments_key), body)
        if found is None or body[found.end() : found.end() + 1] not in ("{", "["):
            return None
        start = found.end()
        end = json_value_end(body, start)
        return PartialCall(json.loads(found.group(1)), body[start : len(body) if end is None else end], end is not None)


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"
    PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def grammar(self, functions: list[dict[str, Any]]) -> GrammarSpec:
        schema = {"anyOf": [_call_schema(function, self.arguments_key) for function in functions],
                  "x-guidance": {"whitespace_flexible": False}}  # compact JSON, as GrammarSpec.json_schema
        return GrammarSpec.lark(f'start: "{self.START}\\n" call "\\n{self.END}"\ncall: %json {json.dumps(schema)}')

    def sure_content(self, text: str) -> int:
        """Up to the first ``<tool_call>`` (or the start of one that may be coming), without the whitespace before
        it, which `parse` strips once there is a call."""
        end = text.find(self.START)
        if end < 0:
            end = len(text)
            for length in range(min(len(self.START) - 1, len(text)), 0, -1):
                if self.START.startswith(text[-length:]):
                    end = len(text) - length
                    break
        kept = text[:end].rstrip()
        return len(kept) if kept.strip() and not text[:1].isspace() else 0

    def partial(self, text: str) -> list[PartialCall]:
        calls = []
        for found in re.finditer(re.escape(self.START), text):
            call = self._partial_call(text[found.end() :].lstrip())
            if call is None:
                break
            calls.append(call)
        return calls

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for found in self.PATTERN.finditer(text):
            call = self._call(found.group(1))
            if call is None:
                return text, []  # a malformed call: the answer stays text, as the model wrote it
            calls.append(call)
        if not calls:
            return text, []
        content = self.PATTERN.sub("", text).strip()
        return content or None, calls


class Llama3JsonParser(ToolCallParser):
    arguments_key = "parameters"

    def grammar(self, functions: list[dict[str, Any]]) -> GrammarSpec:
        return GrammarSpec.json_schema({"anyOf": [_call_schema(function, self.arguments_key) for function in functions]})

    def sure_content(self, text: str) -> int:
        """All of it once it starts with something else than ``{`` (then it is not a call)."""
        stripped = text.lstrip()
        return len(text) if stripped and not stripped.startswith("{") else 0

    def partial(self, text: str) -> list[PartialCall]:
        calls, rest = [], text.lstrip()
        while rest.startswith("{"):
            call = self._partial_call(rest)
            end = json_value_end(rest, 0)
            if call is None:
                break
            calls.append(call)
            rest = rest[end:].lstrip() if end is not None else ""
            if not rest.startswith(";"):  # Llama 3 separates parallel calls with ";"
                break
            rest = rest[1:].lstrip()
        return calls

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls, rest = [], text.strip()
        if not rest.startswith("{"):
            return text, []
        while True:
            end = json_value_end(rest, 0)
            call = self._call(rest[:end]) if end is not None else None
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end:].lstrip()
            if not rest:
                return None, calls
            if not rest.startswith(";"):  # Llama 3 separates parallel calls with ";"
                return text, []
            rest = rest[1:].lstrip()


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request's tools ask of its answer."""

    functions: list[dict[str, Any]]  # as the chat template takes them
    grammar: GrammarSpec | None  # the call the answer is held to ("required", a named function); None: auto
    parser: ToolCallParser
    parallel: bool = True  # False: an answer's first call only

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The content and the calls of an answer (only its first call unless `parallel`)."""
        content, calls = self.parser.parse(text)
        return content, calls if self.parallel else calls[:1]

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls an answer so far is writing (only its first unless `parallel`)."""
        calls = self.parser.partial(text)
        return calls if self.parallel else calls[:1]


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                 parser_name: str) -> ToolRequest | None:
    """The request's tools as the answer must use them; None without tools or with ``tool_choice: "none"``.

    400 for a malformed tool, an unknown ``tool_choice``, or a named function that is not among the tools.
    ``parallel_tool_calls: false`` is honoured: a constrained answer holds one call, and so does a parsed one
    (a 400 is not needed, the grammar allows one call only).
    """
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    functions = [tool_function(tool, number) for number, tool in enumerate(tools)]
    parser, parallel = PARSERS[parser_name](), parallel_tool_calls is not False
    if tool_choice in (None, "auto"):
        return ToolRequest(functions, None, parser, parallel)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolRequest(functions, parser.grammar(functions), parser, parallel)
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(named, str):
        raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice", code="invalid_value")
    chosen = [function for function in functions if function["name"] == named]
    if not chosen:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools", param="tool_choice",
                       code="invalid_value")
    return ToolRequest(functions, parser.grammar(chosen), parser, parallel)
