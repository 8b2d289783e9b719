"""The verification rule of speculative decoding: which of a row's draft tokens a step keeps.

A step computes the logits of a row's last token and of each of its ``k`` drafts. Position ``j`` is picked as
it would be without drafts (greedy, or sampled with the row's own generator, after the picks kept before it);
the drafts are kept while each pick is the draft it verifies, and the first pick that differs (or the pick
after the last draft) is the row's own token. So a step keeps between 1 and ``k + 1`` tokens and changes none:
the output is the output without speculation, and a sampled draft is kept with probability ``p(draft)``, as
speculative sampling's rule keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class Pick(Protocol):
    """A token picked at one position, and whether the row stops there."""

    token: int
    finished: bool


P = TypeVar("P", bound=Pick)


def kept_picks(drafts: Sequence[int], pick: Callable[[int, Sequence[P]], P]) -> list[P]:
    """The picks a row keeps of a step that verified `drafts`: ``pick(j, kept)`` picks position ``j`` after the
    picks `kept` before it; the row goes on while a pick is the draft it verifies and does not stop the row."""
    kept: list[P] = []
    for position, draft in enumerate([*drafts, None]):
        choice = pick(position, kept)
        kept.append(choice)
        if choice.finished or choice.token != draft:
            break
    return kept
