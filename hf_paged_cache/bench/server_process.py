"""A benchmarked server in a process of its own: a free port, a start that waits for ``/health``, a stop that
ends its whole process group, and the tail of its log for the errors.

`running_process` is what a benchmark wraps around a server it times: started in a session of its own (Ctrl-C
reaches the benchmark only, which then stops the server's whole group), waited on until ``GET /health`` answers
200, and stopped (SIGTERM, then SIGKILL) whatever happens meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx

HOST = "127.0.0.1"  # every benchmarked server listens here only


def free_port() -> int:
    """A TCP port of `HOST` that nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_process(command: Callable[[int], list[str]], env: Mapping[str, str], log_path: Callable[[int], Path],
                    start_timeout: float) -> Iterator[tuple[str, float]]:
    """Start ``command(port)`` on a free port (its output in ``log_path(port)``), wait for ``/health``, yield
    ``(url, startup seconds)``, and stop it and every process it started, whatever happens meanwhile.

    Raises RuntimeError (the process exited) or TimeoutError (no 200 within `start_timeout` seconds), each with
    the log's tail, once the process is stopped.
    """
    port = free_port()
    url = f"http://{HOST}:{port}"
    log = log_path(port)
    start = time.perf_counter()
    with log.open("wb") as out:
        # A session of its own: Ctrl-C reaches this process only, which then stops the server's whole group.
        process = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=dict(env), start_new_session=True)
    try:
        wait_healthy(process, url, start_timeout, log)
        yield url, time.perf_counter() - start
    finally:
        stop(process)


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    """Poll ``url/health`` every 0.5 s until it answers 200; raise if `process` exits or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode} before answering /health:\n"
                                   f"{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s:\n{log_tail(log_path)}")
            time.sleep(0.5)


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace` seconds; returns once it has exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of the log at `path` (undecodable bytes replaced)."""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
