"""Admission with reservation: will the pool hold every request in flight at every step until each finishes?

Counting steps from the next one (``t = 1`` is the coming step), a request in flight stores at most one more
token per step, never more than ``max_length - 1`` tokens (its last token is never fed back), and gives its
blocks back after its last step. A `Lifetime` bounds that: ``blocks(min(base + t, top))`` tokens' worth at
step ``t`` up to its ``last`` step, nothing after. Stopping early (EOS, a stop string) only lowers the curve.

Summed over the requests still alive at ``t``, the blocks in flight can only grow between two last steps, so
the peak over every future step is the largest sum at some request's last step (`peak_blocks`). Admitting a
request only while that peak fits the pool means none is ever preempted, and a request admits as soon as the
pool can hold it beside the ones that will still be running, rather than beside every request at its longest
all at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedCache
    from ..pool.kv_pool import KVPool
    from .request import Request


@dataclass(frozen=True)
class Lifetime:
    """At most ``min(base + t, top)`` tokens stored at step ``t`` for ``1 <= t <= last``; none after ``last``."""

    base: int
    top: int
    last: int

    @classmethod
    def running(cls, tokens: int, max_length: int) -> Lifetime:
        """A decoding request with `tokens` tokens (its cache stores all but the last): one more per step."""
        return cls(base=tokens - 1, top=max(max_length - 1, tokens), last=max(max_length - tokens, 1))

    @classmethod
    def prefilling(cls, tokens: int, max_length: int, ready: int) -> Lifetime:
        """A request whose `tokens` (prompt, or prompt and tokens so far) are all stored by step `ready`.

        In step `ready` it picks its first new token and stores it in that step's decode; each step after
        stores one more, and the step that picks its ``max_length``-th token is its last.
        """
        return cls(base=tokens, top=max(max_length - 1, tokens), last=ready + max(max_length - tokens - 2, 0))


def peak_blocks(lifetimes: Sequence[Lifetime], block_size: int, cap: int) -> int:
    """The most blocks `lifetimes` hold together at any future step, each row at most `cap` blocks.

    `cap` is what one row can hold in the layer group: its sliding window's blocks, or the pool's capacity.
    """
    if not lifetimes:
        return 0
    base, top, last = (torch.tensor([getattr(life, name) for life in lifetimes]) for name in ("base", "top", "last"))
    steps = last.unique()  # [S] the steps after which some request is gone: the peak is at one of them
    tokens = torch.minimum(base.unsqueeze(0) + steps.unsqueeze(1), top.unsqueeze(0))  # [S, R]
    blocks = (-(-tokens // block_size)).clamp(max=cap)  # [S, R] ceil(tokens / block_size), at most cap
    alive = last.unsqueeze(0) >= steps.unsqueeze(1)  # [S, R]
    return int((blocks * alive).sum(dim=1).max())


def lifetimes_in_flight(
    running: Sequence[Request],
    prefilling: Sequence[tuple[Request, int]],
    request: Request,
    max_step_tokens: int,
    block_size: int,
) -> list[Lifetime]:
    """The lifetimes of the requests in flight and of `request` if it starts now, after the prefilling ones.

    `prefilling` pairs each prefilling request with its prompt tokens done; prompts are computed in order,
    `max_step_tokens` a step. The other choices of a prompt (its leader's followers) share the prompt's full
    blocks, so each counts only the blocks of its tokens past them.
    """
    lifetimes = [Lifetime.running(len(r.tokens), r.max_length) for r in running]
    queued = 0  # prompt tokens the prefill computes, in order, before each prefilling request is done
    for other, done in [*prefilling, (request, 0)]:
        tokens = len(other.tokens)
        queued += tokens - done
        ready = -(-queued // max_step_tokens) + 1  # it decodes from the step after its prompt is done
        lifetimes.append(Lifetime.prefilling(tokens, other.max_length, ready))
        shared = tokens // block_size * block_size  # tokens in the prompt's full blocks
        lifetimes += [
            Lifetime.prefilling(tokens - shared, follower.max_length - shared, ready) for follower in other.followers
        ]
    return lifetimes


def pool_holds(pool: KVPool, lifetimes: Sequence[Lifetime], caches: Sequence[PagedCache]) -> bool:
    """Whether each fixed layer group of `pool` can hold `lifetimes` at their peak, beside the blocks that
    caches other than `caches` (those of the requests in flight) hold on the pool."""
    for group, (blocks, layers) in enumerate(zip(pool.groups, pool.layer_groups)):
        if blocks.max_blocks is None:
            continue  # elastic: it grows
        in_flight = set().union(*(cache.batch.groups[group].unique_blocks() for cache in caches))
        held_elsewhere = blocks.num_used - len(in_flight)  # by other caches sharing the pool
        cap = min(layers.max_blocks_per_row(max(life.top for life in lifetimes), blocks.block_size), blocks.capacity)
        if peak_blocks(lifetimes, blocks.block_size, cap) > blocks.capacity - held_elsewhere:
            return False
    return True
