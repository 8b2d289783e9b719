"""`PagedBatch`: the sequences one cache keeps in the pool, and the forward step in progress over them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import ATTENTION_NAME
from .block_table import BlockTables, slots_for_positions
from .inputs import PendingInputs
from .kv_pool import KVPool
from .step import (
    Step,
    StepIndex,
    StepUndo,
    build_index,
    gather,
    head_major_rows,
    plan_step,
    prefix_token_ids,
)


class PagedBatch:
    """The rows of one `PagedCache`: their block tables, which logical positions hold real tokens, and the step.

    Every forward is one step: its first layer plans it (`begin`: blocks for the real new tokens, all or
    nothing), every layer writes and reads through its slot index (`index`), and it is kept (`commit`) once
    the last layer has written. Until then `rollback` restores the rows, their blocks and reference counts
    exactly as they were, so a forward that fails at any layer leaves no trace.
    """

    def __init__(self, pool: KVPool, root: bytes | None):
        self.pool = pool
        self.tables = BlockTables(pool.blocks, root=root)
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)  # [B, L] False where a position is padding
        self.step: Step | None = None  # the step in progress, if any
        self.pending = PendingInputs()  # the next forward's padding mask, ids and positions

    @property
    def batch_size(self) -> int:
        return self.tables.batch_size

    def begin(self, past_length: int, batch_size: int, query_length: int, device: torch.device) -> Step:
        """Plan a forward of `batch_size` x `query_length` new tokens after `past_length` positions."""
        undo = StepUndo(self.tables.savepoint(), self.is_real)
        rows = self.tables.batch_size
        new_real, new_ids, positions, attention = self.pending.take(batch_size, query_length)  # [B, q] or None
        if rows == 0 and past_length == 0:
            self.tables.add_rows(batch_size)
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
        token_ids = prefix_token_ids(self.tables.num_tokens, past_length, new_real, new_ids, positions)
        try:
            step = plan_step(self.tables, self.pool, past_length, query_length, new_real, token_ids, undo)
        except BaseException:
            self.tables.rollback(undo.tables)
            self.is_real = undo.is_real
            raise
        if new_real is None:
            new_real = torch.ones(batch_size, query_length, dtype=torch.bool, device=device)
        self.is_real = torch.cat([self.is_real.to(device), new_real.to(device)], dim=1)  # [B, L + q]
        # MLA models expand the cached latent into keys and values after `update`: attention cannot read the pool
        step.from_pool = attention == ATTENTION_NAME and not self.pool.layout.latent
        self.step = step
        return step

    def index(self, device: torch.device) -> StepIndex:
        """The step in progress's slot index on `device`."""
        return build_index(self.step, self.tables, self.is_real, self.pool.block_size, device)

    def commit(self) -> None:
        """Keep the step in progress (every layer has written it) and register the blocks it filled."""
        self.step = None
        self.tables.commit()

    def rollback(self) -> int:
        """Undo the step in progress: its blocks, copies and rows. Returns the length to go back to."""
        step, self.step = self.step, None
        self.tables.rollback(step.undo.tables)
        self.is_real = step.undo.is_real
        return step.past_length

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `indices` (repeats allowed, any order), sharing their blocks."""
        rows = torch.as_tensor(indices, dtype=torch.long).cpu()
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.batch_size):
            raise IndexError(f"row indices {rows.tolist()} out of range for {self.batch_size} rows")
        self.tables.select(rows.tolist())
        self.is_real = self.is_real[rows.to(self.is_real.device)]

    def truncate(self, length: int) -> None:
        """Keep the first `length` logical positions of every row."""
        removed = self.is_real[:, length:].sum(dim=1).tolist()  # real tokens per row
        self.tables.truncate(removed)
        self.is_real = self.is_real[:, :length]

    def reset(self) -> None:
        """Give every block back, an unfinished step's included, and forget every row."""
        self.step = None
        self.tables.release()
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)
        self.pending.clear()

    def adopt_prefix(self, rows: list[list[int]], device: torch.device) -> int:
        """Start these unpadded rows from their longest cached prefix; returns its length."""
        length = self.tables.adopt_longest_prefix(rows)
        self.is_real = torch.ones(len(rows), length, dtype=torch.bool, device=device)
        return length

    def copy_to(self, other: PagedBatch) -> None:
        """Give `other` (empty, on the same pool) the same rows, sharing every block."""
        self.tables.copy_to(other.tables)
        other.is_real = self.is_real.clone()

    def dense(self, layer_idx: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values from position `offset` on: dense ``[B, H, L - offset, D]`` copies."""
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        if keys is None:
            raise ValueError(f"layer {layer_idx} has stored nothing yet")
        table = self.tables.as_tensor(keys.device)  # [B, max_blocks]
        slots = slots_for_positions(table, self.is_real.to(keys.device), self.pool.block_size)  # [B, L]
        rows = head_major_rows(slots[:, offset:], keys.shape[1])  # [B, H, L - offset]
        with self.pool.storage_lock.shared():
            return gather(keys, rows), gather(values, rows)
