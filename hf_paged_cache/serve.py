"""``python -m hf_paged_cache.serve MODEL``: the OpenAI-compatible server's command (`hf_paged_cache.server.cli`).

The same command is ``hf-paged-cache serve MODEL``; ``python -m hf_paged_cache.serve --help`` lists its options.
"""

import sys

from .server.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
