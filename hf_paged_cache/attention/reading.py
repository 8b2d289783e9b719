"""Laying out a forward's reads: which pool slots each row's attention reads, made once per forward for all layers.

The cache's forward index (`hf_paged_cache.cache.forward.SlotIndex`, a `ForwardSlots`) knows where every position of the
forward lies in the pool; from it these functions say how attention reads them: each row's real keys and queries for a
row-by-row forward (`build_row_keys`, `build_query_rows`), or, for a decode forward (one real new token per row, every
key in the pool), a `DecodeReads` (`build_decode_reads`): the rows grouped by length (`length_groups`), each row's run
of consecutive slots (`consecutive_runs`), the keys all rows share (cascade) and the rows' block tables.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..pool.block_pool import NULL_BLOCK
from .flex_decode import BlockRows
from .reads import DecodeReads, KeyGroup, QueryRows, RowKeys, SharedPrefix

DECODE_CALL_COST = 256
"""What one SDPA call of a decode forward costs beyond its keys, in key positions per row (`length_groups`).

Measured on a 2-core CPU (SmolLM2-135M, float32): one row's gathers and SDPA call in a per-row path cost
about as much as gathering and attending over 300 more key positions in one padded call. A decode forward groups
its rows by length so that each group's rows, padded to its longest, cost the least in all: one group of
every row when they hold little padding, a group per row when their lengths differ widely. Decode forwards of
SmolLM2-135M (2-core AMD EPYC, one cache state, forwards alternated): 40 rows of 50 to 450 tokens ran 1.17x
(1 thread) and 1.16x (2 threads) faster grouped than in one padded call, 24 rows of 50 to 350 tokens 1.11x
and 1.09x, and 1.07x to 1.12x faster than with a group per row; a cost of 128 or 512 ran within 5% of 256.
"""


ZERO_COPY_MAX_ROWS = 16
"""Rows up to which a decode forward whose rows each hold their keys in consecutive slots attends each row from a
view of the pool (`DecodeReads.runs`) rather than gathering all rows into one padded SDPA call.

