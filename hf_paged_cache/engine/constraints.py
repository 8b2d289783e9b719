"""What the engine asks of a row held to a structured output (`Constraint`), whatever engine computes it.

A constraint says which tokens may follow a row's generated tokens. The engine knows nothing of grammars: it
asks a row's constraint for its mask when the row picks a token (`Request.pick`), brings it to the tokens a
step kept (`follow`: forward by the tokens kept, back past the drafts a step did not keep, or a step dropped
whole), and has the masks of a step's constrained rows filled while its forward runs, by the constraint's own
`mask_filler`. The state a backend keeps is a function of the tokens it was brought to, so a retried pick, a
dropped step or a preempted and recomputed request all see the mask of their own tokens.

llguidance is the backend today (`hf_paged_cache.structured.processor.GrammarLogitsProcessor`, whose filler is
`hf_paged_cache.structured.mask_prefetch.MaskPrefetch`); another grammar engine is one module implementing
these two protocols.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


class MaskFiller(Protocol):
    """Fills the masks of many constrained rows ahead of the step that asks for them, off the loop's thread."""

    def start(self, rows: Sequence[tuple[Constraint, Sequence[int]]]) -> None:
        """Start filling the mask of each ``(constraint, generated tokens)``; a `Constraint.mask` call for the
        same tokens waits for it and takes it. Nothing depends on it: a mask it did not fill is filled then."""
        ...

    def wait(self) -> None:
        """Until the fill in flight (if any) has ended."""
        ...


@runtime_checkable
class Constraint(Protocol):
    """A row's structured-output constraint, as the engine sees it.

    `mask_filler` makes the `MaskFiller` of this kind of constraint (the engine keeps one per kind and hands it
    every row of its kind at each step).
    """

    mask_filler: Callable[[], MaskFiller]

    def mask(self, generated: Sequence[int], vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens that may follow `generated` (none when `generated` left it)."""
        ...

    def follow(self, generated: Sequence[int]) -> bool:
        """Bring the constraint to exactly `generated`: forward by the tokens a step kept, back past drafts it
        did not keep; False when they leave it."""
        ...

    def is_complete(self, generated: Sequence[int]) -> bool:
        """Whether `generated` completes it, with nothing allowed to follow (the row stops)."""
        ...
