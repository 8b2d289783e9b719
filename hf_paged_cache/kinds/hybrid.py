"""Hybrid layers: an attention head and a linear-attention (SSM) head side by side in one layer (Falcon-H1,
Hymba), keeping both keys and values per token in blocks and conv and recurrent states per sequence in slots."""

from .base import LayerKind

HYBRID = LayerKind("hybrid", tokens=True, state=True)
HYBRID_SLIDING = LayerKind("hybrid_sliding", tokens=True, state=True, windowed=True)

KINDS = (HYBRID, HYBRID_SLIDING)
