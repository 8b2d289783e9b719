"""Batch-invariant attention from the pool: each query's output the same bits whatever else the forward holds.

`paged_sdpa` attends each forward the fastest way its shape allows (a row's prefill by SDPA's causal kernel, a
decode forward's rows in groups by length over left-padded keys), and those kernels sum in an order that depends
on the shape: a row's attention changes in its last bits with the rows beside it, with the length of the chunk its
query came in, and between a prefill and a decode step. Here every query, in any forward, is computed the same
way: its own row's keys and values, gathered from the pool and padded with zeros at the end to a whole number of
`KEY_TILE` positions, masked past the query's position; the query heads that share a key/value head, padded with
zero rows to a multiple of 4, 8 or 16 (`head_rows`: the first whose products hold here), multiplied by them in a
batched product; a float32 softmax; the values weighted tile by tile (`weighted_values`: a product per
`VALUE_TILE` key positions, the tiles added in position order, since one product over all of a forward's keys may
split its sum by their padded length). A decode forward attends all its rows in one batched call of each, a
longer forward each row's queries in tiles of queries. The padding only appends exact zeros to every sum, and the
products sum each row of theirs in an order that neither the other rows nor the padding change: so a query's
output depends on its row's keys and values and nothing else, alone or among 63 other rows, in a prefill, a
chunk, a decode step or a verification of drafted tokens.
On a sliding-window layer the keys read start where the window does, which moves with the forward (a prefill
reads keys a decode step no longer holds): there each row's keys are placed by their index among its real tokens
(`_by_real_index`), so that a tile of values holds the same keys in any forward, the keys outside a query's window
masked wherever they sit, and whole tiles of masked keys in front add zeros only. `head_rows` and
`attention_probe` check the kernels' part of all that on the machine at hand, for the shapes used.

The price: no fused kernel, and a prefill attends row by row. Attention sinks and dropout are not supported here
(a clear error says so).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..pool.kv_format import StoredStates
from .reads import PAST_EVERY_QUERY, PagedAttentionInputs, RowKeys

VALUE_TILE = 64
"""The values are weighted in products over this many key positions each, added in order (`weighted_values`)."""
KEY_TILE = VALUE_TILE
"""A row's stored keys are read padded to a multiple of this many positions (the padding masked, zeros): whole tiles
of values, so that `weighted_values` copies nothing to fill the last one (measured on an Intel Xeon with AMX: a
decode forward's attention of 16 rows of 150-420 keys, 0.74x the time of keys padded to 16 in float32, 0.85x in
bfloat16, the same bits)."""
HEAD_ROWS = (4, 8, 16)
"""The multiples the query heads of a key/value head may be padded to with zero rows (at least one multiple), cheapest
first; `head_rows` picks the first whose products give each query the same bits here. On the CPUs measured, a
product of 1 row, or of 6 or 9, sums in an order that depends on the other dimensions, and on an Intel Xeon with AMX
a float32 one over 128 dimensions sums 4 rows in another order than 8 or more."""
_PROBE_QUERIES = 32  # another summation order shows in few of a query's outputs: the probe compares many
_LARGE = 2.0**20  # the probe's cancelling inputs (`_cancelling_queries`, `_cancelling_states`)
QUERY_CHUNK_KEYS = 1 << 16
"""A row's queries are attended in tiles of at most this many (query, key position) pairs, which bounds the scores
one product makes."""


def attend_invariant(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    scaling: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of `query` ``[B, Hq, q, D]`` over each row's stored keys, each real query as if alone; returns
    ``[B, q, Hq, Dv]`` (padding queries: zeros).

    A forward of one new token per row attends all its rows in one pair of products (one batch entry per row and
    key/value head); a longer one attends row by row, each row's queries in tiles of one product each.

    On a sliding-window layer a query sees the keys inside its window: the others are masked, wherever they sit.
    """
    batch_size, query_heads, query_length, head_dim = query.shape
    heads = inputs.num_kv_heads
    groups = query_heads // heads
    call = _Call(heads, groups, scaling if scaling is not None else head_dim ** -0.5, softcap, inputs.window,
                 head_rows(head_dim, groups, query.dtype, torch.get_num_threads()))
    out = query.new_zeros(batch_size, query_length, query_heads, inputs.values.dim)
    keys, values, key_positions = _keys_of_rows(inputs, batch_size)  # [B, H, n', D], [B, H, n', Dv], [B, n']
    spans, picked, positions = inputs.queries.spans, inputs.queries.picked, inputs.queries.positions
    real = [b for b in range(batch_size) if spans[b] is not None]
    if query_length == 1 and real:
        rows = None if len(real) == batch_size else torch.tensor(real, device=query.device)  # None: every row
        own = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        items = call.head_rows(own(query).reshape(-1, heads, 1, call.groups, head_dim))  # [B', H, G, D]
        seen = call.seen(own(key_positions), positions[:1])  # [B', 1, n']
        attended = call.attend(items, own(keys), own(values), seen.unsqueeze(1))  # [B', H, g, Dv]
        out[real if rows is not None else slice(None), 0] = attended.reshape(len(real), query_heads, -1).to(out.dtype)
        return out
    for b in real:
        own = torch.arange(query_length, device=query.device) if picked[b] is None else picked[b]  # [q_b]
        # [1, H, q_b, g, D]: the row's real queries, each query's heads grouped by their key/value head
        row_query = query[b].index_select(1, own).view(heads, call.groups, -1, head_dim).transpose(1, 2).unsqueeze(0)
        tile = max(1, QUERY_CHUNK_KEYS // keys.shape[2])
        for start in range(0, own.shape[0], tile):
            part = slice(start, start + tile)
            items = call.head_rows(row_query[:, :, part])  # [1, H, t * G, D]
            seen = call.seen(key_positions[b], positions[own[part]])  # [t, n']
            mask = seen.view(1, 1, -1, 1, seen.shape[1]).expand(-1, -1, -1, call.padded_groups, -1)
            attended = call.attend(items, keys[b : b + 1], values[b : b + 1], mask.flatten(2, 3))  # [1, H, t * g, Dv]
            attended = attended.view(heads, -1, call.groups, attended.shape[-1]).transpose(0, 1)  # [t, H, g, Dv]
            out[b, own[part]] = attended.reshape(attended.shape[0], query_heads, -1).to(out.dtype)
    return out


@dataclass(frozen=True)
class _Call:
    """One layer's attention settings, and the two products every query goes through."""

    heads: int  # H: key/value heads
    groups: int  # g: query heads per key/value head
    scale: float
    softcap: float | None
    window: int | None = None  # a sliding-window layer's window
    rows: int = HEAD_ROWS[0]  # the query heads of a key/value head are padded to a multiple of this (`head_rows`)

    def seen(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """``[t, n']`` (``[N, 1, n']`` for keys ``[N, n']`` and one query): True where a query at `query_positions`
        ``[t]`` sees a key at `key_positions` ``[n']``: causal, and inside the window."""
        keys, queries = key_positions.unsqueeze(-2), query_positions.unsqueeze(-1)  # [..., 1, n'], [t, 1]
        seen = keys <= queries
        return seen if self.window is None else seen & (keys > queries - self.window)

    @property
    def padded_groups(self) -> int:
        """G: `groups` rounded up to a multiple of `rows`."""
        return -(-self.groups // self.rows) * self.rows

    def head_rows(self, queries: torch.Tensor) -> torch.Tensor:
        """``[N, H, t * G, D]``: queries ``[N, H, t, g, D]`` with each query's g heads padded with zero rows to G."""
        padded = F.pad(queries, (0, 0, 0, self.padded_groups - self.groups))  # [N, H, t, G, D]
        return padded.flatten(2, 3)

    def attend(self, items: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """``[N, H, t * g, Dv]``: attention of query rows `items` ``[N, H, t * G, D]`` over `keys` ``[N, H, n', D]``
        and `values`, keys masked where `seen` (broadcast to ``[N, H, t * G, n']``) is False; padding rows dropped."""
        scores = torch.matmul(items, keys.transpose(2, 3)) * self.scale  # [N, H, t * G, n']
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        scores = scores.masked_fill(~seen, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1)  # [N, H, t * G, n'] float32
        attended = weighted_values(weights, values).to(values.dtype)  # [N, H, t * G, Dv]
        rows = attended.shape[2] // self.padded_groups
        return attended.unflatten(2, (rows, self.padded_groups))[:, :, :, : self.groups].flatten(2, 3)


def weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[N, H, M, Dv]`` float32: `weights` ``[N, H, M, n']`` (float32) times `values` ``[N, H, n', Dv]`` (column i
    holding a row's key of real index i, or the i-th from a multiple of `VALUE_TILE`), summed tile by tile: one
    product per `VALUE_TILE` key positions (zero keys added to fill the last), then the tiles' products added one
    after another in position order. One product over all n' keys lets the kernel split its sum by n', which the
    forward's longest row sets (measured on an Intel Xeon with AMX: float32 products over 1,024 keys, and over
    the same keys followed by 16 or more zero ones, always round differently; bfloat16 ones now and then, from
    112 keys); a product of one tile's keys always has one shape, and zero tiles (padding after, masked keys in
    front) add nothing."""
    n, h, m, keys = weights.shape
    spare = -keys % VALUE_TILE
    if spare:
        weights, values = F.pad(weights, (0, spare)), F.pad(values, (0, 0, 0, spare))
    tiles = (keys + spare) // VALUE_TILE
    tiled_weights = weights.view(n, h, m, tiles, VALUE_TILE).transpose(2, 3)  # [N, H, C, M, T]
    tiled_values = values.float().view(n, h, tiles, VALUE_TILE, values.shape[-1])  # [N, H, C, T, Dv]
    products = torch.matmul(tiled_weights, tiled_values)  # [N, H, C, M, Dv]: a product per tile of keys
    total = products[:, :, 0].clone()  # [N, H, M, Dv]
    for tile in range(1, tiles):
        total += products[:, :, tile]
    return total


def _keys_of_rows(inputs: PagedAttentionInputs, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's keys ``[B, H, n', D]``, values ``[B, H, n', Dv]`` and their positions ``[B, n']``, laid out by
    their index among the row's real tokens: its stored keys from the first (`RowKeys.padded`: padding at the end,
    at a position no query sees) or, on a sliding-window layer, placed by `_by_real_index`."""
    positions = inputs.row_keys.padded(KEY_TILE)[1]  # [B, n']
    with inputs.lock.shared():
        keys = _row_states(inputs.keys, inputs.row_keys, batch_size)  # [B, H, n', D]
        values = _row_states(inputs.values, inputs.row_keys, batch_size)  # [B, H, n', Dv]
    if inputs.window is None and inputs.new_states is None:  # the keys from each row's first real token
        return keys, values, positions
    return _by_real_index(inputs, keys, values, positions)


def _by_real_index(inputs: PagedAttentionInputs, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sliding-window layer's keys ``[B, H, n', D]``, values and positions ``[B, n']``: the stored ones (`keys`,
    `values`, `positions`, as `RowKeys.padded` lays them), then, in a forward whose new tokens are not all stored
    (a window's forward longer than it keeps), the real new tokens' as the layer computed them, each row's placed
    so that every `VALUE_TILE` columns hold the keys of the same real indices in any forward
    (`RowKeys.by_real_index`): a query's tiles of values are then the same whether its window's first key is read
    (a prefill) or not (a decode step), and zeros fill the rest."""
    batch_size, heads = keys.shape[:2]
    new = inputs.new_states
    index = inputs.row_keys.by_real_index(VALUE_TILE, keys.shape[2], inputs.queries if new is not None else None)
    null_positions = positions.new_full((batch_size, 1), PAST_EVERY_QUERY)
    source_positions = [null_positions, positions]  # [B, 1], [B, n_s]
    if new is not None:
        source_positions.append(inputs.queries.positions.unsqueeze(0).expand(batch_size, -1))  # [B, q]

    def placed(stored: torch.Tensor, fresh: torch.Tensor | None) -> torch.Tensor:  # [B, H, n', dim]
        sources = [stored.new_zeros(batch_size, heads, 1, stored.shape[-1]), stored]
        if fresh is not None:
            sources.append(fresh.to(stored.dtype))
        columns = index.view(batch_size, 1, -1, 1).expand(-1, heads, -1, stored.shape[-1])
        return torch.cat(sources, dim=2).gather(2, columns)

    return (placed(keys, None if new is None else new[0]), placed(values, None if new is None else new[1]),
            torch.cat(source_positions, dim=1).gather(1, index))


def _row_states(storage: StoredStates, row_keys: RowKeys, batch_size: int) -> torch.Tensor:
    """``[B, H, n', D]`` contiguous: every row's keys (or values) at its `RowKeys.padded` slots, in one gather from
    plain storage (`RowKeys.row_major`), else gathered and decoded head-major, then laid out by row."""
    plain = storage.plain
    if plain is not None and plain.is_contiguous():
        heads, capacity, dim = plain.shape
        rows = row_keys.row_major(KEY_TILE, heads, capacity)  # [B * H * n']
        return plain.view(heads * capacity, dim).index_select(0, rows).view(batch_size, heads, -1, dim)
    gathered = storage.gather(row_keys.padded(KEY_TILE)[0].view(-1))  # [H, B * n', D]
    heads, _, dim = gathered.shape
    return gathered.view(heads, batch_size, -1, dim).transpose(0, 1).contiguous()


@functools.cache
def head_rows(head_dim: int, groups: int, dtype: torch.dtype, threads: int) -> int:
    """The first of `HEAD_ROWS` under which `attend_invariant`'s products give a query the same bits beside other
    queries (other rows of a decode forward, or other queries of its row's tile) and over more key padding, at
    `threads` threads, on layers without a window (`_probe`; cancelling inputs, 2 key/value heads of `groups` query
    heads). Cached.

    Raises:
        RuntimeError: none does, with each one's problem.
    """
    problems = []
    with torch.inference_mode(False), torch.no_grad():
        for multiple in HEAD_ROWS:
            problem = _probe(head_dim, groups, dtype, threads, multiple)
            if not problem:
                return multiple
            problems.append(f"heads padded to a multiple of {multiple}: {problem}")
    raise RuntimeError("; ".join(problems))


@functools.cache
def attention_probe(head_dim: int, groups: int, dtype: torch.dtype, threads: int, window: int | None = None) -> str:
    """Why `attend_invariant` would give a query other bits beside other queries or over more key padding, at
    `threads` threads: no `head_rows` serves, or, given a sliding `window`, a query over the window fails
    `_window_probe`; "" when neither. Cached."""
    try:
        rows = head_rows(head_dim, groups, dtype, threads)
    except RuntimeError as error:
        return str(error)
    if window is None:
        return ""
    with torch.inference_mode(False), torch.no_grad():
        return _window_probe(head_dim, groups, dtype, window, rows)


def _window_probe(head_dim: int, groups: int, dtype: torch.dtype, window: int, rows: int) -> str:
    """Why a sliding-window layer's query over a full window of keys would get other bits beside rows whose keys run
    longer, or with more keys masked in front (whole tiles of them: the window's keys start at the same column of a
    tile in any forward, `_by_real_index`, but a prefill reads keys before the window that a decode step does not);
    "" when it would not."""
    generator = torch.Generator().manual_seed(1)
    call, heads = _Call(2, groups, head_dim ** -0.5, None, window=window, rows=rows), 2
    length, lead = min(window, 4096), 5  # the window's keys, after `lead` masked ones in their first tile
    keys, values = _cancelling_states(*(torch.randn(2, heads, length, head_dim, generator=generator).to(dtype)
                                        for _ in range(2)))
    queries = call.head_rows(_cancelling_queries(torch.randn(2, heads, 1, groups, head_dim,
                                                             generator=generator).to(dtype)))

    def attend(count: int, front: int = lead, slack: int = 0) -> torch.Tensor:
        """The first query's output, among `count` rows whose keys follow `front` masked ones, padded with zero keys
        to whole `KEY_TILE`s and `slack` more."""
        size = -(-(front + length) // KEY_TILE) * KEY_TILE + slack
        seen = torch.zeros(count, 1, call.padded_groups, size, dtype=torch.bool)
        seen[..., front : front + length] = True
        padded = [F.pad(states[:count], (0, 0, front, size - length - front)) for states in (keys, values)]
        return call.attend(queries[:count], *padded, seen)[:1]

    alone = attend(1)
    for slack in (16, 48):  # padding that is not whole tiles too
        if not torch.equal(attend(2, slack=slack), alone):
            return f"a query over a window of {length} keys changed beside a row of {slack} keys more"
    for tiles in (1, 2, 5):
        if not torch.equal(attend(1, front=lead + tiles * VALUE_TILE), alone):
            return f"a query over a window of {length} keys changed after {tiles * VALUE_TILE} more masked keys"
    return ""


def _probe(head_dim: int, groups: int, dtype: torch.dtype, threads: int, multiple: int) -> str:
    """Why a query's output would change beside other queries, with the query heads padded to a `multiple`."""
    generator = torch.Generator().manual_seed(0)
    call, heads, length, count = _Call(2, groups, head_dim ** -0.5, None, rows=multiple), 2, 37, _PROBE_QUERIES

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int = length) -> torch.Tensor:
        """``[N, H, t, g, Dv]``: queries ``[N, H, t, g, D]`` over keys ``[N, H, n', D]`` whose first `length` are
        real (the others masked padding)."""
        seen = torch.zeros(keys.shape[0], 1, queries.shape[2] * call.padded_groups, keys.shape[2], dtype=torch.bool)
        seen[..., :length] = True
        out = call.attend(call.head_rows(queries), keys, values, seen)  # [N, H, t * g, Dv]
        return out.unflatten(2, (queries.shape[2], groups))

    def padded(states: torch.Tensor, size: int) -> torch.Tensor:  # zero keys after the real ones
        return F.pad(states, (0, 0, 0, size - length))

    # a decode forward: each target query with keys of its own, alone, then among `rows` rows
    # half the targets random, half cancelling (`_cancelling_queries`): each input shows other reorderings
    queries = random(count, heads, 1, groups, head_dim)
    keys, values = random(count, heads, length, head_dim), random(count, heads, length, head_dim)
    _cancelling_queries(queries[count // 2 :])
    _cancelling_states(keys[count // 2 :], values[count // 2 :])
    alone = torch.cat([attend(queries[i : i + 1], padded(keys[i : i + 1], 48), padded(values[i : i + 1], 48))
                       for i in range(count)])  # [T, H, 1, g, Dv]
    for rows, size in itertools.product((2, 7, 64), (48, 64, 320)):
        taken = min(rows, count)
        for at in (0, rows - taken):
            batch = slice(at, at + taken)
            row_queries = random(rows, heads, 1, groups, head_dim)
            row_keys, row_values = random(rows, heads, size, head_dim), random(rows, heads, size, head_dim)
            row_queries[batch] = queries[:taken]
            row_keys[batch], row_values[batch] = padded(keys[:taken], size), padded(values[:taken], size)
            if not torch.equal(attend(row_queries, row_keys, row_values)[batch], alone[:taken]):
                return f"a query's attention changed in rows {at}-{at + taken - 1} of {rows} at {threads} threads"
    # a longer forward: target queries of one row, each alone, then in a tile of `tile`
    queries = random(1, heads, count, groups, head_dim)
    _cancelling_queries(queries[:, :, count // 2 :])
    keys, values = padded(keys[-1:], 48), padded(values[-1:], 48)  # a cancelling target's
    alone = torch.cat([attend(queries[:, :, i : i + 1], keys, values) for i in range(count)], dim=2)
    for tile in (2, 7, 64):
        taken = min(tile, count)
        for at in (0, tile - taken):
            tile_queries = random(1, heads, tile, groups, head_dim)
            tile_queries[:, :, at : at + taken] = queries[:, :, :taken]
            if not torch.equal(attend(tile_queries, keys, values)[:, :, at : at + taken], alone[:, :, :taken]):
                return f"a query's attention changed in a tile of {tile} at {threads} threads"
    # a long row alone, then beside longer rows (more key padding: kernels split long sums by their length)
    long = 1000
    for cancelling in (False, True):
        keys, values = random(2, heads, long, head_dim), random(2, heads, long, head_dim)
        queries = random(2, heads, 1, groups, head_dim)
        if cancelling:
            _cancelling_states(keys, values)
            _cancelling_queries(queries)
        alone = attend(queries[:1], F.pad(keys[:1], (0, 0, 0, 8)), F.pad(values[:1], (0, 0, 0, 8)), length=long)
        for size in (1024, 1040, 2048):
            beside = [F.pad(states, (0, 0, 0, size - long)) for states in (keys, values)]
            if not torch.equal(attend(queries, *beside, length=long)[:1], alone):
                return f"a query's attention over {long} keys changed beside a row of {size}, at {threads} threads"
    return ""


def _cancelling_queries(queries: torch.Tensor) -> torch.Tensor:
    """`queries` ``[..., D]`` with a large value and its negative in dimensions 0 and D/2, in place; over keys equal
    in those two dimensions (`_cancelling_states`) the two products cancel exactly, and the score's rounding shows
    the order in which the product summed the others (as `row_tiles._cancelling` does for linear layers: on random
    inputs another order changes few bfloat16 outputs, and the probe would miss it)."""
    queries[..., 0] = _LARGE
    queries[..., queries.shape[-1] // 2] = -_LARGE
    return queries


def _cancelling_states(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[N, H, n, D]`` equal in dimensions 0 and D/2 (for `_cancelling_queries`), and the keys of positions
    1 and n - 2 equal, their values a large value and its negative: the weighted values then hold a sum whose
    rounding shows the order of its terms, across tiles of keys too. In place."""
    keys[..., keys.shape[-1] // 2] = keys[..., 0]
    first, last = 1, keys.shape[2] - 2
    keys[:, :, last] = keys[:, :, first]
    values[:, :, first] = _LARGE
    values[:, :, last] = -_LARGE
    return keys, values