A view saves the gather (the bytes `DynamicCache`'s ``cat`` moves at every forward) but costs one SDPA call per
row. Measured per layer on a 2-core AMD EPYC (SmolLM2-135M shapes: 3 KV heads of 64, 9 query heads; float32;
views against gather and one call): one row of 512 tokens 73-137 us against 95-148 us; 16 rows of 100 to 400
tokens 765-1,252 us against 771-2,085 us (one and two threads; measured when the pool was token-major, whose
views SDPA read more slowly than the head-major ones of today, so the choice holds). A fresh cache's rows start in consecutive
blocks, and a row alone keeps them (`generate` at batch size 1 reads views at every forward); rows of a batch
lose them once one takes a block that another row's run holds the next of.
"""


CASCADE_MIN_SHARED = 64
"""Key positions all rows of a decode forward must share, in consecutive slots, for the forward to attend them once
for all rows (`SharedPrefix`) rather than gather them into every row.

The cascade costs a second SDPA call and a few small ops to merge (about 40 us per layer here) and saves
the copy of the shared keys and values into every row: on SmolLM2-135M shapes (3 KV heads of 64, float32,
2-core AMD EPYC) 4 beams sharing 512 keys attend in 340 us per layer against 550 us with the gather
(measured on the token-major pool, whose views read more slowly than today's head-major ones).
"""


class ForwardSlots(Protocol):
    """Where one forward's positions lie in the pool, as the functions here read it
    (`hf_paged_cache.cache.forward.SlotIndex`
    is one)."""

    rows: BlockRows  # the group's block tables with the forward's blocks taken
    is_real: torch.Tensor  # [B, L + q] False where a position is padding
    past_length: int  # L: positions before this forward's
    new_from_states: bool  # some real new tokens have no slot: attention reads new K/V from the states
    repeats: list[int] | None  # per row, the first row it repeats

    @property
    def read_slots(self) -> torch.Tensor:  # [B, L + q] pool slot of every position (padding: the null block)
        ...

    @property
    def pool_end(self) -> int:  # positions read from the pool end here
        ...

    def read_slots_from(self, offset: int) -> torch.Tensor:  # [B * kv] slots of positions offset:pool_end
        ...


def build_row_keys(index: ForwardSlots, offset: int) -> RowKeys:
    """Each row's real keys in positions ``offset:pool_end``, as pool slots and positions (no padding), with one
    nonzero and one split for the whole batch."""
    real = index.is_real[:, offset : index.pool_end]  # [B, kv]
    counts = real.sum(dim=1).tolist()  # n_b per row
    positions = real.nonzero()[:, 1] + offset  # [N] row-major, so rows come in order
    slots = index.read_slots[:, offset : index.pool_end][real]  # [N]
    flat, spans, start = positions.tolist(), [], 0
    for count in counts:
        spans.append((flat[start], flat[start + count - 1]) if count else (0, -1))
        start += count
    # real positions not read, per row (a sliding window's; no op for the usual offset 0)
    before = index.is_real[:, :offset].sum(dim=1).tolist() if offset else [0] * len(counts)
    return RowKeys(slots=list(slots.split(counts)), positions=list(positions.split(counts)), spans=spans,
                   before=before)


def build_query_rows(index: ForwardSlots) -> QueryRows:
    """The forward's new tokens per row: positions, the indices of the real ones, their first and last."""
    past, length = index.past_length, index.is_real.shape[1]
    new_real = index.is_real[:, past:]  # [B, q]
    positions = torch.arange(past, length, device=index.is_real.device)  # [q]
    picked: list[torch.Tensor | None] = []
    spans: list[tuple[int, int] | None] = []
    for row, full in zip(new_real, new_real.all(dim=1).tolist()):
        if full:
            picked.append(None)
            spans.append((past, length - 1))
            continue
        real = row.nonzero().squeeze(1)  # [q'] this row's real new tokens
        picked.append(real)
        spans.append((past + int(real[0]), past + int(real[-1])) if len(real) else None)
    return QueryRows(positions, picked, spans, index.repeats)


def build_decode_reads(index: ForwardSlots, offset: int, window: int | None, views: bool) -> DecodeReads | None:
    """For a decode forward (one real new token per row, every key in the pool): how its rows read their keys, else
    None.

    Positions ``offset:pool_end`` in the cache's column layout; the mask keeps real keys inside the window of the
    query at position ``L``. `views`: whether the storage can be read as views (stored as the model computes).
    """
    if index.is_real.shape[1] - index.past_length != 1 or index.new_from_states:
        return None  # not a decode forward
    if not bool(index.is_real[:, -1].all()):
        return None  # a padding query, which the per-row path leaves zero
    mask = index.is_real[:, offset:]  # [B, kv]
    if window is not None:
        positions = torch.arange(offset, index.is_real.shape[1], device=mask.device)  # [kv]
        mask = mask & (positions > index.past_length - window)
    elif views and offset == 0 and mask.shape[0] <= ZERO_COPY_MAX_ROWS:
        runs = consecutive_runs(index.rows)
        if runs is not None:
            return DecodeReads(None, [], runs)
    reads = DecodeReads(*_key_groups(index, offset, mask))
    if views and window is None and mask.device.type == "cpu":
        reads.shared = _shared_prefix(index, offset, mask)
    if views and window is None and offset == 0:
        reads.blocks = index.rows  # every key of a row in its blocks from the first: `paged_flex` reads them
    return reads


def _key_groups(index: ForwardSlots, offset: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[KeyGroup]]:
    """The decode forward's rows grouped by how many key positions they read (`length_groups`), and the pool
    slots of every group's keys, group after group.

    Args:
        mask: ``[B, kv]`` the keys from `offset` that each row's query sees (its new token's at least).
    """
    slots = index.read_slots[:, offset:]  # [B, kv]
    width = mask.shape[1]
    lengths = (width - mask.int().argmax(dim=1)).tolist()  # per row: from its first key seen to the end
    rows_by_group = length_groups(lengths, DECODE_CALL_COST)
    if len(rows_by_group) == 1:
        length = max(lengths)
        seen = mask[:, width - length :]  # [B, kv']
        group = KeyGroup(None, length, None if bool(seen.all()) else seen[:, None, None, :])
        return slots[:, width - length :].reshape(-1), [group]
    groups, group_slots = [], []
    for rows in rows_by_group:
        length = max(lengths[row] for row in rows)
        rows_index = torch.tensor(rows, device=mask.device)  # [n]
        seen = mask[rows_index, width - length :]  # [n, kv']
        groups.append(KeyGroup(rows_index, length, None if bool(seen.all()) else seen[:, None, None, :]))
        group_slots.append(slots[rows_index, width - length :].reshape(-1))  # [n * kv']
    return torch.cat(group_slots), groups


def _shared_prefix(index: ForwardSlots, offset: int, mask: torch.Tensor) -> SharedPrefix | None:
    """The decode forward's keys from `offset` that every row reads from the same consecutive slots, when there are
    at least `CASCADE_MIN_SHARED` of them (never the new token: each row keeps a tail)."""
    slots = index.read_slots[:, offset:]  # [B, kv]
    if slots.shape[0] < 2:
        return None
    first = slots[0, 0]
    run = torch.arange(slots.shape[1], device=slots.device) + first  # [kv] consecutive slots from the first
    shared = (slots == run).all(dim=0) & mask.all(dim=0)  # [kv] every row real there, in the run
    count = min(int(shared.int().cumprod(dim=0).sum()), slots.shape[1] - 1)
    if count < CASCADE_MIN_SHARED:
        return None
    tail_slots = index.read_slots_from(offset + count)  # [B * (kv - count)]
    seen = mask[:, None, None, count:]  # [B, 1, 1, kv - count]
    tail_mask = torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))
    return SharedPrefix(int(first), count, tail_slots, tail_mask)


