"""`PackedCaches`: the cache of one forward over the new tokens of several `PagedCache`s packed into one sequence.

A packed forward (`hf_paged_cache.cache.packed_forward.packed_forward`) holds each member cache's new tokens as one
`Segment` of a ``[1, T]`` sequence. At each layer `PackedCaches.update` hands every member its slice of the new
keys and values, shaped ``[rows, heads, q, dim]`` as if it ran alone (`PagedCache.update` stores them and lays out
attention from the pool), and `paged_sdpa` attends each slice from its own member's blocks
(`paged_sdpa.attend_packed`). No token attends across members.

Packing needs attention straight from the pool (``paged_sdpa`` and a model that hands its attention kwargs
to ``cache.update``); otherwise `PackingUnsupported` is raised before anything is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache

from ..attention.paged_sdpa import ATTENTION_NAME
from ..attention.reads import PAGED_INPUTS, PackedAttentionInputs, PagedAttentionInputs, SegmentSpan
from .paged_cache import PagedCache


class PackingUnsupported(NotImplementedError):
    """The model cannot run a packed forward (its attention does not read from the pool)."""


@dataclass(frozen=True)
class Segment:
    """One member's new tokens: ``rows x length`` tokens of `cache`, row after row in the packed sequence.

    The decode rows of a running cache are one segment of ``B x 1``; a prompt chunk is one of ``1 x c``.
    """

    cache: PagedCache
    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor  # [rows, length]
    attention_mask: torch.Tensor | None = None  # [rows, past + length], as for the cache's own forward
    start: int = 0  # index of its first token in the packed sequence

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def end(self) -> int:
        return self.start + self.input_ids.numel()

    @property
    def span(self) -> SegmentSpan:
        return SegmentSpan(self.start, self.rows, self.length)


class PackedCaches(Cache):
    """The cache a packed forward runs on: it routes each segment's keys and values to the segment's cache.

    Built by `packed_forward` for one forward; not reusable. transformers builds a causal mask over the
    packed sequence from `get_mask_sizes`; ``paged_sdpa`` ignores it and masks each segment by its own
    positions.
    """

    def __init__(self, segments: Sequence[Segment]):
        self.segments = list(segments)
        super().__init__(layers=list(self.segments[0].cache.layers))  # read for is_sliding and the like

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each segment's slice of ``[1, heads, T, dim]`` keys and values in its cache; returns them as given."""
        attention_kwargs = kwargs.get("kwargs")
        if not isinstance(attention_kwargs, dict):
            raise PackingUnsupported("this model does not hand its attention kwargs to cache.update()")
        inputs = []
        for segment in self.segments:
            own: dict[str, Any] = {}
            keys, values = segment.span.unpack(key_states), segment.span.unpack(value_states)  # [rows, H, q, D]
            segment.cache.update(keys, values, layer_idx, kwargs=own)
            if not isinstance(own.get(PAGED_INPUTS), PagedAttentionInputs):
                raise PackingUnsupported(f"layer {layer_idx} cannot attend from the pool ({ATTENTION_NAME} needed)")
            inputs.append(own[PAGED_INPUTS])
        attention_kwargs[PAGED_INPUTS] = PackedAttentionInputs([s.span for s in self.segments], inputs)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise PackingUnsupported("a packed forward has no single past length: it needs position_ids")

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0
