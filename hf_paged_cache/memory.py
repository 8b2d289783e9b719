"""How many bytes a KV block costs, how many blocks a memory budget buys, and whether this machine holds them.

For a model with `L` attention layers, `H` key/value heads of width `D`, blocks of `T` tokens and a dtype of
`s` bytes, one block costs

    bytes_per_block = 2 x L x H x D x T x s

(the 2 is one key and one value vector per token, head and layer). Models whose key and value widths
differ (DeepSeek-V3 caches a compressed latent and a rotary key) use `H x (D_key + D_value)` instead of
`2 x H x D`, summed over layers.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

import psutil
import torch
from transformers import PreTrainedConfig

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(value: int | str) -> int:
    """Bytes in `value`: an int (or numpy integer), or a string such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(f"max_memory must be a number of bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
        raise ValueError(f"cannot read {value!r} as a memory size; use bytes or e.g. '512MiB', '2GiB', '1.5GB'")
    try:
        return operator.index(value)  # int, numpy integers, anything with __index__
    except TypeError:
        raise TypeError(
            f"max_memory must be a number of bytes or a string like '512MiB', got {type(value).__name__}"
        ) from None


def format_memory(num_bytes: float, spec: str = ".1f") -> str:
    """`num_bytes` for people in binary units: ``"512.0 MiB"``, ``"90.9 TiB"``; `spec` formats the number
    (``".4g"`` gives ``"1.5 KiB"``, ``"24 GiB"``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:{spec}} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class LayerShape:
    """What one attention layer caches per token: `num_heads` key vectors of `key_dim`, values of `value_dim`."""

    num_heads: int
    key_dim: int
    value_dim: int


@dataclass(frozen=True)
class KVLayout:
    """The per-layer K/V shapes of a model, read from its config."""

    layers: tuple[LayerShape, ...]
    latent: bool = False  # the cache holds a compressed latent that attention expands after `update` (MLA)

    @classmethod
    def from_config(cls, config: PreTrainedConfig) -> KVLayout:
        text = config.get_text_config(decoder=True)
        num_layers = text.num_hidden_layers
        num_heads = text.num_attention_heads
        if getattr(text, "kv_lora_rank", None):  # DeepSeek-style MLA: one compressed latent + one rotary key
            shape = LayerShape(1, text.kv_lora_rank, text.qk_rope_head_dim)
        else:
            kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
            if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
                kv_heads = 1  # Falcon-7B style multi-query attention
            elif getattr(text, "new_decoder_architecture", False):
                kv_heads = text.num_kv_heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
            shape = LayerShape(kv_heads, head_dim, head_dim)
        return cls(layers=(shape,) * num_layers, latent=bool(getattr(text, "kv_lora_rank", None)))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token costs across all layers (keys and values)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(layer.num_heads * (layer.key_dim + layer.value_dim) for layer in self.layers) * itemsize


def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """``2 x layers x kv_heads x head_dim x block_size x dtype bytes`` (see the module docstring)."""
    return layout.bytes_per_token(dtype) * block_size


def blocks_for_budget(max_memory: int | str, layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks (the reserved null block included) fit in `max_memory` bytes."""
    budget = parse_memory(max_memory)
    per_block = bytes_per_block(layout, block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(
            f"max_memory={max_memory!r} ({budget} bytes) is too small: one block of {block_size} tokens costs "
            f"{per_block} bytes for this model and the pool needs at least 2 (block 0 is reserved)"
        )
    return num_blocks


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens of one sequence."""
    return math.ceil(num_tokens / block_size)


def machine_memory(*, accelerators: bool = True) -> dict[str, int]:
    """Total memory of each place a pool's tensors can live: ``{"cpu": RAM bytes, "cuda:0": ..., ...}``.

    RAM is `psutil.virtual_memory().total` (swap not counted). With `accelerators`, every visible CUDA (or
    ROCm) and XPU device is added; asking for them initializes CUDA, so `check_fits_machine` does so only
    when the RAM alone is too small.
    """
    places = {"cpu": psutil.virtual_memory().total}
    if accelerators:
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                places[f"cuda:{index}"] = torch.cuda.get_device_properties(index).total_memory
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            for index in range(xpu.device_count()):
                places[f"xpu:{index}"] = xpu.get_device_properties(index).total_memory
    return places


def check_fits_machine(num_blocks: int, per_block: int, asked: str) -> None:
    """Raise `ValueError` if a pool of `num_blocks` blocks of `per_block` bytes exceeds this machine's memory.

    The limit is the RAM plus every accelerator's memory (a model spread over several devices keeps each
    layer's tensors beside that layer), so a pool refused here cannot be allocated anywhere on this machine;
    one accepted may still not fit its device, which then fails when the storage is allocated. `asked`
    names what the caller passed (``"max_memory='100TB'"``).
    """
    requested = num_blocks * per_block
    too_big = exceeds_machine(requested)
    if too_big:
        raise ValueError(
            f"{asked} asks for a KV pool of {requested:,} bytes ({format_memory(requested)}: {num_blocks:,} blocks "
            f"x {per_block:,} bytes) but this machine has {too_big}. Pass a smaller max_memory= or num_blocks=, "
            "or neither for a pool that starts small and grows as the sequences need it."
        )


def exceeds_machine(num_bytes: int) -> str | None:
    """None if `num_bytes` fit in this machine's memory (RAM + accelerators), else what the machine has, in words."""
    if num_bytes <= machine_memory(accelerators=False)["cpu"]:
        return None  # the common case, answered without initializing CUDA
    places = machine_memory()
    total = sum(places.values())
    if num_bytes <= total:
        return None
    where = " + ".join(f"{format_memory(size)} ({name})" for name, size in places.items())
    return f"{total:,} bytes ({where})"
