"""Errors raised by `hf_paged_cache`."""

from __future__ import annotations

import torch


class PoolExhaustedError(RuntimeError):
    """A forward needed more KV blocks than the pool has free.

    Raised before anything is written, so the pool and every cache on it are exactly as they were: the
    caller can free other caches, crop this one, or retry with a bigger pool.

    Attributes:
        needed: blocks the failing step asked for.
        free: blocks free in the pool at that moment.
        group: which layer group ran out ("sliding window 512"), for a pool with several, or "sequence states"
            when the per-sequence state slots did (then `block_size` is 0 and the counts are slots); else None.
    """

    def __init__(self, needed: int, free: int, total: int, block_size: int, group: str | None = None):
        self.needed = needed
        self.free = free
        self.total = total
        self.block_size = block_size
        self.group = group  # the layer group that ran out, in a pool with several
        where = f" for its {group} layers" if group else ""
        if block_size == 0:  # per-sequence state slots (`pool.state_slots`), not blocks of tokens
            super().__init__(
                f"state slot pool exhausted: this step needs {needed} slots for {group} (one per sequence) but only "
                f"{free} of {total} are free. Release or finish other sequences on this pool, or build the pool for "
                "more sequences (`max_sequences=`)."
            )
            return
        super().__init__(
            f"KV block pool exhausted: this step needs {needed} blocks of {block_size} tokens{where} but only "
            f"{free} of {total} are free. Release or crop other caches on this pool, or build the pool bigger "
            "(`num_blocks=` or `max_memory=`)."
        )


class KVMemoryError(MemoryError):
    """The device could not allocate (or grow) a KV pool's storage.

    Attributes:
        requested_bytes: bytes the failing allocation asked for.
        device: where.

    Raised from `BlockPool.allocate` when an elastic pool cannot grow (nothing taken, nothing written, the
    pool keeps its size: the step can be retried after freeing memory), or from `KVPool.layer` when a layer's
    storage cannot be created on its first forward.
    """

    def __init__(self, message: str, requested_bytes: int, device: torch.device | str):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.device = device


class QueueFullError(RuntimeError):
    """`ContinuousBatcher.submit` refused a request: `max_waiting` requests already wait to start.

    Nothing was queued; try again later (a server answers 429 or 503).

    Attributes:
        max_waiting: the bound that was reached.
    """

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        super().__init__(
            f"the batcher's queue is full: {max_waiting} requests already wait to start (max_waiting={max_waiting})"
        )


class BatcherClosed(RuntimeError):
    """The `ContinuousBatcher` is closed: `submit` refuses new requests, and a request it had not finished when
    `close(timeout)` ran out ends with this (a server answers 503)."""


class RequestCancelled(RuntimeError):
    """A batcher request ended by `RequestHandle.cancel()` before it finished.

    Raised by `result()` and, after the tokens generated before the cancellation, by iterating the handle.
    """


class EngineUnavailable(RuntimeError):
    """The engine running a request is gone (a replica of a Ray Serve deployment died mid-request); the
    request ends with this after the tokens it had (a server answers 503: retry)."""
