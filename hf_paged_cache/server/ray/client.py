"""`ReplicaClient`: the engine deployment's replicas as `EngineClient` sees a batcher (a `Submitter`).

`submit_group` returns `RequestHandle`s at once and streams the request from a replica on the event loop
(`EngineReplica.generate`), feeding each handle its tokens and its end; so everything above it (the
handlers, detokenizing, stop strings, metrics) is the single-process server's own code.

Failures:

- a replica that refuses the request (a full queue, a bad value) ends each choice with the `APIError` the
  single-process server would answer (for a streamed request, after the stream began: as its last event);
- a replica that dies (or becomes unreachable) ends the open choices of its requests with `EngineUnavailable`
  (503: a streamed request gets it as its last event, after the tokens it had). The client may retry: the
  router sends new requests to the live replicas while Ray replaces the dead one. A handle is always
  finished, so no client waits on a dead replica;
- a choice cancelled here (its client went away, or a stop string ended it) ends at once; the replica's
  stream is cancelled once every choice of the request has ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from ...engine.request import RequestHandle
from ...errors import BatcherClosed, EngineUnavailable
from ..http.errors import APIError
from .replica import EngineFacts, Event

logger = logging.getLogger("hf_paged_cache.serve")

REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class ReplicaClient:
    """Requests of one ingress, run on the engine deployment's replicas through `engine`, a deployment handle.

    Must be used on the event loop of the app that reads the handles (it streams on that loop).
    """

    def __init__(self, engine: Any, facts: EngineFacts):
        self._engine = engine.options(stream=True)
        self.context = facts.context
        self.vocab_size = facts.vocab_size
        self.eos_token_ids = facts.eos_token_ids
        self._ids = itertools.count()
        self._running: set[asyncio.Task] = set()
        self._closed = False

    def submit(self, input_ids: Sequence[int], **generation_kwargs: Any) -> RequestHandle:
        return self.submit_group(input_ids, 1, **generation_kwargs)[0]

    def submit_group(self, input_ids: Sequence[int], n: int, **generation_kwargs: Any) -> list[RequestHandle]:
        """Start `n` choices of `input_ids` on a replica; their handles, at once."""
        if self._closed:
            raise BatcherClosed("the server is shutting down")
        loop = asyncio.get_running_loop()
        task: asyncio.Task | None = None

        def on_cancel(handle: RequestHandle) -> None:  # any thread
            handle._finish()  # ends with RequestCancelled
            if task is not None and all(h.done() for h in handles):
                loop.call_soon_threadsafe(task.cancel)

        handles: list[RequestHandle] = []
        for choice in range(n):
            handles.append(RequestHandle(next(self._ids), on_cancel=lambda choice=choice: on_cancel(handles[choice])))
        task = loop.create_task(self._stream(list(input_ids), generation_kwargs, handles))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return handles

    def close(self, timeout: float = 0.0) -> None:
        """Refuse new requests; those streaming go on until their replica ends them (it owns their fate)."""
        self._closed = True

    async def _stream(self, prompt: list[int], kwargs: dict[str, Any], handles: list[RequestHandle]) -> None:
        response = self._engine.generate.remote(prompt=prompt, n=len(handles), kwargs=kwargs)
        try:
            async for events in response:
                _deliver(events, handles)
        except asyncio.CancelledError:  # every choice ended here: stop the replica's work
            response.cancel()
            raise
        except REPLICA_GONE as error:
            _fail(handles, EngineUnavailable(f"the replica running this request failed ({type(error).__name__})"))
        except Exception as error:  # noqa: BLE001 (a bug in the replica: the request fails, 500)
            logger.error("request failed on its replica", exc_info=error)
            _fail(handles, RuntimeError(f"the replica failed: {error}"))


def _deliver(events: list[Event], handles: list[RequestHandle]) -> None:
    """Hand a batch of a replica's events to their handles."""
    for kind, choice, *rest in events:
        handle = handles[choice]
        if handle.done():  # cancelled here meanwhile
            continue
        if kind == "token":
            token, logprob, prompt_logprobs = rest
            handle._emit(token, logprob, prompt_logprobs)
        else:
            reason, error = rest
            handle._finish(None if error is None else APIError(error[0], error[1], param=error[2], code=error[3]),
                           reason)


def _fail(handles: list[RequestHandle], error: BaseException) -> None:
    for handle in handles:
        handle._finish(error)
