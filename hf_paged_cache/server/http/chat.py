"""`/v1/chat/completions` answers in OpenAI's shapes: a whole response, or the chunks of a stream.

A stream opens each choice with a chunk holding the assistant's role, then sends its text as it comes, and
ends it with a chunk holding its finish reason. Log-probabilities are in the chat format: per token its text,
its log-probability, its UTF-8 bytes and the most likely alternatives (``top_logprobs``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence

from ...engine.logprobs import TokenLogprob
from .completions import token_name, usage
from .engine import EngineClient
from .generation import ChoiceResult, Generation
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from .tool_deltas import ToolDeltas
from .tools import ToolRequest


class ChatFormatter:
    """The responses of one chat completion request.

    Args:
        engine: for token texts.
        model: the model name the responses carry.
        logprobs: alternatives per token (None: no logprobs).
        tokens_as_ids: name tokens ``token_id:N`` in logprobs.
        tools: the request's tools, whose calls are parsed out of each answer (None: no tools). A streamed
            answer with tools sends the text that cannot be part of a call and each call's arguments as they
            come (`ToolDeltas`).
    """

    def __init__(self, engine: EngineClient, *, model: str, logprobs: int | None, tokens_as_ids: bool,
                 tools: ToolRequest | None = None):
        self.engine = engine
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.logprobs = logprobs
        self.tokens_as_ids = tokens_as_ids
        self.tools = tools

    def response(self, generation: Generation, results: Sequence[ChoiceResult]) -> ChatCompletionResponse:
        choices = []
        for result in results:
            content, calls = self._calls(result.text)
            message = AssistantMessage(content=content, tool_calls=[
                ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls
            ] or None)
            choices.append(ChatChoice(index=result.index, message=message, logprobs=self._logprobs(result.logprobs),
                                      finish_reason=self._finish_reason(result.finish_reason, calls)))
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage(generation, results))

    def _calls(self, text: str) -> tuple[str | None, list]:
        return (text, []) if self.tools is None else self.tools.calls(text)

    @staticmethod
    def _finish_reason(reason: str | None, calls: list) -> str | None:
        return "tool_calls" if calls and reason == "stop" else reason

    async def chunks(self, generation: Generation, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
        """The role chunk of every choice, then one chunk per update, then usage if asked."""
        results = [ChoiceResult(choice.index, choice.prompt_index) for choice in generation.choices]
        for result in results:
            yield self._chunk(ChatStreamChoice(index=result.index, delta=DeltaMessage(role="assistant", content="")))
        sent = {result.index: ToolDeltas(self.tools) for result in results} if self.tools is not None else {}
        async for update in generation:
            results[update.index].add(update)
            if self.tools is not None:
                for chunk in self._tool_chunks(results[update.index], sent[update.index], update.finish_reason):
                    yield chunk
                continue
            if not (update.text or update.finish_reason or (update.tokens and self.logprobs is not None)):
                continue
            yield self._chunk(ChatStreamChoice(
                index=update.index, delta=DeltaMessage(content=update.text or None),
                logprobs=self._logprobs(update.logprobs) if update.tokens else None,
                finish_reason=update.finish_reason,
            ))
        if include_usage:
            yield ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage(generation, results))

    def _tool_chunks(
        self, result: ChoiceResult, sent: ToolDeltas, finish_reason: str | None
    ) -> list[ChatCompletionChunk]:
        """What a streamed answer of a request with tools adds (its content and its calls' pieces, as OpenAI
        streams them), and once it ends (`finish_reason`), the chunk with the reason."""
        if not finish_reason:
            deltas = sent.update(result.text)
            return [self._chunk(ChatStreamChoice(index=result.index, delta=delta)) for delta in deltas]
        deltas, calls = sent.end(result.text)
        reason = self._finish_reason(result.finish_reason, calls)
        return [*(self._chunk(ChatStreamChoice(index=result.index, delta=delta)) for delta in deltas),
                self._chunk(ChatStreamChoice(index=result.index, delta=DeltaMessage(), finish_reason=reason))]

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._entry(logprob.token, logprob.logprob).model_dump(),
                             top_logprobs=[self._entry(token, value) for token, value in logprob.top])
            for logprob in logprobs
        ])

    def _entry(self, token: int, logprob: float) -> TopLogprob:
        name = token_name(self.engine, token, self.tokens_as_ids)
        return TopLogprob(token=name, logprob=logprob, bytes=list(name.encode("utf-8")))
