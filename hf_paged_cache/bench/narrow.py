"""`narrowed`: a model's architecture with its widths cut to a few units, to time what a step costs beyond its math.

A decode step of a small model on a CPU spends a good part of its time outside the products: in Python (the
modules' forwards, a cache's bookkeeping), in dispatching hundreds of small ops, in allocating their outputs.
That fixed cost does not grow with the widths; the products do. So the same architecture with every width cut
(a few units per head, a small MLP) runs the same modules, caches and Python as the real model, and its step
time is, within a few percent, the fixed cost alone (`scripts/bench/generate/bench_decode.py --per-step --fixed-cost`).
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

NARROW_HEAD_DIM = 8
"""Channels per attention head of a narrowed model."""
NARROW_INTERMEDIATE_SIZE = 64
"""Hidden units of a narrowed model's MLPs."""


def narrowed(
    model: PreTrainedModel,
    *,
    head_dim: int = NARROW_HEAD_DIM,
    intermediate_size: int = NARROW_INTERMEDIATE_SIZE,
    seed: int = 0,
) -> PreTrainedModel:
    """A model of `model`'s architecture with its widths cut, weights drawn at random from `seed`.

    Kept: the layers and their types (sliding windows included), the attention and key/value head counts, the
    vocabulary and the generation config; cut: `head_dim` channels per head, a hidden size of one head's worth
    per attention head (``num_attention_heads * head_dim``) and `intermediate_size` MLP units. On `model`'s
    device and dtype, in eval mode, with its attention implementation.

    Raises:
        ValueError: the text config lacks one of ``hidden_size``, ``num_attention_heads`` or
            ``intermediate_size`` (an architecture this cannot narrow).
    """
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    missing = [name for name in ("hidden_size", "num_attention_heads", "intermediate_size") if not hasattr(text, name)]
    if missing:
        raise ValueError(f"cannot narrow {type(model).__name__}: its text config has no {', '.join(missing)}")
    text.head_dim = head_dim
    text.hidden_size = text.num_attention_heads * head_dim
    text.intermediate_size = intermediate_size
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(seed)
        narrow = AutoModelForCausalLM.from_config(
            config, dtype=model.dtype, attn_implementation=model.config._attn_implementation
        )  # built on the CPU, moved below
    narrow.generation_config = copy.deepcopy(model.generation_config)
    return narrow.to(model.device).eval()
