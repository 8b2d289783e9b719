"""What a cache learns about each forward's inputs: which new tokens are padding, and their token ids.

transformers passes a cache the new keys and values, never the ``attention_mask`` or ``input_ids``. A
`PagedCache` built from a model therefore installs a forward pre-hook (`attach_input_hook`) that hands it
both before each forward given that cache, and keeps them in a `PendingInputs` until the forward's first
``update`` takes them.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Protocol

import torch
from transformers import PreTrainedModel


class InputObserver(Protocol):
    def observe_inputs(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, query_length: int
    ) -> None: ...


class PendingInputs:
    """The next forward's padding mask and token ids, kept from the pre-hook until the forward's first layer."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [B, q] True for real new tokens
        self.ids: torch.Tensor | None = None  # [B, q] the new tokens' ids

    def observe(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, query_length: int) -> None:
        """Keep the last `query_length` columns of a 2-D ``[B, past + q]`` mask, and 2-D `input_ids`.

        Anything else means "no padding" and "ids unknown".
        """
        self.mask = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
            if attention_mask.shape[1] >= query_length:
                self.mask = attention_mask[:, attention_mask.shape[1] - query_length :].bool()
        self.ids = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else None

    def take(self, batch_size: int, query_length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(new_real, new_ids)`` for a forward of this shape, then forget them.

        Either is None when unknown or when it does not match the forward's shape; `new_real` is also None
        when the mask shows no padding.
        """
        mask, ids = self.mask, self.ids
        self.clear()
        if mask is not None and (mask.shape != (batch_size, query_length) or bool(mask.all())):
            mask = None
        if ids is not None and ids.shape != (batch_size, query_length):
            ids = None
        return mask, ids

    def clear(self) -> None:
        self.mask = self.ids = None


def attach_input_hook(model: PreTrainedModel, cache: InputObserver) -> torch.utils.hooks.RemovableHandle:
    """Install a forward pre-hook that shows `cache` each forward's ``input_ids`` and ``attention_mask``.

    The hook holds the cache weakly and acts only on forwards that were given this cache, so any number of
    caches can watch one model (from any number of threads) without seeing each other's inputs.
    """
    names = list(inspect.signature(model.forward).parameters)
    cache_ref = weakref.ref(cache)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        target = cache_ref()
        if target is None or kwargs is None:
            # torch registers a kwargs hook in two steps; a forward running in another thread meanwhile
            # calls it without kwargs. That forward is not this cache's (it is being built or released).
            return
        bound = dict(zip(names, args)) | kwargs
        if (bound.get("cache") if bound.get("cache") is not None else bound.get("past_key_values")) is not target:
            return
        if bound.get("use_cache") is False:
            # the model would still write into the cache while the caller re-feeds the whole sequence
            # (generate(use_cache=False) does), silently stacking duplicate positions
            raise ValueError("a PagedCache was passed with use_cache=False; pass use_cache=True or no cache")
        inputs = bound.get("input_ids")
        if inputs is None:
            inputs = bound.get("inputs_embeds")
        if inputs is None:
            target.observe_inputs(None, None, 0)
            return
        target.observe_inputs(bound.get("input_ids"), bound.get("attention_mask"), inputs.shape[1])

    return model.register_forward_pre_hook(hook, with_kwargs=True)
