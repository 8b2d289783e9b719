"""KV byte accounting for dense and paged caches, as the benchmarks and the demo report it.

For a model with ``L`` layers, ``H`` KV heads of width ``D`` and a dtype of ``s`` bytes one token costs
``2 x L x H x D x s`` bytes (`kv_bytes_per_token`; 46080 bytes for SmolLM2-135M in float32). Then

- DynamicCache reserved = sum over layers of ``keys.numel() * element_size`` + values likewise
  (`cache_tensor_bytes`): ``B x (longest prompt + new tokens - 1)`` positions, padding included;
- StaticCache reserved = ``2 x L x H x D x max_cache_len x B x s`` (`static_cache_reserved_bytes`);
- used bytes (any cache) = ``real tokens x bytes per token`` (`used_bytes`), padding excluded;
- PagedCache: ``stats().bytes_reserved`` (blocks in use) and ``stats().bytes_used``; a row storing ``t``
  tokens needs ``ceil(t / block_size)`` blocks (`paged_blocks`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import transformers

from ..pool.memory import KVLayout


def kv_bytes_per_token(config: transformers.PreTrainedConfig, dtype: torch.dtype) -> int:
    """``2 x layers x kv_heads x head_dim x dtype bytes``: the K/V one token costs over all layers."""
    return KVLayout.from_config(config).bytes_per_token(dtype)


def cache_tensor_bytes(cache: transformers.Cache) -> int:
    """Bytes of the key and value tensors a dense cache (Dynamic or Static) holds right now, and of the conv and
    recurrent states of its linear-attention layers."""
    total = 0
    for layer in cache.layers:
        states = (*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values())
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None), *states):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def static_cache_reserved_bytes(
    config: transformers.PreTrainedConfig, max_cache_len: int, batch_size: int, dtype: torch.dtype
) -> int:
    """``2 x layers x kv_heads x head_dim x max_cache_len x batch x dtype bytes`` (the formula, not a tensor)."""
    return kv_bytes_per_token(config, dtype) * max_cache_len * batch_size


def used_bytes(real_tokens: Iterable[int], bytes_per_token: int) -> int:
    """Bytes holding real (non-padding) tokens: ``sum(real_tokens) x bytes_per_token``."""
    return sum(real_tokens) * bytes_per_token


def paged_blocks(tokens_per_row: Iterable[int], block_size: int) -> int:
    """``sum(ceil(t / block_size))``: blocks a paged cache needs for rows storing these token counts."""
    return sum(-(-t // block_size) for t in tokens_per_row)


def stored_tokens(prompt_lens: Iterable[int], new_tokens: int) -> list[int]:
    """Real tokens each row's KV cache holds after ``generate(max_new_tokens=new_tokens)``.

    ``generate`` never feeds its last token back, so a row stores ``prompt + new_tokens - 1`` tokens.
    """
    return [p + new_tokens - 1 for p in prompt_lens]


def paged_pool_blocks(prompt_lens: list[int], new_tokens: int, expand: int, block_size: int) -> int:
    """Pool blocks for rows of `prompt_lens` generating `new_tokens` each, every row expanded `expand` times
    inside ``generate`` (beams or samples). Greedy (``expand == 1``): exactly
    ``sum(ceil((prompt + new - 1) / block))`` plus the null block. Beams / samples: an upper bound, every
    expanded row holding its own prompt and new tokens plus one copy-on-write block, plus the null block."""
    if expand == 1:
        return paged_blocks(stored_tokens(prompt_lens, new_tokens), block_size) + 1
    return expand * (paged_blocks([p + new_tokens for p in prompt_lens], block_size) + len(prompt_lens)) + 1
