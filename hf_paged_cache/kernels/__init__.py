"""Faster kernels for the model around the cache: opt-in transformations of a loaded model."""

from .mkl_dispatch import mkl_takes_fast_path
from .packed_linear import PackedLinear, pack_linears, packed_linears_supported

__all__ = ["PackedLinear", "mkl_takes_fast_path", "pack_linears", "packed_linears_supported"]
