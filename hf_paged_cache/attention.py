"""`paged_sdpa`: the attention function registered for paged caches.

transformers hands an attention function only the tensors the cache's ``update`` returned, never the
cache itself, so the block-table gather happens in `PagedCache.update` (one ``index_select`` per layer over
slot ids computed once per forward) and this function attends over the gathered K/V. What it adds over
the stock ``sdpa`` path:

- grouped-query attention through SDPA's ``enable_gqa`` at every step (no ``repeat_kv`` copy of K/V);
- logit soft-capping (Gemma 2), which SDPA cannot express, by an explicit masked softmax;
- a clear error for what it cannot do (attention sinks, ``output_attentions``).

Sliding windows need nothing here: the mask registered beside this function is transformers' own SDPA
mask, so sliding-window and padding masks arrive ready-made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "paged_sdpa"


def paged_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention over K/V gathered from a paged cache.

    Args:
        query: ``[B, Hq, q, D]``.
        key, value: ``[B, Hkv, kv, D]`` (``Hq`` a multiple of ``Hkv``).
        attention_mask: ``[B, 1, q, kv]`` bool (True = attend) or additive float mask, or None for causal.
        softcap: if set, scores become ``softcap * tanh(scores / softcap)`` before masking.
    Returns:
        ``([B, q, Hq, D], None)``, the layout transformers' attention modules expect.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{ATTENTION_NAME} does not support attention sinks (s_aux); use 'eager'")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"{ATTENTION_NAME} cannot return attention weights; use 'eager' for them")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"{ATTENTION_NAME} does not support position_bias; use 'sdpa' or 'eager'")
    q_len, kv_len = query.shape[2], key.shape[2]
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads cannot share {key.shape[1]} key/value heads")
    causal = getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:
        # [q, kv] causal mask aligned to the bottom right: query i sees keys up to kv - q + i
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)
    dropout = dropout if module.training else 0.0

    if softcap is None:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # [B, Hq, q, D]
    else:
        out = _softcapped_attention(query, key, value, attention_mask, dropout, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def _softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # [B, Hq, kv, D]
    value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # [B, Hq, q, kv]
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value)  # [B, Hq, q, D]


def set_paged_attention(model: PreTrainedModel) -> None:
    """Switch `model` to ``paged_sdpa``, or raise `NotImplementedError` if its architecture cannot use it.

    Prefer this to ``model.set_attn_implementation("paged_sdpa")`` for two architectures:

    - Gemma 2 marks itself as not supporting SDPA (stock SDPA cannot soft-cap logits) and transformers
      refuses every implementation whose name contains "sdpa" for it; ``paged_sdpa`` does soft-capping,
      so this sets it anyway.
    - Falcon does not dispatch attention through `AttentionInterface`: transformers would log a warning
      and silently keep its own attention. This raises instead. `PagedCache` is still exact with
      Falcon's default attention.
    """
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            f"so it cannot run {ATTENTION_NAME!r}; use PagedCache with its default attention instead"
        )
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except ValueError:
        if model._supports_sdpa:
            raise
        model.config._attn_implementation = ATTENTION_NAME  # what set_attn_implementation does after its checks
        model.config.get_text_config(decoder=True)._attn_implementation = ATTENTION_NAME


def register_paged_attention() -> None:
    """Make ``attn_implementation="paged_sdpa"`` available to every transformers model.

    Idempotent; runs when `hf_paged_cache` is imported.
    """
    AttentionInterface.register(ATTENTION_NAME, paged_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
