"""One forward over the new tokens of several `PagedCache`s, packed into one ``[1, T]`` sequence.

A continuous batcher's forward has decode rows (one new token each, in the running cache) and prompt chunks
(each in its own request's cache). Run as separate forwards, every forward reads every weight again, and
the decode rows' matmuls run at a few dozen rows, far below what a CPU reaches at hundreds. Packed, the
model sees one sequence of all T new tokens with their own ``position_ids``: each linear layer runs once
over all of them. The forward runs on `PackedCaches` (`hf_paged_cache.cache.packed_caches`), which hands each
member cache its slice of every layer's new keys and values; `paged_sdpa` attends each slice from its own
member's blocks. No token attends across members.

Packing needs attention straight from the pool (``paged_sdpa`` and a model that hands its attention kwargs
to ``cache.update``); otherwise `PackingUnsupported` is raised before anything is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from .packed_caches import PackedCaches, Segment


def packed_forward(model: PreTrainedModel, segments: Sequence[Segment], logits_at: Sequence[int]) -> torch.Tensor:
    """Run `model` once over every segment's new tokens; returns the logits ``[len(logits_at), vocab]``.

    Args:
        segments: the caches and their new tokens, each cache in at most one segment (``start`` is set here).
        logits_at: indices in the packed sequence (`Segment.start` onwards) whose logits to compute.

    All or nothing: if the forward fails anywhere (the LM head included), every segment's cache is rolled back
    before the error is raised; else each keeps its forward (or leaves it pending, for a ``manual_commit`` cache).
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
