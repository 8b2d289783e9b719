"""`/v1/completions` answers in OpenAI's shapes: a whole response, or the chunks of a stream.

Log-probabilities follow OpenAI's legacy format: per token its text (``tokens``), its log-probability
(``token_logprobs``), the most likely alternatives as ``{token text: logprob}`` (``top_logprobs``) and where
its text starts in the choice's text (``text_offset``). With ``echo`` the prompt's tokens come first, the very
first with ``null`` (nothing predicts it): what lm-evaluation-harness reads to score a continuation.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence

from ...engine.logprobs import TokenLogprob
from .detokenize import IncrementalDetokenizer
from .engine import EngineClient
from .generation import ChoiceResult, Generation
from .protocol import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage


def token_name(engine: EngineClient, token: int, as_id: bool) -> str:
    """How logprobs name a token: its text, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""
    return f"token_id:{token}" if as_id else engine.token_text(token)


def top_alternatives(engine: EngineClient, logprob: TokenLogprob, as_id: bool) -> dict[str, float]:
    """``{token text: logprob}`` of the most likely tokens (two tokens with one text: the likelier kept)."""
    top: dict[str, float] = {}
    for token, value in logprob.top:
        top.setdefault(token_name(engine, token, as_id), value)
    return top


def usage(generation: Generation, results: Sequence[ChoiceResult]) -> Usage:
    completion = sum(len(result.tokens) for result in results)
    return Usage(prompt_tokens=generation.prompt_tokens, completion_tokens=completion,
                 total_tokens=generation.prompt_tokens + completion)


class CompletionFormatter:
    """The responses of one completion request.

    Args:
        engine: for token texts.
        model: the model name the responses carry.
        prompts: each prompt's token ids; `prompt_texts` their text (what ``echo`` repeats).
        echo: put the prompt before each choice's text (and its tokens before its logprobs).
        logprobs: alternatives per token (None: no logprobs).
        tokens_as_ids: name tokens ``token_id:N`` in logprobs.
    """

    def __init__(
        self, engine: EngineClient, *, model: str, prompts: Sequence[Sequence[int]], prompt_texts: Sequence[str],
        echo: bool, logprobs: int | None, tokens_as_ids: bool,
    ):
        self.engine = engine
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.prompts = prompts
        self.prompt_texts = prompt_texts
        self.echo = echo
        self.logprobs = logprobs
        self.tokens_as_ids = tokens_as_ids

    def response(self, generation: Generation, results: Sequence[ChoiceResult]) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=result.index, text=self._prefix(result.prompt_index) + result.text,
                logprobs=self._logprobs(result.prompt_index, result.tokens, result.logprobs, result.text_offsets,
                                        result.prompt_logprobs, first=True),
                finish_reason=result.finish_reason,
            )
            for result in results
        ]
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage(generation, results))

    async def chunks(self, generation: Generation, include_usage: bool) -> AsyncIterator[CompletionResponse]:
        """One chunk per update; the prompt (with ``echo``) leads each choice's first; then usage if asked."""
        results = [ChoiceResult(choice.index, choice.prompt_index) for choice in generation.choices]
        started: set[int] = set()
        async for update in generation:
            first = update.index not in started
            started.add(update.index)
            results[update.index].add(update)
            wanted = update.text or update.finish_reason or (update.tokens and self.logprobs is not None)
            if not (wanted or (first and self.echo)):
                continue
            choice = CompletionChoice(
                index=update.index, text=(self._prefix(update.prompt_index) if first else "") + update.text,
                logprobs=self._logprobs(update.prompt_index, update.tokens, update.logprobs, update.text_offsets,
                                        update.prompt_logprobs, first=first),
                finish_reason=update.finish_reason,
            )
            yield CompletionResponse(id=self.id, model=self.model, choices=[choice])
        if include_usage:
            yield CompletionResponse(id=self.id, model=self.model, choices=[], usage=usage(generation, results))

    def _prefix(self, prompt_index: int) -> str:
        return self.prompt_texts[prompt_index] if self.echo else ""

    def _logprobs(
        self, prompt_index: int, tokens: Sequence[int], logprobs: Sequence[TokenLogprob], offsets: Sequence[int],
        prompt_logprobs: Sequence[TokenLogprob] | None, *, first: bool,
    ) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogprobs()
        if self.echo and first:
            prompt = self.prompts[prompt_index]
            out.tokens += [token_name(self.engine, token, self.tokens_as_ids) for token in prompt]
            out.token_logprobs += [None, *(lp.logprob for lp in prompt_logprobs or ())]
            out.top_logprobs += [None, *(top_alternatives(self.engine, lp, self.tokens_as_ids)
                                         for lp in prompt_logprobs or ())]
            out.text_offset += self._prompt_offsets(prompt)
        base = len(self._prefix(prompt_index))
        for token, logprob, offset in zip(tokens, logprobs, offsets):
            out.tokens.append(token_name(self.engine, token, self.tokens_as_ids))
            out.token_logprobs.append(logprob.logprob)
            out.top_logprobs.append(top_alternatives(self.engine, logprob, self.tokens_as_ids))
            out.text_offset.append(base + offset)
        return out

    def _prompt_offsets(self, prompt: Sequence[int]) -> list[int]:
        """Where each prompt token's text starts in the prompt's decoded text."""
        detokenizer = IncrementalDetokenizer(self.engine.tokenizer)
        offsets, length = [], 0
        for token in prompt:
            offsets.append(length)
            length += len(detokenizer.add(token))
        return offsets
