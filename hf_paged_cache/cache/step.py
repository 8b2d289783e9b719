"""Planning one forward: which blocks its new tokens take, and which pool slot every position reads.

A forward calls ``cache.update`` once per layer with the same batch of new tokens. The first layer plans
the step for all of them (`PagedBatch.begin`, `plan_group`): in every layer group it takes blocks for the
real new tokens (all or nothing) and records which positions are padding. Each group and device then gets
one `StepIndex` of slot ids (`build_index`), shared by the group's layers on that device and by keys and
values alike.

A sliding-window group stores only the tokens its next queries can see (`keep_from`): in a step longer
than the window (a long prefill), the earliest new tokens get no slot, unless their block is held already
(a block filled in part by the step before is completed, so that it is whole if it is found by prefix). The step's own queries still see
them: attention then takes the step's new keys and values from the layer's states (`new_from_states`)
and only the past ones from the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention.block_attention import KeyGroup, PaddedKeys, QueryRows, RowKeys, SharedPrefix
from ..errors import PoolExhaustedError
from ..pool.block_pool import NULL_BLOCK
from ..pool.kv_pool import KVPool
from .block_table import BlockTables, RowsView, TablesSavepoint, slots_for_positions

DECODE_CALL_COST = 256
"""What one SDPA call of a decode step costs beyond its keys, in key positions per row (`length_groups`).

Measured on a 2-core CPU (SmolLM2-135M, float32): one row's gathers and SDPA call in a per-row path cost
about as much as gathering and attending over 300 more key positions in one padded call. A decode step groups
its rows by length so that each group's rows, padded to its longest, cost the least in all: one group of
every row when they hold little padding, a group per row when their lengths differ widely. Decode steps of
SmolLM2-135M (2-core AMD EPYC, one cache state, forwards alternated): 40 rows of 50 to 450 tokens ran 1.17x
(1 thread) and 1.16x (2 threads) faster grouped than in one padded call, 24 rows of 50 to 350 tokens 1.11x
and 1.09x, and 1.07x to 1.12x faster than with a group per row; a cost of 128 or 512 ran within 5% of 256.
"""


ZERO_COPY_MAX_ROWS = 16
"""Rows up to which a decode step whose rows each hold their keys in consecutive slots attends each row from a
view of the pool (`PaddedKeys.runs`) rather than gathering all rows into one padded SDPA call.

