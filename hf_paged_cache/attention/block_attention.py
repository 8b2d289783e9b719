"""Attention straight from the block pool: each row attends to its own real tokens, with no padded copy.

The dense path gathers a padded ``[B, heads, kv_length, dim]`` copy of every row's history for every layer
and then computes attention over the padding too. Here `PagedCache.update` writes the new keys and values
into the pool and leaves a `PagedAttentionInputs` in the attention kwargs instead (transformers passes the
same dict to ``cache.update`` and to the attention function); `attend_from_pool` then reads, for each row,
the keys and values of its real tokens only (one gather each by slot: the pool is head-major, so SDPA gets
contiguous heads) and runs SDPA on them, with the grouped query heads folded into the query rows of their
key/value head.

A decode step (one new token per row, all real) is the exception: there a loop over rows costs more than it
saves (two gathers and one SDPA call per row and layer), and one padded call over all rows attends over the
padding of the short rows. So the rows are grouped by length (`KeyGroup`, planned once per step): each group's
keys are gathered padded to its longest row (all groups' in one gather, which several threads share:
`gathers_rows`) and attended in one masked call, the grouping chosen to minimize the keys read plus a fixed
cost per call (`cache.step.length_groups`): an SDPA call, or, with ``decode="products"`` (``paged_bmm``), in
float32, two batched matrix products and a softmax (`product_attention`), faster on CPUs at two threads but
equal to SDPA only up to float32 rounding. With ``decode="flex"`` (``paged_flex``), a float32 decode step on a CPU
whose rows fall in two groups or more copies nothing: a compiled `flex_attention` reads each row's blocks in
place (`flex_decode`). When every row's keys fill consecutive slots (a row alone, whose
blocks follow each other, or a fresh batch), each row attends instead from a strided view of the pool, with no
copy at all. When the rows share their first keys in consecutive slots (beams, or samples of one prompt,
reading the prompt's blocks), the shared keys are attended once for all rows from a view and only each row's
own tail is gathered; the two partial softmaxes merge by their log-sum-exp (`SharedPrefix`, cascade
attention). At more than one thread, float32 decode steps hand SDPA each query head as a row of its own rather
than folded into its key/value head's rows, which gives the threads more work to share (`splits_query_heads`).

A first forward's rows that repeat an earlier row (the same prompt: `generate` repeats it for beams and samples,
`QueryRows.repeats`) share that row's blocks, so they read the same keys and values: a repeat whose queries equal
its first row's (compared, bit for bit) takes that row's attention output instead of attending again.

A packed forward (`hf_paged_cache.serving.packed`) holds several caches' new tokens in one ``[1, T]`` sequence:
`attend_packed` cuts the queries into each segment's ``[rows, Hq, q, D]`` and attends each from its own
cache as above.

Masks are built from logical positions, as transformers builds its own: a query at position ``p`` sees the
stored keys at positions ``k <= p`` (causal) and, on a sliding layer of window ``W``, ``k > p - W``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..pool.kv_format import StoredStates
from ..pool.locks import SharedExclusiveLock
from .flex_decode import BlockRows, FlexDecodePlan, attend_flex, flex_decode_applies, plan_flex_decode

PAGED_INPUTS = "paged_attention_inputs"
"""The attention-kwargs key under which `PagedCache.update` leaves a `PagedAttentionInputs` for `paged_sdpa`."""

DECODE_KERNELS = ("sdpa", "products", "flex")
"""How a decode step's rows attend: SDPA over gathered keys (``paged_sdpa``), batched products over them in
float32 (``paged_bmm``, `product_attention`), or a compiled `flex_attention` reading the blocks in place
(``paged_flex``, `flex_decode`)."""


@dataclass
class RowKeys:
    """Where each row's keys for one window offset live in a layer's ``[H, slots, D]`` storage."""

    slots: list[torch.Tensor]  # per row b: [n_b] pool slots of its real keys
    positions: list[torch.Tensor]  # per row b: [n_b] their logical positions
    spans: list[tuple[int, int]]  # per row b: its first and last key position (n_b >= 1 for a row with queries)


@dataclass
class QueryRows:
    """The step's new tokens (queries) of each row: which are real, and where they sit."""

    positions: torch.Tensor  # [q] logical positions of the new tokens (the same for every row)
    picked: list[torch.Tensor | None]  # per row: indices of its real new tokens; None = all of them
    spans: list[tuple[int, int] | None]  # per row: first and last real query position; None = all padding
    # per row, the first row it repeats: the same new tokens at the same positions, reading the same keys
    # (a first forward's repeated prompts: beams, samples); None when no row repeats another
    repeats: list[int] | None = None


