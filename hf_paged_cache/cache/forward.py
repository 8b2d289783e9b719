"""Laying out one forward: which blocks its new tokens take, and which pool slot every position reads.

A forward calls ``cache.update`` once per layer with the same batch of new tokens. The first layer lays out the forward
for all of them (`ForwardLifecycle.begin`, `take_group_blocks`): in every layer group it takes blocks for the real new
tokens (all or nothing) and records which positions are padding. Each group and device then gets one `SlotIndex` of slot
ids (`build_index`), shared by the group's layers on that device and by keys and values alike. How attention reads those
slots (each row's keys and queries, or a decode forward's `DecodeReads`) is laid out from the index, once per forward,
by `hf_paged_cache.attention.reading`.

A sliding-window group stores only the tokens its next queries can see (`keep_from`): in a forward longer than the
window (a long prefill), the earliest new tokens get no slot, unless their block is held already (a block filled in part
by the forward before is completed, so that it is whole if it is found by prefix). The forward's own queries still see
them: attention then takes the forward's new keys and values from the layer's states (`new_from_states`) and only the
past ones from the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention.reading import build_decode_reads, build_query_rows, build_row_keys
from ..attention.reads import DecodeReads, QueryRows, RowKeys
from ..errors import PoolExhaustedError
from ..pool.kv_pool import KVPool
from .block_table import BlockTables, RowsView, TablesSavepoint, slots_for_positions
from .row_states import StatesSavepoint


@dataclass
class SlotIndex:
    """Where one forward's tokens go and where every position is read from, on one device."""

    write_slots: torch.Tensor  # [N] pool slot of each stored new token
    write_rows: torch.Tensor | None  # [N] index into the flattened [B * q] new tokens; None = all of them
    rows: RowsView  # the group's block tables with the forward's blocks taken (unchanged until the forward ends)
    is_real: torch.Tensor  # [B, L + q] False where a position is padding
    past_length: int  # L: positions before this forward's
    new_from_states: bool = False  # some real new tokens have no slot: attention reads new K/V from the states
    repeats: list[int] | None = None  # per row, the first row it repeats (`Step.repeats`)
    _read_slots: torch.Tensor | None = None  # read_slots, once made
    _row_keys: dict[int, RowKeys] = field(default_factory=dict)  # row_keys, per offset
    _queries: QueryRows | None = None
    _decode_reads: dict[tuple[int, int | None, bool], DecodeReads | None] = field(default_factory=dict)

    @property
    def read_slots(self) -> torch.Tensor:
        """``[B, L + q]`` pool slot of every position (padding: the null block), made on first use: a decode forward
        whose rows attend from views of the pool (`decode_plan`) never needs it."""
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

        Computed once per forward for all layers alike (`build_row_keys`).
        """
        keys = self._row_keys.get(offset)
        if keys is None:
            keys = self._row_keys[offset] = build_row_keys(self, offset)
        return keys

    def decode_reads(self, offset: int, window: int | None, views: bool = True) -> DecodeReads | None:
        """For a decode forward (one real new token per row, every key in the pool): how its rows read their keys
        (`build_decode_reads`), else None.

        Positions ``offset:pool_end`` in the cache's column layout; the mask keeps real keys inside the window
        of the query at position ``L``. Computed once per forward for all layers alike. `views`: whether the
        storage can be read as views (stored as the model computes).
        """
        key = (offset, window, views)
        if key not in self._decode_reads:
            self._decode_reads[key] = build_decode_reads(self, offset, window, views)
        return self._decode_reads[key]

    def queries(self) -> QueryRows:
        """The forward's new tokens per row: positions, the indices of the real ones, their first and last
        (`build_query_rows`)."""
        if self._queries is None:
            self._queries = build_query_rows(self)
        return self._queries


@dataclass
class Forward:
    """The layout of the forward in progress, made once by its first layer and used by all of them.

    A forward is all or nothing: it is committed when the forward that made it has ended well (or, without the
    model's forward hook, when the last layer has written its keys and values; or by `PagedCache.commit` for
    a cache with ``manual_commit``), and until then `undo` holds what a rollback restores.
    """

    batch_size: int
    query_length: int
    past_length: int
    all_real: bool  # no padding among the new tokens
    undo: ForwardUndo
    keep_from: list[list[int] | None]  # per group, each row's first token kept (sliding windows); None = all
    num_layers: int  # layers that write the forward: it is complete when all of them have
    # per row, the first row it repeats (the same new token ids, padding and positions in a first forward:
    # it shares that row's blocks and keys); None when no row repeats another
    repeats: list[int] | None = None
    from_pool: bool = False  # attention (paged_sdpa) reads K/V straight from the pool: no dense gather
    thread: int = 0  # threading.get_ident() of the thread running the forward
    commit_at_end: bool = False  # the model's forward hook keeps (or drops) it when the forward ends
    drafts: int = 0  # each row's last new tokens that `commit` may drop (speculative decoding's drafts)
    layers_done: int = 0
    index: dict[tuple[int, torch.device], SlotIndex] = field(default_factory=dict)  # per (group, device)

    @property
    def length(self) -> int:
        return self.past_length + self.query_length

    @property
    def complete(self) -> bool:
        """Every layer has written its keys and values."""
        return self.layers_done == self.num_layers


@dataclass
class ForwardUndo:
    """The cache as it was before a forward began."""

    tables: list[TablesSavepoint]  # per layer group
    is_real: torch.Tensor  # [B, L] the padding mask before the forward
    states: StatesSavepoint = field(default_factory=StatesSavepoint)  # the rows' state slots (`RowStates.savepoint`)


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
        stored: tokens each row stored before this forward.
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
    # lists, not tensor ops: a decode forward (one token per row) has a few values, and a prefill's are
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
    """Each row's first token that a sliding window of `window` still needs after a forward (None: all of them).

    The next query sits at position ``L`` (`is_real` is ``[B, L]`` after the forward) and sees keys
    ``k > L - W``: the tokens before that position are no longer needed.
    """
    start = is_real.shape[1] - window + 1 if window is not None else 0
    if start <= 0:
        return None
    return is_real[:, :start].sum(dim=1).tolist()


def take_group_blocks(
    tables: BlockTables,
    pool: KVPool,
    group: int,
    new_tokens: list[int],
    token_ids: list[list[int] | None] | None,
    keep: list[int] | None,
) -> None:
    """Take one layer group's blocks for a forward's real new tokens (all or nothing) and copy shared last blocks.

    Args:
        new_tokens: per row of `tables`, its real new tokens.
        token_ids: per row, the real new tokens' ids when they can key prefix blocks (`prefix_token_ids`).
        keep: per row, its first token still needed after the forward (`keep_from`); None keeps every token.
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


