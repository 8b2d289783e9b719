"""`RowStates`: each row's state slot, and the states the forward in progress reads and writes.

A forward never writes a slot before it is kept: the states it reads are copies gathered from the rows'
slots (`state`), which the model may update in place (a decode step's causal-conv update does), and the
states it writes (`update_conv`, `update_recurrent`) are held as they are. `commit` then stores them into the
rows' slots; `restore` (a rollback) drops them, leaving every slot as it was. So a forward that fails
anywhere leaves no trace, as the block tables' savepoints guarantee for keys and values.

Rows share slots by reference count (`select`, copies, forks): the first forward that writes them gives each
row a slot of its own (`begin`: a row keeps its slot only if no other row or cache holds it), taken before
anything is computed, all or nothing.

Snapshots for prefix caching: when a kept forward leaves a row at a block boundary, its slot is registered in
the slots' prefix index under the chained key of the row's last block (`commit(boundaries)`), so that a later
row starting with the same tokens starts from these states (`adopt`) instead of computing them. A registered
slot is never written again: the row's next forward takes a fresh slot for its states (or, when none is free,
unregisters the snapshot and writes in place), and the snapshot, once no row holds it, waits in the free list
with its contents until a slot is needed (evicted like a cached block). Only a row whose every forward computed
all its new positions (no padding among them: a padded position may leak into a state) registers snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..pool.prefix_index import IndexEntry
from ..pool.state_slots import NULL_SLOT, StateKey, StateSlots, slot_tensor

Boundary = tuple[bytes, Sequence[int]]
"""A row at a block boundary: the prefix key of its last block and that block's tokens."""


@dataclass(frozen=True)
class StatesSavepoint:
    """The rows' slots and snapshot flags before a forward (`RowStates.savepoint`)."""

    slots: list[int] = field(default_factory=list)
    keyable: list[bool] = field(default_factory=list)


