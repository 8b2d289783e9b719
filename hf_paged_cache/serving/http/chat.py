"""`/v1/chat/completions` answers in OpenAI's shapes: a whole response, or the chunks of a stream.

A stream opens each choice with a chunk holding the assistant's role, then sends its text as it comes, and
ends it with a chunk holding its finish reason. Log-probabilities are in the chat format: per token its text,
its log-probability, its UTF-8 bytes and the most likely alternatives (``top_logprobs``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence

from ..logprobs import TokenLogprob
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
    TopLogprob,
)


class ChatFormatter:
    """The responses of one chat completion request.

    Args:
        engine: for token texts.
        model: the model name the responses carry.
        logprobs: alternatives per token (None: no logprobs).
        tokens_as_ids: name tokens ``token_id:N`` in logprobs.
    """

    def __init__(self, engine: EngineClient, *, model: str, logprobs: int | None, tokens_as_ids: bool):
        self.engine = engine
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.logprobs = logprobs
        self.tokens_as_ids = tokens_as_ids

    def response(self, generation: Generation, results: Sequence[ChoiceResult]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=result.index, message=AssistantMessage(content=result.text),
                       logprobs=self._logprobs(result.logprobs), finish_reason=result.finish_reason)
            for result in results
        ]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage(generation, results))

    async def chunks(self, generation: Generation, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
        """The role chunk of every choice, then one chunk per update, then usage if asked."""
        results = [ChoiceResult(choice.index, choice.prompt_index) for choice in generation.choices]
        for result in results:
            yield self._chunk(ChatStreamChoice(index=result.index, delta=DeltaMessage(role="assistant", content="")))
        async for update in generation:
            results[update.index].add(update)
            if not (update.text or update.finish_reason or (update.tokens and self.logprobs is not None)):
                continue
            yield self._chunk(ChatStreamChoice(
                index=update.index, delta=DeltaMessage(content=update.text or None),
                logprobs=self._logprobs(update.logprobs) if update.tokens else None,
                finish_reason=update.finish_reason,
            ))
        if include_usage:
            yield ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage(generation, results))

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
