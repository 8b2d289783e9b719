"""Loading the scripts under `scripts/` as modules, and reading their ``--help``."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from repo_paths import SCRIPTS


def script_path(name: str) -> Path:
    """The one script called ``{name}.py`` in ``scripts/``'s groups (bench/generate, bench/serving, ...)."""
    (path,) = SCRIPTS.rglob(f"{name}.py")
    return path


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", script_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


def option_blocks(text: str) -> dict[str, str]:
    """``{"--option METAVAR": its help text}`` from argparse's "options:" section."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (--?[\w-]+(?: [\w{},.-]+)?)(.*)", line)
        if match:
            current = match.group(1)
            blocks[current] = match.group(2)
        elif current is not None:
            blocks[current] += " " + line.strip()
    return blocks