@dataclass
class SharedPrefix:
    """Keys every row of a decode step shares, in consecutive slots: attended once for all rows (cascade).

    The rows' first `count` key positions read the same slots ``first .. first + count - 1`` (beams, or
    samples of one prompt, reading their prompt's blocks): one SDPA call over a view of them serves every
    row's queries, a second over each row's own tail (`tail_slots`, gathered), and the two partial softmaxes
    are merged by their log-sum-exp. The tail always holds the row's new token, so it is never empty.
    """

    first: int
    count: int
    tail_slots: torch.Tensor  # [B * kv'] pool slots of the positions after the prefix, row after row
    # [B, 1, 1, kv'] float32 mask for those positions, additive (0 where seen, -inf where not): the SDPA
    # kernel that returns the log-sum-exp takes no boolean mask; built once per step for all layers
    tail_mask: torch.Tensor


@dataclass
class KeyGroup:
    """Rows of a decode step attended in one SDPA call, over their last `length` key positions (the cache's
    column layout: a shorter row's first ones are padding, masked)."""

    rows: torch.Tensor | None  # [n] which rows of the step, ascending; None = all of them, as one group
    length: int  # kv: the key positions read for each of its rows
    mask: torch.Tensor | None  # [n, 1, 1, kv] True where the row's one query sees the key; None = it sees all


@dataclass
class PaddedKeys:
    """A decode step's keys for batched SDPA calls: rows grouped by length, each group's keys padded to its longest."""

    # [sum of n * kv over groups] pool slots of every group's positions, group after group, row after row
    # (padding: null); None with `runs`
    slots: torch.Tensor | None
    groups: list[KeyGroup]  # empty with `runs`
    # per row (first slot, count) when each row's keys fill consecutive slots, all seen by its query: then each
    # row attends from a view of the pool, with no copy (up to cache.step.ZERO_COPY_MAX_ROWS rows)
    runs: list[tuple[int, int]] | None = None
    # the keys all rows share, when enough of them sit in consecutive slots (`slots` and `groups` stay whole,
    # for attention that cannot merge partial softmaxes: soft-capping, sinks, dropout)
    shared: SharedPrefix | None = None
    # the rows' block tables, when every key of a row is in its blocks from the first (no sliding window): what
    # `flex_plan` reads for ``paged_flex``
    blocks: BlockRows | None = None
    # (heads, storage slots) -> `row_major_rows` of that storage: the same for every layer of the step
    _row_major: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    # (query heads per key/value head, storage slots) -> `flex_plan`: likewise
    _flex: dict[tuple[int, int], FlexDecodePlan] = field(default_factory=dict, repr=False)

    def flex_plan(self, groups: int, capacity: int, device: torch.device) -> FlexDecodePlan:
        """The step's block mask for ``paged_flex`` (`plan_flex_decode`), made by the first layer that asks."""
        key = (groups, capacity)
        if key not in self._flex:
            self._flex[key] = plan_flex_decode(self.blocks, groups, capacity, device)
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
    row_keys: RowKeys | None  # None with `padded` (a decode step attends its rows in groups, not one by one)
    queries: QueryRows | None  # likewise
    window: int | None  # the layer's sliding window
    lock: SharedExclusiveLock  # held while reading the storage (another thread may grow it)
    # ([B, H, q, key_dim], [B, H, q, value_dim]) the step's new keys and values, when some have no slot
    # (a sliding window longer step): `row_keys` then covers the past only and the new ones come from here
    new_states: tuple[torch.Tensor, torch.Tensor] | None = None
    padded: PaddedKeys | None = None  # set for a decode step (one real new token per row, keys all in the pool)


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
    """A packed forward's segments (`hf_paged_cache.serving.packed`): where each sits, and its own attention inputs."""

    spans: list[SegmentSpan]
    inputs: list[PagedAttentionInputs]


