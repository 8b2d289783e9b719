"""The ``hf-paged-cache`` command: ``hf-paged-cache serve MODEL ...`` runs the OpenAI-compatible server
(`hf_paged_cache.server.cli`), ``hf-paged-cache plan ...`` the KV-memory planner (`hf_paged_cache.planner`),
``hf-paged-cache env`` the CPU paths this machine gets (`hf_paged_cache.env`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "serve": ("hf_paged_cache.server.cli", "run the OpenAI-compatible HTTP server"),
    "plan": ("hf_paged_cache.planner.cli", "plan KV memory for a model and a batch"),
    "env": ("hf_paged_cache.env", "print which CPU paths this machine gets"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-paged-cache",
        description="; ".join(f"{name}: {what}" for name, (_, what) in COMMANDS.items()),
        epilog="'hf-paged-cache COMMAND --help' describes a command's options.",
    )
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="the command's own arguments")
    options = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[options.command][0])  # imported only when run: serve needs its extra
    return module.main(options.arguments)


if __name__ == "__main__":
    sys.exit(main())
