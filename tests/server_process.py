"""The server as its tests run it: a real `python -m hf_paged_cache.serve` subprocess on a free port, on a tiny
random Llama saved with the character tokenizer of `tests/data/char_tokenizer`, plus the references its answers
are checked against (`generate` with `DynamicCache` on the same token ids, the model's own log-softmax) and a
reader of its Prometheus metrics. A server's start-up is waited for as long as it advances (`wait_for_start`:
its log keeps growing), not to a fixed deadline.

The fixtures built on these (`model_dir`, `server`, `reference`) are in `tests/server/conftest.py`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from repo_paths import DATA
from tiny_models import tiny_model
from transformers import AutoTokenizer, DynamicCache

from hf_paged_cache.bench.server_process import free_port

KEY = "test-key-0123456789"
NAME = "tiny-llama"
CONTEXT = 1024  # the saved model's max_position_embeddings: long enough for requests that are cut off
MAX_BODY = 64 * 1024
MAX_N = 4
SERVER_OPTIONS = ("--num-blocks", "512", "--max-n", str(MAX_N), "--max-body-bytes", str(MAX_BODY))  # `server`'s
JSON_MAX_SCHEMA_BYTES = 2048  # --max-schema-bytes of the JSON-capable model's server: small, so requests can pass it
STARTUP_STALL_S = 120.0
"""How long a starting server may go with no new output in its log before `wait_for_start` fails it as stalled."""
STARTUP_LIMIT_S = 600.0
"""The most `wait_for_start` waits for a start-up in all, however steadily it advances."""
PROBE_ECHO = re.compile(rb"Client for request \S+ disconnected, cancelling request")
"""The line Ray Serve's proxy logs for each ``/health`` probe that gives up on an application not yet ready: the
wait's own doing, so never progress."""


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
        limit = time.monotonic() + STARTUP_LIMIT_S  # one limit for them all: they start side by side
        for server in started:
            wait_for_start(server.process, server.log, partial(healthy, server.url),
                           limit_s=limit - time.monotonic())
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


class ServerDidNotStart(AssertionError):
    """A start-up that `wait_for_start` gave up on; `reason` says why: ``"exited"``, ``"stalled"`` or ``"limit"``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def healthy(url: str) -> bool:
    """Whether the server at `url` answers 200 on ``/health`` (within a second)."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_start(process: subprocess.Popen, log: Path, ready: Callable[[], bool], *,
                   stall_s: float = STARTUP_STALL_S, limit_s: float = STARTUP_LIMIT_S, poll_s: float = 0.2) -> float:
    """Wait until `ready()` is true of `process`, whose stdout and stderr go to `log`, for as long as its start-up
    advances, not to a fixed deadline; returns the seconds waited.

    Progress is new output in `log` (a server writes as it loads; Ray Serve's driver relays every line of its
    controller, proxy and replicas: "Deploying new version of Deployment", "Adding 2 replicas", a replica's
    own lines): a new complete line other than `PROBE_ECHO`, which a probe of this wait makes Ray write, or a last,
    unfinished line that grew (a progress bar redrawn in place). Each round, every `poll_s` seconds: the process's
    exit is checked first, then `ready()`, then the log. `ServerDidNotStart` is raised, its message naming the
    reason and ending with the log's last lines:

    - ``"exited"``: the process ended, found in the round after it did;
    - ``"stalled"``: neither ready nor any progress for `stall_s` seconds;
    - ``"limit"``: not ready after `limit_s` seconds in all, progress or not.
    """
    start = time.monotonic()
    last_progress = start
    offset = log.stat().st_size  # what the log held before: the stall clock starts now
    unfinished = b""  # the last line, not yet ended, after `offset` as last read
    while True:
        now = time.monotonic()
        if process.poll() is not None:
            _did_not_start("exited", f"exited with code {process.returncode} ({now - start:.0f} s into the wait)", log)
        if ready():
            return time.monotonic() - start
        with open(log, "rb") as out:
            out.seek(offset)
            head, newline, tail = out.read().rpartition(b"\n")
        lines = [line for line in (head + newline).splitlines() if line.strip() and not PROBE_ECHO.search(line)]
        if lines or len(tail) > len(unfinished):
            last_progress = time.monotonic()
        offset += len(head) + len(newline)
        unfinished = tail
        now = time.monotonic()
        if now - last_progress >= stall_s:
            _did_not_start("stalled", f"stalled: no new output in its log for {stall_s:.3g} s, and not ready "
                                      f"({now - start:.0f} s into the wait)", log)
        if now - start >= limit_s:
            _did_not_start("limit", f"was not ready after {limit_s:.3g} s (the start-up limit), though its log "
                                    f"last advanced {now - last_progress:.0f} s ago", log)
        time.sleep(poll_s)


def _did_not_start(reason: str, what: str, log: Path, lines: int = 80) -> None:
    __tracebackhide__ = True
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    raise ServerDidNotStart(reason, f"the server {what}; the last {len(tail)} lines of {log}:\n" + "\n".join(tail))


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
