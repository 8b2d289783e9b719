"""Timers for the benchmarks: wall and CPU time, per-step stamps inside `generate`, time to first token,
and `in_fresh_thread`, which runs a contender on a thread of its own."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from transformers import LogitsProcessor
from transformers.generation.streamers import BaseStreamer

T = TypeVar("T")


def in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new thread that ends with it; returns its result or raises its exception.

    Why: with GNU OpenMP (PyTorch's CPU wheels), every thread that runs parallel torch work keeps its own
    pool of worker threads, idle but counted, until it exits. Once the pools hold more threads than there
    are cores, libgomp stops spin-waiting between parallel regions and puts its workers to sleep after
    each one, which slows every thread's small ops. A contender timed on the main thread after another ran
    there, or one with its own background thread (a continuous batcher) timed after the main thread ran
    torch work, would pay for what ran before it. Running each contender on a thread of its own, which
    takes its pool with it when it ends, makes every run start from the same state.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 (re-raised on the calling thread)
            outcome["error"] = error

    thread = threading.Thread(target=target, name=getattr(fn, "__name__", "run"))
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on CUDA (timers must not stop while work is still in flight)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """``with Timer(device) as t: ...`` then ``t.seconds``; synchronizes CUDA on entry and exit.

    Also records ``cpu_seconds``, the process CPU time (`time.process_time`, all threads) over the same
    span. On a CPU shared with other work, wall time includes waiting for a core while CPU time does not,
    so CPU time is the steadier measure of the work done (on CUDA it only measures the host side).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.start = float("nan")  # time.perf_counter() on entry, after synchronizing
        self.cpu_start = float("nan")  # time.process_time() on entry
        self.seconds = float("nan")
        self.cpu_seconds = float("nan")

    def __enter__(self) -> Timer:
        synchronize(self.device)
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        return self

    def __exit__(self, *exc_info: object) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start


class StepClock(LogitsProcessor):
    """A pass-through logits processor that timestamps every decoding step.

    ``generate`` calls logits processors once per step, right after that step's forward (greedy, sampling
    and beam search alike), so ``stamps[0]`` marks the end of prefill (time to first token, minus the token
    choice) and ``stamps[-1] - stamps[0]`` spans the remaining ``len(stamps) - 1`` decode forwards.

    `probe`, if given, is called at every step, after the stamp (its cost, microseconds for the probes the
    scripts use, falls inside the decode span), and the largest value it returns is kept in `high_water`:
    e.g. the KV bytes a cache holds.
    """

    def __init__(self, device: torch.device | str, probe: Callable[[], int] | None = None):
        self.device = torch.device(device)
        self.stamps: list[float] = []  # time.perf_counter() at each step
        self.cpu_stamps: list[float] = []  # time.process_time() at each step (see `Timer`)
        self.probe = probe
        self.high_water = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        if self.probe is not None:
            self.high_water = max(self.high_water, self.probe())
        return scores


def reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str, cache_bytes: int) -> dict[str, Any]:
    """Peak memory of the last run: ``torch.cuda.max_memory_allocated`` on CUDA; elsewhere the cache's own
    tensor bytes (`cache_bytes`), since CPU allocators expose no comparable peak counter."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"kind": "cuda_max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    return {"kind": "cache_tensor_bytes", "bytes": int(cache_bytes)}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0 to 1) of `values` by nearest rank: ``sorted(values)[round(q x (n - 1))]``; NaN if empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


class FirstTokenTimer(BaseStreamer):
    """Time to first token of one `generate` call, as a streamer: `generate`'s first `put` is the prompt,
    its second the first new token. Create it right before calling `generate`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass

    @property
    def seconds(self) -> float:
        """Seconds from construction to the first new token (to now if none came yet)."""
        return (self.first_token_at or time.perf_counter()) - self.start
