"""The package's rooms keep to their jobs: the engine knows nothing of the server, speculation nothing of the
engine, the HTTP stack lives in `server/` alone, no room outgrows the package, and no module or script grows
past what a reader holds at once. Imports are read from the source (`package_imports`); nothing is imported."""

from __future__ import annotations

import ast

import pytest
from package_imports import NAME, _imports, package_modules
from repo_paths import PACKAGE, SCRIPTS

HTTP_STACK = ("fastapi", "starlette", "uvicorn", "pydantic")
MAX_ROOM_SHARE = 0.30  # of the package's lines, in one folder (its subfolders included)
MAX_MODULE_LINES = 500
MAX_SCRIPT_LINES = 600


def imported_modules(room: str) -> dict[str, set[str]]:
    """Module of `room` (``"engine"``, ``"server.http"``) -> every module its imports name, absolute."""
    found = {}
    for module, path in package_modules().items():
        if module == f"{NAME}.{room}" or module.startswith(f"{NAME}.{room}."):
            tree = ast.parse(path.read_text(), str(path))
            found[module] = {target for target, _ in _imports(tree, module, path.name == "__init__.py")}
    assert found, f"no modules in {room}"
    return found


def reaching(room: str, others: tuple[str, ...]) -> dict[str, set[str]]:
    """The modules of `room` that import anything under one of `others` (top-level names or rooms)."""
    hits = {}
    for module, targets in imported_modules(room).items():
        bad = {t for t in targets for other in others if t == other or t.startswith(other + ".")}
        if bad:
            hits[module] = bad
    return hits


@pytest.mark.parametrize("room, forbidden", [
    ("engine", (f"{NAME}.server", f"{NAME}.serve", f"{NAME}.structured", *HTTP_STACK)),
    ("speculative", (f"{NAME}.engine", f"{NAME}.server", *HTTP_STACK)),
    ("structured", (f"{NAME}.engine", f"{NAME}.server", *HTTP_STACK)),
    ("cache", (f"{NAME}.engine", f"{NAME}.speculative", f"{NAME}.server", *HTTP_STACK)),
    ("compiled", (f"{NAME}.engine", f"{NAME}.speculative", f"{NAME}.server", *HTTP_STACK)),
])
def test_a_room_imports_nothing_of_the_rooms_after_it(room, forbidden):
    assert not reaching(room, forbidden), f"{room} reaches what it must not: {reaching(room, forbidden)}"


def test_the_http_stack_is_imported_only_in_the_server():
    outside = {}
    for room in sorted({module.split(".")[1] for module in package_modules() if module.count(".") >= 1}):
        if room != "server":
            outside.update(reaching(room, HTTP_STACK))
    assert not outside, f"fastapi, starlette, uvicorn or pydantic imported outside server/: {outside}"
    assert reaching("server.http", HTTP_STACK), "the check found no HTTP import in server/http at all"


def test_no_room_holds_more_than_its_share_of_the_package():
    lines: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        room = parts[0] if len(parts) > 1 else "(top level)"
        lines[room] = lines.get(room, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    heavy = {room: f"{count / total:.0%}" for room, count in lines.items() if count > MAX_ROOM_SHARE * total}
    assert not heavy, f"rooms over {MAX_ROOM_SHARE:.0%} of the package's {total} lines: {heavy}"


def test_no_module_or_script_is_too_long_to_read_at_once():
    long_modules = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
                    if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    long_scripts = {str(p.relative_to(SCRIPTS)): n for p in SCRIPTS.rglob("*.py")
                    if (n := len(p.read_text().splitlines())) > MAX_SCRIPT_LINES}
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines (split each by job): {long_modules}"
    assert not long_scripts, f"scripts over {MAX_SCRIPT_LINES} lines (shared pieces: hf_paged_cache/bench/): {long_scripts}"


def test_the_deprecated_top_level_shims_are_gone():
    assert not (PACKAGE / "plan.py").exists() and not (PACKAGE / "config_limits.py").exists()
    assert not (PACKAGE / "serving").exists(), "serving/ was split into engine/, speculative/ and server/"


def test_every_folder_of_the_package_is_a_package():
    """A folder without ``__init__.py`` imports in a checkout (a namespace package) but is left out of a wheel."""
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    assert not [str(folder) for folder in folders if not (folder / "__init__.py").exists()]
