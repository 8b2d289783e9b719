"""Deprecated: the planner is `hf_paged_cache.planner` (its command line `hf_paged_cache.planner.cli`).

This module re-exports its names, and ``python -m hf_paged_cache.plan`` still runs its command line.
"""

import warnings

from .planner import *  # noqa: F403 (the planner's public names, as this module held them)
from .planner import __all__, main  # noqa: F401

warnings.warn("hf_paged_cache.plan is deprecated: import hf_paged_cache.planner instead", DeprecationWarning,
              stacklevel=2)

if __name__ == "__main__":
    raise SystemExit(main())
