"""Layers that keep nothing: MLP- or MoE-only layers, and layers that attend with the keys and values an earlier
layer stored (Gemma-3n's KV sharing: transformers hands them over outside the cache, so such a model keeps its
default attention, which reads the dense keys and values the storing layer's `update` returned)."""

from .base import LayerKind

DUMMY = LayerKind("dummy", tokens=False, state=False)

KINDS = (DUMMY,)
