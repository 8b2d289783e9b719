"""`PagedBatch`: the sequences one cache keeps in the pool, and the forward step in progress over them."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ..attention.paged_sdpa import PAGED_ATTENTION_NAMES
from ..pool.kv_pool import KVPool
from .block_table import BlockTables, RowsView, slots_for_positions
from .inputs import PendingInputs, repeated_rows
from .layer_io import gather
from .prefix import adopt_longest_prefix
from .step import (
    Step,
    StepIndex,
    StepUndo,
    build_index,
    keep_from,
    plan_group,
    prefix_token_ids,
)


class PagedBatch:
    """The rows of one `PagedCache`: their block tables, which logical positions hold real tokens, and the step.

    Each layer group of the pool has its own block tables (`groups`, one row per sequence in each); the
    padding mask `is_real` is shared, since positions are the same in every layer.

    Every forward is one step: its first layer plans it (`begin`: blocks for the real new tokens in every
    group, all or nothing), every layer writes and reads through its group's slot index (`index`), and it is
    kept (`commit`) once the last layer has written. Until then `rollback` restores the rows, their blocks
    and reference counts exactly as they were, so a forward that fails at any layer leaves no trace.

    When a first forward's rows repeat each other (``generate`` repeats each prompt for
    ``num_return_sequences`` and ``num_beams``), each distinct row is stored once and its repeats share its
    blocks. Sliding-window groups keep only what their next queries can see, except while `record_past` is
    set (transformers sets it before forwards it may `crop`): then steps keep every block and `truncate`
    trims.

    `lock` makes each change atomic for readers on other threads, which read `committed()`: the rows as the
    last committed step left them (the step in progress keeps them in its undo record).
    """

    def __init__(self, pool: KVPool, root: bytes | None):
        self.pool = pool
        self.groups = [BlockTables(blocks, root=root) for blocks in pool.groups]
        self.windows = [group.window for group in pool.layer_groups]
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)  # [B, L] False where a position is padding
        self.step: Step | None = None  # the step in progress, if any
        self.pending = PendingInputs()  # the next forward's padding mask, ids and positions
        self.record_past = False  # sliding groups keep out-of-window blocks until the next `truncate`
        self.lock = threading.RLock()  # held by every change, and by readers of `committed()`

    @property
    def tables(self) -> BlockTables:
        """The first layer group's block tables (full attention when the model has any)."""
        return self.groups[0]

    @property
    def batch_size(self) -> int:
        return self.tables.batch_size

    def begin(
        self, past_length: int, batch_size: int, query_length: int, device: torch.device, num_layers: int
    ) -> Step:
        """Plan a forward of `batch_size` x `query_length` new tokens after `past_length` positions."""
        with self.lock:
            return self._begin(past_length, batch_size, query_length, device, num_layers)

    def _begin(
        self, past_length: int, batch_size: int, query_length: int, device: torch.device, num_layers: int
    ) -> Step:
        undo = StepUndo([tables.savepoint() for tables in self.groups], self.is_real)
        rows = self.batch_size
        new_real, new_ids, positions, attention, hooked = self.pending.take(batch_size, query_length)  # [B, q]
        sources = None  # per row, the first row it repeats (a first forward's repeated prompts)
        if rows == 0 and past_length == 0:
            sources = repeated_rows(new_ids, new_real, positions)
            self.is_real = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        elif rows and batch_size != rows and batch_size % rows == 0:
            # generate() expands input_ids (num_return_sequences, num_beams) but not a cache passed to it:
            # k x B rows fed to a cache of B rows means each row repeated k times, sharing its blocks.
            self.select(torch.arange(rows).repeat_interleave(batch_size // rows))
        elif batch_size != rows:
            raise ValueError(
                f"this cache holds {rows} sequences but the forward has batch size {batch_size}; call "
                "batch_select_indices() or batch_repeat_interleave() to change the batch, or reset() it"
            )
        real = new_real if new_real is not None else torch.ones(batch_size, query_length, dtype=torch.bool)
        is_real = torch.cat([self.is_real.to(device), real.to(device)], dim=1)  # [B, L + q]
        stored = self.tables.num_tokens if rows else [0] * batch_size
        token_ids = prefix_token_ids(stored, past_length, new_real, new_ids, positions)
        kept = [None if self.record_past else keep_from(is_real, window) for window in self.windows]
        try:
            for group, tables in enumerate(self.groups):
                self._plan(group, tables, real.sum(dim=1).tolist(), token_ids, kept[group], sources)
        except BaseException:
            for tables, savepoint in zip(self.groups, undo.tables):
                tables.rollback(savepoint)
            self.is_real = undo.is_real
            raise
        step = Step(batch_size, query_length, past_length, new_real is None, undo, kept, num_layers, sources,
                    thread=threading.get_ident(), commit_at_end=hooked)
        self.is_real = is_real
        # MLA models expand the cached latent into keys and values after `update`: attention cannot read the pool
        step.from_pool = attention in PAGED_ATTENTION_NAMES and not self.pool.layout.latent
        self.step = step
        return step

    def _plan(
        self,
        group: int,
        tables: BlockTables,
        new_tokens: list[int],
        token_ids: list[list[int] | None] | None,
        keep: list[int] | None,
        sources: list[int] | None,
    ) -> None:
        """Take group `group`'s blocks for the step; a first step's repeated rows share their first row's."""
        if sources is None:
            if not tables.batch_size:
                tables.add_rows(len(new_tokens))
            plan_group(tables, self.pool, group, new_tokens, token_ids, keep)
            return
        planned = sorted(set(sources))  # the rows that take blocks
        tables.add_rows(len(planned))
        plan_group(
            tables,
            self.pool,
            group,
            [new_tokens[r] for r in planned],
            None if token_ids is None else [token_ids[r] for r in planned],
            None if keep is None else [keep[r] for r in planned],
        )
        tables.select([planned.index(s) for s in sources])  # repeats share their first row's blocks

    def index(self, group: int, device: torch.device) -> StepIndex:
        """The step in progress's slot index for layer group `group` on `device`."""
        return build_index(self.step, group, self.groups[group], self.is_real, device)

    def commit(self) -> None:
        """Keep the step in progress (every layer has written it), register the blocks it filled, and give
        back the blocks that sliding windows no longer need."""
        with self.lock:
            self.step = None
            for tables in self.groups:
                tables.commit()

    def rollback(self) -> int:
        """Undo the step in progress: its blocks, copies and rows. Returns the length to go back to."""
        with self.lock:
            step, self.step = self.step, None
            for tables, savepoint in zip(self.groups, step.undo.tables):
                tables.rollback(savepoint)
            self.is_real = step.undo.is_real
            return step.past_length

    def committed(self) -> tuple[list[RowsView], torch.Tensor]:
        """Each group's rows and the ``[B, L]`` padding mask as the last committed step left them.

        Hold `lock` while using them: a commit may change the lists and give their blocks back.
        """
        if self.step is None:
            return [tables.view() for tables in self.groups], self.is_real
        size = self.pool.block_size
        return [savepoint.view(size) for savepoint in self.step.undo.tables], self.step.undo.is_real

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `indices` (repeats allowed, any order), sharing their blocks."""
        rows = torch.as_tensor(indices, dtype=torch.long).cpu()
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.batch_size):
            raise IndexError(f"row indices {rows.tolist()} out of range for {self.batch_size} rows")
        with self.lock:
            for tables in self.groups:
                tables.select(rows.tolist())
            self.is_real = self.is_real[rows.to(self.is_real.device)]

    def truncate(self, length: int) -> None:
        """Keep the first `length` logical positions of every row; then sliding groups keep only what their
        next queries can see (also while `record_past` is set, as `DynamicSlidingWindowLayer.crop` does).

        Raises `ValueError`, changing nothing, if a sliding group would need positions it has given back.
        Call under `lock`.
        """
        removed = self.is_real[:, length:].sum(dim=1).tolist()  # real tokens per row
        is_real = self.is_real[:, :length]  # [B, length]
        for tables, window in zip(self.groups, self.windows):
            needed = keep_from(is_real, window) or [0] * self.batch_size
            for row, first in enumerate(needed):
                if tables.first_held_token(row) > first and tables.num_tokens[row] - removed[row] > first:
                    raise ValueError(
                        f"cannot remove {self.is_real.shape[1] - length} positions: the layers with a sliding "
                        f"window of {window} already gave back positions they would then need. Call "
                        "cache.activate_past_recording() before forwards you may crop (generate does for "
                        "assisted decoding): the cache then keeps them until the next crop"
                    )
        for tables, window in zip(self.groups, self.windows):
            tables.truncate(removed)
            kept = keep_from(is_real, window)
            if kept is not None:
                tables.drop_blocks_before(kept)
        self.is_real = is_real

    def reset(self) -> None:
        """Give every block back, an unfinished step's included, and forget every row."""
        with self.lock:
            self.step = None
            for tables in self.groups:
                tables.release()
            self.is_real = torch.zeros(0, 0, dtype=torch.bool)
            self.pending.clear()

    def adopt_prefix(self, rows: list[list[int]], device: torch.device) -> int:
        """Start these unpadded rows from their longest prefix cached in every group; returns its length.

        Call under `lock`.
        """
        length = adopt_longest_prefix(self.groups, self.windows, rows)
        self.is_real = torch.ones(len(rows), length, dtype=torch.bool, device=device)
        return length

    def copy_to(self, other: PagedBatch) -> None:
        """Give `other` (empty, on the same pool) the same rows, sharing every block. Call under `lock`."""
        for mine, theirs in zip(self.groups, other.groups):
            mine.copy_to(theirs)
        other.is_real = self.is_real.clone()

    def absorb(self, other: PagedBatch) -> int:
        """Append `other`'s rows (same pool, no step in progress) after these, sharing their blocks.

        Rows stay right-aligned: the side with fewer positions gets left padding, which takes no blocks and
        keeps each row's real tokens contiguous at its end (so sliding windows see the same tokens). Returns
        the new number of positions. Call under `lock`.
        """
        length = max(self.is_real.shape[1], other.is_real.shape[1])
        device = self.is_real.device if self.batch_size else other.is_real.device
        mine, theirs = (_left_pad(mask.to(device), length) for mask in (self.is_real, other.is_real))
        for tables, their_tables in zip(self.groups, other.groups):
            tables.extend_from(their_tables)
        self.is_real = torch.cat([mine, theirs])  # [B + B', length]
        return length

    def drop_leading_padding(self) -> int:
        """Forget the first positions that are padding in every row; returns how many were dropped.

        Call under `lock`.
        """
        real_columns = self.is_real.any(dim=0).nonzero()
        drop = int(real_columns[0]) if len(real_columns) else self.is_real.shape[1]
        self.is_real = self.is_real[:, drop:]
        return drop

    def dense(self, layer_idx: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values from position `offset` on, as last committed: dense
        ``[B, H, L - offset, D]`` copies. Call under `lock`."""
        keys, values = self.pool.stored(layer_idx)  # ValueError if the layer has stored nothing yet
        device = keys.data.device
        views, is_real = self.committed()
        table = views[self.pool.group_of[layer_idx]].as_tensor(device)  # [B, max_blocks]
        slots = slots_for_positions(table, is_real.to(device), self.pool.block_size)  # [B, L]
        slots = slots[:, offset:].reshape(-1)  # [B * (L - offset)]
        with self.pool.storage_lock.shared():
            return gather(keys, slots, is_real.shape[0]), gather(values, slots, is_real.shape[0])


def _left_pad(is_real: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]``: `is_real` ``[B, L]`` with ``length - L`` padding positions in front."""
    padding = torch.zeros(is_real.shape[0], length - is_real.shape[1], dtype=torch.bool, device=is_real.device)
    return torch.cat([padding, is_real], dim=1)
