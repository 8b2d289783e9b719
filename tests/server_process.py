"""The server as its tests run it: a real `python -m hf_paged_cache.serve` subprocess on a free port, on a tiny
random Llama saved with the character tokenizer of `tests/data/char_tokenizer`, plus the references its answers
are checked against (`generate` with `DynamicCache` on the same token ids, the model's own log-softmax) and a
reader of its Prometheus metrics.

The fixtures built on these (`model_dir`, `server`, `reference`) are in `tests/server/conftest.py`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from repo_paths import DATA
from tiny_models import tiny_model
from transformers import AutoTokenizer, DynamicCache

KEY = "test-key-0123456789"
NAME = "tiny-llama"
CONTEXT = 1024  # the saved model's max_position_embeddings: long enough for requests that are cut off
MAX_BODY = 64 * 1024
MAX_N = 4
SERVER_OPTIONS = ("--num-blocks", "512", "--max-n", str(MAX_N), "--max-body-bytes", str(MAX_BODY))  # `server`'s
JSON_MAX_SCHEMA_BYTES = 2048  # --max-schema-bytes of the JSON-capable model's server: small, so requests can pass it


@dataclass
class Server:
    """A server subprocess: where it listens, its process and its log."""

    url: str
    process: subprocess.Popen
    log: Path

    def headers(self, key: str | None = KEY) -> dict[str, str]:
        return {} if key is None else {"Authorization": f"Bearer {key}"}


def save_tiny_llama(path: Path) -> Path:
    """The tiny random Llama (vocabulary 96) with the character tokenizer, saved to `path` for a server to load."""
    model = tiny_model("llama")
    model.config.max_position_embeddings = CONTEXT  # plain RoPE: the weights do not depend on it
    tokenizer = AutoTokenizer.from_pretrained(DATA / "char_tokenizer")
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # as a real model's: generate() stops there too
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_json_llama(path: Path) -> Path:
    """The tiny random Llama with the character tokenizer that can write JSON (`json_tokenizer`), EOS ``</s>``,
    saved to `path` for a server to load."""
    from json_tokenizer import save_json_tokenizer

    save_json_tokenizer(path)
    model = tiny_model("llama")
    model.config.max_position_embeddings = CONTEXT
    model.generation_config.eos_token_id = 2  # </s>
    model.save_pretrained(path)
    return path


@contextmanager
def run_server(model_dir: Path, log: Path, *options: str) -> Iterator[Server]:
    """`python -m hf_paged_cache.serve` on `model_dir` and a free port, with the key and name of these tests and
    `options`, its output in `log`; yields it once healthy and always stops it (SIGTERM, then kill)."""
    with run_servers([(model_dir, log, *options)]) as (server,):
        yield server


@contextmanager
def run_servers(commands: list[tuple[Path | str, ...]],
                envs: list[dict[str, str | None]] | None = None) -> Iterator[list[Server]]:
    """`run_server` for several servers at once, each ``(model_dir, log, *options)``: all are started before
    any is waited for (they load side by side), yielded once all are healthy, and always all stopped.

    `envs`, one per command: environment variables to set for that server (None: to remove)."""
    started: list[Server] = []
    try:
        for (model_dir, log, *options), changes in zip(commands, envs or [{}] * len(commands), strict=True):
            port = free_port()
            while any(server.url.endswith(f":{port}") for server in started):  # not yet bound by its server
                port = free_port()
            command = [
                sys.executable, "-m", "hf_paged_cache.serve", str(model_dir), "--port", str(port), "--api-key", KEY,
                "--served-model-name", NAME, "--shutdown-grace", "20", "--log-level", "warning", *options,
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            env.pop("HF_PAGED_CACHE_API_KEY", None)
            for name, value in changes.items():
                if value is None:
                    env.pop(name, None)
                else:
                    env[name] = value
            with open(log, "wb") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            started.append(Server(f"http://127.0.0.1:{port}", process, Path(log)))
        for server in started:
            wait_for_health(server.url, server.process, server.log)
        yield started
    finally:
        for server in started:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in started:
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(url: str, process: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server was not healthy after {timeout} s:\n{log.read_text(errors='replace')}")


def generate_alone(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy `generate` with a `DynamicCache` on this prompt alone: the reference for every greedy answer."""
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, cache=DynamicCache(config=model.config))
    return out[0, len(ids):].tolist()


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def token_ids(names: list[str]) -> list[int]:
    """Tokens named ``token_id:N`` (``return_tokens_as_token_ids``) as ids."""
    return [int(name.removeprefix("token_id:")) for name in names]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def log_softmax_rows(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of `ids`: ``[len, V]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus exposition (`labels` as written between the braces, if any)."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def metrics_text(server: Server) -> str:
    import httpx

    return httpx.get(server.url + "/metrics", timeout=10).text