def attend_packed(
    query: torch.Tensor,
    packed: PackedAttentionInputs,
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
    decode: str = "sdpa",
) -> torch.Tensor:
    """Attention of a packed `query` ``[1, Hq, T, D]``, each segment from its own rows; returns ``[1, T, Hq, Dv]``."""
    outs = []
    for span, inputs in zip(packed.spans, packed.inputs, strict=True):
        own = span.unpack(query).contiguous()  # [rows, Hq, length, D]
        # [rows, length, Hq, Dv]
        out = attend_from_pool(own, inputs, scaling, softcap, sinks, dropout, decode)
        outs.append(out.reshape(1, span.rows * span.length, *out.shape[2:]))
    return torch.cat(outs, dim=1)


def attend_from_pool(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
    decode: str = "sdpa",
) -> torch.Tensor:
    """Attention of `query` ``[B, Hq, q, D]`` over each row's stored keys; returns ``[B, q, Hq, Dv]``.

    Padding queries (new tokens that are padding) are not computed: their output is zero.
    `decode`: how a decode step's rows attend (one of `DECODE_KERNELS`).
    """
    if inputs.padded is not None:
        return _attend_decode(query, inputs, inputs.padded, scaling, softcap, sinks, dropout, decode)
    batch_size, query_heads, query_length, _ = query.shape
    heads = inputs.num_kv_heads
    groups = query_heads // heads
    key_dim, value_dim = inputs.keys.dim, inputs.values.dim
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    row_sinks = None if sinks is None else sinks.view(1, heads, groups, 1)  # [1, H, g, 1]
    # a row that repeats an earlier one reads the same keys and values; with the same queries too, it has the
    # same outputs (not with dropout, nor with new keys of its own from the states)
    repeats = inputs.queries.repeats if dropout == 0.0 and inputs.new_states is None else None
    outs = []
    with inputs.lock.shared():
        stored = _every_row_read(inputs)
        for b in range(batch_size):
            if repeats is not None and repeats[b] != b and torch.equal(query[b], query[repeats[b]]):
                outs.append(outs[repeats[b]])
                continue
            picked, query_span = inputs.queries.picked[b], inputs.queries.spans[b]
            if query_span is None:  # this chunk of the row is all padding (chunked prefill): nothing to compute
                outs.append(query.new_zeros(1, query_heads, query_length, value_dim))
                continue
            keys, values, key_positions, key_span = _row_keys_and_values(inputs, b, picked, query_span, stored)
            row_query = query[b : b + 1] if picked is None else query[b : b + 1].index_select(2, picked)
            q_len = row_query.shape[2]  # row_query: [1, Hq, q', D]
            plain = softcap is None and row_sinks is None
            if plain and _plain_causal(inputs.window, key_span, key_positions, q_len, query_span):
                # the row's keys are exactly its queries (a prefill from empty): SDPA's own causal kernel
                row_out = F.scaled_dot_product_attention(
                    row_query, keys, values, is_causal=True, dropout_p=dropout, scale=scale, enable_gqa=groups > 1
                )  # [1, Hq, q', Dv]
                outs.append(_place(row_out, picked, query, query_length))
                continue
            query_positions = inputs.queries.positions if picked is None else inputs.queries.positions[picked]
            mask = _row_mask(inputs.window, key_span, key_positions, query_positions, query_span)  # [q', n] or None
            # [1, H, g * q', D]: query head kv * g + j reads key/value head kv; 4-D takes SDPA's fused CPU kernel
            row_query = row_query.reshape(1, heads, groups * q_len, key_dim)
            if mask is not None:
                mask = mask.repeat(groups, 1)  # [g * q', n]
            if softcap is None and row_sinks is None:
                row_out = F.scaled_dot_product_attention(
                    row_query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scale
                )  # [1, H, g * q', Dv]
            else:
                sink_logits = None if row_sinks is None else row_sinks.expand(-1, -1, -1, q_len).reshape(
                    1, heads, groups * q_len, 1
                )
                row_out = explicit_attention(row_query, keys, values, mask, scale, softcap, sink_logits, dropout)
            outs.append(_place(row_out.view(1, query_heads, q_len, value_dim), picked, query, query_length))
    return torch.cat(outs).transpose(1, 2).contiguous()  # [B, q, Hq, Dv]


