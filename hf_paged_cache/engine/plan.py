"""`StepPlan`: the whole decision for one step of the engine, which the executor runs as it says.

The scheduler picks the step's rows (`Scheduler.plan`: a decode row for every running request, the prompt
chunks the token budget allows); `StepRoles` (`engine.roles`) gives them the rest of their roles: whether the
step runs as one packed forward, the draft tokens each decode row verifies, and which rows pick under a
constraint. The executor decides nothing: it runs the plan, and falls back to smaller forwards only when the
planned one fails (`engine.recovery`). ``repr(plan)`` prints every row and its role, so a failing test shows
the step that failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..cache.paged_cache import PagedCache
from ..speculative.speculator import Drafts
from .constraints import Constraint
from .request import Request


@dataclass(frozen=True)
class Chunk:
    """`tokens` of a request's prompt (prompt and tokens so far, after a preemption) from index `start`."""

    request: Request
    cache: PagedCache  # the request's own cache, holding its first `start` tokens
    start: int
    tokens: list[int]

    @property
    def reads_media(self) -> bool:
        """Whether the chunk's forward reads its request's images (it starts before their end)."""
        return self.request.media is not None and self.start < self.request.media.end

    @property
    def finishes(self) -> bool:
        """Whether this chunk completes the prompt (the step then picks the request's next token)."""
        return self.start + len(self.tokens) == len(self.request.tokens)


@dataclass(frozen=True)
class ConstrainedRow:
    """A row that picks a token in the step under `constraint`, after its `generated` tokens: its mask is filled
    while the forward runs."""

    request: Request
    constraint: Constraint
    generated: tuple[int, ...]


@dataclass(frozen=True, repr=False)
class StepPlan:
    """One step: a decode row for every running request, the prompt chunks the token budget allows, and how
    they run.

    Attributes:
        running: the decode rows, in the order of the running cache's rows.
        running_cache: the cache holding one row per running request.
        chunks: prompt chunks, oldest request first, each in its request's own cache.
        packed: the decode rows and the chunks run in one packed forward (`cache.packed_forward`); else the
            decode rows in one forward, then each chunk in one of its own.
        drafts: the draft tokens each decode row verifies (``drafts.tokens[b]`` for ``running[b]``), or None:
            one token per row.
        constrained: the rows that pick a token under a constraint (structured outputs), with the tokens their
            masks are for.
        drafting_seconds: what proposing the drafts took (a draft model's forwards), counted in the step's time.
    """

    running: list[Request]
    running_cache: PagedCache
    chunks: list[Chunk]
    packed: bool = False
    drafts: Drafts | None = None
    constrained: tuple[ConstrainedRow, ...] = field(default=())
    drafting_seconds: float = 0.0  # what proposing the drafts took (counted in the step's time)

    def __post_init__(self) -> None:
        if self.drafts is not None and self.chunks and not self.packed:
            raise ValueError("a step whose decode rows carry drafts runs its prompt chunks packed with them")

    @property
    def choosing(self) -> list[Request]:
        """The requests that pick a token in this step: every running one, and each choice of a prompt whose
        last chunk this step computes."""
        return [*self.running, *(member for chunk in self.chunks if chunk.finishes for member in chunk.request.group)]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step computes."""
        return sum(len(chunk.tokens) for chunk in self.chunks)

    @property
    def positions(self) -> int:
        """Positions the planned forward computes: each decode row's token and drafts, and the prompt tokens."""
        return len(self.running) * (1 + (self.drafts.k if self.drafts else 0)) + self.prompt_tokens

    def without_drafts(self) -> StepPlan:
        """The same step with one token per decode row (what runs when a speculative step is dropped)."""
        return replace(self, drafts=None)

    def __repr__(self) -> str:
        constrained = {row.request for row in self.constrained}
        kind = "packed" if self.packed else "apart"
        drafts = f", {self.drafts.k} drafts a row" if self.drafts else ""
        lines = [f"StepPlan({kind}, {len(self.running)} decode rows, {len(self.chunks)} prompt chunks "
                 f"({self.prompt_tokens} tokens){drafts}, {len(constrained)} constrained)"]
        for row, request in enumerate(self.running):
            line = f"  decode  row {row}: request {request.id} at {len(request.tokens)} tokens"
            if self.drafts:
                tokens, proposed = self.drafts.tokens[row], self.drafts.proposed[row]
                line += f", verifies {tokens} ({proposed} proposed)"
            lines.append(line + (", constrained" if request in constrained else ""))
        for chunk in self.chunks:
            end, total = chunk.start + len(chunk.tokens), len(chunk.request.tokens)
            line = f"  prefill request {chunk.request.id}: tokens {chunk.start}..{end} of {total}"
            if chunk.finishes:
                picks = len(chunk.request.group)
                line += f", finishes ({picks} choice{'s' if picks > 1 else ''} pick)"
            lines.append(line + (", constrained" if chunk.request in constrained else ""))
        return "\n".join(lines)
