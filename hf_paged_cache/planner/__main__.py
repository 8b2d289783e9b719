"""``python -m hf_paged_cache.planner``: the planner's command line (`cli.main`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
