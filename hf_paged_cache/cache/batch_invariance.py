"""`make_batch_invariant`: switch a model to computing each row as if it were alone in its batch.

A row's logits pass through three kinds of operations: those that treat each row (or each element) apart by
construction (embeddings, norms, rotary embeddings, activations, residual adds: the same loop over a row whatever
rows follow it, found invariant by `tests/cache/test_batch_invariance.py`), matrix products whose kernels pick
their summation order by the number of rows (every linear layer: `kernels.row_tiles` gives them whole tiles of
rows), and attention, whose fast kernels depend on the shape of the whole forward (`attention.invariant` computes
each query alone). `PagedCache(model, batch_invariant=True)` calls this; docs/determinism.md has the table.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..attention.invariant import attention_probe
from ..attention.paged_sdpa import PAGED_ATTENTION_NAMES, set_paged_attention
from ..kernels.row_tiles import tile_rows
from ..kinds import LayerSpec
from ..kinds.encoder_decoder import is_encoder_decoder
from ..pool.kv_pool import KVPool


def make_batch_invariant(model: PreTrainedModel | None, specs: list[LayerSpec], pool: KVPool) -> None:
    """Make `model` (whose cache layers are `specs`, its keys and values in `pool`) compute every row's logits
    independently of the other rows, in place and for good: its attention becomes ``paged_sdpa`` (which a
    batch-invariant `PagedCache` makes attend each query alone) and its linear layers multiply whole tiles of rows
    (`tile_rows`). Idempotent.

    Raises:
        ValueError: `model` is None (a cache built from a config).
        NotImplementedError: a model this mode cannot run: encoder-decoder, recurrent or dense-only layers,
            attention sinks, or sliding windows over keys and values stored in another format than computed.
        RuntimeError: this machine's kernels fail the mode's probes (`attention_probe`, `tiles_probe`).
    """
    if model is None:
        raise ValueError("batch_invariant needs the model: PagedCache(model, batch_invariant=True)")
    config = model.config
    name = config.model_type
    if is_encoder_decoder(config):
        raise NotImplementedError(f"batch-invariant mode does not support encoder-decoder models ({name!r})")
    others = sorted({spec.kind.name for spec in specs
                     if spec.kind.state or spec.kind.dense_only or not spec.kind.tokens})
    if others:
        raise NotImplementedError(f"batch-invariant mode supports attention layers only; {name!r} has {others} layers")
    if any(spec.window is not None for spec in specs) and pool.kv_format.storage != pool.dtype:
        raise NotImplementedError(  # a window's long forward attends its new keys as computed, not as stored
            f"batch-invariant mode keeps a sliding-window model's keys and values as computed: {name!r} cannot "
            f"store them as {pool.kv_format.name}"
        )
    text = config.get_text_config(decoder=True)
    if getattr(text, "attention_sink", None) or "gpt_oss" in name:
        raise NotImplementedError(f"batch-invariant mode does not support attention sinks ({name!r})")
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    groups = heads // (getattr(text, "num_key_value_heads", None) or heads)
    window = max((spec.window for spec in specs if spec.window is not None), default=None)  # the longest
    problem = attention_probe(head_dim, groups, model.dtype, torch.get_num_threads(), window)
    if problem:
        raise RuntimeError(f"batch-invariant attention is not available on this machine: {problem}")
    if getattr(config, "_attn_implementation", None) not in PAGED_ATTENTION_NAMES:
        set_paged_attention(model)
    tile_rows(model)
