"""`StepExecutor`: runs a `StepPlan` as it says, all or nothing, and reports what each request kept.

The plan decides everything (`engine.plan`, `engine.roles`); the executor runs it on the model through
`StepForwards` and reports a `StepResult`:

- a **packed** plan runs its decode rows and prompt chunks in one forward; when that fails, the step runs again
  apart (`engine.recovery`: decode rows, then each chunk alone, each forward tried twice, the cause isolated),
  and a model that cannot pack at all says so in the result (`packing_unsupported`);
- a plan **apart** runs as `engine.recovery.run_apart` says;
- a plan with **drafts** runs its decode rows with their drafts in one forward of ``1 + k`` positions a row
  (packed with the step's prompt chunks, if any): each row keeps the drafts the model agrees with and one
  token of its own after them (`speculative.verification`), and the cache drops the rest (`PagedCache.commit`
  with ``keep``). A speculative step that fails in any way (a forward, a pick, no blocks for the drafts) is
  dropped whole, every cache and sampling generator as it was, and the step runs again without drafts
  (`drafts_dropped`).

The masks of the plan's constrained rows are filled while the forward runs, each kind of constraint by its
own `MaskFiller`: a mask depends only on the tokens a row has before the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import PreTrainedModel

from ..cache.packed_caches import PackingUnsupported
from ..compiled import CompiledForward
from .constraints import Constraint, MaskFiller
from .forwards import StepForwards
from .plan import StepPlan
from .recovery import run_apart
from .request import Choice, Request
from .step_result import StepResult, StepTimes
from .token_choice import choose_for_chunk, choose_rows, verify_rows


class StepExecutor:
    """Runs `StepPlan`s on `model` and reports a `StepResult` for each: what each request of the plan kept, or
    why it failed."""

    def __init__(self, model: PreTrainedModel, compiled: CompiledForward | None = None):
        self.forwards = StepForwards(model, compiled)
        self.packed_steps = 0  # steps run as one packed forward so far
        self.times = StepTimes()  # replaced whole after each step: any thread may read it
        self._fillers: dict[Callable[[], MaskFiller], MaskFiller] = {}  # one per kind of constraint, made on use

    def run(self, plan: StepPlan) -> StepResult:
        """Run `plan` (its drafts dropped if the speculative step fails) and report what each request kept; the
        step's time is added to `times` whatever happens."""
        start = time.perf_counter()
        picked = None  # decode tokens kept, when drafts were verified (else one per row)
        try:
            self._prefill_masks(plan)
            result = self._run_speculative(plan) if plan.drafts is not None else None
            if result is not None:
                picked = len(plan.running) + sum(len(kept) for kept in result.accepted.values())
            else:
                result = self._run_plain(plan.without_drafts())
                result.drafts_dropped = plan.drafts is not None
        finally:
            seconds = time.perf_counter() - start + plan.drafting_seconds
            self.times = self.times.adding(plan, seconds, picked)
        result.seconds = seconds
        return result

    def idle(self) -> None:
        """Nothing runs (the loop waits, or ends): let the mask fills in flight end."""
        for filler in self._fillers.values():
            filler.wait()

    def _prefill_masks(self, plan: StepPlan) -> None:
        """Start filling the masks of the step's constrained rows, each kind by its own `MaskFiller`."""
        by_kind: dict[Callable[[], MaskFiller], list[tuple[Constraint, tuple[int, ...]]]] = {}
        for row in plan.constrained:
            by_kind.setdefault(row.constraint.mask_filler, []).append((row.constraint, row.generated))
        for kind, rows in by_kind.items():
            if kind not in self._fillers:
                self._fillers[kind] = kind()
            self._fillers[kind].start(rows)

    def _run_plain(self, plan: StepPlan) -> StepResult:
        """A plan without drafts: packed, or apart (also when the packed forward fails)."""
        unsupported = False
        if plan.packed:
            result = StepResult()
            try:
                self._run_packed(plan, result)
                return result
            except PackingUnsupported:
                unsupported = True
            except Exception:  # noqa: BLE001 (every cache is as it was: each part runs again on its own)
                pass
        result = StepResult(packing_unsupported=unsupported)
        run_apart(self.forwards, plan, result)
        return result

    def _run_packed(self, plan: StepPlan, result: StepResult) -> list[list[Choice]]:
        """The plan's decode rows and prompt chunks in one packed forward, their picks in `result`. With drafts,
        each decode row keeps what `verify_rows` keeps: returned, for the caller to put in `result`. Any failure
        propagates with every cache as it was."""
        running, drafts = plan.running, plan.drafts
        logits, chunk_rows, caches = self.forwards.packed(plan)  # [R, V]; every cache pending
        q = 1 + (drafts.k if drafts is not None else 0)  # positions per decode row
        kept: list[list[Choice]] = []
        try:
            if drafts is None:
                choose_rows(running, logits[: len(running)], result)
            elif running:
                kept = verify_rows(running, logits[: len(running) * q].unflatten(0, (len(running), q)), drafts)
            for chunk, rows in zip(plan.chunks, chunk_rows):
                choose_for_chunk(chunk, logits[rows], result)
        except BaseException:
            for cache in caches:
                cache.settle()
            raise
        for cache in caches:
            if cache is plan.running_cache and kept:
                cache.commit(keep=[len(choices) for choices in kept])
            else:
                cache.commit()
        self.packed_steps += 1
        return kept

    def _run_speculative(self, plan: StepPlan) -> StepResult | None:
        """The decode rows with their drafts verified in one forward (with the step's prompt chunks, packed),
        or None (every cache and every sampling generator as it was) when anything fails: the step then runs
        without drafts, and draws what it would have drawn."""
        sampling = [request for request in plan.choosing if request.config.do_sample]
        states = [request.generator.get_state() for request in sampling]
        result = self._try_speculative(plan)
        if result is None:
            for request, state in zip(sampling, states):
                request.generator.set_state(state)
        return result

    def _try_speculative(self, plan: StepPlan) -> StepResult | None:
        """`_run_speculative`, but for the generators."""
        cache, requests, drafts = plan.running_cache, plan.running, plan.drafts
        result = StepResult()
        if plan.packed:
            try:
                kept = self._run_packed(plan, result)
            except Exception:  # noqa: BLE001 (rolled back: the plain step isolates the cause, or stops packing)
                return None
            return _with_kept(result, requests, kept)
        try:
            logits = self.forwards.decode(cache, requests, drafts)  # [B, 1 + k, V]
        except Exception:  # noqa: BLE001 (rolled back by the cache: the plain step isolates the cause)
            return None
        try:
            kept = verify_rows(requests, logits, drafts)
        except Exception:  # noqa: BLE001 (a pick failed: the plain step fails that request alone)
            cache.settle()
            return None
        except BaseException:
            cache.settle()
            raise
        cache.commit(keep=[len(choices) for choices in kept])
        return _with_kept(result, requests, kept)


def _with_kept(result: StepResult, requests: list[Request], kept: list[list[Choice]]) -> StepResult:
    """`result` with each decode row's `kept` tokens: the drafts it kept, then its own token."""
    for request, choices in zip(requests, kept):
        result.accepted[request], result.choices[request] = choices[:-1], choices[-1]
    return result
