"""A model's forward compiled by inductor around the paged cache (`CompiledForward`), and the opaque attention
operator that makes it one graph (`running_attention`)."""

from .forward import CompiledForward, compile_refusal
from .running_attention import running_cache, running_cache_attention

__all__ = ["CompiledForward", "compile_refusal", "running_cache", "running_cache_attention"]
