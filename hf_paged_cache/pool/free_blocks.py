"""`FreeBlocks`: a pool's recycled blocks (reference count 0) in the order `BlockPool.allocate` takes them.

A free block may still hold prefix-cached contents; taking it evicts them. Which to take first decides what
the prefix cache keeps. Least recently freed first (LRU) alone keeps a system prompt shared by every request
only until enough one-off prompts have been freed after it: under memory pressure a burst of unique requests
flushes the blocks that many future requests would hit. So the free list is a segmented LRU (SLRU):

1. **empty**: blocks that hold nothing findable (a partial block, a row without token ids) go first;
2. **probation**: cached blocks never reused since they were cached, least recently freed first;
3. **protected**: cached blocks that were reused (a prefix hit) at least once, least recently freed first.

The protected segment is bounded (``protected_limit``, given by the pool: half its capacity): beyond it, its
least recently freed block moves to the back of probation, SLRU's demotion. So a prefix that stopped being
used ages out like any other block, and one-off blocks always have half the pool to cycle through.

One exception to the order: a growing row may take the block right after its last one out of turn, when that
block is empty or on probation (`take_unprotected`; `BlockPool.allocate`'s ``prefer``), so that its keys stay in
consecutive slots and decode steps read them as one view. Protected blocks are always taken in order.

Each segment is an ordered dict used as an ordered set: append at the back, pop from the front and remove any
block, all O(1) (which a deque cannot do).
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum


class Reuse(Enum):
    """What a freed block's contents are worth to the prefix cache (its segment)."""

    EMPTY = 0  # nothing findable: overwrite it first
    CACHED = 1  # findable, never hit since cached
    REUSED = 2  # findable and hit at least once


class FreeBlocks:
    """Recycled blocks in eviction order: empty, then probation, then protected (see the module docstring)."""

    def __init__(self) -> None:
        self._empty: OrderedDict[int, None] = OrderedDict()
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        # Indexed by `Reuse.value`, in the order `pop` takes them; each least recently freed first.
        self._segments = (self._empty, self._probation, self._protected)

    def __len__(self) -> int:
        return len(self._empty) + len(self._probation) + len(self._protected)

    def add(self, block_id: int, reuse: Reuse, protected_limit: int) -> None:
        """Put a block nobody holds any more at the back of its segment; keep protected at most `protected_limit`."""
        self._segments[reuse.value][block_id] = None
        while len(self._protected) > protected_limit:
            self._probation[self._protected.popitem(last=False)[0]] = None  # demoted: the back of probation

    def remove(self, block_id: int) -> None:
        """Take a specific free block out (a prefix hit holds it again). `KeyError` if it is not free."""
        for segment in self._segments:
            if block_id in segment:
                del segment[block_id]
                return
        raise KeyError(block_id)

    def take_unprotected(self, block_id: int) -> bool:
        """Take `block_id` out if it is empty or on probation (never reused since cached), and say whether it was.

        Out of order within those segments: a growing row asks for the block after its last one, so its keys stay
        in consecutive slots. A protected block (its prefix was hit) is never taken out of order.
        """
        for segment in (self._empty, self._probation):
            if block_id in segment:
                del segment[block_id]
                return True
        return False

    def pop(self) -> int:
        """The next block to hand out: the front of the first non-empty segment. `KeyError` if none is free."""
        for segment in self._segments:
            if segment:
                return segment.popitem(last=False)[0]
        raise KeyError("no free block")
