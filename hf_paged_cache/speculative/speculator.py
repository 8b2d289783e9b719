"""`Speculator`: which draft tokens each decode step of the engine verifies, and whether it pays.

On a CPU a decode step reads every weight once whatever the number of rows, so a step of 1 + k positions per row costs
little more than a step of one. A row that carries k draft tokens has them verified in one forward (the engine's
executor; the rule is `speculative.verification`): the longest prefix the model agrees with is kept, with one token of
the model's own after it, so a step yields between 1 and k + 1 tokens per row and the output is the output without
speculation.

Drafts come from a `DraftSource` (`speculative.proposers`), asked for all of a step's rows at once. By default, from
each request's own tokens (`OwnTokens` of `NgramDrafts`, n-gram prompt lookup): the longest suffix of `max_n` down to
`min_n` tokens that occurred before, and the tokens that followed its latest occurrence. Answers that repeat their input
(summaries, edits, quotes, code) are where it pays. A smaller model with the same tokenizer drafts from its own greedy
continuation (`hf_paged_cache.speculative.draft_model.DraftModel`).

Whether a step speculates, and how far (`Speculator.drafts`), is decided from two things measured as the
batcher runs: each request's recent acceptance (the share of its drafts the model kept, `RowState`), and what
a decode step costs by the positions it computes (`StepCosts`, a line fitted to the step times). The step
drafts ``K`` tokens per row for the ``K`` (0 to `max_tokens`) that maximises the expected tokens per second;
``K = 0`` is a plain decode step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .proposers import DraftRow, DraftSource, OwnTokens

logger = logging.getLogger(__name__)

DEFAULT_SPECULATIVE_TOKENS = 4
PRIOR_ACCEPTANCE = 0.5  # a request's acceptance before any of its drafts was verified
ACCEPTANCE_MEMORY = 0.7  # weight of the past in a request's acceptance (an exponential moving average)
COST_SAMPLES = 256  # decode steps the cost model remembers


@dataclass
class RowState:
    """What the speculator knows of one running request: its recent acceptance."""

    acceptance: float = PRIOR_ACCEPTANCE  # expected share of a draft token the model keeps

    def expected_kept(self, k: int) -> float:
        """Draft tokens expected kept of `k` proposed: each is kept only if all before it were."""
        return sum(self.acceptance ** j for j in range(1, k + 1))


class StepCosts:
    """What a decode step costs by the positions it computes: a line ``seconds = a + b x positions`` fitted by
    least squares to the last `COST_SAMPLES` steps."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)

    def add(self, positions: int, seconds: float) -> None:
        self._samples.append((positions, seconds))

    def has(self, positions: int) -> bool:
        return any(p == positions for p, _ in self._samples)

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``, or None before two step sizes were seen."""
        n = len(self._samples)
        xs = [p for p, _ in self._samples]
        if n < 2 or min(xs) == max(xs):
            return None
        mean_x, mean_y = sum(xs) / n, sum(s for _, s in self._samples) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        b = sum((x - mean_x) * (s - mean_y) for x, s in self._samples) / sxx
        return max(mean_y - b * mean_x, 1e-6), max(b, 0.0)


@dataclass(frozen=True)
class Drafts:
    """One step's draft tokens: `tokens[b]` for row ``b``, all `k` long (those past `proposed[b]` are filler,
    verified like drafts but not counted as proposed)."""

    tokens: list[list[int]]
    proposed: list[int]

    @property
    def k(self) -> int:
        return len(self.tokens[0])


@dataclass(frozen=True)
class SpeculationStats:
    """Draft tokens the batcher's steps proposed and kept, and the steps that verified them."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class Speculator:
    """Chooses each decode step's drafts (`drafts`) and learns from what the step kept (`verified`).

    `source` (default: `OwnTokens`, n-gram lookup) proposes the drafts. A step whose source fails in any way
    runs without drafts.
    """

    def __init__(
        self,
        max_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
        adaptive: bool = True,
        source: DraftSource | None = None,
    ):
        if max_tokens < 1:
            raise ValueError(f"speculative tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.adaptive = adaptive  # False: every step drafts as far as the proposals reach (tests, experiments)
        self.source: DraftSource = source if source is not None else OwnTokens()
        self.costs = StepCosts()
        self.stats = SpeculationStats()  # replaced whole after each step: any thread may read it
        self._rows: dict[DraftRow, RowState] = {}

    def drafts(self, requests: Sequence[DraftRow], prompt_tokens: int = 0) -> Drafts | None:
        """Draft tokens for a step of the decode rows `requests` (the running rows, in order) and
        `prompt_tokens` tokens of prompt chunks, or None when a plain step is expected to yield more tokens per
        second (or the cost of a plain step is not known yet)."""
        self._rows = {r: self._rows.get(r) or RowState() for r in requests}
        self.source.keep_only(requests)
        # drafts past a request's longest could never be kept
        limits = [max(0, min(self.max_tokens, r.max_length - len(r.tokens) - 1)) for r in requests]
        try:
            if self.source.proposes_as_asked:
                k = self._best_k(requests, limits, prompt_tokens)
                proposals = self.source.propose(requests, [min(k, limit) for limit in limits]) if k else []
            else:
                proposals = self.source.propose(requests, limits)
                k = self._best_k(requests, [len(p) for p in proposals], prompt_tokens)
        except Exception:  # noqa: BLE001 (drafts are an optimisation: the step runs plainly)
            logger.warning("drafting failed; the step runs without drafts", exc_info=True)
            return None
        if not k:
            return None
        tokens = [(p + [p[-1] if p else r.generated[-1]] * k)[:k] for r, p in zip(requests, proposals)]
        return Drafts(tokens, [min(len(p), k) for p in proposals])

    def release(self) -> None:
        """Let go of everything the draft source holds for requests (nothing runs)."""
        self._rows = {}
        self.source.keep_only([])

    def _best_k(self, requests: Sequence[DraftRow], lengths: Sequence[int], prompt_tokens: int = 0) -> int:
        """The drafts per row (row ``b`` has at most `lengths[b]`) that maximise the expected decode tokens
        per second of a step that also computes `prompt_tokens` (0: none)."""
        longest = max(lengths)
        rows = len(requests)
        if not longest or not self.adaptive:
            return longest
        line = self.costs.line()
        if line is None:  # measure a plain step first, then a speculative one
            return 0 if not self.costs.has(rows + prompt_tokens) else longest
        a, b = line
        best, best_rate = 0, rows / (a + b * (rows + prompt_tokens))
        for k in range(1, longest + 1):
            kept = sum(self._rows[r].expected_kept(min(k, length)) for r, length in zip(requests, lengths))
            rate = (rows + kept) / (a + b * (rows * (1 + k) + prompt_tokens))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verified(self, requests: Sequence[DraftRow], drafts: Drafts, kept: Sequence[int]) -> None:
        """Learn from a step that kept `kept[b]` of row ``b``'s drafts (verified ones only, fillers included)."""
        proposed = accepted = 0
        for request, count, keep in zip(requests, drafts.proposed, kept):
            if count:
                state = self._rows[request]
                tried = min(keep + 1, count)  # drafts the model judged: those kept and the first it did not
                share = min(keep, count) / tried
                state.acceptance = ACCEPTANCE_MEMORY * state.acceptance + (1 - ACCEPTANCE_MEMORY) * share
                proposed, accepted = proposed + count, accepted + min(keep, count)
        s = self.stats
        self.stats = SpeculationStats(s.steps + 1, s.draft_tokens + proposed, s.accepted_tokens + accepted)
