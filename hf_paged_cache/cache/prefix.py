"""Starting new rows from blocks already in the pool: the longest prefix every layer group has cached.

A full-attention group needs every block of the prefix. A sliding-window group of window `W` needs only
the blocks its next query can see: a prefix of `n` tokens is usable if the group still has the blocks
holding tokens ``n - W + 1 .. n - 1`` (blocks before those may have been given back or evicted). A model with
conv / recurrent states also needs a snapshot of the states after exactly those `n` tokens (`RowStates`),
registered under the prefix key of the prefix's last block.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..pool.block_pool import NULL_BLOCK
from ..pool.prefix_index import block_keys
from .block_table import BlockTables
from .row_states import RowStates

_RETRIES = 3  # lookups to try again when another thread evicts a block between lookup and hold


def adopt_longest_prefix(
    groups: Sequence[BlockTables],
    windows: Sequence[int | None],
    rows: Sequence[Sequence[int]],
    states: RowStates | None = None,
) -> int:
    """Add `rows` to every group's tables (and to `states`, for a model with states), started from the longest
    prefix (whole blocks) all of them find.

    Each row keeps at least one token to compute. Returns the number of tokens adopted per row (0 when
    nothing usable is cached).
    """
    root = groups[0].root
    if root is None:
        raise ValueError("these block tables have no prefix root: nothing can be looked up by prefix")
    size = groups[0].blocks.block_size
    max_blocks = (min(len(tokens) for tokens in rows) - 1) // size
    for _ in range(_RETRIES):
        found = [[tables.blocks.lookup_prefix(tokens, max_blocks, root) for tokens in rows] for tables in groups]
        snapshots = None if states is None else [_snapshots(states, tokens, max_blocks, size, root) for tokens in rows]
        length = next(
            n for n in range(max_blocks, -1, -1)
            if all(_usable(hits, n, window, size) for per_row, window in zip(found, windows) for hits in per_row)
            and (snapshots is None or n == 0 or all(per_row[n - 1] is not None for per_row in snapshots))
        )
        held = _hold(groups, windows, found, length, size, max_blocks)
        if held is None:
            continue
        slots = [] if snapshots is None or length == 0 else [per_row[length - 1] for per_row in snapshots]
        if not slots or states.store.ids.hold_cached(slots, looked_up=len(slots)):
            break
        _free(groups, held)  # a snapshot was evicted meanwhile
    else:
        length, held, slots = 0, [[[] for _ in rows] for _ in groups], []
    for tables, per_row in zip(groups, held):
        start = tables.batch_size
        tables.add_rows(len(rows))
        for row, (tokens, blocks) in enumerate(zip(rows, per_row), start=start):
            tables.adopt_prefix(row, blocks, tokens[: length * size])
    if states is not None:
        if slots:
            states.adopt([slot for slot, _ in slots])
        else:
            states.add_rows(len(rows))
    return length * size


def _snapshots(states: RowStates, tokens: Sequence[int], max_blocks: int, size: int, root: bytes) -> list:
    """For each of the first `max_blocks` block boundaries of `tokens`: ``(slot, key)`` of the states snapshot
    registered there, else None."""
    keys = block_keys(tokens[: max_blocks * size], size, root)
    return [states.store.ids.lookup(key, tokens[i * size : (i + 1) * size]) for i, key in enumerate(keys)]


def _free(groups: Sequence[BlockTables], held: list[list[list[int]]]) -> None:
    """Drop the holds `_hold` took."""
    for tables, per_row in zip(groups, held):
        for blocks in per_row:
            tables.blocks.free(reversed([block for block in blocks if block != NULL_BLOCK]))


def _first_needed(num_blocks: int, window: int | None, size: int) -> int:
    """The first block a group needs after a prefix of `num_blocks` blocks (0 for full attention)."""
    if window is None:
        return 0
    return max(num_blocks * size - window + 1, 0) // size


def _usable(hits: list, num_blocks: int, window: int | None, size: int) -> bool:
    return all(hits[i] is not None for i in range(_first_needed(num_blocks, window, size), num_blocks))


def _hold(groups, windows, found, num_blocks: int, size: int, max_blocks: int) -> list[list[list[int]]] | None:
    """Hold every needed block (null entries before a window's first), or None if one was evicted meanwhile."""
    held: list[list[list[int]]] = []
    taken: list[tuple[BlockTables, list[int]]] = []
    for tables, per_row, window in zip(groups, found, windows):
        first = _first_needed(num_blocks, window, size)
        rows = []
        for hits in per_row:
            needed = hits[first:num_blocks]
            if not tables.blocks.hold_cached(needed, looked_up=max_blocks):
                for owner, blocks in taken:
                    owner.blocks.free(reversed(blocks))
                return None
            blocks = [block for block, _ in needed]
            taken.append((tables, blocks))
            rows.append([NULL_BLOCK] * first + blocks)
        held.append(rows)
    return held
