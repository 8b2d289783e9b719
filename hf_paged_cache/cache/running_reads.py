"""`RunningReads`: a continuous batcher's running rows' cross-attention keys and values, kept dense between steps.

The decode rows of an encoder-decoder model read their cross-attention as one dense ``[B, heads, S, dim]`` tensor
a layer. Gathering it from the pool's blocks at every step would copy every row's encoder positions (Whisper:
1,500 a row) every layer, every step; gathering it again whenever a row joins or leaves still copies all rows
each time. Instead each layer's keys and values stay in one buffer of rows, and a change of rows moves rows:

- a row that leaves: the rows after it move up by one (a copy of each, in place; no allocation);
- a row that joins: its source is copied in from the pool after the others;
- a longer source than the buffer holds, or more rows, or rows in another order: the buffer is made anew.

What attention reads is a view of the buffer's first ``B`` rows and ``S`` positions; a row's positions past its
own source's end hold whatever was there (finite values: zeros, or another row's keys), which the encoder's
attention mask hides. The buffer is one more copy of the running rows' cross-attention, as large as a dense
cache's; the pool's blocks hold the lasting one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class _Buffer:
    """One layer's keys (or values) of the rows `tags`, in `data` ``[capacity, heads, S, dim]``."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.tags: list[object] = []


class RunningReads:
    """Dense cross-attention reads of the running rows, kept in step with them by moving rows (see the module
    docstring). Rows are named by their source's tag: an object made with the source, alive as long as it is."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], _Buffer] = {}  # (layer, keys 0 / values 1)

    def read(
        self, layer: int, which: int, tags: Sequence[object], length: int,
        fetch: Callable[[object], torch.Tensor],
    ) -> torch.Tensor:
        """``[B, heads, length, dim]`` the keys (`which` 0) or values (1) of layer `layer` for rows whose sources
        are `tags`, in order; `fetch(tag)` gives a source's ``[heads, S_source, dim]`` from the pool."""
        buffer = self._buffers.get((layer, which))
        if buffer is None or buffer.data.shape[0] < len(tags) or buffer.data.shape[2] < length:
            first = fetch(tags[0])  # [H, S0, D]
            held = buffer.data.shape[0] if buffer is not None else 0  # rows the old buffer had room for
            capacity = held if len(tags) <= held else max(len(tags), 2 * held)
            heads, _, dim = first.shape
            buffer = _Buffer(first.new_zeros(capacity, heads, length, dim))
            self._buffers[(layer, which)] = buffer
        old = buffer.tags
        for row, tag in enumerate(tags):
            if row < len(old) and old[row] is tag:
                continue
            later = next((j for j in range(row + 1, len(old)) if old[j] is tag), None)  # not yet overwritten
            if later is not None:
                buffer.data[row].copy_(buffer.data[later])
            else:
                states = fetch(tag)  # [H, S_source, D]
                buffer.data[row, :, : states.shape[1]].copy_(states)
        buffer.tags = list(tags)
        return buffer.data[: len(tags), :, :length]

    def clear(self) -> None:
        self._buffers = {}
