"""What one forward of one token tells about a model's conv and recurrent states, which are sized by the model's
own code, not by its config: how many bytes one sequence's take."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def state_bytes_per_sequence(model: PreTrainedModel) -> int:
    """Bytes of one sequence's conv and recurrent states over every layer of `model`, from a forward of one token
    through a `DynamicCache` (each state is ``[1, ...]`` there)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=one_token(model), cache=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            states = (*layer.conv_states.values(), *layer.recurrent_states.values())
            total += sum(state[0].numel() * state.element_size() for state in states if state is not None)
    return total


def one_token(model: PreTrainedModel) -> torch.Tensor:
    """``[1, 1]`` token id 0 on the model's device: the input of a probing forward."""
    return torch.zeros(1, 1, dtype=torch.long, device=model.device)
