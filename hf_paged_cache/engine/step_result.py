"""What came of one step (`StepResult`), request by request, and the steps a batcher ran (`StepTimes`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..errors import PoolExhaustedError
from .logprobs import TokenLogprob
from .plan import StepPlan
from .request import Choice, Request


@dataclass
class StepResult:
    """What a step kept, request by request. A request of the plan in none of these did not run this step and
    is exactly as it was (its cache too)."""

    choices: dict[Request, Choice] = field(default_factory=dict)  # the token each picked, kept
    # draft tokens a speculative step verified and kept, which come before the request's token in `choices`
    accepted: dict[Request, list[Choice]] = field(default_factory=dict)
    kept: set[Request] = field(default_factory=set)  # prompt chunks computed and kept (the prompt goes on)
    # prompt log-probabilities computed (for prompt tokens `first`, `first + 1`, ...), kept with the chunk
    prompt_logprobs: dict[Request, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    failures: dict[Request, BaseException] = field(default_factory=dict)  # requests that fail, each alone
    exhausted: dict[Request, PoolExhaustedError] = field(default_factory=dict)  # chunks that found no blocks
    decode_exhausted: PoolExhaustedError | None = None  # the decode rows found no blocks (none ran)
    drafts_dropped: bool = False  # the plan's drafts were dropped (the step ran again without them)
    packing_unsupported: bool = False  # the model cannot run a packed forward (the step ran apart)
    seconds: float = 0.0  # wall time of the step: forwards, token choice and commit


@dataclass(frozen=True)
class StepTimes:
    """The steps a batcher ran and the wall time they took (forward, token choice and commit), by kind: decode
    steps (running rows only) and prompt steps (prompt chunks, with the running rows when the step is packed)."""

    decode_steps: int = 0
    decode_rows: int = 0  # the tokens the decode steps picked (one per row, and the drafts a row kept)
    decode_seconds: float = 0.0
    prompt_steps: int = 0
    prompt_tokens: int = 0  # prompt tokens the prompt steps computed
    prompt_seconds: float = 0.0

    def adding(self, plan: StepPlan, seconds: float, picked: int | None = None) -> StepTimes:
        """These times and one more step, of `plan`, that took `seconds` (a decode step that `picked` tokens:
        by default one per row)."""
        if plan.chunks:
            return replace(
                self, prompt_steps=self.prompt_steps + 1, prompt_seconds=self.prompt_seconds + seconds,
                prompt_tokens=self.prompt_tokens + plan.prompt_tokens,
            )
        return replace(
            self, decode_steps=self.decode_steps + 1, decode_seconds=self.decode_seconds + seconds,
            decode_rows=self.decode_rows + (len(plan.running) if picked is None else picked),
        )

    def since(self, earlier: StepTimes) -> StepTimes:
        """The steps run between `earlier` (a snapshot of the same batcher's times) and these."""
        return StepTimes(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))
