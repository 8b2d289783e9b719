"""`paged_sdpa`, its registration with transformers, and attention read straight from the block pool."""

from .paged_sdpa import ATTENTION_NAME, paged_sdpa_attention, register_paged_attention, set_paged_attention

__all__ = ["ATTENTION_NAME", "paged_sdpa_attention", "register_paged_attention", "set_paged_attention"]
