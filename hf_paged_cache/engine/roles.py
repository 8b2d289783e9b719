"""`StepRoles`: the rest of a step's decision, once the scheduler has picked its rows.

The scheduler decides which requests run (`Scheduler.plan`); `StepRoles.plan` completes the `StepPlan` with the
role of each row:

- **packed or apart**: the decode rows and prompt chunks run in one packed forward when the model can
  (``paged_sdpa``, `pack_steps`), there are chunks, more than one thing to pack, and no chunk reads images;
- **drafts**: the decode rows verify draft tokens when the `Speculator` expects that to pay (never beside
  prompt chunks unless the step is packed, since they must ride in one forward);
- **constrained**: every row that picks a token under a `Constraint` (structured outputs), so that its mask is
  filled while the forward runs.

After the step, `learn` takes what it taught: the drafts each row kept and what the step cost (the
speculator's acceptance and cost line), and whether the model turned out unable to pack.
"""

from __future__ import annotations

import time
from dataclasses import replace

from transformers import PreTrainedModel

from ..attention import PAGED_ATTENTION_NAMES
from ..cache.paged_cache import PagedCache
from ..speculative.speculator import Speculator
from .plan import Chunk, ConstrainedRow, StepPlan
from .request import Request
from .step_result import StepResult


class StepRoles:
    """Gives each row of a step its role (see the module docstring) and learns from what the step did."""

    def __init__(self, model: PreTrainedModel, pack_steps: bool = True, speculator: Speculator | None = None):
        self.pack_steps = pack_steps and model.config._attn_implementation in PAGED_ATTENTION_NAMES
        self.speculator = speculator  # drafts for decode steps (None: no speculative decoding)

    def plan(self, running: list[Request], running_cache: PagedCache, chunks: list[Chunk]) -> StepPlan:
        """The whole plan of a step of decode rows `running` (in `running_cache`'s row order) and `chunks`."""
        prompt_tokens = sum(len(chunk.tokens) for chunk in chunks)
        packed = self.pack_steps and bool(chunks) and (bool(running) or len(chunks) > 1)
        packed = packed and not any(chunk.reads_media for chunk in chunks)  # pixels ride in a forward of their own
        drafts, drafting = None, 0.0
        if self.speculator is not None and running and (not chunks or packed):
            start = time.perf_counter()
            drafts = self.speculator.drafts(running, prompt_tokens)
            drafting = time.perf_counter() - start
        plan = StepPlan(running, running_cache, chunks, packed=packed, drafts=drafts, drafting_seconds=drafting)
        constrained = tuple(ConstrainedRow(request, constraint, tuple(request.generated))
                            for request in plan.choosing for constraint in request.constraints)
        return replace(plan, constrained=constrained)

    def learn(self, plan: StepPlan, result: StepResult) -> None:
        """Take what the step of `plan` taught: the model cannot pack; the drafts each row kept and the cost of a
        decode step (a line fitted to decode steps that ran as planned, not to one run twice)."""
        if result.packing_unsupported:
            self.pack_steps = False
        if self.speculator is None or not plan.running:
            return
        verified = plan.drafts is not None and not result.drafts_dropped
        if verified:
            kept = [len(result.accepted.get(request, ())) for request in plan.running]
            self.speculator.verified(plan.running, plan.drafts, kept)
        if not plan.chunks and (plan.drafts is None or verified):
            self.speculator.costs.add(plan.positions if verified else len(plan.running), result.seconds)

    def release(self) -> None:
        """Nothing runs (the loop waits, or ends): give back what the drafts held for requests (draft caches)."""
        if self.speculator is not None:
            self.speculator.release()
