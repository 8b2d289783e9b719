"""The KV-memory planner: what a model's KV cache takes per token and block, its weights, and how many rows of
a batch fit beside them with DynamicCache, StaticCache and PagedCache, from the model's config alone.

- `estimate`: the maths (`plan_memory` and its `MemoryPlan`), and reading a model for it;
- `weights`: weight bytes from safetensors headers, or counted from the config on the meta device;
- `config_limits`: the sizes a config may ask for before transformers builds anything from it;
- `report`: the plan as text tables (`format_plan`);
- `cli`: the command line, ``python -m hf_paged_cache.planner`` (``hf-paged-cache plan``).
"""

from .cli import build_parser, main, parse_lengths
from .config_limits import CONFIG_LIMITS, MAX_ENTRIES, MAX_LIST_ITEMS, Limit, check_config_dict, load_config, one_line
from .estimate import (
    CACHES,
    DEFAULT_BATCH,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_MAX_MEMORY,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT_LEN,
    MAX_BLOCKS,
    MAX_ROWS,
    MAX_TOKENS,
    GroupPlan,
    MemoryPlan,
    PoolFit,
    bounded_count,
    dynamic_positions,
    layer_groups,
    load_config_and_weight_bytes,
    plan_memory,
    pool_fit,
    rows_that_fit,
    static_positions,
)
from .report import format_bytes, format_plan
from .weights import WeightEstimate, torch_dtype, weights_from_config, weights_from_folder, weights_of_model

__all__ = [
    "CACHES",
    "CONFIG_LIMITS",
    "DEFAULT_BATCH",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DTYPE",
    "DEFAULT_MAX_MEMORY",
    "DEFAULT_NEW_TOKENS",
    "DEFAULT_PROMPT_LEN",
    "MAX_BLOCKS",
    "MAX_ENTRIES",
    "MAX_LIST_ITEMS",
    "MAX_ROWS",
    "MAX_TOKENS",
    "GroupPlan",
    "Limit",
    "MemoryPlan",
    "PoolFit",
    "WeightEstimate",
    "bounded_count",
    "build_parser",
    "check_config_dict",
    "dynamic_positions",
    "format_bytes",
    "format_plan",
    "layer_groups",
    "load_config",
    "load_config_and_weight_bytes",
    "main",
    "one_line",
    "parse_lengths",
    "plan_memory",
    "pool_fit",
    "rows_that_fit",
    "static_positions",
    "torch_dtype",
    "weights_from_config",
    "weights_from_folder",
    "weights_of_model",
]