class RowStates:
    """The state slots of one cache's rows (`slots`, one per row) in the pool's `StateSlots`, and the working
    states of the forward in progress (see the module docstring)."""

    def __init__(self, store: StateSlots, state_layers: Sequence[int]):
        self.store = store
        self.state_layers = frozenset(state_layers)  # the model's layers with states: a snapshot holds all of them
        self.slots: list[int] = []  # per row; NULL_SLOT until the row's first forward is kept
        self.keyable: list[bool] = []  # per row: whether its states may be registered as snapshots (no padding)
        self.written: set[StateKey] = set()  # states some kept forward wrote: the rows have a previous state
        self.reading: list[int] | None = None  # per row, the slot the forward in progress reads (None: no forward)
        self.working: dict[StateKey, torch.Tensor] = {}  # [B, *shape] the forward's states, kept by `commit`
        self.updated: set[StateKey] = set()  # states the forward in progress has written
        self.padded: list[int] = []  # rows with padding among the forward in progress's new positions
        self.replaced: list[int] = []  # the slots rows held before the forward in progress gave them fresh ones
        self.unregistered: list[tuple[int, IndexEntry]] = []  # snapshots the forward in progress writes over

    # ------------------------------------------------------------------ rows

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def add_rows(self, n: int) -> None:
        """Append `n` rows without state (the null slot)."""
        self.slots.extend([NULL_SLOT] * n)
        self.keyable.extend([True] * n)

    def adopt(self, slots: Sequence[int]) -> None:
        """Append rows that start from snapshots: `slots`, each already held once for its row (`hold_cached`)."""
        self.slots.extend(slots)
        self.keyable.extend([True] * len(slots))
        self.written |= set(self.store.tensors)  # a snapshot holds every state the model writes

    def select(self, rows: Sequence[int]) -> None:
        """Keep rows `rows` (repeats allowed, any order), sharing their slots."""
        slots = [self.slots[r] for r in rows]
        self.store.ids.incref(_held(slots))
        self.store.ids.free(_held(self.slots))
        self.slots = slots
        self.keyable = [self.keyable[r] for r in rows]

    def extend_from(self, other: RowStates) -> None:
        """Append `other`'s rows (same pool), sharing their slots."""
        self.store.ids.incref(_held(other.slots))
        self.slots.extend(other.slots)
        self.keyable.extend(other.keyable)
        self.written |= other.written

    def copy_to(self, other: RowStates) -> None:
        """Give `other` (empty, same pool) the same rows, sharing their slots."""
        other.extend_from(self)

    def savepoint(self) -> StatesSavepoint:
        """The rows' slots now, for `restore`."""
        return StatesSavepoint(list(self.slots), list(self.keyable))

    def restore(self, saved: StatesSavepoint) -> None:
        """Undo everything since `savepoint` (rows repeated or reordered, never dropped; fresh slots taken;
        snapshots unregistered): hold the saved slots again, then drop the current holds, so every reference
        count is as it was."""
        self.store.ids.incref(_held(saved.slots))
        self.store.ids.free(_held(self.slots) + _held(self.replaced))
        self.slots = list(saved.slots)
        self.keyable = list(saved.keyable)
        for slot, entry in self.unregistered:  # not written over after all
            self.store.ids.remember(slot, entry)
        self._end_forward()

    def release(self) -> None:
        """Give every row's slot back and forget the rows (and the forward in progress's states)."""
        for slot, entry in self.unregistered:  # a forward in progress ends unkept: its snapshots stand
            self.store.ids.remember(slot, entry)
        self.store.ids.free(_held(self.slots) + _held(self.replaced))
        self.slots = []
        self.keyable = []
        self.written.clear()
        self._end_forward()

    # ------------------------------------------------------------------ the forward in progress

    def begin(self, padded: Sequence[int] = ()) -> None:
        """Start a forward over the rows (`padded`: those with padding among its new positions): each row that
        has no slot of its own (none yet, or one shared with another row or cache) takes a fresh one to write,
        all or nothing (`PoolExhaustedError`, `KVMemoryError`: nothing changed); it still reads its states from
        the old one. A row whose own slot is a snapshot takes a fresh one too if one is free, else writes over
        the snapshot, which stops being findable now (and is findable again if the forward is rolled back)."""
        ids = self.store.ids
        self.reading = list(self.slots)
        holders = Counter(self.slots)
        fresh_rows, snapshot_rows, seen = [], [], set()
        for row, slot in enumerate(self.slots):
            owned = slot != NULL_SLOT and slot not in seen and ids.refcount(slot) == holders[slot]
            seen.add(slot)
            if not owned:
                fresh_rows.append(row)
            elif ids.is_cached(slot):
                snapshot_rows.append(row)
        if not ids.can_allocate(len(fresh_rows) + len(snapshot_rows)):
            for row in snapshot_rows:
                slot = self.slots[row]
                self.unregistered.append((slot, ids.forget(slot)))
                if ids.refcount(slot) != holders[slot]:  # another cache started from it before it was forgotten
                    fresh_rows.append(row)
            snapshot_rows = []
        fresh_rows = sorted(fresh_rows + snapshot_rows)
        fresh = self.store.take(len(fresh_rows))
        self.replaced = [self.slots[row] for row in fresh_rows]  # still held: given back when the forward is kept
        for row, slot in zip(fresh_rows, fresh):
            self.slots[row] = slot
        self.padded = list(padded)

    def has_previous_state(self, key: StateKey) -> bool:
        return key in self.written or key in self.updated

    def state(self, key: StateKey) -> torch.Tensor | None:
        """``[B, *shape]`` the rows' state `key` for the forward in progress (a working copy the model may update
        in place), or None when no forward has written it yet."""
        working = self.working.get(key)
        if working is not None or key not in self.written:
            return working
        working = self.store.read(key, slot_tensor(self.reading))
        self.working[key] = working
        return working

    def update_conv(self, key: StateKey, inputs: torch.Tensor, kernel_size: int | None) -> torch.Tensor:
        """Append a forward's conv inputs ``[B, C, q]`` to state `key` and return what the causal convolution
        reads: ``[B, C, K + q]`` after a previous state, else the inputs left-padded to at least the kernel
        size `K`; the state keeps the last `K` columns (as transformers' `LinearAttentionLayer` does)."""
        slots = self.store.tensors.get(key)  # [slots, C, K] once any forward wrote it: its width is the kernel's
        kernel = slots.shape[-1] if slots is not None else kernel_size or inputs.shape[-1]
        previous = self.state(key)
        if previous is None:
            full = inputs
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous, inputs], dim=-1)
        self.working[key] = full[..., -kernel:].contiguous()
        self.store.ensure(key, self.working[key])  # its slots exist before the forward is kept
        self.updated.add(key)
        return full

    def update_recurrent(self, key: StateKey, states: torch.Tensor) -> torch.Tensor:
        """Make `states` ``[B, *shape]`` the rows' recurrent state `key` once the forward is kept; returns it."""
        self.store.ensure(key, states)  # its slots exist before the forward is kept
        self.working[key] = states
        self.updated.add(key)
        return states

    def commit(self, boundaries: Sequence[Boundary | None] = ()) -> None:
        """Keep the forward's states: store each into the rows' slots. A state it did not touch is copied
        into the rows that took a fresh slot. Then register the slot of each row the forward left at a block
        boundary (`boundaries[b]`, None for a row inside a block or whose tokens are unknown) as a snapshot,
        unless padding ever reached the row's states or some layer's states are not in the slots (kept in the
        model's own modules)."""
        if self.reading is None:
            return
        for row in self.padded:
            self.keyable[row] = False
        device_slots = slot_tensor(self.slots)
        for key, states in self.working.items():
            self.store.write(key, device_slots, states)
        moved = [(old, new) for old, new in zip(self.reading, self.slots) if old != new]  # from null: zeros
        for key in self.written - set(self.working):
            if moved:
                self.store.copy(key, slot_tensor([o for o, _ in moved]), slot_tensor([n for _, n in moved]))
        self.written |= set(self.working)
        self.store.ids.free(_held(self.replaced))  # each stays held by another row or cache, or is a snapshot
        if self.state_layers <= {layer for layer, _, _ in self.written}:  # else some live in the model's modules
            self._register_snapshots(boundaries)
        self._end_forward()

    def _register_snapshots(self, boundaries: Sequence[Boundary | None]) -> None:
        for row, boundary in enumerate(boundaries):
            if boundary is not None and self.keyable[row] and self.slots[row] != NULL_SLOT:
                self.store.ids.register(self.slots[row], *boundary)  # a key already registered keeps its slot

    def _end_forward(self) -> None:
        self.reading = None
        self.working = {}
        self.updated = set()
        self.padded = []
        self.replaced = []
        self.unregistered = []


def _held(slots: Sequence[int]) -> list[int]:
    return [slot for slot in slots if slot != NULL_SLOT]
