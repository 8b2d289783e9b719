"""The contenders of ``scripts/bench/serving/bench_http.py`` and how each server starts and stops.

A contender is a name: a server (ours with its flags, ``transformers serve``, vLLM's CPU build, ours on Ray
Serve), one of those started with a library preloaded (``-preloaded``) or sent each job's ``response_format``
(``-json``), or a `ContinuousBatcher` in the benchmark's own process (`BATCHERS`). `ServerSettings` holds what
every server is started with and gives each contender's command line and environment; `running_server` starts
one on a free port and stops its process group at the end (`hf_paged_cache.bench.server_process`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .server_process import HOST, running_process

CONTENDERS = (
    "ours", "transformers", "batcher", "ours-stock", "ours-timed", "ours-bmm", "ours-flex", "batcher-flex", "vllm",
    "ours-preloaded", "vllm-preloaded", "ray-prefix", "ray-pow2", "ray-single", "ours-spec", "vllm-spec",
    "ours-json", "vllm-json", "ours-int8", "ours-int4", "ours-bound", "ours-invariant", "ours-compiled",
)
PRELOADED = "-preloaded"  # a contender with this suffix: the one before it, started with LD_PRELOAD=--preload
OUR_SERVERS = ("ours", "ours-stock", "ours-timed", "ours-bmm", "ours-flex", "ours-spec", "ours-int8",
               "ours-int4", "ours-bound", "ours-invariant", "ours-compiled")
BOUND_THREADS = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}  # ours-bound: OpenMP's threads, one per core
VLLM_SERVERS = ("vllm", "vllm-spec")
SPECULATIVE = ("ours-spec", "vllm-spec")  # n-gram prompt lookup: --speculative-tokens drafts a step
SPECULATIVE_SET = frozenset(SPECULATIVE)
CONSTRAINED = {"ours-json": "ours", "vllm-json": "vllm"}  # these servers, sent each job's response_format
BATCHERS = {"batcher": "sdpa", "batcher-flex": "flex"}  # the in-process contenders, and how their decode steps attend
DEFAULT_CONTENDERS = ("ours", "transformers", "batcher")  # vllm: only when asked, CI does not install it
RAY_CONTENDERS = ("ray-prefix", "ray-pow2", "ray-single")  # --ray's defaults
BLOCK_SIZE = 16  # our server's and ContinuousBatcher's default block size
TRANSFORMERS_PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size's default in transformers 5.24
VLLM_BLOCK_SIZE = 128  # vLLM's CPU block size (vllm/platforms/cpu.py, 0.32)
VLLM_PYTHON_ENV = "VLLM_PYTHON"  # --vllm-python's default, else DEFAULT_VLLM_PYTHON
DEFAULT_VLLM_PYTHON = "vllm-venv/bin/python"
API_KEY_ENV = "HF_PAGED_CACHE_API_KEY"  # our server's default --api-key


def base_contender(contender: str) -> str:
    """The server that `contender` runs (itself, the one it preloads a library into, or the one it sends
    response_format to)."""
    name = contender.removesuffix(PRELOADED)
    return CONSTRAINED.get(name, name)


def is_vllm(contender: str) -> bool:
    """Whether `contender` is a vLLM server (vllm, vllm-spec, vllm-preloaded, vllm-json)."""
    return base_contender(contender) in VLLM_SERVERS


@dataclass(frozen=True)
class ServerSettings:
    """What every server is started with."""

    model_path: str
    budget: int  # KV bytes
    cb_num_blocks: int  # the budget in transformers' blocks of `cb_page_size` tokens
    cb_page_size: int | None  # None: transformers' default
    threads: int
    start_timeout: float  # seconds a server may take to answer /health
    dtype: str = "float32"
    vllm_python: str = DEFAULT_VLLM_PYTHON
    max_model_len: int = 2048  # vLLM's --max-model-len: the longest request, in whole vLLM blocks
    max_num_seqs: int = 16  # vLLM's --max-num-seqs: the concurrency
    preload: str | None = None  # LD_PRELOAD of the *-preloaded contenders
    replicas: int = 2  # engine replicas of ray-prefix and ray-pow2
    speculative_tokens: int = 4  # draft tokens a step of ours-spec and vllm-spec may verify
    prompt_lookup: tuple[int, int] = (2, 4)  # vllm-spec's shortest and longest n-gram looked up

    def speculative_config(self) -> str:
        """vllm-spec's ``--speculative-config``: n-gram prompt lookup."""
        return json.dumps({"method": "ngram", "num_speculative_tokens": self.speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup[1], "prompt_lookup_min": self.prompt_lookup[0]})

    def command(self, contender: str, port: int | str) -> list[str]:
        """The command line that starts `contender`'s server on `port` of 127.0.0.1."""
        contender = base_contender(contender)
        if contender in RAY_CONTENDERS:
            replicas = 1 if contender == "ray-single" else self.replicas
            return [sys.executable, "-m", "hf_paged_cache.serve", self.model_path, "--device", "cpu", "--dtype",
                    self.dtype, "--host", HOST, "--port", str(port), "--max-memory", str(self.budget),
                    "--ray", "--replicas", str(replicas), "--replica-cpus", "0",
                    "--replica-threads", str(max(1, self.threads // replicas)),
                    "--router", "pow2" if contender == "ray-pow2" else "prefix", "--speculative", "off"]
        if contender in OUR_SERVERS:
            plain = ["--speculative", "off"]  # the others' decode steps compute one token per row
            flags = {"ours": plain, "ours-stock": ["--no-packed-linears", *plain],
                     "ours-timed": ["--time-linears", *plain], "ours-bmm": ["--bmm-decode", *plain],
                     "ours-flex": ["--flex-decode", *plain],
                     "ours-int8": ["--quantize", "int8", *plain], "ours-int4": ["--quantize", "int4", *plain],
                     "ours-bound": plain, "ours-invariant": ["--batch-invariant", *plain],
                     "ours-compiled": ["--compile", *plain],
                     "ours-spec": ["--speculative", "ngram", "--speculative-tokens", str(self.speculative_tokens)],
                     }[contender]
            return [sys.executable, "-m", "hf_paged_cache.serve", self.model_path, "--device", "cpu", "--dtype",
                    self.dtype, "--host", HOST, "--port", str(port), "--max-memory", str(self.budget), *flags]
        if contender in VLLM_SERVERS:
            spec = ["--speculative-config", self.speculative_config()] if contender == "vllm-spec" else []
            return [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                    "--served-model-name", Path(self.model_path).name, "--dtype", self.dtype,
                    "--host", HOST, "--port", str(port), "--kv-cache-memory-bytes", str(self.budget),
                    "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs), *spec]
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_path,
                   "--continuous-batching", "--device", "cpu", "--dtype", self.dtype, "--host", HOST,
                   "--port", str(port), "--cb-num-blocks", str(self.cb_num_blocks)]
        if self.cb_page_size is not None:
            command += ["--cb-block-size", str(self.cb_page_size)]
        return command

    def own_env(self, contender: str) -> dict[str, str]:
        """The variables `contender` alone is started with (shown with its command in the results)."""
        preload = {}
        if contender.endswith(PRELOADED):  # before any library the environment already preloads
            preload = {"LD_PRELOAD": " ".join(filter(None, [str(self.preload), os.environ.get("LD_PRELOAD")]))}
        if not is_vllm(contender):
            return (BOUND_THREADS if base_contender(contender) == "ours-bound" else {}) | preload
        # vLLM binds its compute threads to these cores (by default one thread on one core).
        cores = "0" if self.threads == 1 else f"0-{self.threads - 1}"
        return {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"} | preload

    def command_line(self, contender: str) -> str:
        """`contender`'s variables and command as one shell line, its port shown as ``PORT``."""
        return " ".join([f"{k}={v}" for k, v in self.own_env(contender).items()]
                        + [shlex.quote(part) for part in self.command(contender, "PORT")])

    def env(self, contender: str) -> dict[str, str]:
        """The whole environment `contender`'s server runs in: this process's, ``--threads`` threads, offline
        for a local folder, `own_env`, without our API key or vLLM's KV-space override."""
        env = os.environ | {
            "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
        } | self.own_env(contender)
        env.pop(API_KEY_ENV, None)  # ours would then ask these clients for the key
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override vLLM's --kv-cache-memory-bytes
        if Path(self.model_path).is_dir():  # a local folder: nothing to ask the Hub for
            env["HF_HUB_OFFLINE"] = "1"
        return env


def check_vllm_python(python: str) -> None:
    """Exit with a clear message unless `python` runs and can import vllm (looked up, not imported: quick)."""
    install = (f"install vLLM's CPU build in a virtualenv of its own (see this script's docstring) and pass its "
               f"Python as --vllm-python or ${VLLM_PYTHON_ENV}")
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise SystemExit(f"the vllm contender needs vLLM: --vllm-python {python} is no Python here; {install}")
    found = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    if found.returncode != 0:
        raise SystemExit(f"the vllm contender needs vLLM: {python} cannot import vllm; {install}")


@contextlib.contextmanager
def running_server(contender: str, settings: ServerSettings, log_dir: Path) -> Iterator[tuple[str, float]]:
    """Start `contender`'s server on a free port, wait for ``/health``, yield ``(url, startup seconds)``, and stop
    it and every process it started, whatever happens meanwhile (its output in ``log_dir/CONTENDER-PORT.log``)."""
    with running_process(lambda port: settings.command(contender, port), settings.env(contender),
                         lambda port: log_dir / f"{contender}-{port}.log", settings.start_timeout) as started:
        yield started
