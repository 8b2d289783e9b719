"""Paged attention as one opaque operator, so that a compiled forward is one graph around it.

A compiled forward (`compiled.forward.CompiledForward`) runs the model with no cache argument: Dynamo cannot trace
a `PagedCache`'s Python (block tables, the pool's free lists). Each attention layer instead calls
``torch.ops.hf_paged_cache.running_cache_attention`` on its new queries, keys and values. The operator's body runs
eagerly: it stores the keys and values in the cache of the forward running on this thread (`running_cache`) and
attends from the pool, as ``paged_sdpa`` does in an eager forward. Inductor sees a function of tensors with a known
output shape, and compiles everything between two such calls (norms, rotary, residual adds, activations) into one
graph; packed linear layers are operators of their own (`kernels.packed_linear`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import Cache

from ..attention.paged_sdpa import attend_from_pool
from ..attention.reads import PAGED_INPUTS


@dataclass
class RunningForward:
    """The cache a compiled forward on this thread stores into, and how many attention calls it served."""

    cache: Cache  # a `PagedCache` built from the model
    attended: int = 0


class _Running(threading.local):
    forward: RunningForward | None = None


_running = _Running()  # per thread: each thread runs its own forwards


@contextmanager
def running_cache(cache: Cache) -> Iterator[RunningForward]:
    """Make `cache` the one this thread's `running_cache_attention` calls store into, for the ``with`` block."""
    if _running.forward is not None:
        raise RuntimeError("a compiled forward is already running on this thread")
    _running.forward = RunningForward(cache)
    try:
        yield _running.forward
    finally:
        _running.forward = None


def running_cache_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    decode: str,
) -> torch.Tensor:
    """Store layer `layer_idx`'s new `key`/`value` ``[B, Hkv, q, D]`` in the running cache and attend `query`
    ``[B, Hq, q, D]`` from the pool; returns ``[B, q, Hq, Dv]``."""
    running = _running.forward
    if running is None:
        raise RuntimeError("running_cache_attention was called outside a compiled forward (running_cache)")
    attention_kwargs: dict = {}
    running.cache.update(key, value, layer_idx, kwargs=attention_kwargs)
    running.attended += 1
    paged = attention_kwargs.get(PAGED_INPUTS)
    if paged is None:
        raise RuntimeError(f"{type(running.cache).__name__} did not lay out attention from its pool")
    return attend_from_pool(query, paged, scaling, softcap, sinks, decode=decode).contiguous()


# the low-level API: `torch.library.custom_op`'s wrapper costs ~35 us a call
_LIBRARY = torch.library.Library("hf_paged_cache", "FRAGMENT")
_LIBRARY.define("running_cache_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float? scaling, "
                "float? softcap, Tensor? sinks, str decode) -> Tensor")
_LIBRARY.impl("running_cache_attention", running_cache_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged_cache::running_cache_attention", lib=_LIBRARY)
def _(query, key, value, layer_idx, scaling, softcap, sinks, decode) -> torch.Tensor:
    batch, heads, length, _ = query.shape
    return query.new_empty(batch, length, heads, value.shape[-1])
