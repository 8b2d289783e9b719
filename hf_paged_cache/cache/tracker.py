"""`StepTracker`: the forward in flight on one cache, from its first layer until it is kept or rolled back."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .batch import PagedBatch
from .layer import PagedLayer
from .step import Step


class StepTracker:
    """When a cache's step begins, when it is complete, kept (committed) or rolled back, and what readers see.

    Each layer counts the positions it has seen (`PagedLayer.length`): a layer whose count already includes
    the step in progress is a new forward, so the step it finds was left by a failed one. A step is kept when
    the forward that made it ends well (the model's forward hook calls `forward_ended`), when its last layer
    has written it if no hook will report (a cache built from a config, a forward that skips the hook), or,
    with `manual_commit`, only on `commit`. Until then readers see `committed_length`, the positions before
    it. A forward that raises is rolled back by the hook at once; a ``KeyboardInterrupt``, which no hook sees,
    by the next change or by the next read on the thread it happened on (`settle_failed_here`).
    """

    def __init__(self, batch: PagedBatch, layers: Sequence[PagedLayer], manual_commit: bool):
        self.batch = batch
        self.layers = layers
        self.manual_commit = manual_commit

    def enter(self, layer: PagedLayer, batch_size: int, query_length: int, device: torch.device) -> Step:
        """The step `layer`'s update belongs to: the one in progress, or a new one that it begins."""
        step = self.batch.step
        if step is not None and layer.length == step.length:
            self.drop_unfinished()  # this layer already did the step in progress: a new forward began
            step = None
        if step is None:
            return self.batch.begin(layer.length, batch_size, query_length, device, len(self.layers))
        if layer.length != step.past_length:
            raise RuntimeError(
                f"layer {layer.layer_idx} has seen {layer.length} positions but the forward in progress runs from "
                f"{step.past_length}: every layer of the model must update the cache once per forward"
            )
        if (batch_size, query_length) != (step.batch_size, step.query_length):
            raise ValueError(
                f"layer {layer.layer_idx} got {batch_size} rows x {query_length} tokens but this forward began "
                f"with {step.batch_size} x {step.query_length}"
            )
        return step

    def leave(self, layer: PagedLayer, step: Step) -> None:
        """`layer` has written `step`; the last layer keeps it when no forward hook will report the end."""
        layer.length = step.length
        step.layers_done += 1
        if step.complete and not (step.commit_at_end or self.manual_commit):
            self.batch.commit()

    def forward_ended(self, failed: bool) -> None:
        """Keep the step a forward made (unless `manual_commit`), or roll it back when the forward raised."""
        step = self.batch.step
        if step is None:
            self.batch.pending.clear()  # the forward raised before its first layer
        elif failed or not step.complete:
            self.settle()
        elif step.commit_at_end and not self.manual_commit:
            self.batch.commit()

    def commit(self) -> None:
        step = self.batch.step
        if step is None:
            return
        if not step.complete:
            raise RuntimeError("the last forward on this cache did not finish: settle() it instead of commit()")
        self.batch.commit()

    def settle(self) -> None:
        """Roll back the step not committed, if any (complete or not)."""
        with self.batch.lock:
            if self.batch.step is not None:
                length = self.batch.rollback()
                for layer in self.layers:
                    layer.length = length

    def drop_unfinished(self) -> None:
        """Before a change: roll back a step left over by a failed forward; refuse to drop a pending one."""
        step = self.batch.step
        if step is not None and step.complete and self.manual_commit:
            raise RuntimeError(
                "this cache's last forward awaits commit() or settle() (manual_commit=True): call one of them "
                "before changing the cache or running the next forward"
            )
        self.settle()

    def settle_failed_here(self) -> None:
        """Before a read: roll back a step left over by a failed forward on this thread; other threads' reads
        change nothing."""
        step = self.batch.step
        if step is not None and step.thread == threading.get_ident() and not (self.manual_commit and step.complete):
            self.settle()

    def committed_length(self) -> int:
        """Positions the last kept step left (call under `batch.lock`)."""
        step = self.batch.step
        return step.past_length if step is not None else self.layers[0].length
