"""Plan KV memory from a model's config alone: bytes per token and block, weights, and what fits.

For B rows of prompt lengths ``p_i`` (longest ``P``), ``n`` new tokens each, a dtype of ``s`` bytes, and
each layer group ``g`` (layers caching the same span: full attention, or a sliding window ``W``):

    per token (g)  = sum over g's layers of kv_heads x (key_dim + value_dim) x s   (KVLayout)
    per block (g)  = per token (g) x block_size                                    (bytes_per_block)
                     (PagedCache with kv_dtype int8 / float8_e4m3fn: s = 1 plus each head vector's scales:
                     int8 a float16 (minimum, step) pair per 32 elements, float8 one float32 scale)
    DynamicCache   = B x sum_g per_token_g x D_g   (rows left-padded to P)
                     D = P + n (full);  min(P + n, W - 1) (sliding: DynamicSlidingWindowLayer)
    StaticCache    = B x sum_g per_token_g x S_g   (M = max_cache_len, default P + n)
                     S = M (full);  min(W, M) (sliding: StaticSlidingWindowLayer)
    PagedCache     = sum_g sum_i blocks_g(p_i + n) x per block (g)   (no padding; each group its own blocks)
                     blocks(t) = ceil(t / block_size) (full);  ceil(t / block_size) - (t - k) // block_size
                     with k = min(t, W - 1) (sliding: the blocks holding the last W - 1 tokens)
    weights        = safetensors bytes (rescaled to the dtype), else parameters x s
    free           = max_memory - weights; rows that fit = rows of this batch's mix whose KV fits in free

A PagedCache pool of fixed size (``num_blocks``, or what ``max_memory`` buys: ``free // per block (all groups)``,
as `KVPool.for_config` sizes it) gives EVERY group the same N blocks, block 0 being the null block, and a row
takes a different number of blocks in each group:

    peak blocks(t) = ceil(t / block_size) (full);  min(ceil(t / block_size), ceil(W / block_size) + 1) (sliding:
                     the most a row holds during a step, `LayerGroup.max_blocks_per_row`)
    rows that fit  = min over groups g of the rows whose peak blocks in g fit in N - 1   (the binding group)

which is what `ContinuousBatcher` reserves for a request (prompt + max_new_tokens - 1 stored), so it admits
that many such requests at once.

`load_config_and_weight_bytes` reads what `plan_memory` needs of a model: its config (`config_limits`) and
its weight bytes (`weights`).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedConfig

from ..kinds import keeps_states
from ..models import resolve_model_path
from ..pool.kv_format import KVFormat, kv_format
from ..pool.kv_pool import DEFAULT_MAX_SEQUENCES
from ..pool.memory import KVLayout, LayerGroup, LayerShape, bytes_per_block, parse_memory
from .config_limits import load_config
from .states import state_bytes_from_config
from .weights import WeightEstimate, dtype_name, torch_dtype, weights_from_config, weights_from_folder

DEFAULT_BATCH, DEFAULT_PROMPT_LEN, DEFAULT_NEW_TOKENS = 32, 512, 256
MAX_ROWS = 1 << 16
"""Most rows a plan takes (65,536; the rows are listed one by one)."""
MAX_TOKENS = 1 << 24
"""Most tokens of a prompt, of new tokens per row, of a block and of StaticCache's length (16,777,216, the
positions limit of `config_limits.CONFIG_LIMITS`)."""
MAX_BLOCKS = 1 << 40
"""Most blocks of a planned pool."""
DEFAULT_DTYPE, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MEMORY = "bfloat16", 16, "24GiB"
CACHES = ("DynamicCache", "StaticCache", "PagedCache")


@dataclass(frozen=True)
class GroupPlan:
    """Layers caching the same span of tokens (window None = full attention) and their KV for the batch."""

    name: str
    window: int | None
    num_layers: int
    layer_shapes: tuple[LayerShape, ...]  # the distinct per-layer shapes (KV heads, key dim, value dim)
    bytes_per_token: int
    bytes_per_block: int
    kv_bytes: dict[str, int]  # cache name -> bytes this group holds for the batch


@dataclass(frozen=True)
class PoolFit:
    """What a fixed PagedCache pool holds of the batch's mix of rows, layer group by layer group.

    Every group has `num_blocks` blocks (block 0, the null block, included), and a row takes a different number
    of blocks in each (all of its tokens with full attention, at most ``ceil(W / block_size) + 1`` with a
    window W), so the rows that fit are the fewest any group holds: the `binding_group`'s.
    """

    num_blocks: int  # blocks in every layer group, the null block included
    sized_by: str  # "num_blocks", or "max_memory" (what the memory left beside the weights buys)
    peak_blocks: dict[str, int]  # group name -> the most blocks the batch's rows hold in it together
    rows_per_group: dict[str, int]  # group name -> rows of the batch's mix that its usable blocks hold
    binding_group: str  # the group holding the fewest rows (the first such, in the order of `groups`)
    rows: int  # rows that fit: ``rows_per_group[binding_group]``


@dataclass(frozen=True)
class MemoryPlan:
    """What `plan_memory` found: every byte count for the batch described by its first fields."""

    model: str
    dtype: str
    kv_dtype: str  # how PagedCache stores keys and values (the dense caches store `dtype`)
    block_size: int
    prompt_lens: tuple[int, ...]  # one per row
    new_tokens: int
    max_cache_len: int  # StaticCache's length
    groups: tuple[GroupPlan, ...]
    bytes_per_token: int  # all layers
    bytes_per_block: int  # all layers: one PagedCache block
    paged_blocks: int  # blocks the batch takes, all groups together (the pool's null block not included)
    kv_bytes: dict[str, int]  # cache name -> bytes for the whole batch
    weights: WeightEstimate
    max_memory: int | None
    paged_pool: PoolFit | None  # the fixed pool's fit per layer group (given num_blocks or max_memory)
    rows_that_fit: dict[str, int] | None  # cache name -> rows of this batch's mix that fit (Dynamic/Static: max_memory)
    assumptions: tuple[str, ...]
    state_bytes: int = 0  # one sequence's conv / recurrent states (every cache holds them per row; 0: no such layers)
    max_sequences: int | None = None  # PagedCache's state slots under max_memory (None: no states, or no budget)

    @property
    def batch_size(self) -> int:
        return len(self.prompt_lens)

    @property
    def free_bytes(self) -> int | None:
        return None if self.max_memory is None else self.max_memory - self.weights.num_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "batch_size": self.batch_size, "free_bytes": self.free_bytes}


def layer_groups(config: PreTrainedConfig) -> dict[LayerGroup, KVLayout]:
    """The model's layer groups (full attention first, then each window), each with its layers' shapes.

    Raises `NotImplementedError` for a model PagedCache does not support and for an encoder-decoder model (its
    cross-attention is not planned yet), `ValueError` for a config without
    attention or state layers or with attention layers that cache nothing (0 heads or dims).
    """
    if getattr(config, "is_encoder_decoder", False):  # a plan of the decoder's tokens alone would leave most out
        raise NotImplementedError(
            f"the planner plans decoder-only models, and {config.model_type!r} is an encoder-decoder model: its "
            "cross-attention keys and values (per request, the encoder's positions) are not planned yet"
        )
    layout = KVLayout.from_config(config)  # NotImplementedError for unsupported models
    shapes = [layout.layers[i] for i in layout.token_layers]  # layers that keep nothing (MLP-only, KV sharing): none
    empty = [shape for shape in shapes if min(shape.num_heads, shape.key_dim, shape.value_dim) < 1]
    if (not shapes and not layout.state_layers) or empty:  # a pure SSM keeps states only: its one group is empty
        raise ValueError(f"the config has {len(shapes)} attention layers" + (
            f", caching {empty[0].num_heads} KV heads of key dim {empty[0].key_dim} and value dim "
            f"{empty[0].value_dim}: nothing to plan" if empty else ": nothing to plan"))
    indexer = layout.indexer_dims  # DSA: each token's indexer key, in the same blocks
    return {group: KVLayout(tuple(layout.layers[i] for i in group.layers),
                            indexer_dims=tuple(indexer[i] for i in group.layers) if indexer else None)
            for group in layout.groups}


def dynamic_positions(window: int | None, length: int) -> int:
    """Positions a DynamicCache layer keeps after `length`: the last W - 1 on a sliding layer (it slices
    ``[-W + 1:]``, so W = 1 keeps everything)."""
    return length if window is None or window <= 1 else min(length, window - 1)


def static_positions(window: int | None, max_cache_len: int) -> int:
    """Positions a StaticCache layer allocates: ``max_cache_len``, or ``min(W, max_cache_len)`` if sliding."""
    return max_cache_len if window is None else min(window, max_cache_len)


def pool_fit(
    layouts: dict[LayerGroup, KVLayout], tokens: Sequence[int], block_size: int, num_blocks: int, sized_by: str
) -> PoolFit:
    """Rows of `tokens` (each row's stored tokens, in order) that a pool of `num_blocks` blocks in every
    group holds at their peak (`LayerGroup.max_blocks_per_row`), group by group."""
    peaks = {group.name: [group.max_blocks_per_row(t, block_size) for t in tokens] for group in layouts}
    usable = max(num_blocks - 1, 0)  # block 0 is the null block
    fits = {name: rows_that_fit(usable, costs) for name, costs in peaks.items()}
    binding = min(fits, key=fits.get)  # the first group with the fewest rows
    return PoolFit(num_blocks, sized_by, {name: sum(costs) for name, costs in peaks.items()}, fits, binding,
                   fits[binding])


def rows_that_fit(budget: int, row_costs: Sequence[int]) -> int:
    """Rows fitting in `budget`, taking the batch's rows in order, again and again (its mix of lengths)."""
    per_batch = sum(row_costs)
    if budget <= 0 or per_batch <= 0:
        return 0
    rows, left = budget // per_batch * len(row_costs), budget % per_batch
    for cost in row_costs:
        if cost > left:
            break
        rows, left = rows + 1, left - cost
    return rows


def plan_memory(
    config: PreTrainedConfig,
    *,
    batch_size: int | None = None,
    prompt_lens: int | Sequence[int] = DEFAULT_PROMPT_LEN,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    kv_dtype: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_memory: int | str | None = None,
    num_blocks: int | None = None,
    max_cache_len: int | None = None,
    weight_bytes: int | WeightEstimate | None = None,
    model_name: str | None = None,
    state_bytes: int | None = None,
    max_sequences: int | None = None,
) -> MemoryPlan:
    """The KV memory of one batch with each cache, and how many such rows fit beside the weights.

    `prompt_lens` is one length for all `batch_size` rows (default 32) or one length per row (then
    `batch_size` must be None or match). `weight_bytes` defaults to the parameter count of the model
    built from `config` on the meta device. Each row stores ``prompt + new_tokens`` tokens.

    PagedCache's fit is that of a fixed pool (`PoolFit`): `num_blocks` blocks in every layer group, else what
    ``max_memory - weights`` buys (as ``PagedCache(model, max_memory=...)`` or ``ContinuousBatcher`` build it).
    With both, the pool must fit beside the weights (`ValueError` if not). DynamicCache's and StaticCache's fit
    need `max_memory`. `kv_dtype` is how PagedCache stores keys and values (`PagedCache`'s argument; default:
    `dtype`); DynamicCache and StaticCache store `dtype`.

    A model with conv / recurrent states holds `state_bytes` per row in every cache (default: measured from the
    config, `planner.states`); under `max_memory` a PagedCache pool sets aside `max_sequences` state slots (default
    64, as ``PagedCache(model, max_memory=...)``; the batcher's is its ``max_running``) and the null slot, and buys
    blocks with the rest, so its rows are also at most `max_sequences`.
    """
    dtype, layouts = torch_dtype(dtype), layer_groups(config)  # NotImplementedError for unsupported models
    lens = _prompt_lens(prompt_lens, batch_size)
    new_tokens = bounded_count("new_tokens", new_tokens, 0, MAX_TOKENS)
    block_size = bounded_count("block_size", block_size, 1, MAX_TOKENS)
    if num_blocks is not None:
        num_blocks = bounded_count("num_blocks", num_blocks, 2, MAX_BLOCKS, " (block 0 is the reserved null block)")
    padded = max(lens) + new_tokens  # positions of every DynamicCache row (left padding)
    max_cache_len = padded if max_cache_len is None else bounded_count("max_cache_len", max_cache_len, 1, 2 * MAX_TOKENS)
    if max_cache_len < padded:
        raise ValueError(f"max_cache_len={max_cache_len} is below longest prompt + new tokens = {padded}")
    if not isinstance(weight_bytes, WeightEstimate):
        weight_bytes = (weights_from_config(config, dtype) if weight_bytes is None
                        else WeightEstimate(int(weight_bytes), "given"))
    stored = kv_format(kv_dtype, dtype)  # ValueError for an unknown name
    groups, total_blocks = [], 0
    for group, layout in layouts.items():
        window = group.window
        per_token, per_block = layout.bytes_per_token(dtype), bytes_per_block(layout, block_size, stored)
        row_blocks = [group.blocks_kept(p + new_tokens, block_size) for p in lens]  # no padding in PagedCache
        total_blocks += sum(row_blocks)
        kv = {"DynamicCache": len(lens) * per_token * dynamic_positions(window, padded),
              "StaticCache": len(lens) * per_token * static_positions(window, max_cache_len),
              "PagedCache": sum(row_blocks) * per_block}
        shapes = tuple(dict.fromkeys(layout.layers))  # distinct, in layer order
        groups.append(GroupPlan(group.name, window, layout.num_layers, shapes, per_token, per_block, kv))
    states = _state_bytes(config, dtype, state_bytes)
    kv_bytes = {cache: sum(g.kv_bytes[cache] for g in groups) + len(lens) * states for cache in CACHES}
    per_block = sum(g.bytes_per_block for g in groups)
    slots = None
    if states and max_memory is not None:
        slots = bounded_count("max_sequences", DEFAULT_MAX_SEQUENCES if max_sequences is None else max_sequences, 1,
                              MAX_ROWS)

    fit, paged_pool = None, None
    if max_memory is not None:
        max_memory = parse_memory(max_memory)
        free = max_memory - weight_bytes.num_bytes
        fit = {cache: rows_that_fit(free, [kv_bytes[cache] // len(lens)] * len(lens)) for cache in CACHES[:2]}
        if num_blocks is not None and num_blocks * per_block > free:
            raise ValueError(f"a pool of num_blocks={num_blocks} in every layer group takes {num_blocks * per_block:,} "
                             f"bytes, more than the {max(free, 0):,} bytes that max_memory leaves beside the weights")
    if num_blocks is not None or (max_memory is not None and per_block):
        sized_by = "num_blocks" if num_blocks is not None else "max_memory"
        for_blocks = max(free - (slots + 1) * states if slots else free, 0) if max_memory is not None else 0
        blocks = num_blocks if num_blocks is not None else for_blocks // per_block
        paged_pool = pool_fit(layouts, [p + new_tokens for p in lens], block_size, blocks, sized_by)
        fit = {**(fit or {}), "PagedCache": paged_pool.rows if slots is None else min(paged_pool.rows, slots)}
    elif max_memory is not None:  # blocks hold no bytes (state layers only): the slots alone bound the rows
        fit = {**fit, "PagedCache": slots if free >= (slots + 1) * states else 0}
    return MemoryPlan(
        model=model_name or config.name_or_path or config.model_type, dtype=dtype_name(dtype), kv_dtype=stored.name,
        block_size=block_size,
        prompt_lens=tuple(lens), new_tokens=new_tokens, max_cache_len=max_cache_len, groups=tuple(groups),
        bytes_per_token=sum(g.bytes_per_token for g in groups), bytes_per_block=per_block,
        paged_blocks=total_blocks, kv_bytes=kv_bytes, weights=weight_bytes, max_memory=max_memory,
        paged_pool=paged_pool, rows_that_fit=fit,
        assumptions=_assumptions(config, groups, max_memory, paged_pool, stored, dtype, states),
        state_bytes=states, max_sequences=slots,
    )


def _state_bytes(config: PreTrainedConfig, dtype: torch.dtype, given: int | None) -> int:
    """One sequence's state bytes: `given`, else measured from the config for a model with states, else 0."""
    if not keeps_states(config):
        return 0
    if given is not None:
        return bounded_count("state_bytes", given, 1, MAX_BLOCKS)
    return state_bytes_from_config(config, dtype)


def bounded_count(name: str, value: object, low: int, high: int, hint: str = "") -> int:
    """`value` as an int if it is a whole number from `low` to `high` (numpy integers too), else `ValueError`."""
    try:
        number = operator.index(value)  # refuses floats and strings
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or not low <= number <= high:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{name} must be from {low:,} to {high:,}{hint}; got {shown}")
    return number


def _prompt_lens(prompt_lens: int | Sequence[int], batch_size: int | None) -> list[int]:
    """One prompt length per row, each from 1 to `MAX_TOKENS`, at most `MAX_ROWS` rows (checked before the
    list is built)."""
    if batch_size is not None:
        batch_size = bounded_count("batch_size", batch_size, 1, MAX_ROWS)
    if isinstance(prompt_lens, numbers.Integral):
        lens = [prompt_lens] * (DEFAULT_BATCH if batch_size is None else batch_size)
    else:
        if len(prompt_lens) > MAX_ROWS:
            raise ValueError(f"at most {MAX_ROWS:,} rows; got {len(prompt_lens):,} prompt lengths")
        lens = list(prompt_lens)
        if batch_size is not None and batch_size != len(lens):
            raise ValueError(f"batch_size={batch_size} but {len(lens)} prompt lengths were given")
    if not lens:
        raise ValueError("need at least one prompt length")
    return [bounded_count(f"prompt lengths (row {row})", length, 1, MAX_TOKENS) for row, length in enumerate(lens, 1)]


def _assumptions(
    config: PreTrainedConfig, groups: list[GroupPlan], max_memory: int | None, pool: PoolFit | None,
    stored: KVFormat, dtype: torch.dtype, states: int = 0,
) -> tuple[str, ...]:
    notes = [
        "Each row stores prompt + new tokens; generate stores one fewer (its last token is never fed back) "
        "and sizes StaticCache to longest prompt + new tokens - 1.",
        "DynamicCache and StaticCache pad every row to the longest prompt (left padding). PagedCache stores "
        "real tokens only (built from the model, it sees the attention mask): ceil(tokens / block_size) "
        "blocks per row, no prefix sharing.",
        "Weights are held in the planned dtype (no quantization); buffers such as rotary tables are not counted.",
    ]
    if stored.storage != dtype:
        notes.append(f"PagedCache stores keys and values as {stored.description} (kv_dtype), so its KV per "
                     "block is not KV per token x block_size: the per-token column is the dense caches' "
                     f"({dtype_name(dtype)}).")
    if pool is not None:
        notes.append("PagedCache's fit is a fixed pool's (num_blocks=, or max_memory= as PagedCache and "
                     "ContinuousBatcher size it): the same number of blocks in every layer group, block 0 reserved; "
                     "a row fits when its most blocks during a step fit in every group, so the rows that fit are "
                     "those of the group that holds fewest (it binds). ContinuousBatcher admits that many such "
                     "requests at once (max_new_tokens = new tokens + 1), at most max_running (64 by default).")
    if states:
        notes.append("Conv / recurrent states: one sequence's, measured by a forward of one token on the meta device "
                     "(the model code's shapes, no weights), are held once per row by every cache, whatever its "
                     "length. Under max_memory, PagedCache sets aside max_sequences slots (and the null slot) "
                     "before it buys blocks, as PagedCache(model, max_memory=...) does; ContinuousBatcher sets aside "
                     "max_running. Prefix snapshots of states live in free slots and are not planned.")
    if getattr(config.get_text_config(decoder=True), "kv_lora_rank", None):
        notes.append("MLA: the cache holds the compressed latent, 1 head of kv_lora_rank as keys and "
                     "qk_rope_head_dim as values (transformers 5.24), not per-head keys and values.")
    if any(g.window is not None for g in groups):
        notes.append("Sliding layers: DynamicCache keeps the last W - 1 positions (it holds the whole prompt "
                     "briefly during prefill); StaticCache allocates min(W, max_cache_len); PagedCache keeps the "
                     "blocks holding the last W - 1 tokens (its own block tables per group), plus one block "
                     "during a step.")
    if max_memory is not None:
        notes.append("Free memory = max_memory - weights, all of it for the KV cache: activations, logits, "
                     "workspace, the CUDA context, allocator fragmentation and DynamicCache's torch.cat "
                     "copies are not counted.")
    return tuple(notes)


def load_config_and_weight_bytes(model: str | None, dtype: str | torch.dtype) -> tuple[PreTrainedConfig, WeightEstimate]:
    """A model's config (folder, config.json path or Hub id; None = the package's default model) and its
    weight bytes in `dtype`: from local safetensors when the folder has them, else counted from the config.

    Raises `ValueError` for a config or weights file that cannot be read or a config beyond
    `config_limits.CONFIG_LIMITS`, and `NotImplementedError` for a model PagedCache does not support.
    """
    path, dtype = resolve_model_path(model), torch_dtype(dtype)
    config = load_config(path)
    layer_groups(config)  # an unsupported model is told so before its weights are counted
    stored = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else None
    weights = weights_from_folder(Path(path), dtype, stored) if Path(path).is_dir() else None
    return config, weights or weights_from_config(config, dtype)