A view saves the gather (the bytes `DynamicCache`'s ``cat`` moves at every step) but costs one SDPA call per
row. Measured per layer on a 2-core AMD EPYC (SmolLM2-135M shapes: 3 KV heads of 64, 9 query heads; float32;
views against gather and one call): one row of 512 tokens 73-137 us against 95-148 us; 16 rows of 100 to 400
tokens 765-1,252 us against 771-2,085 us (one and two threads; measured when the pool was token-major, whose
views SDPA read more slowly than the head-major ones of today, so the choice holds). A fresh cache's rows start in consecutive
blocks, and a row alone keeps them (`generate` at batch size 1 reads views at every step); rows of a batch
lose them once one takes a block that another row's run holds the next of.
"""


CASCADE_MIN_SHARED = 64
"""Key positions all rows of a decode step must share, in consecutive slots, for the step to attend them once
for all rows (`SharedPrefix`) rather than gather them into every row.

The cascade costs a second SDPA call and a few small ops to merge (about 40 us per layer here) and saves
the copy of the shared keys and values into every row: on SmolLM2-135M shapes (3 KV heads of 64, float32,
2-core AMD EPYC) 4 beams sharing 512 keys attend in 340 us per layer against 550 us with the gather
(measured on the token-major pool, whose views read more slowly than today's head-major ones).
"""


@dataclass
class StepIndex:
    """Where one forward's tokens go and where every position is read from, on one device."""

    write_slots: torch.Tensor  # [N] pool slot of each stored new token
    write_rows: torch.Tensor | None  # [N] index into the flattened [B * q] new tokens; None = all of them
    rows: RowsView  # the group's block tables with the step's blocks taken (unchanged until the step ends)
    is_real: torch.Tensor  # [B, L + q] False where a position is padding
    past_length: int  # L: positions before this step's
    new_from_states: bool = False  # some real new tokens have no slot: attention reads new K/V from the states
    repeats: list[int] | None = None  # per row, the first row it repeats (`Step.repeats`)
    _read_slots: torch.Tensor | None = None  # read_slots, once made
    _row_keys: dict[int, RowKeys] = field(default_factory=dict)  # row_keys, per offset
    _queries: QueryRows | None = None
    _padded: dict[tuple[int, int | None, bool], PaddedKeys | None] = field(default_factory=dict)  # decode_keys

    @property
    def read_slots(self) -> torch.Tensor:
        """``[B, L + q]`` pool slot of every position (padding: the null block), made on first use: a decode step
        whose rows attend from views of the pool (`decode_keys`) never needs it."""
        if self._read_slots is None:
            self._read_slots = position_slots(self.rows, self.is_real)
        return self._read_slots

    @property
    def pool_end(self) -> int:
        """Positions read from the pool end here: all of them, or the past only when new K/V come from the states."""
        return self.past_length if self.new_from_states else self.is_real.shape[1]

    def read_slots_from(self, offset: int) -> torch.Tensor:
        """``[B * kv]`` pool slots of every row's positions ``offset:pool_end``, row after row (padding: null)."""
        return self.read_slots[:, offset : self.pool_end].reshape(-1)

    def row_keys(self, offset: int) -> RowKeys:
        """Each row's real keys in positions ``offset:pool_end``, as pool slots and positions (no padding).

        Computed once per step for all layers alike, with one nonzero and one split for the whole batch.
        """
        keys = self._row_keys.get(offset)
        if keys is None:
            real = self.is_real[:, offset : self.pool_end]  # [B, kv]
            counts = real.sum(dim=1).tolist()  # n_b per row
            positions = real.nonzero()[:, 1] + offset  # [N] row-major, so rows come in order
            slots = self.read_slots[:, offset : self.pool_end][real]  # [N]
            flat, spans, start = positions.tolist(), [], 0
            for count in counts:
                spans.append((flat[start], flat[start + count - 1]) if count else (0, -1))
                start += count
            keys = self._row_keys[offset] = RowKeys(
                slots=list(slots.split(counts)), positions=list(positions.split(counts)), spans=spans
            )
        return keys

    def decode_keys(self, offset: int, window: int | None, views: bool = True) -> PaddedKeys | None:
        """For a decode step (one real new token per row, every key in the pool): the padded keys, else None.

        Positions ``offset:pool_end`` in the cache's column layout; the mask keeps real keys inside the window
        of the query at position ``L``. Computed once per step for all layers alike. `views`: whether the
        storage can be read as views (stored as the model computes).
        """
        key = (offset, window, views)
        if key not in self._padded:
            self._padded[key] = self._plan_decode(offset, window, views)
        return self._padded[key]

    def _plan_decode(self, offset: int, window: int | None, views: bool) -> PaddedKeys | None:
        if self.is_real.shape[1] - self.past_length != 1 or self.new_from_states:
            return None  # not a decode step
        if not bool(self.is_real[:, -1].all()):
            return None  # a padding query, which the per-row path leaves zero
        mask = self.is_real[:, offset:]  # [B, kv]
        if window is not None:
            positions = torch.arange(offset, self.is_real.shape[1], device=mask.device)  # [kv]
            mask = mask & (positions > self.past_length - window)
        elif views and offset == 0 and mask.shape[0] <= ZERO_COPY_MAX_ROWS:
            runs = consecutive_runs(self.rows)
            if runs is not None:
                return PaddedKeys(None, [], runs)
        padded = PaddedKeys(*self._key_groups(offset, mask))
        if views and window is None and mask.device.type == "cpu":
            padded.shared = self._shared_prefix(offset, mask)
        if views and window is None and offset == 0:
            padded.blocks = self.rows  # every key of a row in its blocks from the first: `paged_flex` reads them
        return padded

    def _key_groups(self, offset: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[KeyGroup]]:
        """The decode step's rows grouped by how many key positions they read (`length_groups`), and the pool
        slots of every group's keys, group after group.

        Args:
            mask: ``[B, kv]`` the keys from `offset` that each row's query sees (its new token's at least).
        """
        slots = self.read_slots[:, offset:]  # [B, kv]
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
            index = torch.tensor(rows, device=mask.device)  # [n]
            seen = mask[index, width - length :]  # [n, kv']
            groups.append(KeyGroup(index, length, None if bool(seen.all()) else seen[:, None, None, :]))
            group_slots.append(slots[index, width - length :].reshape(-1))  # [n * kv']
        return torch.cat(group_slots), groups

    def _shared_prefix(self, offset: int, mask: torch.Tensor) -> SharedPrefix | None:
        """The decode step's keys from `offset` that every row reads from the same consecutive slots, when
        there are at least `CASCADE_MIN_SHARED` of them (never the new token: each row keeps a tail)."""
        slots = self.read_slots[:, offset:]  # [B, kv]
        if slots.shape[0] < 2:
            return None
        first = slots[0, 0]
        run = torch.arange(slots.shape[1], device=slots.device) + first  # [kv] consecutive slots from the first
        shared = (slots == run).all(dim=0) & mask.all(dim=0)  # [kv] every row real there, in the run
        count = min(int(shared.int().cumprod(dim=0).sum()), slots.shape[1] - 1)
        if count < CASCADE_MIN_SHARED:
            return None
        tail_slots = self.read_slots_from(offset + count)  # [B * (kv - count)]
        seen = mask[:, None, None, count:]  # [B, 1, 1, kv - count]
        tail_mask = torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))
        return SharedPrefix(int(first), count, tail_slots, tail_mask)

    def queries(self) -> QueryRows:
        """The step's new tokens per row: positions, the indices of the real ones, their first and last."""
        if self._queries is None:
            new_real = self.is_real[:, self.past_length :]  # [B, q]
            positions = torch.arange(self.past_length, self.is_real.shape[1], device=self.is_real.device)  # [q]
            picked: list[torch.Tensor | None] = []
            spans: list[tuple[int, int] | None] = []
            for row, full in zip(new_real, new_real.all(dim=1).tolist()):
                if full:
                    picked.append(None)
                    spans.append((self.past_length, self.is_real.shape[1] - 1))
                    continue
                index = row.nonzero().squeeze(1)  # [q'] this row's real new tokens
                picked.append(index)
                past = self.past_length
                spans.append((past + int(index[0]), past + int(index[-1])) if len(index) else None)
            self._queries = QueryRows(positions, picked, spans, self.repeats)
        return self._queries


