"""The softmax maths of attention from the pool, beyond SDPA's own: an explicit softmax (soft-capping, sinks),
a decode forward's attention by batched products, and partial softmaxes merged by their log-sum-exp (cascade)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def attention_with_lse(
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
