"""`Generation`: the choices of one request in flight, as one async stream of `ChoiceUpdate`s.

Each choice's `RequestHandle` is read on a thread of its own, which hands every token to the event loop with
``loop.call_soon_threadsafe``, so the loop never blocks; the thread ends with its handle, and counts the request
in the metrics whether or not anyone still reads it. On the loop (`ChoiceStream`), each choice's tokens become
text (`IncrementalDetokenizer`), cut before the first stop string (`StopStringMatcher`; the request is then
cancelled, as it is done), with the tokens' log-probabilities.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ...engine.logprobs import TokenLogprob
from ...engine.request import RequestHandle
from ...errors import RequestCancelled
from .detokenize import IncrementalDetokenizer
from .metrics import ServerMetrics
from .stop_strings import StopStringMatcher


@dataclass(frozen=True)
class ChoiceUpdate:
    """What one choice gained since its last update: text that is final, and the tokens that made it.

    A choice's updates join to its whole answer; its last one has a `finish_reason`.
    """

    index: int  # of the choice in the request: prompt_index * n + j
    prompt_index: int
    text: str
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked for
    text_offsets: tuple[int, ...] = ()  # where each token's text starts in the choice's text
    finish_reason: str | None = None  # "stop" or "length" on the last update
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on a choice's first update, when asked for


@dataclass
class ChoiceResult:
    """A whole choice, joined from its updates (`Generation.results`)."""

    index: int
    prompt_index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    def add(self, update: ChoiceUpdate) -> None:
        self.text += update.text
        self.tokens.extend(update.tokens)
        self.logprobs.extend(update.logprobs)
        self.text_offsets.extend(update.text_offsets)
        self.finish_reason = update.finish_reason or self.finish_reason
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs


@dataclass
class ChoiceStream:
    """One choice in flight, as the event loop sees it: its handle, its text so far and whether it is done."""

    index: int
    prompt_index: int
    prompt_length: int
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    stop_ids: frozenset[int]  # tokens that end it (EOS, stop_token_ids): their text is not part of the answer
    logprobs: bool
    prompt_logprobs: bool
    first_of_prompt: bool  # the choice that counts the prompt's tokens
    received: int = 0
    finished: bool = False
    stopped_by_text: bool = False  # read by the handle's reader thread once the handle ends

    def on_token(self, token: int, logprob: TokenLogprob | None) -> ChoiceUpdate | None:
        if self.finished:
            return None  # generated after its stop string, before the cancellation took effect
        first = self.received == 0
        self.received += 1
        offset = len(self.matcher.text)
        text = self.matcher.feed("" if token in self.stop_ids else self.detokenizer.add(token))
        if self.matcher.stopped:
            self.finished = self.stopped_by_text = True
            self.handle.cancel()
        prompt = None
        if first and self.prompt_logprobs:
            prompt = tuple(self.handle.prompt_logprobs or ())
        return ChoiceUpdate(
            self.index, self.prompt_index, text, (token,), (logprob,) if logprob is not None else (), (offset,),
            "stop" if self.stopped_by_text else None, prompt,
        )

    def on_end(self, error: BaseException | None) -> ChoiceUpdate | None:
        if self.finished:
            return None
        if error is not None:
            raise error
        self.finished = True
        text = self.matcher.feed(self.detokenizer.flush())
        text += self.matcher.flush()
        reason = "stop" if self.matcher.stopped else self.handle.finish_reason or "length"
        return ChoiceUpdate(self.index, self.prompt_index, text, finish_reason=reason)


_Event = tuple[ChoiceStream, int | None, TokenLogprob | None, BaseException | None]
"""What a handle's reader thread hands the loop: a token (and its logprob), or the end (token None, and the error)."""


class Generation:
    """The choices of one request in flight: iterate it (on the event loop) for `ChoiceUpdate`s as they come.

    Iteration ends when every choice has finished, and raises the error of a choice that failed. `cancel()`
    cancels every choice (a client that went away); it is safe at any time, any number of times.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, choices: list[ChoiceStream], submitted_at: float,
                 metrics: ServerMetrics | None):
        self.choices = choices
        self.prompt_tokens = sum(choice.prompt_length for choice in choices if choice.first_of_prompt)
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        for choice in choices:
            threading.Thread(
                target=_read_handle, args=(choice, loop, self._events, submitted_at, metrics),
                name=f"handle-{choice.handle.request_id}", daemon=True,
            ).start()

    async def __aiter__(self) -> AsyncIterator[ChoiceUpdate]:
        open_choices = len(self.choices)
        while open_choices:
            choice, token, logprob, error = await self._events.get()
            if token is not None:
                update = choice.on_token(token, logprob)
            else:
                open_choices -= 1
                update = choice.on_end(error)
            if update is not None:
                yield update

    async def results(self) -> list[ChoiceResult]:
        """Every choice whole, in index order (a non-streamed answer)."""
        results = [ChoiceResult(choice.index, choice.prompt_index) for choice in self.choices]
        async for update in self:
            results[update.index].add(update)
        return results

    def cancel(self) -> None:
        for choice in self.choices:
            choice.handle.cancel()


def _read_handle(
    choice: ChoiceStream, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, submitted_at: float,
    metrics: ServerMetrics | None,
) -> None:
    """On the choice's own thread: hand each token of its handle to the loop, then its end, then count it."""
    handle = choice.handle

    def put(token: int | None, logprob: TokenLogprob | None, error: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (choice, token, logprob, error))
        except RuntimeError:  # the loop is closed: the server is gone, nobody reads this request any more
            handle.cancel()

    count, last, gaps = 0, None, []
    error: BaseException | None = None
    try:
        for token, logprob in handle.with_logprobs(choice.logprobs):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            put(token, logprob, None)
            count += 1
    except BaseException as failure:  # noqa: BLE001 (handed to the loop, which raises it to the handler)
        error = failure
    put(None, None, error)
    if metrics is None:
        return
    if error is None:
        reason = handle.finish_reason or "length"
    elif isinstance(error, RequestCancelled):
        reason = "stop" if choice.stopped_by_text else "cancelled"
    else:
        reason = "error"
    end = handle.finish_time or time.perf_counter()
    for gap in gaps:
        metrics.inter_token_latency.observe(gap)
    metrics.request_finished(
        reason, prompt_tokens=choice.prompt_length if choice.first_of_prompt else 0,
        generated_tokens=count,
        time_to_first_token=None if handle.first_token_time is None else handle.first_token_time - submitted_at,
        latency=end - submitted_at,
    )
