"""How many bytes a KV block costs, how many blocks a memory budget buys, and whether this machine holds them.

Layers are grouped by what they keep (`LayerGroup`): full attention keeps every token, a sliding window
`W` only the tokens its next query can see. Each group has its own blocks. For a group of `L` attention
layers, `H` key/value heads of width `D`, blocks of `T` tokens and a dtype of `s` bytes, one block costs

    bytes_per_block = 2 x L x H x D x T x s

(the 2 is one key and one value vector per token, head and layer). Models whose key and value widths
differ (DeepSeek-V3 caches a compressed latent and a rotary key) use `H x (D_key + D_value)` instead of
`2 x H x D`, summed over layers. Keys and values stored as 8-bit elements with their scales
(`kv_format.KVFormat.vector_bytes`: int8 `D + 8` for `D = 64`, float8 `D + 4`) cost that per vector instead of `D x s`. A row of `n` tokens holds ``ceil(n / T)`` blocks of a full-attention
group and at most ``ceil(W / T) + 1`` blocks of a sliding group of window `W` (its last ``W - 1``
positions, plus the block a new token opens).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from ..kinds import KINDS, layer_kinds
from ..kinds.encoder_decoder import decoder_shape, is_encoder_decoder
from .kv_format import KVFormat

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


def dense_attention_kinds(config: PreTrainedConfig, layer_types: Sequence[str] | None = None) -> list[str]:
    """The kinds of `config`'s decoder layers that no paged attention can run: chunked attention (a mask of the
    model's own), indexed attention (the keys its indexer picks) and layers that reuse another layer's keys and values (``kv_sharing_modes``: they attend with
    the dense keys and values the storing layer's `update` returned). Such a model keeps its default attention
    over a `PagedCache`. `layer_types`: the config's, when the caller has read them already."""
    text = config.get_text_config(decoder=True)
    if layer_types is None:
        layer_types, _ = get_layer_types_and_kwargs(text)
    kinds = {name for name in layer_types if name in KINDS and KINDS[name].dense_only}
    if "reuse" in (getattr(text, "kv_sharing_modes", None) or ()):
        kinds.add("dummy (KV sharing)")
    return sorted(kinds)


@dataclass(frozen=True)
class LayerShape:
    """What one attention layer caches per token: `num_heads` key vectors of `key_dim`, values of `value_dim`."""

    num_heads: int
    key_dim: int
    value_dim: int


@dataclass(frozen=True)
class LayerGroup:
    """Layers that cache the same span of tokens, and so share one block table per row."""

    window: int | None  # the sliding window W (a query at p sees keys p - W < k <= p); None = full attention
    layers: tuple[int, ...]  # the model's layer indices, in order

    @property
    def name(self) -> str:
        return "full attention" if self.window is None else f"sliding window {self.window}"

    def blocks_kept(self, num_tokens: int, block_size: int) -> int:
        """Blocks a left-padded row holds between steps once it stores `num_tokens` tokens.

        Full attention: ``ceil(n / T)``. A sliding window keeps its last ``k = min(n, W - 1)`` tokens, so the
        blocks from token ``n - k`` on: ``ceil(n / T) - (n - k) // T``.
        """
        blocks = blocks_for_tokens(num_tokens, block_size)
        if self.window is None:
            return blocks
        return blocks - (num_tokens - min(num_tokens, max(self.window - 1, 0))) // block_size

    def max_blocks_per_row(self, num_tokens: int, block_size: int) -> int:
        """Blocks one row of `num_tokens` tokens holds: all of them, or at most ``ceil(W / T) + 1``."""
        blocks = blocks_for_tokens(num_tokens, block_size)
        return blocks if self.window is None else min(blocks, blocks_for_tokens(self.window, block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    """The per-layer K/V shapes and attention windows of a model, and its layers grouped by window."""

    layers: tuple[LayerShape, ...]
    latent: bool = False  # the cache holds a compressed latent that attention expands after `update` (MLA)
    windows: tuple[int | None, ...] | None = None  # each layer's sliding window; None = all full attention
    # which layers keep keys and values per token (None: all); the others (linear attention, SSM, conv, MLP-only
    # layers) keep none, and their `layers` entry is an empty `LayerShape(0, 0, 0)`
    tokens: tuple[bool, ...] | None = None
    state_layers: tuple[int, ...] = ()  # the layers that keep conv / recurrent states per sequence (`StateSlots`)
    indexer_dims: tuple[int, ...] | None = None  # per layer, its DSA indexer key's width (0: none); None: no layer

    def __post_init__(self) -> None:
        if self.windows is not None and len(self.windows) != len(self.layers):
            raise ValueError(f"{len(self.windows)} windows given for {len(self.layers)} layers")
        if self.tokens is not None and len(self.tokens) != len(self.layers):
            raise ValueError(f"{len(self.tokens)} token flags given for {len(self.layers)} layers")

    @property
    def token_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values per token, in order."""
        return tuple(i for i in range(len(self.layers)) if self.tokens is None or self.tokens[i])

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layers that keep tokens, grouped by window: full attention first, then each window from the
        smallest. A model without any (an SSM) has one group of no layers: its block tables count the rows'
        tokens, and its blocks hold no bytes."""
        windows = self.windows or (None,) * len(self.layers)
        kept = self.token_layers
        if not kept:
            return (LayerGroup(None, ()),)
        order = sorted({windows[i] for i in kept}, key=lambda w: (w is not None, w or 0))
        return tuple(LayerGroup(w, tuple(i for i in kept if windows[i] == w)) for w in order)

    def group_of(self) -> tuple[int, ...]:
        """Each layer's group index in `groups`."""
        index = [0] * len(self.layers)
        for g, group in enumerate(self.groups):
            for layer_idx in group.layers:
                index[layer_idx] = g
        return tuple(index)

    def with_windows(self, windows: Sequence[int | None]) -> KVLayout:
        return KVLayout(self.layers, self.latent, tuple(windows), self.tokens, self.state_layers, self.indexer_dims)

    @classmethod
    def from_config(cls, config: PreTrainedConfig) -> KVLayout:
        """Every layer's K/V shape and window as the config declares them (`NotImplementedError` for a
        model with layer kinds not supported, see `kinds.layer_kinds`)."""
        specs = layer_kinds(config)
        if is_encoder_decoder(config):  # the decoder's self-attention layers, every one full attention
            decoder = decoder_shape(config)
            return cls(layers=(LayerShape(decoder.num_heads, decoder.head_dim, decoder.head_dim),) * decoder.num_layers)
        windows = tuple(spec.window for spec in specs)
        tokens = tuple(spec.kind.tokens for spec in specs)
        text = config.get_text_config(decoder=True)
        try:
            num_heads = getattr(text, "num_attention_heads", None)
        except RuntimeError as error:  # transformers' AmbiguousGlobalPerLayerAttributeError: heads differ by layer
            raise NotImplementedError(
                f"model type {config.model_type!r} has layers of different attention shapes (per-layer configs), "
                "which PagedCache does not read yet; use the model's default cache"
            ) from error
        if not any(tokens):  # no attention layer (Mamba): nothing per token
            shape = LayerShape(0, 0, 0)
        elif getattr(text, "kv_lora_rank", None):  # DeepSeek-style MLA: one compressed latent + one rotary key
            shape = LayerShape(1, text.kv_lora_rank, text.qk_rope_head_dim)
        else:
            kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
            if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
                kv_heads = 1  # Falcon-7B style multi-query attention
            elif getattr(text, "new_decoder_architecture", False):
                kv_heads = text.num_kv_heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
            shape = LayerShape(kv_heads, head_dim, head_dim)
        latent = bool(getattr(text, "kv_lora_rank", None))
        layers = tuple(shape if keeps else LayerShape(0, 0, 0) for keeps in tokens)
        state_layers = tuple(i for i, spec in enumerate(specs) if spec.kind.state)
        indexer = tuple(getattr(text, "index_head_dim", 0) if spec.kind.indexer else 0 for spec in specs)
        return cls(layers=layers, latent=latent, windows=windows if any(windows) else None,
                   tokens=None if all(tokens) else tokens, state_layers=state_layers,
                   indexer_dims=indexer if any(indexer) else None)

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> KVLayout:
        """The layout `model` really runs: its config's, with each layer's KV heads as this process holds them.

        Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``), each rank holds a
        share of every layer's key/value heads: the share is read from the local size of the layer's sharded
        ``k_proj`` weight (a DTensor). Raises `NotImplementedError` when a tensor-parallel model's key
        projections cannot be found (pass ``pool=`` built for the rank's heads instead).
        """
        layout = cls.from_config(model.config)
        tp_size = getattr(model, "tp_size", None) or 1
        if tp_size == 1:
            return layout
        if layout.tokens is not None:
            raise NotImplementedError(
                f"{type(model).__name__} under tensor parallelism: layers that keep no keys and values "
                "(linear attention, SSM, conv, MLP-only) are not supported there yet"
            )
        shares = _key_head_shares(model, layout.num_layers)
        layers = []
        for layer_idx, (shape, (local, total)) in enumerate(zip(layout.layers, shares)):
            heads, remainder = divmod(shape.num_heads * local, total)
            if remainder or layout.latent:
                raise NotImplementedError(
                    f"{type(model).__name__} under tensor parallelism: layer {layer_idx}'s rank holds {local} of "
                    f"{total} key projection rows, not a whole number of its {shape.num_heads} KV heads"
                )
            layers.append(LayerShape(heads, shape.key_dim, shape.value_dim))
        return cls(tuple(layers), layout.latent, layout.windows, layout.tokens, layout.state_layers, layout.indexer_dims)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_token(self, dtype: torch.dtype | KVFormat, group: LayerGroup | None = None) -> int:
        """Bytes one token costs across all layers, or across `group`'s layers (keys and values, and indexer keys),
        stored as `dtype` (a plain dtype, or a `KVFormat`: its scales included)."""
        kv = dtype if isinstance(dtype, KVFormat) else KVFormat(str(dtype), dtype)
        indices = range(len(self.layers)) if group is None else group.layers
        indexer = self.indexer_dims or (0,) * len(self.layers)
        total = 0
        for i in indices:
            layer = self.layers[i]
            total += layer.num_heads * (kv.vector_bytes(layer.key_dim) + kv.vector_bytes(layer.value_dim))
            if indexer[i]:
                total += kv.vector_bytes(indexer[i])  # the DSA indexer's key: one head
        return total


def _key_head_shares(model: PreTrainedModel, num_layers: int) -> list[tuple[int, int]]:
    """Per decoder layer, ``(rows this process holds, rows in all)`` of its ``k_proj`` weight."""
    from torch.distributed.tensor import DTensor

    shares: dict[int, tuple[int, int]] = {}
    for name, module in model.named_modules():
        match = re.search(r"(?:^|\.)layers\.(\d+)\.[^.]+\.k_proj$", name)
        weight = getattr(module, "weight", None)
        if match and isinstance(weight, torch.Tensor):
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            shares[int(match.group(1))] = (local.shape[0], weight.shape[0])
    missing = [i for i in range(num_layers) if i not in shares]
    if missing:
        raise NotImplementedError(
            f"PagedCache cannot tell how many key/value heads each tensor-parallel rank of {type(model).__name__} "
            f"holds (no layers.N.*.k_proj weight for layers {missing}); build the cache with pool=KVPool(...) "
            "sized for one rank's heads"
        )
    return [shares[i] for i in range(num_layers)]


def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype | KVFormat, group: LayerGroup | None = None) -> int:
    """``2 x layers x kv_heads x head_dim x block_size x dtype bytes``, over all layers or one group's."""
    return layout.bytes_per_token(dtype, group) * block_size


def blocks_for_budget(max_memory: int | str, layout: KVLayout, block_size: int, dtype: torch.dtype | KVFormat) -> int:
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


def check_fits_machine(requested: int, asked: str, detail: str = "") -> None:
    """Raise `ValueError` if a pool of `requested` bytes exceeds this machine's memory.

    The limit is the RAM plus every accelerator's memory (a model spread over several devices keeps each
    layer's tensors beside that layer), so a pool refused here cannot be allocated anywhere on this machine;
    one accepted may still not fit its device, which then fails when the storage is allocated. `asked`
    names what the caller passed (``"max_memory='100TB'"``), `detail` how the bytes add up.
    """
    too_big = exceeds_machine(requested)
    if too_big:
        raise ValueError(
            f"{asked} asks for a KV pool of {requested:,} bytes ({format_memory(requested)}{detail}) but this "
            f"machine has {too_big}. Pass a smaller max_memory= or num_blocks=, or neither for a pool that starts "
            "small and grows as the sequences need it."
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