def _attend_decode(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    padded: PaddedKeys,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
    decode: str,
) -> torch.Tensor:
    """One new token per row: each group of rows at once over its padded keys (or views, or the cascade, or in
    place by `flex_decode`); returns ``[B, 1, Hq, Dv]``. `decode`: one of `DECODE_KERNELS` (``products``: float32
    groups by `product_attention`; ``flex``: float32 rows read in place; both on plain storage only)."""
    batch_size, query_heads, _, key_dim = query.shape
    heads = inputs.num_kv_heads
    groups = query_heads // heads
    scale = scaling if scaling is not None else key_dim**-0.5
    sink_logits = None if sinks is None else sinks.view(1, heads, groups, 1)
    explicit = softcap is not None or sinks is not None
    split_heads = groups > 1 and not explicit and query.dtype == torch.float32 and splits_query_heads()

    def call(row_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None):
        # one call over rows of queries, [n, Hq, 1, D] with split_heads else [n, H, g, D], and their [n, H, kv, D]
        # keys (a mask: [n, 1, 1, kv]); returns the queries' layout with Dv
        if explicit:
            return explicit_attention(row_query, keys, values, mask, scale, softcap, sink_logits, dropout)
        return F.scaled_dot_product_attention(
            row_query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=split_heads
        )

    plain = softcap is None and sinks is None and dropout == 0.0
    # rows alike (one group) are attended as fast by one SDPA call over their gathered keys (`flex_decode`)
    if decode == "flex" and plain and padded.blocks is not None and len(padded.groups) > 1:
        keys, values = inputs.keys.plain, inputs.values.plain  # [H, slots, D] or None
        if values is not None and flex_decode_applies(query, keys):
            with inputs.lock.shared():  # the storage is read in place
                plan = padded.flex_plan(groups, keys.shape[1], query.device)
                out = attend_flex(query, keys, values, plan, scale)
            if out is not None:
                return out
    if padded.runs is not None:
        with inputs.lock.shared():  # views of the storage: read them before letting the lock go
            return _attend_views(query, inputs, padded.runs, split_heads, call)
    # [B, H, g, D]: query head kv * g + j reads key/value head kv, its g heads as g query rows
    grouped = query.view(batch_size, heads, groups, key_dim)

    def attend(row_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None):
        # [n, H, g, Dv] from [n, H, g, D] queries over [n, H, kv, D] keys (a mask: [n, 1, 1, kv])
        rows = row_query.shape[0]
        if split_heads:
            row_query = row_query.reshape(rows, query_heads, 1, key_dim)  # [n, Hq, 1, D]
        return call(row_query, keys, values, mask).view(rows, heads, groups, -1)  # -> [n, H, g, Dv]

    with inputs.lock.shared():
        if padded.shared is not None and plain:
            out = _attend_cascade(grouped, inputs, padded.shared, scale)  # [B, H, g, Dv]
            return out.reshape(batch_size, 1, query_heads, -1)
        key_storage, value_storage = inputs.keys.plain, inputs.values.plain  # [H, slots, D] or None
        plain_storage = key_storage is not None and value_storage is not None
        by_products = decode == "products" and plain and query.dtype == torch.float32 and plain_storage
        row_major = plain_storage and (by_products or gathers_rows())
        if row_major:
            keys, values = _gather_row_major(key_storage, padded), _gather_row_major(value_storage, padded)
        else:
            keys = inputs.keys.gather(padded.slots)  # [H, N, D]: every group's keys, one copy
            values = inputs.values.gather(padded.slots)  # [H, N, Dv]
    # per group [n, H, kv, D] (contiguous when gathered row-major)
    key_parts, value_parts = _group_parts(keys, padded, row_major), _group_parts(values, padded, row_major)

    def attend_group(
        row_query: torch.Tensor, group_keys: torch.Tensor, group_values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # [n, H, g, Dv] from [n, H, g, D] queries over the group's [n, H, kv, D] keys
        if by_products:
            return product_attention(row_query, group_keys, group_values, mask, scale)
        return attend(row_query, group_keys, group_values, mask)

    if padded.groups[0].rows is None:  # one group of every row
        out = attend_group(grouped, key_parts[0], value_parts[0], padded.groups[0].mask)
        return out.reshape(batch_size, 1, query_heads, -1)  # [B, H, g, Dv] -> [B, 1, Hq, Dv]
    out = grouped.new_empty(batch_size, heads, groups, value_parts[0].shape[-1])  # [B, H, g, Dv]
    for group, group_keys, group_values in zip(padded.groups, key_parts, value_parts):
        out.index_copy_(0, group.rows, attend_group(grouped[group.rows], group_keys, group_values, group.mask))
    return out.reshape(batch_size, 1, query_heads, -1)


def _attend_views(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    runs: list[tuple[int, int]],
    split_heads: bool,
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> torch.Tensor:
    """``[B, 1, Hq, Dv]``: a decode step whose rows each hold their keys in one run of consecutive slots, each row
    attending from views of the storage (no copy, one call per row). Call with the storage lock held.

    Args:
        query: ``[B, Hq, 1, D]``; runs: per row, its ``(first slot, count)``; split_heads: whether `call` takes
            the query heads one by one (`splits_query_heads`); call: `_attend_decode`'s attention over rows of
            queries and their keys and values.
    """
    batch_size, query_heads, _, key_dim = query.shape
    heads = inputs.num_kv_heads
    # [B, Hq, 1, D] as given when the query heads go one by one, else [B, H, g, D]: query head kv * g + j reads
    # key/value head kv, its g heads as g query rows
    rows = query if split_heads else query.view(batch_size, heads, query_heads // heads, key_dim)
    outs = [
        call(rows if batch_size == 1 else rows[b : b + 1], inputs.keys.run(*run), inputs.values.run(*run), None)
        for b, run in enumerate(runs)
    ]  # per row, read from [1, H, n, D] views of its keys and values
    out = outs[0] if batch_size == 1 else torch.cat(outs)  # [B, Hq, 1, Dv] or [B, H, g, Dv]
    return out.reshape(batch_size, 1, query_heads, -1)  # one query per row: both order its heads alike


def gathers_rows() -> bool:
    """Whether a decode step gathers its keys as rows of the storage seen as ``[H * slots, D]``
    (`_gather_row_major`): one ``index_select`` that several threads share, where a select along the slots of
    ``[H, slots, D]`` runs on one (SmolLM2's gather of 16 rows of 300 keys: 0.24 against 0.35 ms at two
    threads). At one thread the select along the slots is the faster (0.32 against 0.35 ms)."""
    return torch.get_num_threads() > 1


def splits_query_heads() -> bool:
    """Whether float32 decode steps hand SDPA their query heads one by one (``[n, Hq, 1, D]`` with
    ``enable_gqa``, as transformers' ``sdpa`` does) rather than as the query rows of their key/value head
    (``[n, H, g, D]``): at more than one thread.

    SDPA's CPU kernel shares its work among threads by (row, head) pair: a row of SmolLM2 (3 key/value heads,
    9 query heads) gives two threads 3 pairs grouped and 9 split. Alternated decode steps at two threads
    (SmolLM2, packed linear layers) ran 1.03x-1.05x faster split at batch 1 (512 keys), 1.02x-1.04x on ragged
    rows and 1.03x on 16 equal rows; with the stock linear kernels, 1.01x at batch 1 and 0.98x-1.01x on
    ragged and equal rows, within noise. At one thread grouped is as fast or faster (0.99x split at batch 1
    and on 11 ragged rows). In bfloat16 the kernel is slow with one query row per head (16 rows of 301 keys, 30
    layers: 115 against 23 ms at two threads), so bfloat16 stays grouped. The same values either way up to
    float32 summation order (SmolLM2 at batch 1: `DynamicCache`'s logits to the last bit).
    """
    return torch.get_num_threads() > 1


def _gather_row_major(storage: torch.Tensor, padded: PaddedKeys) -> torch.Tensor:
    """``[N * H, D]``: every group's keys (or values) from ``[H, slots, D]`` storage, group after group, each
    group's ``[n, H, kv, D]`` contiguous (`PaddedKeys.row_major_rows`); a copy."""
    heads, capacity, dim = storage.shape
    return storage.view(heads * capacity, dim).index_select(0, padded.row_major_rows(heads, capacity))


def _group_parts(gathered: torch.Tensor, padded: PaddedKeys, row_major: bool) -> list[torch.Tensor]:
    """Each group's ``[n, H, kv, D]`` keys (or values) out of a decode step's one gather: ``[N * H, D]`` from
    `_gather_row_major` (each group's part contiguous), else ``[H, N, D]`` (each a view of a slice along the
    slots)."""
    shapes = padded.group_shapes()
    sizes = [rows * length for rows, length in shapes]  # per group n * kv
    if not row_major:
        return [by_row(part, rows) for part, (rows, _) in zip(gathered.split(sizes, 1), shapes)]
    heads = gathered.shape[0] // sum(sizes)
    parts = gathered.split([heads * size for size in sizes])
    return [part.view(rows, heads, length, gathered.shape[-1]) for part, (rows, length) in zip(parts, shapes)]


def product_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``[n, H, g, Dv]``: softmax attention of one query token per row by two batched matrix products.

    SDPA's CPU kernel multiplies the few query rows of each (row, head) by blocks of keys in small products,
    rescaling as it goes; ``bmm`` runs all (row, head) pairs as one batch, which two threads share better.
    Float32 results equal SDPA's up to summation order (about 3e-7 on attention outputs), not bit for bit.

    Args:
        query: ``[n, H, g, D]``, the `g` query heads sharing key/value head `h` as rows of it.
        keys: ``[n, H, kv, D]``, contiguous; values: ``[n, H, kv, Dv]`` likewise.
        mask: ``[n, 1, 1, kv]`` True where the row's query sees the key (at least one), or None for all.
    """
    rows, heads, groups, dim = query.shape
    length = keys.shape[2]
    scaled = (query * scale).reshape(rows * heads, groups, dim)  # [n * H, g, D]
    scores = torch.bmm(scaled, keys.view(rows * heads, length, dim).transpose(1, 2))  # [n * H, g, kv]
    if mask is not None:
        scores.view(rows, heads, groups, length).masked_fill_(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, values.view(rows * heads, length, -1))  # [n * H, g, Dv]
    return out.view(rows, heads, groups, -1)


def _attend_cascade(
    grouped: torch.Tensor, inputs: PagedAttentionInputs, shared: SharedPrefix, scale: float
) -> torch.Tensor:
    """``[B, H, g, Dv]``: a decode step's attention, the shared prefix read once for all rows (a view, no
    copy) and each row's own tail gathered, merged by log-sum-exp. Call with the storage lock held."""
    batch_size, heads, groups, key_dim = grouped.shape
    run = (shared.first, shared.count)
    # [1, H, B * g, D]: every row's queries read the same prefix keys, as one batch of query rows
    stacked = grouped.transpose(0, 1).reshape(1, heads, batch_size * groups, key_dim)
    prefix_out, prefix_lse = _attention_with_lse(
        stacked, inputs.keys.run(*run), inputs.values.run(*run), None, scale
    )  # [1, H, B * g, Dv], [1, H, B * g]
    prefix_out = prefix_out.view(heads, batch_size, groups, -1).transpose(0, 1)  # [B, H, g, Dv]
    prefix_lse = prefix_lse.view(heads, batch_size, groups).transpose(0, 1)  # [B, H, g]
    keys = by_row(inputs.keys.gather(shared.tail_slots), batch_size)  # [B, H, kv', D]
    values = by_row(inputs.values.gather(shared.tail_slots), batch_size)  # [B, H, kv', Dv]
    # [B, H, g, Dv], [B, H, g]
    tail_out, tail_lse = _attention_with_lse(grouped, keys, values, shared.tail_mask, scale)
    return merge_attention(prefix_out, prefix_lse, tail_out, tail_lse)


def _attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU kernel with its log-sum-exp: ``[..., q, Dv]`` and float32 ``[..., q]`` (natural log of the
    sum of exp(scale * q . k) over the keys the query sees). `mask` is additive (0 where a query sees a key,
    -inf where not; cast to the query's dtype, as the kernel wants); every query must see at least one key."""
    attn_mask = None if mask is None else mask.to(query.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=attn_mask, scale=scale
    )


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over two disjoint sets of keys, from each set's output ``[..., q, Dv]`` and
    log-sum-exp ``[..., q]``: the outputs weighted by each set's share of the whole softmax's mass."""
    lse = torch.logaddexp(lse_a, lse_b)  # [..., q] the whole softmax's
    weight_a = (lse_a - lse).exp_().unsqueeze(-1)  # [..., q, 1]
    weight_b = (lse_b - lse).exp_().unsqueeze(-1)
    if out_a.dtype == torch.float32:
        return out_a * weight_a + out_b * weight_b
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


def by_row(gathered: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[B, H, kv, D]``: keys (or values) gathered for `batch_size` rows of ``kv`` slots each, ``[H, B * kv, D]``
    (a view: each row's heads stay contiguous, which is all SDPA needs)."""
    heads, _, dim = gathered.shape
    return gathered.view(heads, batch_size, -1, dim).transpose(0, 1)


def _place(row_out: torch.Tensor, picked: torch.Tensor | None, query: torch.Tensor, query_length: int) -> torch.Tensor:
    """``[1, Hq, q, Dv]``: a row's outputs ``[1, Hq, q', Dv]`` at its real queries, zeros at its padding."""
    if picked is None:
        return row_out
    full = query.new_zeros(1, row_out.shape[1], query_length, row_out.shape[-1])
    return full.index_copy_(2, picked, row_out)


def _every_row_read(inputs: PagedAttentionInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """For a pool not stored as read (int8, float8, a cast): every row's keys ``[H * n_b, D]`` and values,
    gathered and decoded in one pass each (per row, the few small ops of decoding cost more than the work).
    None for a plain pool, whose rows are gathered one by one (a copy either way)."""
    if inputs.keys.plain is not None:
        return None
    slots = inputs.row_keys.slots
    every = torch.cat(slots)  # [sum of n_b]
    sizes = [s.shape[0] for s in slots]
    # per row [H, n_b, D]
    return list(inputs.keys.gather(every).split(sizes, dim=1)), list(inputs.values.gather(every).split(sizes, dim=1))


def _row_keys_and_values(
    inputs: PagedAttentionInputs, row: int, picked: torch.Tensor | None, query_span: tuple[int, int],
    stored: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Row `row`'s keys ``[1, H, n, D]``, values ``[1, H, n, Dv]``, their positions ``[n]`` and first/last one
    (read from `stored`, every row's as `_every_row_read` gives them, when given)."""
    if stored is None:
        slots = inputs.row_keys.slots[row]  # [n]
        keys, values = inputs.keys.gather(slots), inputs.values.gather(slots)  # [H, n, D], [H, n, Dv]
    else:
        keys, values = stored[0][row], stored[1][row]
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, H, n, D], [1, H, n, Dv]
    positions, span = inputs.row_keys.positions[row], inputs.row_keys.spans[row]
    if inputs.new_states is None:
        return keys, values, positions, span
    # the past from the pool, then the step's real new tokens as the layer computed them
    new_keys, new_values = (s[row : row + 1] for s in inputs.new_states)  # [1, H, q, D]
    if picked is not None:
        new_keys, new_values = new_keys.index_select(2, picked), new_values.index_select(2, picked)
    query_positions = inputs.queries.positions if picked is None else inputs.queries.positions[picked]
    first = span[0] if positions.numel() else query_span[0]
    return (
        torch.cat([keys, new_keys], dim=2),
        torch.cat([values, new_values], dim=2),
        torch.cat([positions, query_positions]),
        (first, query_span[1]),
    )


def _plain_causal(
    window: int | None, key_span: tuple[int, int], key_positions: torch.Tensor, q_len: int, query_span: tuple[int, int]
) -> bool:
    """Whether a row's keys are exactly its queries' positions, all inside the window (then causal = SDPA's)."""
    first_key, last_key = key_span
    # its keys include every real query (stored before attention); as many keys as queries: the same positions
    in_window = window is None or last_key - first_key < window
    return key_positions.shape[0] == q_len and q_len > 1 and key_span == query_span and in_window


def _row_mask(
    window: int | None,
    key_span: tuple[int, int],
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    query_span: tuple[int, int],
) -> torch.Tensor | None:
    """``[q', n]`` True where a query may see a key (causal, within the window); None when all may."""
    first_key, last_key = key_span
    first_query, last_query = query_span
    if last_key <= first_query and (window is None or first_key > last_query - window):
        return None  # every query sees every key (decode, or a chunk with nothing ahead of it)
    key_positions = key_positions.unsqueeze(0)  # [1, n]
    query_positions = query_positions.unsqueeze(1)  # [q', 1]
    mask = key_positions <= query_positions  # [q', n]
    if window is not None:
        mask &= key_positions > query_positions - window
    return mask


def explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """Softmax attention written out, for what SDPA cannot do: logit soft-capping and attention sinks.

    Args:
        query: ``[..., q, D]``; key, value: ``[..., n, D]`` (the same leading dims, or broadcastable).
        mask: bool (True = attend) or additive float, broadcastable to ``[..., q, n]``; None for none.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking.
        sinks: ``[..., q, 1]`` logits of a sink column every query attends to but reads nothing from
            (gpt-oss's ``s_aux``), as transformers' eager gpt-oss attention computes it.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [..., q, n]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is not None:
        combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0).to(value.dtype)
    return torch.matmul(weights, value)
