"""Faster kernels for the model around the cache: opt-in transformations of a loaded model."""

from .packed_linear import PackedLinear, pack_linears, packed_linears_supported

__all__ = ["PackedLinear", "pack_linears", "packed_linears_supported"]
