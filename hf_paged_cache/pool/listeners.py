"""`Listeners`: the callbacks a pool calls when something happens to it (blocks freed), without holding their owners."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable


class Listeners:
    """Callbacks to call on one event: a bound method is held weakly (it goes away with its object), anything
    else strongly, so that a listener does not keep a batcher alive. `call` runs them on the caller's thread,
    outside any lock: keep them short (waking a thread, say).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards `_entries`
        self._entries: list[weakref.WeakMethod | Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` on every `call` from now on; returns a function that removes it."""
        entry = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else callback

        def remove() -> None:
            with self._lock:
                if entry in self._entries:
                    self._entries.remove(entry)

        with self._lock:
            self._entries = [e for e in self._entries if not (isinstance(e, weakref.WeakMethod) and e() is None)]
            self._entries.append(entry)
        return remove

    def call(self) -> None:
        """Call every listener whose object is still alive, in the order they were added."""
        with self._lock:
            entries = list(self._entries)
        for entry in entries:
            callback = entry() if isinstance(entry, weakref.WeakMethod) else entry
            if callback is not None:
                callback()
