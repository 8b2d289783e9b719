"""Attention from the pool row by row: a prefill, a chunk, or any forward that is not a plain decode forward.

For each row, `attend_rows` reads the keys and values of its real tokens only (`RowKeys`: one gather each by
slot; the pool is head-major, so SDPA gets contiguous heads) and runs SDPA on them, with the grouped query heads
folded into the query rows of their key/value head. No padded copy of the history is made, and no attention is
computed over padding. (A decode forward, one real new token per row, attends all its rows at once instead:
`decode`.)

A first forward's rows that repeat an earlier row (the same prompt: `generate` repeats it for beams and samples,
`QueryRows.repeats`) share that row's blocks, so they read the same keys and values: a repeat whose queries equal
its first row's (compared, bit for bit) takes that row's attention output instead of attending again.

Masks are built from logical positions, as transformers builds its own: a query at position ``p`` sees the
stored keys at positions ``k <= p`` (causal) and, on a sliding layer of window ``W``, ``k > p - W``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reads import PagedAttentionInputs
from .softmax import explicit_attention


def attend_rows(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of `query` ``[B, Hq, q, D]`` over each row's stored keys, row by row; returns ``[B, q, Hq, Dv]``.

    Padding queries (new tokens that are padding) are not computed: their output is zero.
    """
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
    # the past from the pool, then the forward's real new tokens as the layer computed them
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
