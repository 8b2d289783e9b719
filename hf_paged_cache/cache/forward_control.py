"""`ForwardControl`: how the model's hooks and an engine steer the forward in flight on a `PagedCache`.

The model's forward hook reports each forward's end (`forward_ended`) and may have it computed once per distinct
row (`computes_repeats_once`, `repeat_rows_after_forward`); an engine with ``manual_commit`` keeps or drops a
complete forward itself (`commit`, `settle`) and marks its drafts (`expect_drafts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .forward_lifecycle import ForwardLifecycle


class ForwardControl:
    """The forward-steering half of `PagedCache` (a mixin: the cache holds the lifecycle)."""

    lifecycle: ForwardLifecycle
    _rows_after_forward: torch.Tensor | None
    batch_size: int  # the cache's rows (`PagedCache.batch_size`)
    refuse_with_states: Callable[[str], None]  # `StateAccess.refuse_with_states`

    def computes_repeats_once(self) -> bool:
        """Whether the next forward may compute each distinct row of a batch whose rows repeat each other once
        (`generate` repeats every prompt for beams and samples; the model's hooks then cut the forward to the
        distinct rows and repeat its logits and this cache's rows after it): an empty cache that keeps its
        forwards itself (not `manual_commit`)."""
        return self.batch_size == 0 and not self.lifecycle.manual_commit

    def repeat_rows_after_forward(self, rows: torch.Tensor) -> None:
        """The running forward computes only distinct rows: when it has ended well, row ``i`` of the batch its
        caller gave becomes computed row ``rows[i]`` ``[B]``, sharing its blocks (`take_rows_after_forward`)."""
        self._rows_after_forward = rows

    def take_rows_after_forward(self) -> torch.Tensor | None:
        """The running forward's `repeat_rows_after_forward` rows (None when it computes every row); forgets them."""
        rows, self._rows_after_forward = self._rows_after_forward, None
        return rows

    def forward_ended(self, failed: bool) -> None:
        """Called by the model's forward hook when a forward on this cache ends: keeps the forward it made (with
        `manual_commit`, it waits for `commit()`), or rolls it back when the forward raised anywhere."""
        self.lifecycle.forward_ended(failed)

    def commit(self, keep: Sequence[int] | None = None) -> None:
        """Keep the forward of the last forward (with `manual_commit`; other caches commit by themselves); with
        `keep`, only each row's first ``keep[b]`` new tokens (the rest are drafts: `expect_drafts`).

        Nothing to do when no forward is pending. Raises `RuntimeError` if the last forward did not finish.
        """
        self.lifecycle.commit(keep)

    def expect_drafts(self, drafts: int) -> None:
        """The next forward's last `drafts` new tokens per row are drafts `commit(keep=...)` may drop
        (`NotImplementedError` for a model with conv / recurrent states: they cannot give back rejected drafts)."""
        if drafts:
            self.refuse_with_states("drafts")
        self.lifecycle.expect_drafts(drafts)

    def settle(self) -> None:
        """Roll back the forward not committed, if any: one that a failed forward left unfinished or, with
        `manual_commit`, a complete one awaiting `commit()`. Nothing otherwise.

        Failed forwards are rolled back by themselves; call this to drop a pending forward (`manual_commit`).
        """
        self.lifecycle.settle()
