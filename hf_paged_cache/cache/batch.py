"""`PagedBatch`: the sequences one cache keeps in the pool: their block tables and padding mask."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ..pool.kv_pool import KVPool
from .block_table import BlockTables
from .forward import ForwardUndo, keep_from
from .prefix import adopt_longest_prefix
from .row_states import RowStates, StatesSavepoint


class PagedBatch:
    """The rows of one `PagedCache`: their block tables and which logical positions hold real tokens.

    Each layer group of the pool has its own block tables (`groups`, one row per sequence in each); the
    padding mask `is_real` is shared, since positions are the same in every layer. Rows are selected,
    truncated, copied and appended by sharing blocks (reference counts), never by copying keys and values.

    The forward in progress over the rows (`ForwardLifecycle`) changes them in place and keeps a
    `savepoint` of them, which `restore` brings back if the forward is rolled back.

    `lock` makes each change atomic for readers on other threads, which read the rows as the last committed
    forward left them (`ForwardLifecycle.committed`).
    """

    def __init__(self, pool: KVPool, root: bytes | None):
        self.pool = pool
        self.groups = [BlockTables(blocks, root=root) for blocks in pool.groups]
        # each row's conv / recurrent state slot, for models with linear-attention, SSM or conv layers
        self.states = RowStates(pool.states, pool.layout.state_layers) if pool.layout.state_layers else None
        self.windows = [group.window for group in pool.layer_groups]
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)  # [B, L] False where a position is padding
        self.record_past = False  # sliding groups keep out-of-window blocks until the next `truncate`
        self.lock = threading.RLock()  # held by every change, and by readers of the committed rows

    @property
    def tables(self) -> BlockTables:
        """The first layer group's block tables (full attention when the model has any)."""
        return self.groups[0]

    @property
    def batch_size(self) -> int:
        return self.tables.batch_size

    def savepoint(self) -> ForwardUndo:
        """The rows as they are now, for `restore` (block tables per group and the padding mask)."""
        return ForwardUndo([tables.savepoint() for tables in self.groups], self.is_real,
                           StatesSavepoint() if self.states is None else self.states.savepoint())

    def restore(self, undo: ForwardUndo) -> None:
        """Bring the rows, their blocks and reference counts back to `undo` (`savepoint`). Call under `lock`."""
        for tables, savepoint in zip(self.groups, undo.tables):
            tables.rollback(savepoint)
        if self.states is not None:
            self.states.restore(undo.states)
        self.is_real = undo.is_real

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `indices` (repeats allowed, any order), sharing their blocks."""
        rows = torch.as_tensor(indices, dtype=torch.long).cpu()
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.batch_size):
            raise IndexError(f"row indices {rows.tolist()} out of range for {self.batch_size} rows")
        with self.lock:
            for tables in self.groups:
                tables.select(rows.tolist())
            if self.states is not None:
                self.states.select(rows.tolist())
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
        for tables in self.groups:
            tables.truncate(removed)
        self.is_real = is_real
        self.drop_out_of_window()

    def drop_drafts(self, removed: Sequence[int]) -> None:
        """Forget each row's last `removed[b]` tokens (real ones: the rejected drafts of the forward that wrote
        them), their blocks going back, and shift each row right by as many positions (padding in front), so
        that every row's real tokens stay contiguous at its end. Call under `lock`, before the forward's blocks
        are registered."""
        for tables in self.groups:
            tables.truncate(removed)
        length = self.is_real.shape[1]
        shift = torch.tensor(removed, device=self.is_real.device).unsqueeze(1)  # [B, 1]
        source = torch.arange(length, device=self.is_real.device).unsqueeze(0) - shift  # [B, L]: column it takes
        self.is_real = self.is_real.gather(1, source.clamp(min=0)) & (source >= 0)  # [B, L]

    def drop_out_of_window(self) -> None:
        """Sliding groups give back the blocks their next queries no longer see (after rows got shorter)."""
        for tables, window in zip(self.groups, self.windows):
            kept = keep_from(self.is_real, window)
            if kept is not None:
                tables.drop_blocks_before(kept)

    def reset(self) -> None:
        """Give every block back, those an unfinished forward took included, and forget every row."""
        with self.lock:
            for tables in self.groups:
                tables.release()
            if self.states is not None:
                self.states.release()
            self.is_real = torch.zeros(0, 0, dtype=torch.bool)

    def adopt_prefix(self, rows: list[list[int]], device: torch.device) -> int:
        """Start these unpadded rows from their longest prefix cached in every group (and, for a model with
        states, snapshotted after it); returns its length.

        Call under `lock`.
        """
        length = adopt_longest_prefix(self.groups, self.windows, rows, self.states)
        self.is_real = torch.ones(len(rows), length, dtype=torch.bool, device=device)
        return length

    def copy_to(self, other: PagedBatch) -> None:
        """Give `other` (empty, on the same pool) the same rows, sharing every block. Call under `lock`."""
        for mine, theirs in zip(self.groups, other.groups):
            mine.copy_to(theirs)
        if self.states is not None:
            self.states.copy_to(other.states)
        other.is_real = self.is_real.clone()

    def absorb(self, other: PagedBatch) -> int:
        """Append `other`'s rows (same pool, no forward in progress) after these, sharing their blocks.

        Rows stay right-aligned: the side with fewer positions gets left padding, which takes no blocks and
        keeps each row's real tokens contiguous at its end (so sliding windows see the same tokens). Returns
        the new number of positions. Call under `lock`.
        """
        length = max(self.is_real.shape[1], other.is_real.shape[1])
        device = self.is_real.device if self.batch_size else other.is_real.device
        mine, theirs = (_left_pad(mask.to(device), length) for mask in (self.is_real, other.is_real))
        for tables, their_tables in zip(self.groups, other.groups):
            tables.extend_from(their_tables)
        if self.states is not None:
            self.states.extend_from(other.states)
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


def _left_pad(is_real: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]``: `is_real` ``[B, L]`` with ``length - L`` padding positions in front."""
    padding = torch.zeros(is_real.shape[0], length - is_real.shape[1], dtype=torch.bool, device=is_real.device)
    return torch.cat([padding, is_real], dim=1)
