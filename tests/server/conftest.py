"""Fixtures of the server's tests: the tiny model folder, servers on it and the same model in this process.

Every server costs a process start (Python, torch, the model): those that several modules can ask alike are
started once for the session. `tiny_servers`, on the tiny Llama of `model_dir`: ``main`` (`server`, asked by
test_server.py and test_server_lm_eval.py), ``stock`` and ``int8`` (test_server.py's, started beside it). And
`json_server`, on the tiny model whose tokenizer can write JSON, asked by the structured outputs, tools and
responses modules (same weights, same options). A module that needs other options defines its own `server`
(or `model_dir`), which pytest prefers to these.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_process import (
    JSON_MAX_SCHEMA_BYTES, SERVER_OPTIONS, Server, run_server, run_servers, save_json_llama, save_tiny_llama,
)
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-server"))


@pytest.fixture(scope="session")
def tiny_servers(model_dir, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """Servers on `model_dir`, started side by side: ``main`` (`SERVER_OPTIONS`), ``stock``
    (``--no-packed-linears``), ``int8`` (``--kv-dtype int8 --quantize int8``: int8 keys and values, and
    weights) and ``compiled`` (``--compile``). test_server.py's SIGTERM test stops ``stock``."""
    logs = tmp_path_factory.mktemp("server-logs")
    with run_servers([
        (model_dir, logs / "main.log", *SERVER_OPTIONS),
        (model_dir, logs / "stock.log", "--num-blocks", "64", "--no-packed-linears"),
        (model_dir, logs / "int8.log", "--max-memory", "1MiB", "--kv-dtype", "int8", "--quantize", "int8"),
        (model_dir, logs / "compiled.log", "--num-blocks", "128", "--compile"),
    ]) as running:
        yield dict(zip(("main", "stock", "int8", "compiled"), running))


@pytest.fixture(scope="session")
def server(tiny_servers) -> Server:
    return tiny_servers["main"]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The model the server runs, in this process (default attention, `DynamicCache`), and the same tokenizer.

    The server packs its linear layers for oneDNN by default (``--packed-linears``), so the reference does too.
    """
    from hf_paged_cache.kernels import pack_linears

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pack_linears(model)
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def json_model_dir(tmp_path_factory) -> Path:
    return save_json_llama(tmp_path_factory.mktemp("tiny-llama-json"))


@pytest.fixture(scope="session")
def json_server(json_model_dir, tmp_path_factory) -> Iterator[Server]:
    """The server on `json_model_dir`, with what each module asking it needs: the structured outputs module a small
    ``--max-schema-bytes``, the tools module the hermes tool-call parser (the default, said anyway)."""
    log = tmp_path_factory.mktemp("json-server-log") / "server.log"
    options = ["--num-blocks", "512", "--max-schema-bytes", str(JSON_MAX_SCHEMA_BYTES), "--tool-call-parser", "hermes"]
    with run_server(json_model_dir, log, *options) as running:
        yield running
