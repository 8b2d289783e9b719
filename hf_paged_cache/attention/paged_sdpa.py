"""`paged_sdpa`: the attention function registered for paged caches.

With a `PagedCache` built from the model, `PagedCache.update` writes the new keys and values into the
pool and leaves a `PagedAttentionInputs` in the attention kwargs (transformers hands the same dict to
``cache.update`` and to the attention function): this function then attends straight from the block
tables, each row to its own real tokens, with no padded copy (`attend_from_pool`: row by row, `prefill`, or a
decode forward's rows at once, `decode`). In a packed forward (`hf_paged_cache.cache.packed_forward`) it attends each
segment of the sequence from its own cache (`attend_packed`).

Otherwise (another cache, a config-built `PagedCache`, or a model that calls ``update`` without its
kwargs, such as GPT-NeoX) it attends over the dense K/V it is given, with the mask transformers built.

Either way it adds, over the stock ``sdpa`` path:

- grouped-query attention without ``repeat_kv`` copies of K/V;
- logit soft-capping (Gemma 2) and attention sinks (gpt-oss ``s_aux``), which SDPA cannot express, by an
  explicit softmax;
- a clear error for what it cannot do (``output_attentions``, ``position_bias``).

``paged_bmm`` (`BMM_ATTENTION_NAME`, opt-in) is the same function with a float32 decode forward's groups of rows
attended by batched matrix products rather than SDPA: faster on CPUs at two threads, not bit for bit.
``paged_flex`` (`FLEX_ATTENTION_NAME`, opt-in) attends a float32 decode forward's rows of differing lengths on a CPU
by a compiled `flex_attention` that reads their blocks in place, with no gather (`flex_decode`): it compiles on its
first such forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..pool.memory import dense_attention_kinds
from .decode import DECODE_KERNELS, attend_decode
from .invariant import attend_invariant
from .prefill import attend_rows
from .reads import PAGED_INPUTS, RUNNING_CACHE, PackedAttentionInputs, PagedAttentionInputs
from .softmax import explicit_attention

ATTENTION_NAME = "paged_sdpa"
BMM_ATTENTION_NAME = "paged_bmm"
"""``paged_sdpa``, except that a float32 decode forward's groups of rows attend by two batched matrix products
(`softmax.product_attention`): faster on CPUs at two threads, equal to ``paged_sdpa`` up to float32
rounding but not bit for bit (so greedy search can part from `DynamicCache`'s at a near-tie)."""
FLEX_ATTENTION_NAME = "paged_flex"
"""``paged_sdpa``, except that a float32 decode forward on a CPU whose rows differ in length (two groups or more)
reads each row's blocks in place through a compiled `flex_attention` (`flex_decode`): no gather, one call. It compiles on its first
decode forward (a few seconds) and needs a C++ compiler (without one it gathers as ``paged_sdpa`` does); equal to
``paged_sdpa`` up to float32 rounding, not bit for bit."""
PAGED_ATTENTION_NAMES = (ATTENTION_NAME, BMM_ATTENTION_NAME, FLEX_ATTENTION_NAME)
"""The paged attentions, in the order of the `DECODE_KERNELS` their decode forwards use."""


def paged_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    decode: str = "sdpa",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention for a paged cache: from the pool when it can, else over dense K/V.

    Args:
        query: ``[B, Hq, q, D]``.
        key, value: ``[B, Hkv, kv, D]`` (``Hq`` a multiple of ``Hkv``); unused when `kwargs` carries
            ``paged_attention_inputs``.
        attention_mask: ``[B, 1, q, kv]`` bool (True = attend) or additive float mask, or None for causal.
        softcap: if set, scores become ``softcap * tanh(scores / softcap)`` before masking.
        decode: how a decode forward's rows attend (`DECODE_KERNELS`): what ``paged_bmm`` and ``paged_flex`` set.
        kwargs: ``s_aux`` (``[Hq]`` sink logits, gpt-oss), ``paged_attention_inputs`` (from `PagedCache`, or
            from a packed forward's `PackedCaches`, whose `query` is ``[1, Hq, T, D]``), ``paged_running_cache``
            (`RUNNING_CACHE`: a compiled forward's, whose cache is not handed to the model).
    Returns:
        ``([B, q, Hq, D], None)``, the layout transformers' attention modules expect.
    """
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"{ATTENTION_NAME} cannot return attention weights; use 'eager' for them")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"{ATTENTION_NAME} does not support position_bias; use 'sdpa' or 'eager'")
    sinks = kwargs.get("s_aux")
    dropout = dropout if module.training else 0.0
    if kwargs.get(RUNNING_CACHE):  # a compiled forward: the cache is written and read inside one opaque op
        if dropout:
            raise NotImplementedError("a compiled forward attends without dropout: put the model in eval mode")
        attend = torch.ops.hf_paged_cache.running_cache_attention
        return attend(query, key, value, module.layer_idx, scaling, softcap, sinks, decode), None
    paged = kwargs.get(PAGED_INPUTS)
    if isinstance(paged, PackedAttentionInputs):
        return attend_packed(query, paged, scaling, softcap, sinks, dropout, decode), None
    if paged is not None:
        return attend_from_pool(query, paged, scaling, softcap, sinks, dropout, decode), None

    q_len, kv_len = query.shape[2], key.shape[2]
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads cannot share {key.shape[1]} key/value heads")
    causal = getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:
        # [q, kv] causal mask aligned to the bottom right: query i sees keys up to kv - q + i
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)
    if softcap is None and sinks is None:
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
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)  # [B, Hq, kv, D]
        value = value.repeat_interleave(groups, dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        sink_logits = None if sinks is None else sinks.view(1, -1, 1, 1).expand(query.shape[0], -1, q_len, 1)
        out = explicit_attention(query, key, value, attention_mask, scale, softcap, sink_logits, dropout)
    return out.transpose(1, 2).contiguous(), None


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
    `decode`: how a decode forward's rows attend (one of `DECODE_KERNELS`). A batch-invariant cache's inputs
    attend each query as if alone (`attend_invariant`), whatever `decode` says.
    """
    if inputs.batch_invariant:
        if sinks is not None or dropout:
            raise NotImplementedError("batch-invariant attention supports neither attention sinks nor dropout")
        return attend_invariant(query, inputs, scaling, softcap)
    if inputs.decode_reads is not None:
        return attend_decode(query, inputs, inputs.decode_reads, scaling, softcap, sinks, dropout, decode)
    return attend_rows(query, inputs, scaling, softcap, sinks, dropout)


def paged_bmm_attention(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """``paged_bmm``: `paged_sdpa_attention` with a float32 decode forward's groups of rows by batched products."""
    return paged_sdpa_attention(*args, decode="products", **kwargs)


def paged_flex_attention(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """``paged_flex``: `paged_sdpa_attention` with a float32 decode forward's rows read in place by `flex_attention`."""
    return paged_sdpa_attention(*args, decode="flex", **kwargs)


def decode_kernel(name: str) -> str:
    """How the decode forwards of paged attention `name` (one of `PAGED_ATTENTION_NAMES`) attend: its
    `DECODE_KERNELS` entry, what `set_paged_attention` takes to switch a model to it."""
    return DECODE_KERNELS[PAGED_ATTENTION_NAMES.index(name)]


def set_paged_attention(model: PreTrainedModel, decode: str = "sdpa") -> None:
    """Switch `model` to ``paged_sdpa``, or to the paged attention whose decode forwards attend as `decode` says
    (``"products"``: ``paged_bmm``, see `BMM_ATTENTION_NAME`; ``"flex"``: ``paged_flex``, see
    `FLEX_ATTENTION_NAME`); raise `NotImplementedError` if the architecture cannot use it, `ValueError` for another
    `decode`.

    Prefer this to ``model.set_attn_implementation("paged_sdpa")`` for two architectures:

    - Gemma 2 marks itself as not supporting SDPA (stock SDPA cannot soft-cap logits) and transformers
      refuses every implementation whose name contains "sdpa" for it; ``paged_sdpa`` does soft-capping,
      so this sets it anyway.
    - Falcon does not dispatch attention through `AttentionInterface`: transformers would log a warning
      and silently keep its own attention. This raises instead. `PagedCache` is still exact with
      Falcon's default attention.

    A model with chunked-attention layers (Llama 4) raises too: they attend with the chunked mask
    transformers builds, which the paged attentions do not apply; so does one whose layers reuse another
    layer's keys and values (Gemma-3n). `PagedCache` is exact with their default attention.
    """
    dense_kinds = dense_attention_kinds(model.config)
    if dense_kinds:
        raise NotImplementedError(
            f"{model.config.model_type!r} has {', '.join(dense_kinds)} layers, which {ATTENTION_NAME!r} cannot "
            f"attend; use PagedCache with the model's default attention instead"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            f"so it cannot run {ATTENTION_NAME!r}; use PagedCache with its default attention instead"
        )
    if decode not in DECODE_KERNELS:
        raise ValueError(f"decode must be one of {DECODE_KERNELS}, not {decode!r}")
    name = PAGED_ATTENTION_NAMES[DECODE_KERNELS.index(decode)]
    try:
        model.set_attn_implementation(name)
    except ValueError:
        if model._supports_sdpa:
            raise
        model.config._attn_implementation = name  # what set_attn_implementation does after its checks
        model.config.get_text_config(decoder=True)._attn_implementation = name


def register_paged_attention() -> None:
    """Make ``attn_implementation="paged_sdpa"`` (and ``"paged_bmm"``, ``"paged_flex"``) available to every
    transformers model.

    Idempotent; runs when `hf_paged_cache` is imported.
    """
    AttentionInterface.register(ATTENTION_NAME, paged_sdpa_attention)
    AttentionInterface.register(BMM_ATTENTION_NAME, paged_bmm_attention)
    AttentionInterface.register(FLEX_ATTENTION_NAME, paged_flex_attention)
    for name in PAGED_ATTENTION_NAMES:
        AttentionMaskInterface.register(name, sdpa_mask)
