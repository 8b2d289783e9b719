"""One forward over the new tokens of several `PagedCache`s, packed into one ``[1, T]`` sequence.

A continuous batcher's step has decode rows (one new token each, in the running cache) and prompt chunks
(each in its own request's cache). Run as separate forwards, every forward reads every weight again, and
the decode rows' matmuls run at a few dozen rows, far below what a CPU reaches at hundreds. Packed, the
model sees one sequence of all T new tokens with their own ``position_ids``: each linear layer runs once
over all of them. At each layer `PackedCaches.update` hands every member its slice of the new keys and
values, shaped ``[rows, heads, q, dim]`` as if it ran alone (`PagedCache.update` stores them and plans
attention from the pool), and `paged_sdpa` attends each slice from its own member's blocks
(`paged_sdpa.attend_packed`). No token attends across members.

Packing needs attention straight from the pool (``paged_sdpa`` and a model that hands its attention kwargs
to ``cache.update``); otherwise `PackingUnsupported` is raised before anything is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from ..attention.read_plan import PAGED_INPUTS, PackedAttentionInputs, PagedAttentionInputs, SegmentSpan
from ..attention.paged_sdpa import ATTENTION_NAME
from ..cache.paged_cache import PagedCache


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


def packed_forward(model: PreTrainedModel, segments: Sequence[Segment], logits_at: Sequence[int]) -> torch.Tensor:
    """Run `model` once over every segment's new tokens; returns the logits ``[len(logits_at), vocab]``.

    Args:
        segments: the caches and their new tokens, each cache in at most one segment (``start`` is set here).
        logits_at: indices in the packed sequence (`Segment.start` onwards) whose logits to compute.

    All or nothing: if the forward fails anywhere (the LM head included), every segment's cache is rolled back
    before the error is raised; else each keeps its step (or leaves it pending, for a ``manual_commit`` cache).
    """
    if len({id(segment.cache) for segment in segments}) < len(segments):
        raise ValueError("packed_forward() takes each cache in one segment at most")
    placed, start = [], 0
    for segment in segments:
        placed.append(replace(segment, start=start))
        start = placed[-1].end
    attention = model.config.get_text_config(decoder=True)._attn_implementation  # as the input hook reads it
    for segment in placed:  # each cache hears how the forward ended from here (the model's hook sees PackedCaches)
        segment.cache.observe_inputs(
            segment.input_ids, segment.attention_mask, segment.length, segment.position_ids, attention, hooked=True
        )
    device = model.device
    input_ids = torch.cat([s.input_ids.reshape(-1).to(device) for s in placed]).unsqueeze(0)  # [1, T]
    position_ids = torch.cat([s.position_ids.reshape(-1).to(device) for s in placed]).unsqueeze(0)  # [1, T]
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, cache=PackedCaches(placed), use_cache=True,
                    logits_to_keep=torch.tensor(list(logits_at), device=device))
        logits = out.logits[0]
    except BaseException:
        for segment in placed:
            segment.cache.forward_ended(failed=True)
        raise
    for segment in placed:
        segment.cache.forward_ended(failed=False)
    return logits
