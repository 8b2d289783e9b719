"""`ForwardLifecycle`: the forward in flight on one cache, from its first layer until it is kept or rolled back."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ..attention.paged_sdpa import PAGED_ATTENTION_NAMES
from .batch import PagedBatch
from .block_table import BlockTables, RowsView
from .forward import Forward, SlotIndex, build_index, keep_from, prefix_token_ids, take_group_blocks
from .inputs import PendingInputs, forward_running, repeated_rows
from .layer import PagedLayer
from .row_states import RowStates


class ForwardLifecycle:
    """The forwards on one cache's rows (`batch`), each one forward: when it begins, when it is complete, kept
    (committed) or rolled back, and what readers see meanwhile.

    The first layer of a forward lays it out (`begin`: blocks for the real new tokens in every group, all or
    nothing), every layer writes and reads through its group's slot index (`index`), and the forward is kept
    (`commit`) once it is complete. Until then `rollback` restores the rows, their blocks and reference counts
    exactly as they were (`PagedBatch.savepoint`), so a forward that fails at any layer leaves no trace.

    Each layer counts the positions it has seen (`PagedLayer.length`): a layer whose count already includes
    the forward in progress is a new forward, so the forward it finds was left by a failed one. A forward is kept when
    the forward that made it ends well (the model's forward hook calls `forward_ended`), when its last layer
    has written it if no hook will report (a cache built from a config, a forward that skips the hook), or,
    with `manual_commit`, only on `commit`. Until then readers see `committed` rows and `committed_length`,
    the positions before it. A forward that raises is rolled back by the hook at once; a ``KeyboardInterrupt``,
    which no hook sees, by the next change or by the next read on the thread it happened on
    (`settle_failed_here`); a read from inside the model's forward, still running (`forward_running`), changes
    nothing.

    When a first forward's rows repeat each other (``generate`` repeats each prompt for
    ``num_return_sequences`` and ``num_beams``), each distinct row is stored once and its repeats share its
    blocks. Sliding-window groups keep only what their next queries can see, except while the batch's
    `record_past` is set (transformers sets it before forwards it may `crop`): then forwards keep every block and
    `PagedBatch.truncate` trims.

    A forward's last new tokens may be drafts (speculative decoding: `expect_drafts` before it): `commit` then
    keeps each row's first ``keep[b]`` new tokens and drops the rest before any block of the forward is registered,
    so nothing unverified is ever found by prefix; sliding windows keep what the shortest outcome needs.
    """

    def __init__(
        self,
        batch: PagedBatch,
        layers: Sequence[PagedLayer],
        manual_commit: bool,
        model: PreTrainedModel | None = None,
    ):
        self.batch = batch
        self.layers = layers
        self.token_layers = [layer for layer in layers if isinstance(layer, PagedLayer)]  # keys and values, once a forward
        self.manual_commit = manual_commit  # a complete forward waits for `commit` or `settle`
        self.model = model  # the hooked model (None for a cache built from a config)
        self.forward: Forward | None = None  # the forward in progress, if any
        self.pending = PendingInputs()  # the next forward's padding mask, ids and positions
        self.drafts = 0  # the next forward's last new tokens per row that `commit` may drop (`expect_drafts`)

    # ------------------------------------------------------------------ a forward's layers

    def enter(self, layer: PagedLayer, batch_size: int, query_length: int, device: torch.device) -> Forward:
        """The forward `layer`'s update belongs to: the one in progress, or a new one that it begins."""
        forward = self.forward
        if forward is not None and layer.length == forward.length:
            self.drop_unfinished()  # this layer already did the forward in progress: a new forward began
            forward = None
        if forward is None:
            return self.begin(layer.length, batch_size, query_length, device, len(self.token_layers))
        if layer.length != forward.past_length:
            raise RuntimeError(
                f"layer {layer.layer_idx} has seen {layer.length} positions but the forward in progress runs from "
                f"{forward.past_length}: every layer of the model must update the cache once per forward"
            )
        if (batch_size, query_length) != (forward.batch_size, forward.query_length):
            raise ValueError(
                f"layer {layer.layer_idx} got {batch_size} rows x {query_length} tokens but this forward began "
                f"with {forward.batch_size} x {forward.query_length}"
            )
        return forward

    def leave(self, layer: PagedLayer, forward: Forward) -> None:
        """`layer` has written `step`; the last layer keeps it when no forward hook will report the end."""
        layer.length = forward.length
        forward.layers_done += 1
        if forward.complete and not (forward.commit_at_end or self.manual_commit):
            self.commit()

    def forward_ended(self, failed: bool) -> None:
        """Keep the forward a forward made (unless `manual_commit`), or roll it back when the forward raised."""
        forward = self.forward
        if forward is None:
            self.pending.clear()  # the forward raised before its first layer
            self.drafts = 0
        elif failed or not forward.complete:
            self.settle()
        elif forward.commit_at_end and not self.manual_commit:
            self.commit()

    # ------------------------------------------------------------------ the forward's life

    def begin(
        self, past_length: int, batch_size: int, query_length: int, device: torch.device, num_layers: int
    ) -> Forward:
        """Lay out a forward of `batch_size` x `query_length` new tokens after `past_length` positions."""
        with self.batch.lock:
            return self._begin(past_length, batch_size, query_length, device, num_layers)

    def _begin(
        self, past_length: int, batch_size: int, query_length: int, device: torch.device, num_layers: int
    ) -> Forward:
        batch = self.batch
        undo = batch.savepoint()
        rows = batch.batch_size
        new_real, new_ids, positions, attention, hooked = self.pending.take(batch_size, query_length)  # [B, q]
        sources = None  # per row, the first row it repeats (a first forward's repeated prompts)
        if rows == 0 and past_length == 0:
            sources = repeated_rows(new_ids, new_real, positions)
            batch.is_real = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        elif rows and batch_size != rows and batch_size % rows == 0:
            # generate() expands input_ids (num_return_sequences, num_beams) but not a cache passed to it:
            # k x B rows fed to a cache of B rows means each row repeated k times, sharing its blocks.
            batch.select(torch.arange(rows).repeat_interleave(batch_size // rows))
        elif batch_size != rows:
            raise ValueError(
                f"this cache holds {rows} sequences but the forward has batch size {batch_size}; call "
                "batch_select_indices() or batch_repeat_interleave() to change the batch, or reset() it"
            )
        real = new_real if new_real is not None else torch.ones(batch_size, query_length, dtype=torch.bool)
        is_real = torch.cat([batch.is_real.to(device), real.to(device)], dim=1)  # [B, L + q]
        stored = batch.tables.num_tokens if rows else [0] * batch_size
        token_ids = prefix_token_ids(stored, past_length, new_real, new_ids, positions)
        drafts, self.drafts = self.drafts, 0
        if drafts and (new_real is not None or drafts >= query_length):
            raise ValueError(
                f"{drafts} drafts need a forward of more new tokens ({query_length}), none of them padding"
            )
        settled = is_real[:, : is_real.shape[1] - drafts]  # [B, L + q - drafts]: what every outcome keeps
        kept = [None if batch.record_past else keep_from(settled, window) for window in batch.windows]
        try:
            for group, tables in enumerate(batch.groups):
                self._reads(group, tables, real.sum(dim=1).tolist(), token_ids, kept[group], sources)
            if batch.states is not None:
                batch.states.add_rows(batch_size - batch.states.batch_size)  # a first forward's rows
                padded = (~real).any(dim=1).nonzero().flatten().tolist()  # rows with padding among the new tokens
                batch.states.begin(padded)  # a slot of its own for each row the forward writes
        except BaseException:
            batch.restore(undo)
            raise
        forward = Forward(batch_size, query_length, past_length, new_real is None, undo, kept, num_layers, sources,
                    thread=threading.get_ident(), commit_at_end=hooked, drafts=drafts)
        batch.is_real = is_real
        # MLA models expand the cached latent into keys and values after `update`: attention cannot read the pool
        forward.from_pool = attention in PAGED_ATTENTION_NAMES and not batch.pool.layout.latent
        self.forward = forward
        return forward

    def _reads(
        self,
        group: int,
        tables: BlockTables,
        new_tokens: list[int],
        token_ids: list[list[int] | None] | None,
        keep: list[int] | None,
        sources: list[int] | None,
    ) -> None:
        """Take group `group`'s blocks for the forward; a first forward's repeated rows share their first row's."""
        pool = self.batch.pool
        if sources is None:
            if not tables.batch_size:
                tables.add_rows(len(new_tokens))
            take_group_blocks(tables, pool, group, new_tokens, token_ids, keep)
            return
        taking = sorted(set(sources))  # the rows that take blocks
        tables.add_rows(len(taking))
        take_group_blocks(
            tables,
            pool,
            group,
            [new_tokens[r] for r in taking],
            None if token_ids is None else [token_ids[r] for r in taking],
            None if keep is None else [keep[r] for r in taking],
        )
        tables.select([taking.index(s) for s in sources])  # repeats share their first row's blocks

    def states(self, batch_size: int, device: torch.device) -> RowStates:
        """The rows' states for the forward in progress, which a layer's state access begins if none has (the
        model's pre-hook observed it: `batch_size` and `device` are the layer's, its length the observed one)."""
        states = self.batch.states
        if states is None:
            raise ValueError("this model's PagedCache keeps no conv or recurrent states: no layer of it has any")
        if self.forward is None:
            if not self.pending.observed:
                raise RuntimeError(
                    "a PagedCache keeps conv and recurrent states only for forwards of the model it was built from "
                    "(PagedCache(model)): its forward hooks say when each forward begins and ends"
                )
            with self.batch.lock:
                self._begin(self.committed_length(), batch_size, self.pending.query_length, device, len(self.token_layers))
        return states

    def index(self, group: int, device: torch.device) -> SlotIndex:
        """The forward in progress's slot index for layer group `group` on `device`."""
        return build_index(self.forward, group, self.batch.groups[group], self.batch.is_real, device)

    def expect_drafts(self, drafts: int) -> None:
        """The next forward's last `drafts` new tokens of each row are drafts that `commit` may drop."""
        self.drafts = drafts

    def commit(self, keep: Sequence[int] | None = None) -> None:
        """Keep the forward in progress (every layer has written it), register the blocks it filled, and give
        back the blocks that sliding windows no longer need.

        `keep`: per row, how many of its new tokens to keep (the others, at the end, are rejected drafts:
        `expect_drafts`); their blocks go back before the forward's full blocks are registered. Nothing to do
        when no forward is in progress. Raises `RuntimeError` if the forward did not finish, `ValueError` (the
        forward still pending) if `keep` would drop more than its drafts.
        """
        forward = self.forward
        if forward is None:
            return
        if not forward.complete:
            raise RuntimeError("the last forward on this cache did not finish: settle() it instead of commit()")
        removed = None if keep is None else [forward.query_length - k for k in keep]
        fits = removed is None or (
            len(removed) == forward.batch_size and all(0 <= r <= forward.drafts for r in removed)
        )
        if not fits:
            raise ValueError(f"keep={list(keep)}: each of {forward.batch_size} rows keeps between "
                             f"{forward.query_length - forward.drafts} and {forward.query_length} new tokens")
        trimmed = removed is not None and any(removed)
        with self.batch.lock:
            self.forward = None
            if trimmed:
                self.batch.drop_drafts(removed)
            for tables in self.batch.groups:
                tables.commit()
            if self.batch.states is not None:  # and a snapshot of the states of each row at a block boundary
                self.batch.states.commit(self.batch.tables.boundaries())
            for layer in self.layers:  # the layers without keys and values count the positions too
                layer.length = forward.length
            if trimmed:
                if not self.batch.record_past:  # else they wait for the next `truncate`, as a crop's do
                    self.batch.drop_out_of_window()
                drop = self.batch.drop_leading_padding()
                for layer in self.layers:
                    layer.length -= drop

    def rollback(self) -> int:
        """Undo the forward in progress: its blocks, copies and rows. Returns the length to go back to."""
        with self.batch.lock:
            forward, self.forward = self.forward, None
            self.batch.restore(forward.undo)
            return forward.past_length

    def settle(self) -> None:
        """Roll back the forward not committed, if any (complete or not), and the layers' lengths with it."""
        with self.batch.lock:
            if self.forward is not None:
                length = self.rollback()
                for layer in self.layers:
                    layer.length = length

    def drop_unfinished(self) -> None:
        """Before a change: roll back a forward left over by a failed forward; refuse to drop a pending one."""
        forward = self.forward
        if forward is not None and forward.complete and self.manual_commit:
            raise RuntimeError(
                "this cache's last forward awaits commit() or settle() (manual_commit=True): call one of them "
                "before changing the cache or running the next forward"
            )
        self.settle()

    def settle_failed_here(self) -> None:
        """Before a read: roll back a forward left over by a failed forward on this thread; other threads' reads
        change nothing, and neither does a read from inside the hooked forward itself (its end hook settles it)."""
        forward = self.forward
        here = forward is not None and forward.thread == threading.get_ident()
        if here and not (self.manual_commit and forward.complete):
            if forward.commit_at_end and self.model is not None and forward_running(self.model):
                return
            self.settle()

    def reset(self) -> None:
        """Forget the forward in progress and the next forward's inputs, and give every row's blocks back (the
        forward's included)."""
        with self.batch.lock:
            self.forward = None
            self.batch.reset()
            self.pending.clear()

    # ------------------------------------------------------------------ what readers see

    def committed(self) -> tuple[list[RowsView], torch.Tensor]:
        """Each group's rows and the ``[B, L]`` padding mask as the last committed forward left them.

        Hold the batch's `lock` while using them: a commit may change the lists and give their blocks back.
        """
        forward = self.forward
        if forward is None:
            return [tables.view() for tables in self.batch.groups], self.batch.is_real
        size = self.batch.pool.block_size
        return [savepoint.view(size) for savepoint in forward.undo.tables], forward.undo.is_real

    def committed_length(self) -> int:
        """Positions the last kept forward left (call under the batch's `lock`)."""
        forward = self.forward
        return forward.past_length if forward is not None else self.layers[0].length
