"""`pad_heap`: keep freed memory in a serving process instead of handing it back to the kernel at every step.

A decode step allocates and frees megabytes of short-lived tensors in every layer (the keys and values it
gathers from the pool, SDPA's buffers, the model's activations). With glibc's default settings the allocator
gives the top of its heap back to the kernel whenever more than a few hundred KiB of it is free, and serves
each allocation over its (dynamic) threshold by a fresh ``mmap``: the next layer then faults the same pages
in again, zero-filled. On a 2-core AMD EPYC one layer's gather of 4 rows x 576 keys and its SDPA call took
2.2-3.4 ms that way against 0.46-0.55 ms with the heap padded (SmolLM2-135M shapes, float32).

PyTorch's CPU tuning guide answers this by preloading jemalloc or tcmalloc; a running process cannot preload,
but it can ask glibc to keep what it frees (``mallopt``). This costs resident memory: up to `pad_bytes` x 2
of freed memory may stay with each malloc arena (the main one and one per thread that allocated), a small
share of a serving process's weights and KV pool. It changes settings of the whole process, so only the
process's owner calls it (the single-process serve command, once, at start-up); the library itself never
does, nor do the Ray Serve replicas yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
"""glibc's ceiling for ``M_MMAP_THRESHOLD`` on 64-bit systems (half its thread-arena heap size)."""

DEFAULT_HEAP_PAD = 64 * 1024 * 1024
MAX_HEAP_PAD = 512 * 1024 * 1024  # twice this still fits mallopt's int


def pad_heap(pad_bytes: int = DEFAULT_HEAP_PAD) -> bool:
    """Ask glibc's malloc to keep `pad_bytes` of free memory at the top of each heap and to serve allocations
    up to min(`pad_bytes`, 32 MiB) from the heap, not by fresh mappings. Returns whether it applied (False
    where the C library is not glibc: macOS, musl, Windows).

    Sets ``M_TOP_PAD`` = `pad_bytes`, ``M_TRIM_THRESHOLD`` = 2 x `pad_bytes` and ``M_MMAP_THRESHOLD``; setting
    them turns off glibc's dynamic thresholds for the life of the process.
    """
    if not 0 < pad_bytes <= MAX_HEAP_PAD:
        raise ValueError(f"pad_bytes must be in (0, {MAX_HEAP_PAD}], got {pad_bytes}")
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    settings = (
        (M_MMAP_THRESHOLD, min(pad_bytes, MMAP_THRESHOLD_MAX)),
        (M_TRIM_THRESHOLD, 2 * pad_bytes),
        (M_TOP_PAD, pad_bytes),
    )
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


def glibc_malloc() -> bool:
    """Whether this process's C library is glibc, so that `pad_heap` can apply."""
    return _glibc_mallopt() is not None


def _glibc_mallopt():
    """glibc's ``int mallopt(int, int)``, or None when the process does not run on glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
