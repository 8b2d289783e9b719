"""``/v1/responses``: OpenAI's Responses API, served as a chat completion.

A request becomes a `ChatCompletionRequest` (`chat_request_for`): ``instructions`` a system message, ``input`` the
messages (text, or a list of messages, function calls and their outputs), ``text.format`` the
``response_format``, function tools and ``tool_choice`` in the chat shapes, ``max_output_tokens`` the
``max_tokens``. It then runs as a chat completion does (the same checks, template, constraints and tool
parsing), and its answer is written as a response object, or as the Responses API's stream of events:
``response.created``, ``response.in_progress``; as the answer is written, for a message
``response.output_item.added``, ``response.content_part.added`` and ``response.output_text.delta`` per piece of
text, for a function call (with tools: once its name is written, as chat completions stream it)
``response.output_item.added`` and ``response.function_call_arguments.delta`` per piece of its arguments; when
it ends, per item ``response.output_text.done`` and ``response.content_part.done``, or
``response.function_call_arguments.done``, and ``response.output_item.done``; then ``response.completed``
(``response.incomplete`` when cut by ``max_output_tokens``).

The server keeps nothing: ``store`` is answered false, and ``previous_response_id`` is a 400.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import ValidationError

from .errors import APIError
from .generation import ChoiceResult, Generation
from .protocol import (
    ChatCompletionRequest,
    DeltaMessage,
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
)
from .tool_deltas import ToolDeltas
from .tools import ToolRequest

CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
"""The chat fields a Responses request's fields become, and back (for the `param` of a 400)."""


def responses_param(param: str | None) -> str | None:
    """The Responses request's field for a chat field named in an error."""
    return CHAT_PARAMS.get(param, param) if param is not None else None


