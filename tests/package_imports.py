"""The package's modules and the imports between them, read from the source with `ast` (nothing is imported).

Every import is counted: at module level, inside functions, under ``try`` and under ``if TYPE_CHECKING:`` alike.
`tests/project/test_import_cycles.py` and `tests/project/test_rooms.py` read the package through these.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from repo_paths import PACKAGE

NAME = PACKAGE.name


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if "__pycache__" in parts or any(not part.isidentifier() for part in parts):
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """``(imported module, names taken from it)`` for every import in `tree`, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, [alias.name for alias in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules its imports run (the rule in this file's docstring)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        parts = module.split(".")
        own_packages = {".".join(parts[:i]) for i in range(1, len(parts) + (1 if is_package else 0))}
        edges = set()
        for target, names in _imports(ast.parse(path.read_text(), str(path)), module, is_package):
            if target != NAME and not target.startswith(NAME + "."):
                continue
            target_parts = target.split(".")
            reached = {".".join(target_parts[:i]) for i in range(1, len(target_parts) + 1)}
            reached |= {f"{target}.{name}" for name in names}
            edges |= {m for m in reached if m in modules and m not in own_packages and m != module}
        graph[module] = edges
    return graph
