"""No two modules of `hf_paged_cache` import each other, directly or through others.

The imports are read from the source with `ast` (nothing is imported, so modules of extras that are not
installed are read too), every import counted: at module level, inside functions, under ``try`` and under
``if TYPE_CHECKING:`` alike. An import of module ``X`` (``import X``, ``from X import name``) makes an edge
from the importing module to ``X`` and to each package above ``X`` whose ``__init__`` the import runs, except
the importer's own packages (they are initialized before it runs, so a package's ``__init__`` may import its
submodules). ``from X import name`` where ``X.name`` is a module is an edge to ``X.name`` as well, so
``from . import x`` imports the submodule ``x``, and a submodule reaching back for a name its package's
``__init__`` defines or re-exports (``from .. import name``) is an edge to that ``__init__``.
"""

from __future__ import annotations

import ast

from package_imports import NAME, _imports, import_graph, package_modules


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected `component` (breadth first)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected component always has one


def test_the_rule_sees_cycles() -> None:
    """The finder itself: a cycle through a package's ``__init__`` and a lazy import is found, a package
    importing its own submodules is not a cycle, and ``from . import x`` is an import of ``x``."""
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": set(), "q": {"q.c"}, "q.c": {"q"}}
    assert find_cycles(graph) == [["q", "q.c", "q"]]
    tree = ast.parse("def f():\n    from . import b\n    from ..q import c\n")
    assert list(_imports(tree, "pkg.p.a", False)) == [("pkg.p", ["b"]), ("pkg.q", ["c"])]


def test_no_import_cycles_in_the_package() -> None:
    modules = package_modules()
    assert f"{NAME}.engine.batcher" in modules and NAME in modules
    graph = import_graph(modules)
    assert sum(map(len, graph.values())) > 50, "the import graph is suspiciously small"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between modules of the package:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)
