"""Batch-invariant attention from the pool: each query's output the same bits whatever else the forward holds.

`paged_sdpa` attends each forward the fastest way its shape allows (a row's prefill by SDPA's causal kernel, a
decode forward's rows in groups by length over left-padded keys), and those kernels sum in an order that depends
on the shape: a row's attention changes in its last bits with the rows beside it, with the length of the chunk its
query came in, and between a prefill and a decode step. Here every query, in any forward, is computed the same
way: its own row's keys and values, gathered from the pool and padded with zeros at the end to a whole number of
`KEY_TILE` positions, masked past the query's position; the query heads that share a key/value head, padded with
zero rows to a multiple of `HEAD_ROWS`, multiplied by them in a batched product; a float32 softmax; a second
batched product with the values. A decode forward attends all its rows in one pair of products (a batch entry
per row and key/value head), a longer forward each row's queries in tiles of one product each. The padding only
appends exact zeros to every sum, and the products sum each row of theirs in an order that neither the other
rows nor the padding change: so a query's output depends on its row's keys and values and nothing else, alone or
among 63 other rows, in a prefill, a chunk, a decode step or a verification of drafted tokens.
`attention_probe` checks the kernels' part of that on the machine at hand, for the shapes used.

The price: no fused kernel, and a prefill attends row by row.
Sliding windows, attention sinks and dropout are not supported here (a clear error says so).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..pool.kv_format import StoredStates
from .reads import PagedAttentionInputs, RowKeys

KEY_TILE = 16
"""Every query attends over a multiple of this many key positions (its row's, then masked zeros)."""
HEAD_ROWS = 4
"""The query heads of a key/value head are padded with zero rows to a multiple of this many (at least this many):
on the CPUs measured, a product of 1 row, or of 6 or 9, sums in an order that depends on the other dimensions."""
QUERY_CHUNK_KEYS = 1 << 16
"""Queries are attended in chunks of at most this many (query, key position) pairs, which bounds the copies of
the keys each chunk multiplies."""


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

    Raises:
        NotImplementedError: a sliding-window layer.
    """
    if inputs.window is not None or inputs.new_states is not None:
        raise NotImplementedError(
            f"batch-invariant attention does not support sliding-window layers (window {inputs.window})"
        )
    batch_size, query_heads, query_length, head_dim = query.shape
    heads = inputs.num_kv_heads
    call = _Call(heads, query_heads // heads, scaling if scaling is not None else head_dim ** -0.5, softcap)
    out = query.new_zeros(batch_size, query_length, query_heads, inputs.values.dim)
    key_positions = inputs.row_keys.padded(KEY_TILE)[1]  # [B, n']
    with inputs.lock.shared():
        keys = _row_states(inputs.keys, inputs.row_keys, batch_size)  # [B, H, n', D]
        values = _row_states(inputs.values, inputs.row_keys, batch_size)  # [B, H, n', Dv]
    spans, picked, positions = inputs.queries.spans, inputs.queries.picked, inputs.queries.positions
    real = [b for b in range(batch_size) if spans[b] is not None]
    if query_length == 1 and real:
        rows = None if len(real) == batch_size else torch.tensor(real, device=query.device)  # None: every row
        own = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        items = call.head_rows(own(query).view(-1, heads, 1, call.groups, head_dim))  # [B', H, G, D]
        seen = own(key_positions) <= positions[0]  # [B', n']
        attended = call.attend(items, own(keys), own(values), seen[:, None, None, :])  # [B', H, g, Dv]
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
            seen = key_positions[b] <= positions[own[part]].unsqueeze(1)  # [t, n']
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

    @property
    def padded_groups(self) -> int:
        """G: `groups` rounded up to a multiple of `HEAD_ROWS`."""
        return max(HEAD_ROWS, -(-self.groups // HEAD_ROWS) * HEAD_ROWS)

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
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        attended = torch.matmul(weights, values)  # [N, H, t * G, Dv]
        rows = attended.shape[2] // self.padded_groups
        return attended.unflatten(2, (rows, self.padded_groups))[:, :, :, : self.groups].flatten(2, 3)


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
def attention_probe(head_dim: int, groups: int, dtype: torch.dtype, threads: int) -> str:
    """Why `attend_invariant`'s products would give a query other bits beside other queries (other rows of a
    decode forward, or other queries of its row's tile) or over more key padding, at `threads` threads; "" when
    they do not. Random queries, keys and values (2 key/value heads of `groups` query heads); cached."""
    with torch.inference_mode(False), torch.no_grad():
        return _probe(head_dim, groups, dtype, threads)


def _probe(head_dim: int, groups: int, dtype: torch.dtype, threads: int) -> str:
    generator = torch.Generator().manual_seed(0)
    call, heads, length = _Call(2, groups, head_dim ** -0.5, None), 2, 37  # length: the query's real keys

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    query = random(heads, groups, head_dim)
    keys, values = random(heads, length, head_dim), random(heads, length, head_dim)

    def attend(rows: int, tile: int, at: int, padded: int) -> torch.Tensor:
        """The query's output as query `at` of a tile of `tile` (rows == 1) or in row `at` of `rows`."""
        queries = random(rows, heads, tile, groups, head_dim)
        own_keys, own_values = random(rows, heads, padded, head_dim), random(rows, heads, padded, head_dim)
        row, column = (at, 0) if rows > 1 else (0, at)
        queries[row, :, column] = query
        own_keys[row] = F.pad(keys, (0, 0, 0, padded - length))  # [H, n', D]: zeros past the real keys
        own_values[row] = F.pad(values, (0, 0, 0, padded - length))
        seen = torch.ones(rows, 1, tile * call.padded_groups, padded, dtype=torch.bool)
        seen[row, :, :, length:] = False
        out = call.attend(call.head_rows(queries), own_keys, own_values, seen)  # [rows, H, tile * g, Dv]
        return out[row].unflatten(1, (tile, groups))[:, column]  # [H, g, Dv]

    alone = attend(1, 1, 0, 48)
    for rows, tile in ((2, 1), (7, 1), (64, 1), (1, 2), (1, 7), (1, 64)):
        for padded in (48, 64, 320):
            for at in sorted({0, max(rows, tile) // 2, max(rows, tile) - 1}):
                if not torch.equal(attend(rows, tile, at, padded), alone):
                    where = f"row {at} of {rows}" if rows > 1 else f"query {at} of a tile of {tile}"
                    return f"a query's attention changed as {where}, keys padded to {padded}, at {threads} threads"
    return ""
