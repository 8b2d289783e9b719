"""The engine deployment (`EngineReplica`: a model, a batcher and its pool per replica) and `PoolBoard`, where
replicas post their pool stats for the ingress's ``/metrics``.

A request reaches a replica as ``generate(prompt=ids, n=n, kwargs=submit_kwargs)`` (routed by
`PrefixAwareRouter`, which reads the prompt) and streams back lists of `Event` tuples, one list per batch of
what the batcher produced since the last:

- ``("token", choice, token_id, logprob or None, prompt_logprobs or None)``, the prompt's on a choice's
  first token when asked for;
- ``("end", choice, finish_reason, None)`` once a choice is done, or ``("end", choice, None, error)``
  with ``error`` the `APIError` fields ``(status, message, param, code)`` the single-process server answers
  for the same failure.

Cancelling the stream (the client went away) cancels the request's choices in the batcher.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from ...engine.batcher import BatcherStats
from ...engine.request import RequestHandle
from ..http.errors import api_error_for
from ..launch import load_batcher
from .router import SUMMARY_STAT
from .summary import PrefixSummary

logger = logging.getLogger("hf_paged_cache.serve")

Event = tuple[Any, ...]
ErrorFields = tuple[int, str, "str | None", "str | None"]  # an APIError's status, message, param, code
REPORT_PERIOD_S = 0.5  # how often a replica posts its pool stats to the board


@dataclass(frozen=True)
class EngineFacts:
    """What the ingress needs of the engine besides its requests: the model's limits and its tokenizer."""

    context: int | None
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PoolBoard:
    """The latest `BatcherStats` each engine replica posted; entries older than `max_age_s` are dropped
    (a replica that died stops posting)."""

    def __init__(self, max_age_s: float = 10 * REPORT_PERIOD_S):
        self._max_age_s = max_age_s
        self._posted: dict[str, tuple[float, BatcherStats]] = {}

    def post(self, replica: str, stats: BatcherStats) -> None:
        self._posted[replica] = (time.monotonic(), stats)

    def read(self) -> list[tuple[str, BatcherStats]]:
        """Each live replica's stats, by replica id."""
        now = time.monotonic()
        self._posted = {r: (t, s) for r, (t, s) in self._posted.items() if now - t <= self._max_age_s}
        return sorted((replica, stats) for replica, (_, stats) in self._posted.items())


@serve.deployment
class EngineReplica:
    """One replica of the engine: the model, tokenizer and `ContinuousBatcher` the serve command's options
    describe (`hf_paged_cache.server.launch.load_batcher`), on the replica's own device and pool."""

    def __init__(self, options: argparse.Namespace, board: Any):
        import torch

        if options.replica_threads:
            torch.set_num_threads(options.replica_threads)
        self.batcher, self.tokenizer = load_batcher(options)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._board = board
        self._closed = threading.Event()
        threading.Thread(target=self._post_stats, name="post-pool-stats", daemon=True).start()

    def facts(self) -> EngineFacts:
        batcher = self.batcher
        return EngineFacts(batcher.context, batcher.vocab_size, batcher.eos_token_ids, self.tokenizer)

    async def generate(self, prompt: list[int], n: int, kwargs: dict[str, Any]) -> AsyncIterator[list[Event]]:
        """Run `n` choices of `prompt` (`ContinuousBatcher.submit_group` arguments); stream their events."""
        try:
            handles = (self.batcher.submit_group(prompt, n, **kwargs) if n > 1
                       else [self.batcher.submit(prompt, **kwargs)])
        except Exception as error:  # noqa: BLE001 (refused: each choice ends with the error, as submit raises it)
            fields = _error_fields(error)
            yield [("end", choice, None, fields) for choice in range(n)]
            return
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for choice, handle in enumerate(handles):
            threading.Thread(target=_stream_handle, args=(choice, handle, "logprobs" in kwargs, loop, events),
                             name=f"handle-{handle.request_id}", daemon=True).start()
        try:
            open_choices = n
            while open_choices:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                open_choices -= sum(event[0] == "end" for event in batch)
                yield batch
        finally:  # done, or the stream was cancelled (its client went away): nothing left to compute
            for handle in handles:
                handle.cancel()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats hook, read by `PrefixAwareRouter`: this replica's `PrefixSummary`."""
        return {SUMMARY_STAT: PrefixSummary.of(self.batcher)}

    def _post_stats(self) -> None:
        while not self._closed.wait(REPORT_PERIOD_S):
            try:
                self._board.post.remote(self.replica, self.batcher.stats())
            except Exception:  # noqa: BLE001 (the board is gone: the app is shutting down)
                logger.debug("could not post pool stats", exc_info=True)

    def __del__(self) -> None:
        """Serve's shutdown of the replica: stop posting, fail what is left and give the pool back."""
        if hasattr(self, "batcher"):  # its constructor ran to the end
            self._closed.set()
            self.batcher.close()


def _stream_handle(choice: int, handle: RequestHandle, logprobs: bool, loop: asyncio.AbstractEventLoop,
                   events: asyncio.Queue) -> None:
    """On a thread of its own: hand each token of `handle` to the loop as an event, then its end."""
    try:
        for count, (token, logprob) in enumerate(handle.with_logprobs(logprobs)):
            prompt_logprobs = handle.prompt_logprobs if count == 0 else None
            loop.call_soon_threadsafe(events.put_nowait, ("token", choice, token, logprob, prompt_logprobs))
        end: Event = ("end", choice, handle.finish_reason or "length", None)
    except Exception as error:  # noqa: BLE001 (sent to the ingress, which answers it)
        end = ("end", choice, None, _error_fields(error))
    try:
        loop.call_soon_threadsafe(events.put_nowait, end)
    except RuntimeError:  # the replica's loop is closed: it is shutting down
        pass


def _error_fields(error: BaseException) -> ErrorFields:
    api_error = api_error_for(error)
    if api_error.status >= 500:
        logger.error("request failed", exc_info=error)
    return api_error.status, api_error.message, api_error.param, api_error.code
