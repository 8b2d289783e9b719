"""No class of `hf_paged_cache` is longer than `MAX_CLASS_LINES` lines: one that grows past it does two jobs.

Lines are counted from the source with `ast` (nothing is imported), from the ``class`` line to the class's
last line, docstrings and comments included (``end_lineno - lineno + 1``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import PACKAGE

MAX_CLASS_LINES = 300


def class_sizes(root: Path = PACKAGE) -> dict[str, int]:
    """``"path:ClassName" -> lines`` for every class (nested ones included) of every module under `root`."""
    sizes = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(root.parent)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_class_sizes_counts_a_class_from_its_first_line_to_its_last(tmp_path):
    (tmp_path / "module.py").write_text('class Small:\n    """Three lines."""\n    x = 1\n\n\nclass Empty: ...\n')
    assert class_sizes(tmp_path) == {f"{tmp_path.name}/module.py:Small": 3, f"{tmp_path.name}/module.py:Empty": 1}


def test_no_class_is_longer_than_the_limit():
    too_long = {name: lines for name, lines in class_sizes().items() if lines > MAX_CLASS_LINES}
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines (split each along a job it does): {too_long}"
