"""The layer kinds a `PagedCache` stores, one module per family, keyed by transformers' layer types.

`KINDS` maps each name of ``config.layer_types`` that this package supports to its `LayerKind`; a kind
transformers adds is one new `LayerKind` here (and its cache layer). `layer_kinds` reads a config's layers.
"""

from __future__ import annotations

from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from . import attention, dummy, hybrid, recurrent
from .base import LayerKind, LayerSpec
from .encoder_decoder import decoder_shape, is_encoder_decoder

KINDS: dict[str, LayerKind] = {
    kind.name: kind for module in (attention, recurrent, hybrid, dummy) for kind in module.KINDS
}


def layer_kinds(config: PreTrainedConfig) -> list[LayerSpec]:
    """Each decoder layer's kind, the span of tokens it keeps and its number of states, from `config`.

    For an encoder-decoder model, its decoder's self-attention layers (`encoder_decoder`). Raises
    `NotImplementedError`, naming the model type, for layer types this package does not store yet.
    """
    if is_encoder_decoder(config):
        return [attention.FULL_ATTENTION.spec({})] * decoder_shape(config).num_layers
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unsupported = sorted(set(layer_types) - set(KINDS))
    if unsupported:
        raise NotImplementedError(
            f"model type {config.model_type!r} has layers of type {unsupported}, which PagedCache does not store "
            f"yet (it stores {', '.join(KINDS)}); use the model's default cache"
        )
    return [KINDS[name].spec(kwargs) for name, kwargs in zip(layer_types, layer_kwargs)]


def keeps_states(config: PreTrainedConfig) -> bool:
    """Whether any decoder layer of `config` keeps conv / recurrent states per sequence."""
    return any(spec.kind.state for spec in layer_kinds(config))


__all__ = ["KINDS", "LayerKind", "LayerSpec", "keeps_states", "layer_kinds"]
