"""`RowStates`: each row's state slot, and the states the forward in progress reads and writes.

A forward never writes a slot before it is kept: the states it reads are copies gathered from the rows'
slots (`state`), which the model may update in place (a decode step's causal-conv update does), and the
states it writes (`update_conv`, `update_recurrent`) are held as they are. `commit` then stores them into the
rows' slots; `restore` (a rollback) drops them, leaving every slot as it was. So a forward that fails
anywhere leaves no trace, as the block tables' savepoints guarantee for keys and values.

Rows share slots by reference count (`select`, copies, forks): the first forward that writes them gives each
row a slot of its own (`begin`: a row keeps its slot only if no other row or cache holds it), taken before
anything is computed, all or nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ..pool.state_slots import NULL_SLOT, StateKey, StateSlots, slot_tensor


class RowStates:
    """The state slots of one cache's rows (`slots`, one per row) in the pool's `StateSlots`, and the working
    states of the forward in progress (see the module docstring)."""

    def __init__(self, store: StateSlots):
        self.store = store
        self.slots: list[int] = []  # per row; NULL_SLOT until the row's first forward is kept
        self.written: set[StateKey] = set()  # states some kept forward wrote: the rows have a previous state
        self.kernels: dict[StateKey, int] = {}  # each conv state's kernel size (its width), from its first write
        self.reading: list[int] | None = None  # per row, the slot the forward in progress reads (None: no forward)
        self.working: dict[StateKey, torch.Tensor] = {}  # [B, *shape] the forward's states, kept by `commit`
        self.updated: set[StateKey] = set()  # states the forward in progress has written

    # ------------------------------------------------------------------ rows

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    def add_rows(self, n: int) -> None:
        """Append `n` rows without state (the null slot)."""
        self.slots.extend([NULL_SLOT] * n)

    def select(self, rows: Sequence[int]) -> None:
        """Keep rows `rows` (repeats allowed, any order), sharing their slots."""
        slots = [self.slots[r] for r in rows]
        self.store.ids.incref(_held(slots))
        self.store.ids.free(_held(self.slots))
        self.slots = slots

    def extend_from(self, other: RowStates) -> None:
        """Append `other`'s rows (same pool), sharing their slots."""
        self.store.ids.incref(_held(other.slots))
        self.slots.extend(other.slots)
        self.written |= other.written
        self.kernels |= other.kernels

    def copy_to(self, other: RowStates) -> None:
        """Give `other` (empty, same pool) the same rows, sharing their slots."""
        other.extend_from(self)

    def savepoint(self) -> list[int]:
        """The rows' slots now, for `restore`."""
        return list(self.slots)

    def restore(self, saved: list[int]) -> None:
        """Undo everything since `savepoint` (rows repeated or reordered, never dropped; fresh slots taken):
        hold the saved slots again, then drop the current holds, so every reference count is as it was."""
        self.store.ids.incref(_held(saved))
        self.store.ids.free(_held(self.slots))
        self.slots = saved
        self._end_forward()

    def release(self) -> None:
        """Give every row's slot back and forget the rows (and the forward in progress's states)."""
        self.store.ids.free(_held(self.slots))
        self.slots = []
        self.written.clear()
        self._end_forward()

    # ------------------------------------------------------------------ the forward in progress

    def begin(self) -> None:
        """Start a forward over the rows: each row that has no slot of its own (none yet, or one shared with
        another row or cache) takes a fresh one to write, all or nothing (`PoolExhaustedError`,
        `KVMemoryError`: nothing changed); it still reads its states from the old one."""
        self.reading = list(self.slots)
        holders = Counter(self.slots)
        fresh_rows, seen = [], set()
        for row, slot in enumerate(self.slots):
            owned = slot != NULL_SLOT and slot not in seen and self.store.ids.refcount(slot) == holders[slot]
            seen.add(slot)
            if not owned:
                fresh_rows.append(row)
        fresh = self.store.take(len(fresh_rows))
        old = [self.slots[row] for row in fresh_rows]
        for row, slot in zip(fresh_rows, fresh):
            self.slots[row] = slot
        self.store.ids.free(_held(old))  # each stays held by the row that owns it, or by another cache

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
        kernel = self.kernels.setdefault(key, kernel_size or inputs.shape[-1])
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

    def commit(self) -> None:
        """Keep the forward's states: store each into the rows' slots. A state it did not touch is copied
        into the rows that took a fresh slot."""
        if self.reading is None:
            return
        device_slots = slot_tensor(self.slots)
        for key, states in self.working.items():
            self.store.write(key, device_slots, states)
        moved = [(old, new) for old, new in zip(self.reading, self.slots) if old != new]  # from null: zeros
        for key in self.written - set(self.working):
            if moved:
                self.store.copy(key, slot_tensor([o for o, _ in moved]), slot_tensor([n for _, n in moved]))
        self.written |= set(self.working)
        self._end_forward()

    def _end_forward(self) -> None:
        self.reading = None
        self.working = {}
        self.updated = set()


def _held(slots: Sequence[int]) -> list[int]:
    return [slot for slot in slots if slot != NULL_SLOT]
