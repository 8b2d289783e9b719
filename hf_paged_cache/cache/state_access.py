"""`StateAccess`: how a `PagedCache` answers the models' calls for their conv and recurrent states.

Linear-attention, SSM and conv layers read and write per-sequence states through the cache
(``cache.get_conv_state(layer)``, ``cache.update_conv_state(...)``, ``cache.update_recurrent_state(...)``);
`PagedCache` keeps them per row in the pool's state slots (`RowStates`, `StateSlots`) and keeps a forward's
states only when the forward is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from ..pool.kv_pool import KVPool
from ..pool.state_slots import slot_tensor
from .batch import PagedBatch
from .forward_lifecycle import ForwardLifecycle
from .row_states import RowStates
from .state_layer import PagedStateLayer


class StateAccess:
    """The per-sequence state half of `PagedCache`'s `Cache` contract (a mixin: the cache holds the rows)."""

    pool: KVPool
    batch: PagedBatch
    lifecycle: ForwardLifecycle
    layers: list

    @property
    def keeps_states(self) -> bool:
        """Whether the model has layers with conv / recurrent states (linear attention, SSM, conv), which this
        cache keeps per row in the pool's state slots."""
        return self.batch.states is not None

    def states_kept_elsewhere(self) -> list[int]:
        """The layers with conv / recurrent states of which the kept forwards wrote none: the model keeps those
        states in its own modules, outside any cache (RecurrentGemma does), so they follow no row of this cache."""
        if self.batch.states is None:
            return []
        written = {layer for layer, _, _ in self.batch.states.written}
        return [layer for layer in self.pool.layout.state_layers if layer not in written]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Layer `layer_idx`'s conv state ``[B, channels, kernel]`` for the running forward (a copy the model may
        update in place, kept if the forward is), or None before any forward wrote it. Outside a forward, a copy
        of the kept state."""
        return self._state(layer_idx, "conv", state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Layer `layer_idx`'s recurrent state ``[B, ...]``, as `get_conv_state`."""
        return self._state(layer_idx, "recurrent", state_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Append this forward's conv inputs ``[B, channels, q]``; returns what the causal convolution reads
        (the previous state's columns, then the new ones), as `LinearAttentionLayer.update_conv_state`."""
        states = self._states(conv_states)
        return states.update_conv((layer_idx, "conv", state_idx), conv_states, kwargs.get("conv_kernel_size"))

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Make `recurrent_states` ``[B, ...]`` layer `layer_idx`'s state once this forward is kept; returns it."""
        states = self._states(recurrent_states)
        return states.update_recurrent((layer_idx, "recurrent", state_idx), recurrent_states)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether layer `layer_idx` (default: the last layer with states) has conv states, written by a kept
        forward or the running one (each of its states, or state `state_idx`), as `Cache.has_previous_state`."""
        states = self.batch.states
        if states is None:
            raise ValueError("has_previous_state() asks about linear-attention layers, and this model has none")
        layer_idx = self.pool.layout.state_layers[-1] if layer_idx is None else layer_idx
        layer = self.layers[layer_idx]
        if not isinstance(layer, PagedStateLayer):
            raise ValueError(f"layer {layer_idx} is a {type(layer).__name__}, which keeps no state")
        indices = range(layer.number_of_states) if state_idx is None else [state_idx]
        return all(states.has_previous_state((layer_idx, "conv", i)) for i in indices)

    def committed_state(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        """``[B, ...]`` a copy of a layer's `kind` (``"conv"`` / ``"recurrent"``) state as the last kept forward
        left it, or None when none was kept."""
        states = self.batch.states
        with self.batch.lock:
            if states is None or (layer_idx, kind, state_idx) not in states.written:
                return None
            slots = self.committed_state_slots()
            return self.pool.states.read((layer_idx, kind, state_idx), slot_tensor(slots))

    def _state(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        if self.lifecycle.forward is None and not self.lifecycle.pending.observed:  # outside any forward
            return self.committed_state(layer_idx, kind, state_idx)
        return self._states().state((layer_idx, kind, state_idx))

    def _states(self, like: torch.Tensor | None = None) -> RowStates:
        """The rows' states for the running forward (begun here if no layer has yet); `like` is a state tensor
        ``[B, ...]`` the layer gives, else the observed forward's rows and device are used."""
        if like is not None:
            return self.lifecycle.states(like.shape[0], like.device)
        rows = self.lifecycle.pending.batch_size() or self.batch.batch_size
        return self.lifecycle.states(rows, self.batch.is_real.device)

    def committed_state_slots(self) -> list[int]:
        """Each row's state slot as the last committed forward left it (call under the batch's `lock`)."""
        forward = self.lifecycle.forward
        return list(forward.undo.states.slots if forward is not None else self.batch.states.slots)

    def refuse_with_states(self, what: str) -> None:
        """Raise `NotImplementedError` for `what` (``"crop"``, ``"drafts"``), which per-sequence states
        cannot do, when this model keeps any."""
        if self.batch.states is not None:
            raise NotImplementedError(_REFUSALS[what])


_REFUSALS = {
    "crop": "crop() cannot remove positions from a model with conv / recurrent states: a state cannot go back to an "
            "earlier position",
    "drafts": "drafts (speculative decoding) are not supported on a model with conv / recurrent states: its states "
              "cannot give back rejected drafts",
}
