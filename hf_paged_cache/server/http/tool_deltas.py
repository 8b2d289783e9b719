"""`ToolDeltas`: what one streamed chat choice of a request with tools sends as its answer grows.

OpenAI streams a call as it is written: a first delta with the call's id, type and name (and empty
arguments), then the text of its arguments in pieces. So does this: text that cannot be part of a call is
sent as content as it comes (`ToolCallParser.sure_content`); a call is opened once its name is written and
its arguments have begun, and its arguments are sent as they grow (`ToolCallParser.partial`). When the
answer ends, what the parse of the whole answer (`ToolRequest.calls`) has beyond what was sent follows:
the rest of the content, the rest of each call's arguments, and any call not opened yet, whole. The pieces
of each call join into the call the same answer gives unstreamed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from .tools import ParsedCall, ToolRequest, new_call_id


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""  # sent so far


class ToolDeltas:
    """The deltas of one streamed choice of a request with `tools`: `update` while it grows, `end` once."""

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.content = ""  # content sent so far
        self.calls: list[_SentCall] = []

    def update(self, text: str) -> list[DeltaMessage]:
        """What `text`, the answer so far, adds to what was sent."""
        sure = text[: self.tools.parser.sure_content(text)]
        deltas = []
        if len(sure) > len(self.content) and sure.startswith(self.content):
            deltas.append(DeltaMessage(content=sure[len(self.content) :]))
            self.content = sure
        for number, call in enumerate(self.tools.partial_calls(text)):
            deltas += self._call(number, call.name, call.arguments)
        return deltas

    def end(self, text: str) -> tuple[list[DeltaMessage], list[ParsedCall]]:
        """What the whole answer `text` adds to what was sent, and its calls."""
        content, calls = self.tools.calls(text)
        deltas = []
        content = content or ""
        # an answer whose opened call did not close (cut by max_tokens) parses as text: no second copy of it
        if content.startswith(self.content) and len(content) > len(self.content) and (calls or not self.calls):
            deltas.append(DeltaMessage(content=content[len(self.content) :]))
        for number, call in enumerate(calls):
            deltas += self._call(number, call.name, call.arguments, call.id)
        return deltas, calls

    def _call(self, number: int, name: str, arguments: str, call_id: str | None = None) -> list[DeltaMessage]:
        """Call `number`'s opening if it is new, and the part of `arguments` not sent yet."""
        deltas = []
        if number == len(self.calls):
            self.calls.append(_SentCall(call_id or new_call_id(), name))
            opening = DeltaToolCall(index=number, id=self.calls[number].id, type="function",
                                    function=DeltaFunctionCall(name=name, arguments=""))
            deltas.append(DeltaMessage(tool_calls=[opening]))
        sent = self.calls[number]
        if sent.name == name and arguments.startswith(sent.arguments) and len(arguments) > len(sent.arguments):
            part = DeltaToolCall(index=number, function=DeltaFunctionCall(arguments=arguments[len(sent.arguments) :]))
            deltas.append(DeltaMessage(tool_calls=[part]))
            sent.arguments = arguments
        return deltas
