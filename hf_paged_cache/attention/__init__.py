"""`paged_sdpa` (and `paged_bmm`, `paged_flex`), their registration with transformers, and attention read straight from the pool."""

from .paged_sdpa import (
    ATTENTION_NAME,
    BMM_ATTENTION_NAME,
    FLEX_ATTENTION_NAME,
    PAGED_ATTENTION_NAMES,
    paged_sdpa_attention,
    register_paged_attention,
    set_paged_attention,
)

__all__ = [
    "ATTENTION_NAME",
    "BMM_ATTENTION_NAME",
    "FLEX_ATTENTION_NAME",
    "PAGED_ATTENTION_NAMES",
    "paged_sdpa_attention",
    "register_paged_attention",
    "set_paged_attention",
]
