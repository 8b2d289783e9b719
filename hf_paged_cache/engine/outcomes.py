"""`Outcomes`: what became of the requests a scheduler let go, counted, and `Counts`, what it shows other threads."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RequestCancelled
from .request import Request


@dataclass(frozen=True)
class Counts:
    """The scheduler's state at the last step boundary (what `ContinuousBatcher.stats` reports)."""

    waiting: int = 0  # taken from the inbox, not started (preempted ones included)
    prefilling: int = 0
    running: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    preemptions: int = 0  # running requests preempted (to be computed again)
    prefill_retries: int = 0  # prefilling requests sent back to the queue for want of blocks
    prefix_hit_tokens: int = 0  # prompt tokens taken from the pool's prefix cache at admission


class Outcomes:
    """The totals behind `Counts`, and the requests that left since the last step boundary.

    A request that finishes, fails or is cancelled is recorded at once, but its handle ends only in
    `end_handles`, which the scheduler calls once it has published `counts` that include it: a caller woken by
    its handle then reads counts that include it.
    """

    def __init__(self) -> None:
        self.tally = dict(finished=0, failed=0, cancelled=0, preemptions=0, prefill_retries=0, prefix_hit_tokens=0)
        self._ended: list[tuple[Request, BaseException | None]] = []  # handles to end at the step boundary

    def finish(self, request: Request, error: BaseException | None = None) -> None:
        """`request` is done: finished when `error` is None, failed with it otherwise."""
        self.tally["failed" if error is not None else "finished"] += 1
        self._ended.append((request, error))

    def cancel(self, request: Request) -> None:
        """`request` was cancelled: its handle ends with `RequestCancelled`."""
        self.tally["cancelled"] += 1
        self._ended.append((request, RequestCancelled(f"request {request.id} was cancelled")))

    def counts(self, waiting: int, prefilling: int, running: int) -> Counts:
        """The totals so far, with these requests in each state."""
        return Counts(waiting, prefilling, running, **self.tally)

    def end_handles(self) -> None:
        """End the handles of the requests that left since the last call."""
        ended, self._ended = self._ended, []
        for request, error in ended:
            request.handle._finish(error, None if error is not None else request.finish_reason)
