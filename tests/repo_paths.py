"""Where things are, for tests in any folder under `tests/`: the repository root and its parts.

Tests build paths from these rather than from their own ``__file__``, so moving a test between folders
changes nothing it reads.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"  # tests/data: the character tokenizer, lm-eval tasks, corpora, configs
PACKAGE = ROOT / "hf_paged_cache"
SCRIPTS = ROOT / "scripts"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
