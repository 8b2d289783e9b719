"""Hybrid layers: an attention head and a linear-attention (SSM) head side by side in one layer (Falcon-H1,
Hymba), keeping both keys and values per token in blocks and conv and recurrent states per sequence in slots."""

from .base import LayerKind

HYBRID = LayerKind(
    "hybrid", tokens=True, state=True, stores="keys and values of every token, and each sequence's states",
)
HYBRID_SLIDING = LayerKind(
    "hybrid_sliding", tokens=True, state=True, windowed=True,
    stores="keys and values of the last W - 1 tokens, and each sequence's states",
)

KINDS = (HYBRID, HYBRID_SLIDING)
