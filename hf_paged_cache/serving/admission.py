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

import torch


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
