"""`Inbox`: what other threads hand a batcher's loop (requests, wake-ups, closing), and where the loop sleeps."""

from __future__ import annotations

import threading
import time
from collections import deque

from ..errors import BatcherClosed, QueueFullError
from .request import Request


class Inbox:
    """Requests submitted from any thread, on their way to the batcher's loop, and the loop's sleep.

    The loop sleeps only when nothing can run (`wait`), and any event that may change that wakes it
    (`wake`): a submission, a cancellation, blocks given back to the pool by another cache, closing. Each
    event bumps a counter, and `wait(seen)` returns at once if the counter moved since the loop last looked
    (`events`), so no wake-up is lost between the loop's check and its sleep.

    `max_waiting` bounds the requests submitted and not yet started (`queued`): beyond it `put` raises
    `QueueFullError`. The loop reports each request that starts or leaves without starting (`started`).
    """

    def __init__(self, max_waiting: int | None = None):
        self.max_waiting = max_waiting
        self._changed = threading.Condition()
        self._submitted: deque[Request] = deque()
        self._events = 0
        self._queued = 0
        self._closing = False
        self._deadline: float | None = None  # when closing: the time after which what is left fails

    def put(self, request: Request) -> None:
        """Queue `request` for the loop; `QueueFullError` beyond `max_waiting`, `BatcherClosed` once closed."""
        with self._changed:
            if self._closing:
                raise BatcherClosed("this ContinuousBatcher is closed")
            if self.max_waiting is not None and self._queued >= self.max_waiting:
                raise QueueFullError(self.max_waiting)
            self._submitted.append(request)
            self._queued += 1
            self._wake()

    def take(self) -> list[Request]:
        """The requests submitted since the last call, oldest first."""
        with self._changed:
            taken = list(self._submitted)
            self._submitted.clear()
            return taken

    def started(self, count: int = 1) -> None:
        """`count` queued requests started (or left the queue without starting)."""
        with self._changed:
            self._queued -= count

    @property
    def queued(self) -> int:
        """Requests submitted and not yet started."""
        with self._changed:
            return self._queued

    @property
    def pending(self) -> int:
        """Requests submitted and not yet taken by the loop."""
        with self._changed:
            return len(self._submitted)

    @property
    def events(self) -> int:
        with self._changed:
            return self._events

    def wake(self) -> None:
        """Something happened that may let the loop run (a cancellation, blocks freed): wake it if it sleeps."""
        with self._changed:
            self._wake()

    def _wake(self) -> None:
        self._events += 1
        self._changed.notify_all()

    def wait(self, seen: int) -> None:
        """Sleep until an event after the `events` count `seen` (at once if there was one), or the deadline."""
        with self._changed:
            timeout = None if self._deadline is None else max(self._deadline - time.monotonic(), 0)
            self._changed.wait_for(lambda: self._events != seen, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests; what is queued or running may finish for `timeout` seconds (None: until done).

        Closing again can only bring the deadline forward.
        """
        with self._changed:
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._closing and self._deadline is not None and (deadline is None or deadline > self._deadline):
                deadline = self._deadline
            self._closing, self._deadline = True, deadline
            self._wake()

    @property
    def closing(self) -> bool:
        with self._changed:
            return self._closing

    def past_deadline(self) -> bool:
        """Closing, and out of time for what is left."""
        with self._changed:
            return self._closing and self._deadline is not None and time.monotonic() >= self._deadline
