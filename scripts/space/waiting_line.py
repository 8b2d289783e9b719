"""Admission to the Space's shared pools: requests wait in a bounded line for their worst case of blocks.

`WaitingLine` (one per shared pool) admits a request when its worst case fits, first come first served, and
otherwise makes it wait, with a message for the page, until blocks are given back, its wait runs out or the
line is full (`PoolFullError`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from limits import MAX_WAIT_S, MAX_WAITING, plural

from hf_paged_cache import KVPool, PoolExhaustedError


class PoolFullError(RuntimeError):
    """A request that cannot have its blocks: bigger than the whole pool, or the waiting line is full, or its
    wait ran out. Nothing was taken from the pool; the message is shown to the user as is."""


class WaitingLine:
    """Requests for the blocks of one shared pool wait here, first come first served, instead of failing.

    A request states its worst case (`needed` blocks) and runs inside ``with line.admit(needed):``. It is
    admitted when it is first in line and `needed` fits both beside the worst cases of the requests already
    admitted (``capacity - reserved``) and in the blocks free right now (``num_free``, which also sees blocks
    held outside the line). So requests admitted here never run the pool out between them, and a request
    that fits the pool alone always gets its turn once the others are done. Otherwise, `PoolFullError`:

    - at once, when `needed` is more than the whole pool (``capacity``): waiting could never help;
    - at once, when `max_waiting` requests are already waiting (the line is bounded);
    - after `max_wait_s` seconds in line without getting the blocks.

    Waiting is a condition variable, not polling: an admitted request notifies it when it leaves (its cache
    has given its blocks back by then), and so does every request leaving the line (admitted or giving up:
    the next one may be first now). Blocks given back outside the line (a cache not admitted here) notify
    nobody; waiters also re-check every `RECHECK_S` seconds to notice those.

    Why not the batcher's own admission: the batcher (`hf_paged_cache.engine.admission`, and its inbox's
    `max_waiting`) decides, inside its one loop thread, which of the requests submitted to it start at the
    next step; a submitter never blocks there, and every request runs in the batcher's packed steps. The
    Space shows something else: each Batch request is one ragged `model.generate` on its own `PagedCache`
    (its shared prefix prefilled once, the pool picture drawn from that cache), and each Chat turn one
    `generate` that takes its blocks with `reuse_prefix` and times its first token. Those run in Gradio's
    worker threads, several at once on the same pools, with no loop to queue them in; so the admission they
    need is a blocking, bounded, first-come line across threads that can tell the page a request is waiting.
    Routing the tabs through a `ContinuousBatcher` would make the page show the batcher's steps rather than
    `generate` with a paged cache, which is what the demo is for.
    """

    RECHECK_S = 1.0

    def __init__(self, pool: KVPool, *, max_waiting: int = MAX_WAITING, max_wait_s: float = MAX_WAIT_S):
        self.pool = pool
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._changed = threading.Condition()
        self._line: deque[object] = deque()  # one ticket per waiting request, first come first
        self._reserved = 0  # worst-case blocks of the admitted requests, together

    @property
    def waiting(self) -> int:
        """Requests waiting now."""
        with self._changed:
            return len(self._line)

    @property
    def reserved(self) -> int:
        """Worst-case blocks of the requests admitted now."""
        with self._changed:
            return self._reserved

    @contextmanager
    def admit(self, needed: int, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold `needed` blocks' worth of the pool for the ``with`` block, after waiting in line if need be.

        `on_wait(message)` is called once, if the request has to wait, with a message for the user.
        Raises `PoolFullError` (see the class docstring); nothing is held then.
        """
        blocks = self.pool.blocks
        if needed > blocks.capacity:
            raise PoolFullError(
                f"The shared KV block pool is full for this request: it may need up to {needed} blocks of "
                f"{self.pool.block_size} tokens, more than the whole pool holds ({blocks.capacity}), even with "
                "nobody else using it. Use fewer prompts, fewer new tokens or a shorter conversation."
            )
        with self._changed:
            ticket, message = self._join(needed)
        if ticket is not None:
            try:
                if on_wait is not None:
                    on_wait(message)
                with self._changed:
                    self._wait_turn(ticket, needed)
            finally:
                with self._changed:
                    self._line.remove(ticket)
                    self._changed.notify_all()  # the next in line may be first now
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= needed
                self._changed.notify_all()

    def _fits(self, needed: int) -> bool:
        blocks = self.pool.blocks
        return needed <= min(blocks.capacity - self._reserved, blocks.num_free)

    def _join(self, needed: int) -> tuple[object | None, str]:
        """Admit the request at once (no ticket), or put it in line: its ticket and what to tell the user.

        Called with the lock held.
        """
        if not self._line and self._fits(needed):
            self._reserved += needed
            return None, ""
        if len(self._line) >= self.max_waiting:
            raise PoolFullError(
                f"The shared KV block pool is full: {len(self._line)} requests are already waiting for blocks, "
                "the most this demo lets wait. Try again in a moment."
            )
        ticket = object()
        self._line.append(ticket)
        ahead = f"; {plural(len(self._line) - 1, 'request')} ahead of you" if len(self._line) > 1 else ""
        blocks = self.pool.blocks
        return ticket, (
            f"Waiting for {needed} blocks of the shared KV pool, which other sessions are using "
            f"({blocks.num_free} of {blocks.capacity} free now{ahead}). Your request runs as soon as they give "
            f"them back (at most {self.max_wait_s:g} s)."
        )

    def _wait_turn(self, ticket: object, needed: int) -> None:
        """Wait until `ticket` is first in line and its blocks fit, then admit it (lock held)."""
        deadline = time.monotonic() + self.max_wait_s
        while self._line[0] is not ticket or not self._fits(needed):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolFullError(
                    f"The shared KV block pool is full: this request waited {self.max_wait_s:g} s for {needed} "
                    f"blocks of {self.pool.block_size} tokens while other sessions held them "
                    f"({self.pool.blocks.num_free} free now). Try again in a moment, or use fewer prompts or "
                    "fewer new tokens."
                )
            self._changed.wait(min(left, self.RECHECK_S))
        self._reserved += needed


def pool_full_message(error: PoolFullError | PoolExhaustedError) -> str:
    """What a user sees when the shared pool cannot hold their request."""
    if isinstance(error, PoolFullError):
        return str(error)
    return (
        f"The shared KV block pool is full: this step needed {error.needed} blocks but only {error.free} were "
        "free (other sessions are using the rest). Nothing was changed; try again in a moment, or use fewer "
        "prompts or fewer new tokens."
    )