def build_index(
    forward: Forward, group: int, tables: BlockTables, is_real: torch.Tensor, device: torch.device
) -> SlotIndex:
    """Layer group `group`'s write and read slots on `device` (made once, then reused by the group's layers).

    Args:
        is_real: ``[B, L + q]`` bool over every position including this forward's, False for padding.
    """
    index = forward.index.get((group, device))
    if index is None:
        is_real, rows = is_real.to(device), tables.view()  # [B, L + q]
        plain = forward.keep_from[group] is None and forward.repeats is None
        if forward.query_length == 1 and forward.all_real and plain:
            # a decode forward: each row's new token is its last stored one, found in its block list (no tensor op)
            size = rows.block_size
            last = [table[(n - 1) // size] * size + (n - 1) % size for table, n in zip(rows.tables, rows.num_tokens)]
            index = SlotIndex(torch.tensor(last, device=device), None, rows, is_real, forward.past_length)
        else:
            index = _full_index(forward, group, rows, is_real)
        forward.index[(group, device)] = index
    return index


def _full_index(forward: Forward, group: int, rows: RowsView, is_real: torch.Tensor) -> SlotIndex:
    """The slot index of any forward, from the slots of all its positions (padding, a window, repeated rows)."""
    slots = position_slots(rows, is_real)  # [B, L + q]
    new_real = is_real[:, forward.past_length :]  # [B, q]
    written, new_from_states = new_real, False  # [B, q] new tokens that get a slot
    if forward.keep_from[group] is not None:
        # a new token is written wherever its block is held (the null block's slots are below block_size):
        # tokens before the first block the window keeps get no slot, except in a block held already
        written = new_real & (slots[:, forward.past_length :] >= rows.block_size)
        new_from_states = bool((written != new_real).any())
    if forward.repeats is not None:  # a repeated row's tokens are the first's
        writers = torch.tensor([first == row for row, first in enumerate(forward.repeats)], device=is_real.device)
        written = written & writers.unsqueeze(1)  # [B, q]
    if written is new_real and forward.all_real:
        write_slots, write_rows = slots[:, forward.past_length :].reshape(-1), None
    else:
        write_slots = slots[:, forward.past_length :][written]  # [N]
        write_rows = written.reshape(-1).nonzero().squeeze(1)  # [N]
    return SlotIndex(
        write_slots, write_rows, rows, is_real, forward.past_length, new_from_states, forward.repeats, slots
    )


def position_slots(rows: RowsView, is_real: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` pool slot of every position of `rows` (padding: the null block's), on `is_real`'s device."""
    return slots_for_positions(rows.as_tensor(is_real.device), is_real, rows.block_size)
