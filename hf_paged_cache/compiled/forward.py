"""`CompiledForward`: a decoder's decode forward compiled by inductor around the paged cache, as one graph.

An eager decode step of a small model spends much of its time between the kernels: dozens of small element-wise
ops per layer (norms, rotary, residual adds, activations), each a dispatch, and the Python of every module. Compiled
whole, inductor fuses that work into a few loops and the module Python goes. Dynamo cannot trace the cache, so the
model runs with none: each attention layer calls one opaque operator (`running_attention`) that stores into the
cache of the running forward and attends from its pool.

Packed linear layers (`kernels.pack_linears`) stay opaque operators too, multiplying by their oneDNN-packed weights:
inductor, which cannot know a step's row count in advance, would call ``mm`` for them (MKL's small-batch kernels,
slow on some CPUs). Other layers (stock or quantized) are compiled as they come.

It compiles the forwards that the glue dominates: a cache's rows taking one token each (decode), or a few (drafts).
Their sizes are unbacked symbols and every position's logits are kept, so one graph serves every batch size and
every draft length. The first forward compiles it (about a minute for SmolLM2-135M on two cores the
first time, about 25 s from inductor's disk cache). Compiled and eager forwards compute the same products in other
orders (fused loops): logits agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from ..attention.paged_sdpa import PAGED_ATTENTION_NAMES
from ..attention.reads import RUNNING_CACHE
from ..kinds import layer_kinds
from ..kinds.encoder_decoder import is_encoder_decoder
from .running_attention import running_cache


def compile_refusal(model: PreTrainedModel) -> str | None:
    """Why `model` cannot run a `CompiledForward`, or None when it can."""
    config = model.config
    text = config.get_text_config(decoder=True)
    if is_encoder_decoder(config):
        return f"{config.model_type!r} is an encoder-decoder model"
    kinds = {spec.kind.name for spec in layer_kinds(config) if not spec.kind.tokens or spec.kind.state
             or spec.kind.dense_only or spec.kind.indexer}
    if kinds:
        return f"{config.model_type!r} has {', '.join(sorted(kinds))} layers; only attention layers compile"
    if getattr(text, "kv_lora_rank", None):
        return f"{config.model_type!r} stores latent keys (MLA), which its attention expands outside the pool"
    if model.training:
        return "the model is in training mode (call model.eval())"
    attention = getattr(text, "_attn_implementation", None)
    if attention not in PAGED_ATTENTION_NAMES:
        return f"its attention is {attention!r}, not one of {PAGED_ATTENTION_NAMES} (set_paged_attention)"
    return None


class CompiledForward:
    """`model`'s forward compiled around the paged cache (see the module docstring), for the forwards of a cache's
    rows that each take one or a few new tokens (decode steps, with or without drafts).

    Raises `NotImplementedError` naming the reason for a model it cannot compile (`compile_refusal`).
    """

    def __init__(self, model: PreTrainedModel):
        refusal = compile_refusal(model)
        if refusal is not None:
            raise NotImplementedError(f"cannot compile {type(model).__name__}'s forward: {refusal}")
        self.model = model
        self.attention = model.config.get_text_config(decoder=True)._attn_implementation
        self.layers = len(layer_kinds(model.config))  # attention calls a forward makes
        self._forward = torch.compile(model.forward, dynamic=True)
        # a 4D mask is taken as given, so transformers builds none (the running attention masks by the block tables)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=model.device)

    def __call__(self, cache: Cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits ``[B, q, V]`` (every position's) of one forward of `cache`'s rows (a `PagedCache` built from
        the model) over `input_ids` ``[B, q]`` at `position_ids` ``[B, q]``; `attention_mask` ``[B, L]`` tells
        padding, as for the eager forward. The cache observes the inputs first and hears how the forward ended, as
        from the model's hooks in an eager forward: a forward that raises leaves it as it was.

        Raises `RuntimeError` when a layer attended without the operator (a model that does not pass its attention
        kwargs on): such a forward would have attended to its new tokens alone.
        """
        if getattr(cache, "batch_invariant", False):
            raise NotImplementedError("a batch-invariant cache cannot run a compiled forward: inductor's kernels "
                                      "sum in orders that depend on the batch")
        input_ids = input_ids.clone()  # a tensor of its own: the graph would guard on a view's base
        position_ids = position_ids.clone()
        cache.observe_inputs(input_ids, attention_mask, input_ids.shape[1], position_ids, self.attention, hooked=True)
        # unbacked sizes: no guard on their values, so one graph serves every batch and length (1 included)
        for tensor in (input_ids, position_ids):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
            torch._dynamo.decorators.mark_unbacked(tensor, 1)
        try:
            with torch.no_grad(), running_cache(cache) as running:
                out = self._forward(input_ids=input_ids, position_ids=position_ids, attention_mask=self._no_mask,
                                    use_cache=False, logits_to_keep=0, **{RUNNING_CACHE: True})
            if running.attended != self.layers:
                raise RuntimeError(
                    f"{type(self.model).__name__}'s compiled forward attended {running.attended} of its "
                    f"{self.layers} layers through the paged cache: its attention layers do not pass their kwargs on"
                )
        except BaseException:
            cache.forward_ended(failed=True)
            raise
        cache.forward_ended(failed=False)
        return out.logits
