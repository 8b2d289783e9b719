"""The step plan is the whole decision: every row's role is in it (decode, prefill chunk, drafts to verify,
constrained, packed or not), the executor runs it as it says, and ``repr`` prints it. Structured outputs reach
the engine only through `Constraint`: a backend of a few lines (here, one that allows a set of tokens) runs
in the batcher as the grammar processor does."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from batcher_helpers import assert_pool_empty, wait_until
from tiny_models import tiny_model

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.engine.constraints import Constraint
from hf_paged_cache.engine.executor import StepExecutor
from hf_paged_cache.engine.plan import StepPlan
from hf_paged_cache.speculative import DraftModel, Drafts, Speculator


class Fills:
    """A `MaskFiller` that records what it was asked to fill (the masks are computed when asked for)."""

    started: list[list[tuple[int, ...]]] = []

    def start(self, rows: Sequence[tuple[Constraint, Sequence[int]]]) -> None:
        Fills.started.append([tuple(generated) for _, generated in rows])

    def wait(self) -> None:
        pass


class OneOf:
    """A constraint backend in one class: the answer is `length` tokens, each one of `allowed`."""

    mask_filler = Fills

    def __init__(self, allowed: set[int], length: int):
        self.allowed, self.length = allowed, length
        self.followed: list[tuple[int, ...]] = []

    def mask(self, generated: Sequence[int], vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        if len(generated) < self.length and all(token in self.allowed for token in generated):
            mask[sorted(self.allowed)] = True
        return mask

    def follow(self, generated: Sequence[int]) -> bool:
        self.followed.append(tuple(generated))
        return all(token in self.allowed for token in generated)

    def is_complete(self, generated: Sequence[int]) -> bool:
        return len(generated) >= self.length


def planned_steps(monkeypatch) -> list[StepPlan]:
    plans: list[StepPlan] = []
    run = StepExecutor.run

    def spy(self, plan):
        plans.append(plan)
        return run(self, plan)

    monkeypatch.setattr(StepExecutor, "run", spy)
    return plans


def test_a_plan_names_every_rows_role_and_prints_it(monkeypatch):
    plans = planned_steps(monkeypatch)
    model = tiny_model("llama")
    loop = [5, 6, 7, 8] * 6
    constraint = OneOf({11, 12, 13}, length=6)
    speculator = Speculator(3, adaptive=False, source=DraftModel(model, block_size=4))  # the model drafts for itself
    with ContinuousBatcher(model, num_blocks=64, block_size=4, max_step_tokens=8, speculative=speculator) as batcher:
        first = batcher.submit(loop, max_new_tokens=40, do_sample=False)
        wait_until(lambda: batcher.stats().steps.decode_steps > 0)  # it decodes, drafted by the model itself
        handles = [first, batcher.submit(loop, max_new_tokens=12, do_sample=False),
                   batcher.submit([9] * 20, max_new_tokens=8, do_sample=False, logits_processor=[constraint])]
        outputs = [handle.result() for handle in handles]
        assert_pool_empty(batcher)
    assert len(outputs[2]) == 6 and set(outputs[2]) <= {11, 12, 13}  # held to the constraint, ended by it
    assert constraint.followed[-1] == tuple(outputs[2])  # kept in step with the tokens each step kept
    assert Fills.started and all(len(rows) >= 1 for rows in Fills.started)  # its masks filled ahead of each pick

    assert any(plan.drafts is not None and not plan.chunks for plan in plans)  # decode steps verify drafts
    mixed = [plan for plan in plans if plan.running and plan.chunks]
    assert mixed and all(plan.packed for plan in mixed)  # decode rows and chunks in one forward
    constrained = [plan for plan in plans if plan.constrained]
    assert constrained and all(row.constraint is constraint for plan in constrained for row in plan.constrained)
    text = repr(next(plan for plan in mixed if plan.drafts is not None))
    assert text.startswith("StepPlan(packed, 1 decode rows, ")
    assert "decode  row 0: request" in text and "verifies [" in text and "prefill request" in text
    assert "constrained" in repr(constrained[-1])


def test_a_plan_cannot_verify_drafts_beside_chunks_it_does_not_pack():
    model = tiny_model("llama")
    with ContinuousBatcher(model, num_blocks=16) as batcher:
        with pytest.raises(ValueError, match="packed"):
            StepPlan([], batcher.running_cache, [object()], packed=False, drafts=Drafts([[1]], [1]))
