"""Deprecated: the config limits are `hf_paged_cache.planner.config_limits`; this module re-exports them."""

import warnings

from .planner.config_limits import CONFIG_LIMITS, MAX_ENTRIES, MAX_LIST_ITEMS, Limit, check_config_dict, load_config, one_line

__all__ = ["CONFIG_LIMITS", "MAX_ENTRIES", "MAX_LIST_ITEMS", "Limit", "check_config_dict", "load_config", "one_line"]

warnings.warn("hf_paged_cache.config_limits is deprecated: import hf_paged_cache.planner.config_limits instead",
              DeprecationWarning, stacklevel=2)
