"""`StateSlots`: the per-sequence states of a pool's linear-attention, SSM and conv layers, one slot per sequence.

Attention layers keep keys and values per token, in blocks; a linear-attention or conv layer keeps, per
sequence, a fixed-size conv state (its causal convolution's last inputs) and often a recurrent state, whatever
the sequence's length. A slot holds one sequence's states of every such layer: per state (`StateKey`: layer,
``"conv"`` or ``"recurrent"``, and the layer's state index) a tensor ``[num_slots, *state_shape]`` indexed by
slot id along dim 0, made on the first write of that state (on its device, in its dtype: the shapes are the
model's, learned from what its layers write).

Slot ids come from a `BlockPool` of one-slot blocks, so they are reference counted like blocks: rows (beams,
samples, forks) share a slot until a forward writes their states, which gives each writer a slot of its own.
Slot 0 is the null slot: all zeros, never written. The slots are elastic (the id space starts small and
doubles when rows need more, each state tensor growing in place, ``Tensor.set_``, under the pool's
`storage_lock`: the protocol in `kv_pool`), or fixed at `max_slots` sequences, the number a pool sized by a
memory budget sets aside (`KVPool.for_config`): a step that needs more raises `PoolExhaustedError`, changing
nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Literal

import torch

from ..errors import KVMemoryError, PoolExhaustedError
from .block_pool import NULL_BLOCK, BlockPool
from .layer_storage import _empty, _out_of_memory
from .locks import SharedExclusiveLock
from .memory import format_memory

NULL_SLOT = NULL_BLOCK
"""The slot of a row that has no state yet: zeros, never written."""

StateKey = tuple[int, Literal["conv", "recurrent"], int]
"""One state of one layer: ``(layer index, "conv" or "recurrent", state index within the layer)``."""

START_SLOTS = 8
"""The slots an elastic pool starts with (the null slot included) before it grows."""

STATE_GROUP = "sequence states"
"""What `PoolExhaustedError.group` names when the state slots ran out."""


class StateSlots:
    """Per-sequence conv and recurrent states, addressed by slot id (see the module docstring)."""

    def __init__(self, storage_lock: SharedExclusiveLock, max_slots: int | None = None):
        self.storage_lock = storage_lock  # the pool's: readers hold shared(), growth takes exclusive()
        if max_slots is None:  # elastic
            self.ids = BlockPool(START_SLOTS, 1, max_blocks=None, on_grow=_grow_hook(self))
        else:  # fixed: `max_slots` sequences, plus the null slot
            self.ids = BlockPool(max_slots + 1, 1)
        self.tensors: dict[StateKey, torch.Tensor] = {}  # [num_slots, *state_shape] per state

    def take(self, n: int) -> list[int]:
        """`n` fresh slots, each held once (their contents are undefined until written)."""
        slots = self.ids.allocate(n)
        if slots is None:  # only a fixed id space refuses; an elastic one grows or raises KVMemoryError
            raise PoolExhaustedError(n, self.ids.num_free, self.ids.capacity, 0, STATE_GROUP)
        return slots

    def read(self, key: StateKey, slots: torch.Tensor) -> torch.Tensor | None:
        """``[B, *state_shape]`` copy of state `key` in `slots` ``[B]`` (null slots read zeros); None when no
        row has written that state yet."""
        with self.storage_lock.shared():
            tensor = self.tensors.get(key)
            return None if tensor is None else tensor.index_select(0, slots.to(tensor.device))

    def ensure(self, key: StateKey, states: torch.Tensor) -> None:
        """Make state `key`'s slots for states like ``states`` ``[B, *state_shape]`` if none are made yet, or
        check that they hold such states: before a forward is kept, so that keeping it allocates nothing and
        fails nowhere. Raises `ValueError` for states of another shape or dtype, `KVMemoryError` when the
        device cannot allocate the slots; takes `storage_lock.exclusive()` to make them."""
        if key not in self.tensors:
            with self.storage_lock.exclusive():
                if key not in self.tensors:
                    self.tensors[key] = self._create(key, states)
        tensor = self.tensors[key]
        if states.shape[1:] != tensor.shape[1:] or states.dtype != tensor.dtype:
            raise ValueError(
                f"layer {key[0]} wrote a {key[1]} state {tuple(states.shape[1:])} of {states.dtype}, but its slots "
                f"hold {tuple(tensor.shape[1:])} of {tensor.dtype}: is the pool shared with another model?"
            )

    def write(self, key: StateKey, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Store ``states`` ``[B, *state_shape]`` into `slots` ``[B]`` (distinct, none of them the null slot) of
        state `key`, whose slots `ensure` made."""
        tensor = self.tensors[key]
        with self.storage_lock.shared():
            tensor.index_copy_(0, slots.to(tensor.device), states.detach().to(tensor.device))

    def copy(self, key: StateKey, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy state `key` from slots `sources` ``[N]`` into slots `targets` ``[N]``."""
        tensor = self.tensors.get(key)
        if tensor is not None:
            with self.storage_lock.shared():
                tensor.index_copy_(0, targets.to(tensor.device), tensor.index_select(0, sources.to(tensor.device)))

    def bytes_per_slot(self) -> int:
        """Bytes one sequence's states take (over the states written so far)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def nbytes(self) -> int:
        """Bytes of the state tensors allocated so far."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _create(self, key: StateKey, states: torch.Tensor) -> torch.Tensor:
        shape = (self.ids.num_blocks, *states.shape[1:])
        try:
            tensor = _empty(shape, states.dtype, states.device)
        except (RuntimeError, MemoryError) as error:
            if not _out_of_memory(error):
                raise
            nbytes = shape[0] * states[0].numel() * states.element_size()
            raise KVMemoryError(
                f"creating layer {key[0]}'s {key[1]} state slots ({shape[0]} sequences) needs {nbytes:,} bytes "
                f"({format_memory(nbytes)}) on {states.device}, which it could not allocate ({error})",
                nbytes,
                states.device,
            ) from error
        with torch.inference_mode(False):
            tensor[NULL_SLOT] = 0
        return tensor

    def _grow(self, num_slots: int) -> None:
        """`BlockPool.allocate`'s hook: make every state tensor hold `num_slots` slots before the ids exist."""
        with self.storage_lock.exclusive():
            for key, tensor in self.tensors.items():
                if tensor.shape[0] >= num_slots:
                    continue
                try:
                    with torch.inference_mode(False):
                        grown = torch.empty((num_slots, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
                        grown[: tensor.shape[0]] = tensor
                        tensor.set_(grown)
                except (RuntimeError, MemoryError) as error:
                    if not _out_of_memory(error):
                        raise
                    nbytes = num_slots * tensor[0].numel() * tensor.element_size()
                    raise KVMemoryError(
                        f"growing layer {key[0]}'s {key[1]} state slots to {num_slots} sequences needs {nbytes:,} "
                        f"bytes ({format_memory(nbytes)}) on {tensor.device}, which it could not allocate ({error})",
                        nbytes,
                        tensor.device,
                    ) from error

    def __repr__(self) -> str:
        return (
            f"StateSlots(slots={self.ids.num_blocks}, used={self.ids.num_used}, states={len(self.tensors)}, "
            f"storage={format_memory(self.nbytes())})"
        )


def slot_tensor(slots: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``[B]`` long tensor of slot ids."""
    return torch.tensor(list(slots), dtype=torch.long, device=device)


def _grow_hook(slots: StateSlots):
    ref = weakref.ref(slots)

    def on_grow(num_slots: int) -> None:
        target = ref()
        if target is not None:
            target._grow(num_slots)

    return on_grow
