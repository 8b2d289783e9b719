"""Reading a model's config for the planner without letting the config decide what that costs.

transformers builds a config object from ``config.json`` and the planner then builds the model on the meta
device to count its parameters. Both take time and memory in proportion to what the file asks: a
``gemma3_text`` config of 10^7 layers makes transformers build a list of 10^7 layer types (40 s and gigabytes)
before anything can look at it, and a vision tower of thousands of layers takes seconds more on the meta
device. So `load_config` checks the raw JSON (`check_config_dict`) against `CONFIG_LIMITS` first, and only
then lets transformers build it.

The limits are far above any released model (the largest in early 2026: Llama-3.1-405B has 126 layers,
hidden size 16,384, MLP width 53,248 and 128 heads; Gemma 3 a 262,144-token vocabulary; Llama 4 Scout a
10,485,760-token context; Kimi K2 384 experts), so a real config always passes and a crafted one is refused
in milliseconds, with a message naming the value and its limit:

    =================  =============  ==========================================================================
    what               at most        keys (at any depth: text_config, vision_config, ... included)
    =================  =============  ==========================================================================
    layers             256 in all     num_hidden_layers, n_layer, num_layers, depth(s), encoder/decoder_layers...
    attention heads    1,024          num_attention_heads, num_key_value_heads, n_head, num_heads, ...
    head dims          4,096          head_dim, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, ...
    hidden sizes       262,144        hidden_size, intermediate_size, moe_intermediate_size, d_model, n_embd, ...
    vocabulary         2,097,152      vocab_size
    experts            1,024          num_local_experts, n_routed_experts, num_experts, ...
    positions          16,777,216     max_position_embeddings, n_positions, sliding_window, ...
    =================  =============  ==========================================================================

Each of those values must be a whole number from 0 to its limit (or null); every list holds at most
`MAX_LIST_ITEMS` items and the whole config at most `MAX_ENTRIES` values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

MAX_LIST_ITEMS = 1 << 14
"""Items in any one list of a config (``layer_types`` has one per layer; real lists hold at most hundreds)."""

MAX_ENTRIES = 1 << 17
"""Values in a whole config, nested ones included (real configs hold at most a few thousand)."""


@dataclass(frozen=True)
class Limit:
    """The most a config may ask of one kind of size, and the keys that ask it."""

    what: str  # for messages: "layers", "attention heads", ...
    most: int
    keys: tuple[str, ...]
    summed: bool = False  # the limit holds for all these values together (layers: every tower is built)


CONFIG_LIMITS: tuple[Limit, ...] = (
    Limit("layers", 256, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "depth", "depths",
                          "encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers",
                          "num_global_layers", "num_nextn_predict_layers"), summed=True),
    Limit("attention heads", 1024, ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head",
                                    "num_heads", "multi_query_group_num", "encoder_attention_heads",
                                    "decoder_attention_heads")),
    Limit("head dims", 4096, ("head_dim", "kv_channels", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                              "v_head_dim")),
    Limit("hidden sizes", 1 << 18, ("hidden_size", "n_embd", "d_model", "n_inner", "intermediate_size",
                                    "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_dim",
                                    "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "q_lora_rank")),
    Limit("vocabulary", 1 << 21, ("vocab_size",)),
    Limit("experts", 1024, ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts",
                            "n_shared_experts", "num_experts_per_tok")),
    Limit("positions", 1 << 24, ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                                 "seq_length", "original_max_position_embeddings", "sliding_window")),
)


def check_config_dict(config: dict[str, Any], limits: tuple[Limit, ...] = CONFIG_LIMITS) -> None:
    """Raise `ValueError` naming the first value of `config` (a parsed ``config.json``) beyond `limits`.

    Looks at every value, nested configs and lists included, in the order of the file, and never builds
    anything from them.
    """
    by_key = {key: limit for limit in limits for key in limit.keys}
    totals = {limit.what: 0 for limit in limits if limit.summed}
    for count, (path, key, value) in enumerate(_values(config), start=1):
        if count > MAX_ENTRIES:
            raise ValueError(f"the config holds more than {MAX_ENTRIES:,} values; real configs hold a few thousand")
        if isinstance(value, list) and len(value) > MAX_LIST_ITEMS:
            raise ValueError(f"{path} has {len(value):,} items; a config list may hold at most {MAX_LIST_ITEMS:,}")
        limit = by_key.get(key)
        if limit is None or value is None or isinstance(value, (dict, list)):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path} must be a whole number, got {_shown(value)}")
        if value < 0:
            raise ValueError(f"{path} = {value:,} must not be negative")
        if value > limit.most:
            raise ValueError(f"{path} = {value:,} is beyond the limit: a config may ask for at most {limit.most:,} "
                             f"{limit.what}, far more than any released model has")
        if limit.summed:
            totals[limit.what] += value
            if totals[limit.what] > limit.most:
                raise ValueError(f"the config asks for more than {limit.most:,} {limit.what} in all (reached at "
                                 f"{path} = {value:,}), far more than any released model has")


def _values(config: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """``(path, key, value)`` of every value in `config`, depth first; a list's items carry the list's key."""
    stack: list[tuple[str, str, Any]] = [(key, key, value) for key, value in reversed(config.items())]
    while stack:
        path, key, value = stack.pop()
        yield path, key, value
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}", str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list) and len(value) <= MAX_LIST_ITEMS:
            stack.extend((f"{path}[{i}]", key, v) for i, v in reversed(list(enumerate(value))))


def load_config(model: str) -> PreTrainedConfig:
    """The config of `model` (a Hub id, a local folder or a ``config.json`` path), checked by
    `check_config_dict` before transformers builds it (as `AutoConfig.from_pretrained` would, without remote
    code).

    Raises `ValueError` with a one-line reason when it cannot be read (no such file or repository, not JSON),
    is beyond the limits, or is not a config transformers accepts.
    """
    try:
        config_dict, _ = PreTrainedConfig.get_config_dict(model)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read a config from {model!r}: {one_line(error)}") from None
    check_config_dict(config_dict)
    model_type = config_dict.get("model_type")
    if model_type == "mistral" and "layer_types" in config_dict:
        model_type = "ministral"  # as AutoConfig does: a Mistral config with per-layer attention types
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"the config of {model!r} has model_type {_shown(model_type)}, which this transformers "
                         "does not know")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:
        raise ValueError(f"the config of {model!r} is not a valid {model_type} config: {one_line(error)}") from None
    config.name_or_path = str(model)
    return config


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """`error`'s message on one line (whitespace runs become one space), cut to about `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
