"""What attention reads from the pool: the reads `PagedCache.update` leaves for `paged_sdpa`.

The dense path gathers a padded ``[B, heads, kv_length, dim]`` copy of every row's history for every layer
and then computes attention over the padding too. Here `PagedCache.update` writes the new keys and values
into the pool and leaves a `PagedAttentionInputs` in the attention kwargs instead (transformers passes the
same dict to ``cache.update`` and to the attention function): the layer's storage, and where each row's keys
lie in it. A prefill or a chunk carries, per row, the slots and positions of its real keys (`RowKeys`) and
which of its new tokens are real (`QueryRows`), read row by row (`prefill`); a decode forward carries one
`DecodeReads` instead, made once per forward for all layers (`reading.build_decode_reads`): its rows grouped by
length over padded keys (`KeyGroup`), or each row's run of consecutive slots, the keys every row shares
(`SharedPrefix`) and the rows' block tables, read as `decode` chooses. A packed forward carries one set of
inputs per segment (`PackedAttentionInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..pool.kv_format import StoredStates
from ..pool.locks import SharedExclusiveLock
from .flex_decode import BlockRows, FlexDecodeReads, build_flex_decode_reads

PAST_EVERY_QUERY = 1 << 62
"""A key position no query sees: what padding keys are given (a power of two, which float padding values keep
exact)."""
PAGED_INPUTS = "paged_attention_inputs"
"""The attention-kwargs key under which `PagedCache.update` leaves a `PagedAttentionInputs` for `paged_sdpa`."""
RUNNING_CACHE = "paged_running_cache"
"""The keyword a compiled forward hands the model (``True``), which transformers passes on to each attention call:
``paged_sdpa`` then attends through ``torch.ops.hf_paged_cache.running_cache_attention`` (`compiled`), which stores
into and reads from the cache of the forward running on this thread."""


@dataclass
class RowKeys:
    """Where each row's keys for one window offset live in a layer's ``[H, slots, D]`` storage."""

    slots: list[torch.Tensor]  # per row b: [n_b] pool slots of its real keys
    positions: list[torch.Tensor]  # per row b: [n_b] their logical positions
    spans: list[tuple[int, int]]  # per row b: its first and last key position (n_b >= 1 for a row with queries)
    # per row b: its real positions before the first one read (a sliding window's keys out of every query's reach)
    before: list[int] = field(default_factory=list)
    # key_tile -> ([B, n'] slots, [B, n'] positions): every row's keys from the first column, padded to a multiple
    # of key_tile positions with the null block's slot 0 (zeros) at a position past every query (`invariant`)
    _padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    # (key_tile, heads, storage slots) -> `row_major`
    _row_major: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    # (tile, stored width, whether new tokens follow) -> `by_real_index`
    _by_real_index: dict[tuple[int, int, bool], torch.Tensor] = field(default_factory=dict, repr=False)

    def padded(self, key_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, n'], [B, n'])``: every row's slots and positions from the first column, padded at the end to
        ``n'``, the longest row's count rounded up to `key_tile` (slot 0: the null block, which reads zeros;
        position: past every query). Made once per forward, by the first layer that asks."""
        if key_tile not in self._padded:
            longest = max(max(s.shape[0] for s in self.slots), 1)
            length = -(-longest // key_tile) * key_tile
            beyond = PAST_EVERY_QUERY
            slots = pad_sequence(self.slots, batch_first=True, padding_value=0)  # [B, n_max]
            positions = pad_sequence(self.positions, batch_first=True, padding_value=beyond)
            self._padded[key_tile] = (F.pad(slots, (0, length - slots.shape[1]), value=0),  # [B, n']
                                      F.pad(positions, (0, length - positions.shape[1]), value=beyond))
        return self._padded[key_tile]

    def row_major(self, key_tile: int, heads: int, capacity: int) -> torch.Tensor:
        """``[B * H * n']``: the rows of a ``[H * capacity, D]`` view of ``[H, capacity, D]`` storage that hold the
        `padded` slots, row after row, then head after head: one ``index_select`` gives ``[B, H, n', D]``."""
        key = (key_tile, heads, capacity)
        if key not in self._row_major:
            slots = self.padded(key_tile)[0]  # [B, n']
            offsets = torch.arange(heads, device=slots.device).view(1, heads, 1) * capacity  # [1, H, 1]
            self._row_major[key] = (offsets + slots.unsqueeze(1)).view(-1)  # [B, H, n'] -> [B * H * n']
        return self._row_major[key]

    def by_real_index(self, tile: int, width: int, new: QueryRows | None) -> torch.Tensor:
        """``[B, n']``: where each column of every row's keys comes from, for keys laid out by their index among the
        row's real tokens: column j of row b holds the key of real index ``tile * (r_b // tile) + j``, where r_b is
        the index of the row's first key read (`before`), so that columns ``tile * k`` on always hold the same keys
        of a row whatever the forward reads (a sliding window's first key read moves with the forward). Sources: 0
        is a null key, ``1 + i`` the i-th of a row's `padded` stored keys (`width` columns), ``1 + width + i`` the
        forward's i-th new token (with `new`: a window's longer forward, whose new keys are not all stored; its real
        ones follow the stored keys). ``n'``: the longest row's columns, rounded up to `tile`. Made once per forward.
        """
        key = (tile, width, new is not None)
        if key not in self._by_real_index:
            rows = []
            for b, (slots, before) in enumerate(zip(self.slots, self.before, strict=True)):
                sources = [0] * (before % tile) + list(range(1, 1 + slots.shape[0]))
                if new is not None:
                    picked = new.picked[b]
                    fresh = range(new.positions.shape[0]) if picked is None else picked.tolist()
                    sources += [1 + width + i for i in fresh]
                rows.append(sources)
            length = -(-max(max(map(len, rows)), 1) // tile) * tile
            index = [row + [0] * (length - len(row)) for row in rows]
            self._by_real_index[key] = torch.tensor(index, dtype=torch.long, device=self.slots[0].device)
        return self._by_real_index[key]


@dataclass
class QueryRows:
    """The forward's new tokens (queries) of each row: which are real, and where they sit."""

    positions: torch.Tensor  # [q] logical positions of the new tokens (the same for every row)
    picked: list[torch.Tensor | None]  # per row: indices of its real new tokens; None = all of them
    spans: list[tuple[int, int] | None]  # per row: first and last real query position; None = all padding
    # per row, the first row it repeats: the same new tokens at the same positions, reading the same keys
    # (a first forward's repeated prompts: beams, samples); None when no row repeats another
    repeats: list[int] | None = None


@dataclass
class SharedPrefix:
    """Keys every row of a decode forward shares, in consecutive slots: attended once for all rows (cascade).

    The rows' first `count` key positions read the same slots ``first .. first + count - 1`` (beams, or
    samples of one prompt, reading their prompt's blocks): one SDPA call over a view of them serves every
    row's queries, a second over each row's own tail (`tail_slots`, gathered), and the two partial softmaxes
    are merged by their log-sum-exp. The tail always holds the row's new token, so it is never empty.
    """

    first: int
    count: int
    tail_slots: torch.Tensor  # [B * kv'] pool slots of the positions after the prefix, row after row
    # [B, 1, 1, kv'] float32 mask for those positions, additive (0 where seen, -inf where not): the SDPA
    # kernel that returns the log-sum-exp takes no boolean mask; built once per forward for all layers
    tail_mask: torch.Tensor


@dataclass
class KeyGroup:
    """Rows of a decode forward attended in one SDPA call, over their last `length` key positions (the cache's
    column layout: a shorter row's first ones are padding, masked)."""

    rows: torch.Tensor | None  # [n] which rows of the forward, ascending; None = all of them, as one group
    length: int  # kv: the key positions read for each of its rows
    mask: torch.Tensor | None  # [n, 1, 1, kv] True where the row's one query sees the key; None = it sees all


@dataclass
class DecodeReads:
    """How a decode forward's rows read their keys, laid out once for all layers: rows grouped by length, each group's
    keys padded to its longest (`slots`, `groups`), or each row's run of consecutive slots (`runs`); the keys all
    rows share (`shared`, for the cascade) and the rows' block tables (`blocks`, for ``paged_flex``)."""

    # [sum of n * kv over groups] pool slots of every group's positions, group after group, row after row
    # (padding: null); None with `runs`
    slots: torch.Tensor | None
    groups: list[KeyGroup]  # empty with `runs`
    # per row (first slot, count) when each row's keys fill consecutive slots, all seen by its query: then each
    # row attends from a view of the pool, with no copy (up to reading.ZERO_COPY_MAX_ROWS rows)
    runs: list[tuple[int, int]] | None = None
    # the keys all rows share, when enough of them sit in consecutive slots (`slots` and `groups` stay whole,
    # for attention that cannot merge partial softmaxes: soft-capping, sinks, dropout)
    shared: SharedPrefix | None = None
    # the rows' block tables, when every key of a row is in its blocks from the first (no sliding window): what
    # `flex_plan` reads for ``paged_flex``
    blocks: BlockRows | None = None
    # (heads, storage slots) -> `row_major_rows` of that storage: the same for every layer of the forward
    _row_major: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    # (query heads per key/value head, storage slots) -> `flex_plan`: likewise
    _flex: dict[tuple[int, int], FlexDecodeReads] = field(default_factory=dict, repr=False)

    def flex_reads(self, groups: int, capacity: int, device: torch.device) -> FlexDecodeReads:
        """The forward's block mask for ``paged_flex`` (`build_flex_decode_reads`), made by the first layer that
        asks."""
        key = (groups, capacity)
        if key not in self._flex:
            self._flex[key] = build_flex_decode_reads(self.blocks, groups, capacity, device)
        return self._flex[key]

    def row_major_rows(self, heads: int, capacity: int) -> torch.Tensor:
        """``[N * H]``: the rows of a ``[H * capacity, D]`` view of ``[H, capacity, D]`` storage that hold every
        group's keys, group after group and, within a group, row after row, then head after head: so one
        ``index_select`` gives each group's keys as a contiguous ``[n, H, kv, D]``, SDPA's own layout."""
        key = (heads, capacity)
        if key not in self._row_major:
            offsets = torch.arange(heads, device=self.slots.device).view(1, heads, 1) * capacity  # [1, H, 1]
            shapes = self.group_shapes()
            parts = self.slots.split([rows * length for rows, length in shapes])  # per group [n * kv]
            self._row_major[key] = torch.cat([
                (offsets + part.view(rows, 1, length)).reshape(-1)  # [n, H, kv] -> [n * H * kv]
                for part, (rows, length) in zip(parts, shapes)
            ])
        return self._row_major[key]

    def group_shapes(self) -> list[tuple[int, int]]:
        """Each group's ``(n, kv)``: its rows, and the key positions read for each (its ``n * kv`` slots in
        `slots`)."""
        if self.groups[0].rows is None:  # one group of every row
            length = self.groups[0].length
            return [(self.slots.shape[0] // length, length)]
        return [(len(group.rows), group.length) for group in self.groups]


@dataclass
class PagedAttentionInputs:
    """What `paged_sdpa` needs to attend to one layer's keys and values in the pool."""

    keys: StoredStates  # the layer's stored keys, [H, slots, key_dim], read as the model's dtype
    values: StoredStates  # [H, slots, value_dim] likewise
    num_kv_heads: int
    row_keys: RowKeys | None  # None with `decode_plan` (a decode forward attends its rows in groups, not one by one)
    queries: QueryRows | None  # likewise
    window: int | None  # the layer's sliding window
    lock: SharedExclusiveLock  # held while reading the storage (another thread may grow it)
    # ([B, H, q, key_dim], [B, H, q, value_dim]) the forward's new keys and values, when some have no slot
    # (a sliding window longer forward): `row_keys` then covers the past only and the new ones come from here
    new_states: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_reads: DecodeReads | None = None  # a decode forward's (one real new token per row, keys all in the pool)
    batch_invariant: bool = False  # attend each query as if alone (`invariant`): `row_keys` and `queries` are set


@dataclass(frozen=True)
class SegmentSpan:
    """Where one segment of a packed forward sits: ``rows x length`` tokens from index `start`, row after row."""

    start: int
    rows: int
    length: int

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[rows, heads, length, dim]``: this segment's slice of packed ``[1, heads, T, dim]`` states."""
        heads, dim = packed.shape[1], packed.shape[-1]
        own = packed[0, :, self.start : self.start + self.rows * self.length]  # [heads, rows * length, dim]
        return own.reshape(heads, self.rows, self.length, dim).transpose(0, 1)


@dataclass
class PackedAttentionInputs:
    """A packed forward's segments (`hf_paged_cache.cache.packed_forward`): where each sits, and its own attention
    inputs."""

    spans: list[SegmentSpan]
    inputs: list[PagedAttentionInputs]


def by_row(gathered: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[B, H, kv, D]``: keys (or values) gathered for `batch_size` rows of ``kv`` slots each, ``[H, B * kv, D]``
    (a view: each row's heads stay contiguous, which is all SDPA needs)."""
    heads, _, dim = gathered.shape
    return gathered.view(heads, batch_size, -1, dim).transpose(0, 1)
