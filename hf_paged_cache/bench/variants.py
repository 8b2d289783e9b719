"""The caches a benchmark compares (`VARIANTS`): `DynamicCache` and `PagedCache` with the model's own
attention or ours, and `variant_attention`, which puts the model on the attention a variant names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers import PreTrainedModel

from ..attention import PAGED_ATTENTION_NAMES, set_paged_attention
from ..attention.paged_sdpa import decode_kernel

VARIANTS = ("dynamic", "paged", "paged_sdpa", "paged_bmm", "paged_flex")
"""``dynamic``: DynamicCache, the model's attention; ``paged``: PagedCache, the same attention; ``paged_sdpa``:
PagedCache with `set_paged_attention`; ``paged_bmm`` and ``paged_flex``: the same with ``decode="products"`` and
``decode="flex"``."""


@contextlib.contextmanager
def variant_attention(model: PreTrainedModel, variant: str) -> Iterator[None]:
    """Run the block with the paged attention a variant names (``paged_sdpa``, ``paged_bmm``, ``paged_flex``), the
    model's own attention otherwise."""
    original = model.config._attn_implementation
    if variant in PAGED_ATTENTION_NAMES:  # the paged variants are named after their attention
        set_paged_attention(model, decode=decode_kernel(variant))
    try:
        yield
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
