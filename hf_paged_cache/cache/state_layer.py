"""`PagedStateLayer` and `PagedHybridLayer`: the views of a `PagedCache` for layers that keep per-sequence states.

transformers' models read and write these states through the cache (``cache.get_conv_state(layer_idx)``,
``cache.update_conv_state(...)``, ``cache.update_recurrent_state(...)``), which `PagedCache` answers from the
pool's state slots (`RowStates`); these layers say what kind each layer is (`Cache.is_linear` and
`Cache.has_previous_state` read them) and show the states as transformers' own layers do.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

from .layer import LayerOwner, PagedLayer


class StateOwner(Protocol):
    """What a `PagedStateLayer` needs of its cache (a `PagedCache`, which this module does not import)."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool: ...

    def committed_state(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None: ...

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor: ...

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor: ...


class PagedStateLayer(LinearAttentionCacheLayerMixin):
    """One linear-attention, SSM or conv layer's view of a `PagedCache`: its states live in the pool's slots.

    `conv_states` and `recurrent_states` read like `LinearAttentionLayer`'s (``{state_idx: [B, ...]}``), as the
    last kept forward left them; they are copies. The layer cannot be cropped: a recurrent state cannot go back.
    """

    is_compileable = False
    is_croppable = False
    record_past = False  # a recurrent state keeps no past to go back to (`PagedCache.crop` refuses)

    def __init__(self, cache: StateOwner, layer_idx: int, number_of_states: int = 1):
        self._state_owner = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.number_of_states = number_of_states
        self.length = 0  # logical positions seen (as the attention layers count them)
        self.is_initialized = False  # as transformers' layers: set once a forward has run (the forks copy it)
        self.device = self.dtype = None

    def _owner(self) -> StateOwner:
        cache = self._state_owner()
        if cache is None:
            raise ReferenceError("this layer's PagedCache no longer exists")
        return cache

    @property
    def has_previous_state(self) -> dict[int, bool]:  # type: ignore[override]
        owner = self._owner()
        return {i: owner.has_previous_state(self.layer_idx, i) for i in range(self.number_of_states)}

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:  # type: ignore[override]
        return {i: self._owner().committed_state(self.layer_idx, "conv", i) for i in range(self.number_of_states)}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:  # type: ignore[override]
        owner = self._owner()
        return {i: owner.committed_state(self.layer_idx, "recurrent", i) for i in range(self.number_of_states)}

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to make: the pool's state slots are made on their first write."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self._owner().update_conv_state(conv_states, self.layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self._owner().update_recurrent_state(recurrent_states, self.layer_idx, state_idx, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a recurrent or conv state cannot be cropped back to an earlier position")

    def reset(self) -> None:
        self.length = 0

    def offload(self) -> None:
        """States stay where the pool keeps them."""

    def prefetch(self) -> None:
        """States stay where the pool keeps them."""


class PagedHybridLayer(PagedStateLayer, PagedLayer):
    """A hybrid layer's view (Falcon-H1, Hymba): keys and values per token in blocks, as `PagedLayer`, and
    conv and recurrent states per sequence in slots, as `PagedStateLayer`."""

    is_croppable = False

    def __init__(self, cache: LayerOwner, layer_idx: int, sliding_window: int | None = None,
                 number_of_states: int = 1):
        PagedLayer.__init__(self, cache, layer_idx, sliding_window)
        PagedStateLayer.__init__(self, cache, layer_idx, number_of_states)  # type: ignore[arg-type]

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and not kwargs:  # keys and values (the attention part)
            PagedLayer.lazy_initialization(self, *args)

    def reset(self) -> None:
        PagedLayer.reset(self)

    def get_max_length(self) -> int:
        return -1


class PagedDummyLayer(DummyLayer):
    """A layer that keeps nothing (MLP-only, or reading another layer's keys and values); it counts positions
    like the others."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.length = 0

    def reset(self) -> None:
        self.length = 0
