"""Fixtures of the server's tests: the tiny model folder, the server on it and the same model in this process.

Module-scoped: each test module starts its own server (a module that needs other options defines its own
`server` or `model_dir`, which pytest prefers to these).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from server_process import MAX_BODY, MAX_N, run_server, save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-server"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    options = ["--num-blocks", "512", "--max-n", str(MAX_N), "--max-body-bytes", str(MAX_BODY)]
    with run_server(model_dir, log, *options) as running:
        yield running


@pytest.fixture(scope="module")
def reference(model_dir):
    """The model the server runs, in this process (default attention, `DynamicCache`), and the same tokenizer.

    The server packs its linear layers for oneDNN by default (``--packed-linears``), so the reference does too.
    """
    from hf_paged_cache.kernels import pack_linears

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pack_linears(model)
    return model, AutoTokenizer.from_pretrained(model_dir)
