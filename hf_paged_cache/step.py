"""Planning one forward: which blocks its new tokens take, and which pool slot every position reads.

A forward calls ``cache.update`` once per layer with the same batch of new tokens. The first layer plans
the step for all of them (`plan_step`): it takes blocks for the real new tokens (all or nothing) and
records which positions are padding. Each device then gets one `StepIndex` of slot ids (`build_index`),
shared by every layer on that device and by keys and values alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_table import BlockTables, slots_for_positions
from .kv_pool import KVPool


@dataclass
class StepIndex:
    """Where one forward's tokens go and where every position is read from, on one device."""

    write_slots: torch.Tensor  # [N] pool slot of each stored new token
    write_rows: torch.Tensor | None  # [N] index into the flattened [B * q] new tokens; None = all of them
    read_slots: torch.Tensor  # [B, L + q] pool slot of every position (padding -> null block)
    _rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # read_rows, per (offset, heads)

    def read_rows(self, offset: int, num_heads: int) -> torch.Tensor:
        """``[B, H, kv_length]`` rows of the flat ``[slots * H, D]`` storage for positions ``offset:``.

        Head-major (row ``slot * H + head``), so the gather yields the contiguous per-head layout that
        `DynamicCache` holds and SDPA reads fastest. Computed once per step for all layers alike.
        """
        rows = self._rows.get((offset, num_heads))
        if rows is None:
            slots = self.read_slots[:, offset:]  # [B, kv]
            heads = torch.arange(num_heads, device=slots.device)  # [H]
            rows = self._rows[(offset, num_heads)] = slots.unsqueeze(1) * num_heads + heads.view(1, -1, 1)
        return rows


@dataclass
class Step:
    """The plan of the forward in progress, made once by its first layer and used by all of them."""

    batch_size: int
    query_length: int
    past_length: int
    all_real: bool  # no padding among the new tokens
    index: dict[torch.device, StepIndex] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.past_length + self.query_length


def plan_step(
    tables: BlockTables,
    pool: KVPool,
    past_length: int,
    query_length: int,
    new_real: torch.Tensor | None,
    new_ids: torch.Tensor | None,
) -> Step:
    """Take blocks for a forward's real new tokens (all or nothing) and copy shared last blocks away.

    Args:
        tables: the cache's block tables, one row per sequence of the batch.
        past_length: logical positions every row has seen so far (padding included).
        new_real: ``[B, q]`` bool, False where a new token is padding; None when none is.
        new_ids: ``[B, q]`` token ids of the new tokens when known (they make full blocks findable by prefix).
    Raises:
        PoolExhaustedError: the pool cannot supply every block, in which case nothing changed.
    """
    batch_size = tables.batch_size
    new_tokens = new_real.sum(dim=1).tolist() if new_real is not None else [query_length] * batch_size
    token_ids = None
    if new_ids is not None:
        rows_ids = new_ids.tolist()
        token_ids = rows_ids if new_real is None else [
            [t for t, real in zip(ids, mask) if real] for ids, mask in zip(rows_ids, new_real.tolist())
        ]
    pairs = tables.append(new_tokens, token_ids)  # raises PoolExhaustedError, changing nothing
    pool.copy_blocks(pairs)
    tables.finish_copy_on_write(pairs)
    return Step(batch_size, query_length, past_length, all_real=new_real is None)


def build_index(step: Step, tables: BlockTables, is_real: torch.Tensor, block_size: int, device: torch.device) -> StepIndex:
    """The step's write and read slots on `device` (made once per device, then reused by every layer).

    Args:
        is_real: ``[B, L + q]`` bool over every position including this step's, False for padding.
    """
    index = step.index.get(device)
    if index is None:
        is_real = is_real.to(device)  # [B, L + q]
        table = tables.as_tensor(device)  # [B, max_blocks]
        read_slots = slots_for_positions(table, is_real, block_size)  # [B, L + q]
        new_real = is_real[:, step.past_length :]  # [B, q]
        if step.all_real:
            write_slots, write_rows = read_slots[:, step.past_length :].reshape(-1), None
        else:
            write_slots = read_slots[:, step.past_length :][new_real]  # [N]
            write_rows = new_real.reshape(-1).nonzero().squeeze(1)  # [N]
        index = step.index[device] = StepIndex(write_slots, write_rows, read_slots)
    return index


def write_new_tokens(storage: torch.Tensor, new: torch.Tensor, index: StepIndex) -> None:
    """Store a layer's new keys (or values) ``[B, H, q, D]`` into its flat ``[slots, H, D]`` storage."""
    batch_size, _, query_length, _ = new.shape
    new = new.transpose(1, 2).reshape(batch_size * query_length, *storage.shape[1:])  # [B * q, H, D]
    if index.write_rows is not None:
        new = new.index_select(0, index.write_rows)  # [N, H, D] real tokens only
    storage.index_copy_(0, index.write_slots, new)


def gather(storage: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense ``[B, H, kv_length, D]`` K or V: rows `rows` ``[B, H, kv_length]`` of the flat ``[slots * H, D]``."""
    dim = storage.shape[-1]
    return storage.view(-1, dim).index_select(0, rows.reshape(-1)).view(*rows.shape, dim)  # [B, H, kv, D]