def length_groups(lengths: list[int], call_cost: int) -> list[list[int]]:
    """Rows grouped for one attention call each: the grouping that minimizes, over its groups, the rows times
    the group's longest length plus `call_cost`, each group's rows ascending.

    An optimal grouping takes rows in order of length, so a dynamic program over that order finds it, in
    ``O(B^2)`` steps for ``B`` rows (a decode step plans this once for all its layers).

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


def consecutive_runs(rows: RowsView) -> list[tuple[int, int]] | None:
    """Each row's ``(first slot, count)`` when its stored tokens fill consecutive slots (its blocks follow each
    other); else None. Read from the block lists, with no tensor op (a decode step checks it once for all its
    layers).
    """
    size, runs = rows.block_size, []
    for table, count in zip(rows.tables, rows.num_tokens):
        used = table[: -(-count // size)]  # the blocks holding the row's tokens
        if not used or used[0] == NULL_BLOCK or used != list(range(used[0], used[0] + len(used))):
            return None
        runs.append((used[0] * size, count))
    return runs


@dataclass
class Step:
    """The plan of the forward in progress, made once by its first layer and used by all of them.

    A step is all or nothing: it is committed when the forward that made it has ended well (or, without the
    model's forward hook, when the last layer has written its keys and values; or by `PagedCache.commit` for
    a cache with ``manual_commit``), and until then `undo` holds what a rollback restores.
    """

    batch_size: int
    query_length: int
    past_length: int
    all_real: bool  # no padding among the new tokens
    undo: StepUndo
    keep_from: list[list[int] | None]  # per group, each row's first token kept (sliding windows); None = all
    num_layers: int  # layers that write the step: it is complete when all of them have
    # per row, the first row it repeats (the same new token ids, padding and positions in a first forward:
    # it shares that row's blocks and keys); None when no row repeats another
    repeats: list[int] | None = None
    from_pool: bool = False  # attention (paged_sdpa) reads K/V straight from the pool: no dense gather
    thread: int = 0  # threading.get_ident() of the thread running the forward
    commit_at_end: bool = False  # the model's forward hook keeps (or drops) it when the forward ends
    layers_done: int = 0
    index: dict[tuple[int, torch.device], StepIndex] = field(default_factory=dict)  # per (group, device)

    @property
    def length(self) -> int:
        return self.past_length + self.query_length

    @property
    def complete(self) -> bool:
        """Every layer has written its keys and values."""
        return self.layers_done == self.num_layers


@dataclass
class StepUndo:
    """The cache as it was before a step began."""

    tables: list[TablesSavepoint]  # per layer group
    is_real: torch.Tensor  # [B, L] the padding mask before the step


def prefix_token_ids(
    stored: Sequence[int],
    past_length: int,
    new_real: torch.Tensor | None,
    new_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> list[list[int] | None] | None:
    """Each row's real new token ids when they can key prefix blocks, else None for that row.

    A block's K/V can be reused by prefix only if it was computed with each token at its index in the
    sequence (0, 1, 2, ...): rotary and learned position embeddings make keys depend on positions. Left
    padding shifts a row's positions unless the forward passes ``position_ids`` that skip the padding
    (``generate`` does); without ``position_ids``, transformers uses ``past_length + arange(q)`` for every row.

    Args:
        stored: tokens each row stored before this step.
        new_real: ``[B, q]`` False where a new token is padding; None when none is.
        new_ids: ``[B, q]`` the new token ids; None when unknown (then nothing can be registered).
        positions: the forward's ``position_ids`` (``[B, q]`` or ``[1, q]``), None when not given.
    """
    if new_ids is None:
        return None
    batch_size, query_length = new_ids.shape
    if positions is not None and (
        positions.ndim != 2 or positions.shape[1] != query_length or positions.shape[0] not in (1, batch_size)
    ):
        return None  # multi-dimensional (e.g. rotary sections) or unusual positions: do not key by them
    # lists, not tensor ops: a decode step (one token per row) has a few values, and a prefill's are
    # turned into lists anyway to be kept
    ids = new_ids.tolist()  # [B][q]
    real = new_real.tolist() if new_real is not None else [[True] * query_length] * batch_size
    if positions is None:
        given = [list(range(past_length, past_length + query_length))] * batch_size
    else:
        given = positions.tolist()
        given = given * batch_size if len(given) == 1 else given
    rows = []
    for row_ids, row_real, row_positions, first in zip(ids, real, given, stored):
        kept = [(t, p) for t, p, is_real in zip(row_ids, row_positions, row_real) if is_real]
        aligned = all(p == first + k for k, (_, p) in enumerate(kept))  # the k-th real token at index first + k
        rows.append([t for t, _ in kept] if aligned else None)
    return rows


def keep_from(is_real: torch.Tensor, window: int | None) -> list[int] | None:
    """Each row's first token that a sliding window of `window` still needs after a step (None: all of them).

    The next query sits at position ``L`` (`is_real` is ``[B, L]`` after the step) and sees keys
    ``k > L - W``: the tokens before that position are no longer needed.
    """
    start = is_real.shape[1] - window + 1 if window is not None else 0
    if start <= 0:
        return None
    return is_real[:, :start].sum(dim=1).tolist()


def plan_group(
    tables: BlockTables,
    pool: KVPool,
    group: int,
    new_tokens: list[int],
    token_ids: list[list[int] | None] | None,
    keep: list[int] | None,
) -> None:
    """Take one layer group's blocks for a step's real new tokens (all or nothing) and copy shared last blocks.

    Args:
        new_tokens: per row of `tables`, its real new tokens.
        token_ids: per row, the real new tokens' ids when they can key prefix blocks (`prefix_token_ids`).
        keep: per row, its first token still needed after the step (`keep_from`); None keeps every token.
    Raises:
        PoolExhaustedError: the group cannot supply every block, in which case the tables are unchanged.
    """
    try:
        pairs = tables.append(new_tokens, token_ids, keep)  # changes nothing when it raises
    except PoolExhaustedError as error:
        if len(pool.groups) == 1:
            raise
        name = pool.layer_groups[group].name
        raise PoolExhaustedError(error.needed, error.free, error.total, error.block_size, name) from None
    pool.copy_blocks(pairs, group)


def build_index(step: Step, group: int, tables: BlockTables, is_real: torch.Tensor, device: torch.device) -> StepIndex:
    """Layer group `group`'s write and read slots on `device` (made once, then reused by the group's layers).

    Args:
        is_real: ``[B, L + q]`` bool over every position including this step's, False for padding.
    """
    index = step.index.get((group, device))
    if index is None:
        is_real, rows = is_real.to(device), tables.view()  # [B, L + q]
        if step.query_length == 1 and step.all_real and step.keep_from[group] is None and step.repeats is None:
            # a decode step: each row's new token is its last stored one, found in its block list (no tensor op)
            size = rows.block_size
            last = [table[(n - 1) // size] * size + (n - 1) % size for table, n in zip(rows.tables, rows.num_tokens)]
            index = StepIndex(torch.tensor(last, device=device), None, rows, is_real, step.past_length)
        else:
            index = _full_index(step, group, rows, is_real)
        step.index[(group, device)] = index
    return index


def _full_index(step: Step, group: int, rows: RowsView, is_real: torch.Tensor) -> StepIndex:
    """The slot index of any step, from the slots of all its positions (padding, a window, repeated rows)."""
    slots = position_slots(rows, is_real)  # [B, L + q]
    new_real = is_real[:, step.past_length :]  # [B, q]
    written, new_from_states = new_real, False  # [B, q] new tokens that get a slot
    if step.keep_from[group] is not None:
        # a new token is written wherever its block is held (the null block's slots are below block_size):
        # tokens before the first block the window keeps get no slot, except in a block held already
        written = new_real & (slots[:, step.past_length :] >= rows.block_size)
        new_from_states = bool((written != new_real).any())
    if step.repeats is not None:  # a repeated row's tokens are the first's
        writers = torch.tensor([first == row for row, first in enumerate(step.repeats)], device=is_real.device)
        written = written & writers.unsqueeze(1)  # [B, q]
    if written is new_real and step.all_real:
        write_slots, write_rows = slots[:, step.past_length :].reshape(-1), None
    else:
        write_slots = slots[:, step.past_length :][written]  # [N]
        write_rows = written.reshape(-1).nonzero().squeeze(1)  # [N]
    return StepIndex(write_slots, write_rows, rows, is_real, step.past_length, new_from_states, step.repeats, slots)


def position_slots(rows: RowsView, is_real: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` pool slot of every position of `rows` (padding: the null block's), on `is_real`'s device."""
    return slots_for_positions(rows.as_tensor(is_real.device), is_real, rows.block_size)