def length_groups(lengths: list[int], call_cost: int) -> list[list[int]]:
    """Rows grouped for one attention call each: the grouping that minimizes, over its groups, the rows times
    the group's longest length plus `call_cost`, each group's rows ascending.

    An optimal grouping takes rows in order of length, so a dynamic program over that order finds it, in
    ``O(B^2)`` forwards for ``B`` rows (a decode forward does this once for all its layers).

    Args:
        lengths: per row, the key positions it reads (padded to its group's longest).
        call_cost: one call's fixed cost, in key positions per row.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ordered = [lengths[row] for row in order]
    best = [0]  # best[end]: the least cost of the `end` shortest rows
    starts = [0]  # starts[end]: where the last group of that grouping begins
    for end in range(1, len(order) + 1):
        longest = ordered[end - 1]
        cost, start = min((best[start] + (end - start) * longest, start) for start in range(end))
        best.append(cost + call_cost)
        starts.append(start)
    groups, end = [], len(order)
    while end:
        groups.append(sorted(order[starts[end] : end]))
        end = starts[end]
    return groups[::-1]


def consecutive_runs(rows: BlockRows) -> list[tuple[int, int]] | None:
    """Each row's ``(first slot, count)`` when its stored tokens fill consecutive slots (its blocks follow each
    other); else None. Read from the block lists, with no tensor op (a decode forward checks it once for all its
    layers).
    """
    size, runs = rows.block_size, []
    for table, count in zip(rows.tables, rows.num_tokens):
        used = table[: -(-count // size)]  # the blocks holding the row's tokens
        if not used or used[0] == NULL_BLOCK or used != list(range(used[0], used[0] + len(used))):
            return None
        runs.append((used[0] * size, count))
    return runs
