"""``/v1/responses``: OpenAI's Responses API, served as a chat completion.

A request becomes a `ChatCompletionRequest` (`chat_request_for`): ``instructions`` a system message, ``input`` the
messages (text, or a list of messages, function calls and their outputs), ``text.format`` the
``response_format``, function tools and ``tool_choice`` in the chat shapes, ``max_output_tokens`` the
``max_tokens``. It then runs as a chat completion does (the same checks, template, constraints and tool
parsing), and its answer is written as a response object, or as the Responses API's stream of events:
``response.created``, ``response.in_progress``, for a message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per piece of text, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for a function call its item with
``response.function_call_arguments.done``; then ``response.completed`` (``incomplete`` when cut by
``max_output_tokens``).

The server keeps nothing: ``store`` is answered false, and ``previous_response_id`` is a 400.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError

from .errors import APIError
from .generation import ChoiceResult, Generation
from .protocol import (
    ChatCompletionRequest,
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
)
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

    def response(self, generation: Generation | None, result: ChoiceResult | None) -> ResponseObject:
        """The response object: in progress (no `result` yet), or completed (incomplete when cut)."""
        body = self.body
        response = ResponseObject(
            id=self.id, status="in_progress", model=self.model, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            parallel_tool_calls=body.parallel_tool_calls is not False, tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
        )
        if result is None:
            return response
        response.output = self._items(result)
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
            items.append(OutputMessage(id=self.message_id, content=[OutputText(text=content or "")]))
        items += [OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.name,
                                     arguments=call.arguments) for call in calls]
        return items

    async def events(self, generation: Generation) -> AsyncIterator[ResponseEvent]:
        """The stream's events, numbered from 0. Text is sent as it comes, unless the request has tools (then
        the answer is held back to its end, so that calls are never sent as text)."""
        number = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> ResponseEvent:
            return ResponseEvent(type=kind, sequence_number=next(number), **fields)

        yield event("response.created", response=self.response(None, None))
        yield event("response.in_progress", response=self.response(None, None))
        result = ChoiceResult(0, 0)
        live = self.tools is None  # the message is streamed as it comes
        if live:
            for opening in self._message_opening(event):
                yield opening
        async for update in generation:
            result.add(update)
            if live and update.text:
                yield event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                            delta=update.text)
        final = self.response(generation, result)
        for index, item in enumerate(final.output):
            if isinstance(item, OutputMessage):
                if not live:
                    for opening in self._message_opening(event):
                        yield opening
                    if item.content[0].text:
                        yield event("response.output_text.delta", item_id=item.id, output_index=index,
                                    content_index=0, delta=item.content[0].text)
                yield event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                            text=item.content[0].text)
                yield event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                            part=item.content[0])
            else:
                yield event("response.output_item.added", output_index=index,
                            item=item.model_copy(update={"arguments": "", "status": "in_progress"}))
                yield event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                            delta=item.arguments)
                yield event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                            arguments=item.arguments)
            yield event("response.output_item.done", output_index=index, item=item)
        yield event("response.completed" if final.status == "completed" else "response.incomplete", response=final)

    def _message_opening(self, event) -> Sequence[ResponseEvent]:
        empty = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return [event("response.output_item.added", output_index=0, item=empty),
                event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                      part=OutputText(text=""))]
