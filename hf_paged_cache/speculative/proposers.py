"""Where draft tokens come from: a `Proposer` for one sequence's tokens (n-gram lookup, `NgramDrafts`), and a
`DraftSource` for all the rows of a decode step at once (`OwnTokens`, one proposer per row; or a draft model,
`hf_paged_cache.speculative.draft_model`).

A row is anything with the tokens it has so far (`DraftRow`): the engine's requests are, and so is a list of ids
in a loop of your own, wrapped: nothing here knows the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol


class DraftRow(Hashable, Protocol):
    """What a draft source reads of a decode row: its prompt and output so far (which only grow), its last token
    and the most tokens it may reach. The engine's `Request` is one."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def generated(self) -> list[int]: ...

    @property
    def max_length(self) -> int: ...


class Proposer(Protocol):
    """Where one request's drafts come from: a function of its tokens so far."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


class DraftSource(Protocol):
    """Where a decode step's drafts come from, for all its rows at once.

    Drafts only decide how far a step verifies: every position is picked as it would be without them (a sampled
    request with its own generator), so they change no token. `proposes_as_asked`: the source always proposes as
    many tokens as it is asked for (a draft model), so the speculator chooses how many before asking, not after
    seeing what it finds.
    """

    proposes_as_asked: bool

    def propose(self, requests: Sequence[DraftRow], limits: Sequence[int]) -> list[list[int]]:
        """Up to `limits[b]` tokens to follow the tokens of ``requests[b]`` (the step's rows, in order)."""
        ...

    def keep_only(self, requests: Sequence[DraftRow]) -> None:
        """Let go of what is held for any request not in `requests` (those still running)."""
        ...


class NgramDrafts:
    """Draft tokens from one request's own tokens: n-gram prompt lookup.

    Keeps, for every n-gram of `min_n` to `max_n` tokens, where it last ended, updated as tokens come (each
    token is indexed once): proposing is a few dictionary lookups whatever the length.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._indexed = 0  # tokens whose n-grams ending there are in `_last_end`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens` (the request's prompt and output so far, which only grow)."""
        self._index(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end : end + k])
        return []

    def _index(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that end before the last token (the suffix itself is never its own match)."""
        for end in range(max(self._indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last_end[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))


class OwnTokens:
    """Drafts from each request's own tokens: one `Proposer` per running request (n-gram lookup by default)."""

    proposes_as_asked = False

    def __init__(self, proposer: Callable[[], Proposer] = NgramDrafts):
        self.proposer = proposer  # makes each new request's `Proposer`
        self._rows: dict[DraftRow, Proposer] = {}

    def propose(self, requests: Sequence[DraftRow], limits: Sequence[int]) -> list[list[int]]:
        proposals = []
        for request, limit in zip(requests, limits):
            proposer = self._rows.get(request)
            if proposer is None:
                proposer = self._rows[request] = self.proposer()
            proposals.append(proposer.propose(request.tokens, limit) if limit > 0 else [])
        return proposals

    def keep_only(self, requests: Sequence[DraftRow]) -> None:
        self._rows = {r: self._rows[r] for r in requests if r in self._rows}
