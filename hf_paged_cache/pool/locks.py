"""`SharedExclusiveLock`: the readers-writer lock that lets a pool grow while other threads use it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SharedExclusiveLock:
    """A readers-writer lock: any number of threads in `shared()` at once, or one thread in `exclusive()`.

    Writers are preferred: once a thread waits for `exclusive()`, new `shared()` holders wait behind it,
    except a thread that already holds `shared()` (or `exclusive()`), which re-enters at once, so nesting
    never deadlocks. `exclusive()` is reentrant; asking for it while holding only `shared()` (an upgrade,
    which would deadlock against another upgrader) raises `RuntimeError`. Leaving a block by any exception,
    `KeyboardInterrupt` included, releases the lock, and an exception while waiting leaves it unchanged.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the counts below; `with` on it directly is the cheaper path
        self._condition = threading.Condition(self._mutex)
        self._readers = 0  # shared() holds, over all threads (re-entries counted)
        self._writer: int | None = None  # the thread holding exclusive()
        self._writer_depth = 0
        self._writers_waiting = 0
        self._local = threading.local()  # this thread's shared() depth
        self._shared_hold = SharedHold(self)

    def _shared_depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def held_shared(self) -> bool:
        """Whether the calling thread holds `shared()`."""
        return self._shared_depth() > 0

    def held_exclusive(self) -> bool:
        """Whether the calling thread holds `exclusive()`."""
        return self._writer == threading.get_ident()

    def shared(self) -> SharedHold:
        """Hold the lock shared (``with lock.shared():``): other `shared()` holders may run, `exclusive()` may not."""
        return self._shared_hold

    def _enter_shared(self) -> None:
        with self._mutex:
            busy = self._writer is not None or self._writers_waiting  # else nothing to wait for (the usual case)
            if busy and self._writer != threading.get_ident() and not self._shared_depth():
                while self._writer is not None or self._writers_waiting:
                    self._condition.wait()
            self._readers += 1
            self._local.depth = self._shared_depth() + 1

    def _leave_shared(self) -> None:
        with self._mutex:
            self._readers -= 1
            self._local.depth -= 1
            if not self._readers and self._writers_waiting:  # only writers wait for the readers to leave
                self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone: waits until no thread holds `shared()` or `exclusive()`."""
        me = threading.get_ident()
        with self._condition:
            if self._writer == me:
                self._writer_depth += 1
            else:
                if self._shared_depth():
                    raise RuntimeError(
                        "SharedExclusiveLock.exclusive() called by a thread that holds shared(): upgrading would "
                        "deadlock; leave shared() first"
                    )
                self._writers_waiting += 1
                try:
                    while self._writer is not None or self._readers:
                        self._condition.wait()
                finally:
                    self._writers_waiting -= 1
                    if not self._writers_waiting:
                        self._condition.notify_all()  # readers held back by a writer that gave up waiting
                self._writer, self._writer_depth = me, 1
        try:
            yield
        finally:
            with self._condition:
                self._writer_depth -= 1
                if not self._writer_depth:
                    self._writer = None
                    self._condition.notify_all()

    def __repr__(self) -> str:
        return (
            f"SharedExclusiveLock(shared={self._readers}, exclusive={self._writer is not None}, "
            f"writers_waiting={self._writers_waiting})"
        )


class SharedHold:
    """What `SharedExclusiveLock.shared` returns: a plain context manager, holding no state of its own (the lock
    counts its holders per thread), so one serves every ``with`` on its lock. Cheaper than a generator-based
    ``contextmanager``, which matters here: a paged cache takes the lock twice per layer and forward."""

    __slots__ = ("_lock",)

    def __init__(self, lock: SharedExclusiveLock):
        self._lock = lock

    def __enter__(self) -> None:
        self._lock._enter_shared()

    def __exit__(self, *exc_info: object) -> None:
        self._lock._leave_shared()