def chat_request_for(body: ResponsesRequest) -> ChatCompletionRequest:
    """`body` as the chat completion that computes it (400 for ``previous_response_id`` and malformed items)."""
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses (send the "
                            "whole conversation as input)", param="previous_response_id",
                       code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else []
    for number, item in enumerate([] if isinstance(body.input, str) else body.input):
        if item.type == "message":
            content = item.content if isinstance(item.content, str) else "".join(
                part.text or "" for part in item.content or ())
            if item.role is None:
                raise APIError(400, f"input[{number}]: a message needs a role", param="input", code="invalid_value")
            items.append({"role": "system" if item.role == "developer" else item.role, "content": content})
        elif item.type == "function_call":
            items.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"}}]})
        elif item.type == "function_call_output":
            items.append({"role": "tool", "content": item.output or "", "tool_call_id": item.call_id})
        else:
            raise APIError(400, f"input[{number}]: items of type {item.type!r} are not supported (message, "
                                "function_call, function_call_output)", param="input", code="invalid_value")
    messages += items
    if not messages:
        raise APIError(400, "input is empty", param="input", code="empty_prompt")
    chat: dict[str, Any] = {"messages": messages, "stream": body.stream}
    for field in ("temperature", "top_p", "seed", "parallel_tool_calls", "user"):
        if getattr(body, field) is not None:
            chat[field] = getattr(body, field)
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    text_format = body.text.format if body.text is not None else None
    if text_format is not None:
        chat["response_format"] = {"type": text_format.type}
        if text_format.schema_ is not None:
            chat["response_format"]["json_schema"] = {"name": text_format.name, "schema": text_format.schema_,
                                                      "strict": text_format.strict}
    if body.tools:
        chat["tools"] = [_chat_tool(tool, number) for number, tool in enumerate(body.tools)]
    if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:
        raise APIError(400, f"the request does not make a chat completion: {error.errors()[0]['msg']}",
                       param="input", code="invalid_value") from error


def _chat_tool(tool: dict[str, Any], number: int) -> dict[str, Any]:
    """A Responses function tool (``{"type": "function", "name", "parameters", ...}``) as a chat tool."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise APIError(400, f"tools[{number}]: only function tools ({{\"type\": \"function\", \"name\": ...}}) are "
                            "supported", param="tools", code="invalid_value")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


class ResponsesFormatter:
    """The answer to one Responses request: a `ResponseObject`, or its events."""

    def __init__(self, body: ResponsesRequest, *, model: str, tools: ToolRequest | None):
        self.body = body
        self.model = model
        self.tools = tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def response(self, generation: Generation | None, result: ChoiceResult | None,
                 output: list[OutputMessage | OutputFunctionCall] | None = None) -> ResponseObject:
        """The response object: in progress (no `result` yet), or completed (incomplete when cut), its `output`
        the items a stream sent (default: those of `result`'s answer)."""
        body = self.body
        response = ResponseObject(
            id=self.id, status="in_progress", model=self.model, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            parallel_tool_calls=body.parallel_tool_calls is not False, tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
        )
        if result is None:
            return response
        response.output = output if output is not None else self._items(result)
        response.status = "incomplete" if result.finish_reason == "length" else "completed"
        if result.finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        prompt = generation.prompt_tokens if generation is not None else 0
        response.usage = ResponsesUsage(input_tokens=prompt, output_tokens=len(result.tokens),
                                        total_tokens=prompt + len(result.tokens))
        return response

    def _items(self, result: ChoiceResult) -> list[OutputMessage | OutputFunctionCall]:
        content, calls = (result.text, []) if self.tools is None else self.tools.calls(result.text)
        items: list[OutputMessage | OutputFunctionCall] = []
        if content or not calls:
            status = "incomplete" if result.finish_reason == "length" else "completed"
            items.append(OutputMessage(id=self.message_id, status=status, content=[OutputText(text=content or "")]))
        items += [OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.name,
                                     arguments=call.arguments) for call in calls]
        return items

    async def events(self, generation: Generation) -> AsyncIterator[ResponseEvent]:
        """The stream's events, numbered from 0: each output item is opened as the answer writes it (a message
        when text comes; with tools, text that cannot be part of a call, and each call once `ToolDeltas` opens
        it, its arguments in pieces), and all are closed, in order, when the answer ends."""
        number = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> ResponseEvent:
            return ResponseEvent(type=kind, sequence_number=next(number), **fields)

        yield event("response.created", response=self.response(None, None))
        yield event("response.in_progress", response=self.response(None, None))
        output = StreamedOutput(self.message_id, event)
        deltas = ToolDeltas(self.tools) if self.tools is not None else None
        if deltas is None:
            for opened in output.text(""):  # the message opens at once
                yield opened
        result = ChoiceResult(0, 0)
        async for update in generation:
            result.add(update)
            if not update.text:
                continue
            for written in output.text(update.text) if deltas is None else output.deltas(deltas.update(result.text)):
                yield written
        calls = None
        if deltas is not None:
            ending, calls = deltas.end(result.text)
            for written in output.deltas(ending):
                yield written
        for closed in output.close(cut=result.finish_reason == "length", calls=None if calls is None else len(calls)):
            yield closed
        final = self.response(generation, result, output=output.items)
        yield event("response.completed" if final.status == "completed" else "response.incomplete", response=final)


class StreamedOutput:
    """The output items of one streamed response, as their events open, grow and close them.

    `event` makes a numbered event (`ResponsesFormatter.events`). Items keep the order they were opened in; the
    final response lists them so (a message and its text as streamed, each call with its arguments as streamed).
    """

    def __init__(self, message_id: str, event: Callable[..., ResponseEvent]):
        self.message_id = message_id
        self.event = event
        self.items: list[OutputMessage | OutputFunctionCall] = []
        self.output_index: dict[str, int] = {}  # an item's id -> its place in `items`
        self.message: OutputMessage | None = None
        self.calls: dict[int, OutputFunctionCall] = {}  # by the call's index in the chat deltas

    def text(self, text: str) -> list[ResponseEvent]:
        """The message's next piece of `text` (the message opened first if it is not yet)."""
        events = self._open_message() if self.message is None else []
        if text:
            self.message.content[0].text += text
            events.append(self.event("response.output_text.delta", item_id=self.message.id,
                                     output_index=self.output_index[self.message.id], content_index=0, delta=text))
        return events

    def deltas(self, deltas: list[DeltaMessage]) -> list[ResponseEvent]:
        """`ToolDeltas`' chat deltas as the Responses API's events: content as the message's text, a call's
        opening as a function call item, its arguments' pieces as ``response.function_call_arguments.delta``."""
        events = []
        for delta in deltas:
            if delta.content:
                events += self.text(delta.content)
            for call in delta.tool_calls or ():
                if call.id is not None:  # its opening: id, name, empty arguments
                    item = OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.function.name,
                                              arguments="", status="in_progress")
                    self.calls[call.index] = item
                    events.append(self.event("response.output_item.added", output_index=self._add(item),
                                             item=item.model_copy()))
                piece = call.function.arguments if call.function is not None else None
                if piece:
                    item = self.calls[call.index]
                    item.arguments += piece
                    events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                             output_index=self.output_index[item.id], delta=piece))
        return events

    def close(self, *, cut: bool, calls: int | None) -> list[ResponseEvent]:
        """Every item's closing events, in order (an empty message first if nothing was written). Items end
        ``completed``, but the message of an answer `cut` by ``max_output_tokens`` and a call opened beyond the
        `calls` the whole answer holds (one it did not finish) end ``incomplete``."""
        events = self._open_message() if not self.items else []
        if self.message is not None:
            self.message.status = "incomplete" if cut else "completed"
        for number, call in self.calls.items():
            call.status = "completed" if calls is None or number < calls else "incomplete"
        for index, item in enumerate(self.items):
            if isinstance(item, OutputMessage):
                text = item.content[0]
                events += [self.event("response.output_text.done", item_id=item.id, output_index=index,
                                      content_index=0, text=text.text),
                           self.event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=text.model_copy())]
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                         output_index=index, arguments=item.arguments))
            events.append(self.event("response.output_item.done", output_index=index, item=item.model_copy(deep=True)))
        return events

    def _open_message(self) -> list[ResponseEvent]:
        self.message = OutputMessage(id=self.message_id, status="in_progress", content=[OutputText(text="")])
        index = self._add(self.message)
        return [self.event("response.output_item.added", output_index=index,
                           item=self.message.model_copy(update={"content": []})),
                self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                           content_index=0, part=OutputText(text=""))]

    def _add(self, item: OutputMessage | OutputFunctionCall) -> int:
        """Open `item` as the next output item; its output index."""
        self.output_index[item.id] = len(self.items)
        self.items.append(item)
        return self.output_index[item.id]
