"""What one forward of one token tells about a model's conv and recurrent states (they are sized by the model's
own code, not by its config): how many bytes one sequence's take, and whether the model keeps some in its own
modules instead of its cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def state_bytes_per_sequence(model: PreTrainedModel) -> int:
    """Bytes of one sequence's conv and recurrent states over every layer of `model`, from a forward of one token
    through a `DynamicCache` (each state is ``[1, ...]`` there)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=_one_token(model), cache=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states = (*layer.conv_states.values(), *layer.recurrent_states.values())
            total += sum(state[0].numel() * state.element_size() for state in states if state is not None)
    return total


def layers_keeping_states_elsewhere(model: PreTrainedModel) -> list[int]:
    """The layers with conv / recurrent states whose states `model` keeps in its own modules, outside any cache
    (RecurrentGemma does): they would not follow a cache's rows. From a forward of one token on a `PagedCache`."""
    from .paged_cache import PagedCache  # noqa: PLC0415 (the cache module imports this one)

    with PagedCache(model) as probe, torch.no_grad():
        model(input_ids=_one_token(model), cache=probe, use_cache=True)
        return probe.states_kept_elsewhere()


def _one_token(model: PreTrainedModel) -> torch.Tensor:
    return torch.zeros(1, 1, dtype=torch.long, device=model.device)
