"""`wait_for_start`, the start-up wait of every server these tests run, on tiny stand-in processes (plain
``python -c`` scripts writing to a log as a server does) with windows of a second or two: it waits as long as
the log advances, fails at once when the process exits, and fails a process silent for the stall window or
still not ready at the overall limit, each failure saying which and showing the log's tail."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from server_process import ServerDidNotStart, free_port, healthy, wait_for_start

HEALTHY_LATER = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

print("loading", flush=True)
for part in range(4):  # lines, as a server logs while it loads
    time.sleep(0.3)
    print(f"loaded part {part}", flush=True)
for step in range(1, 7):  # then a progress bar redrawn in place, for longer than the stall window: no new line
    time.sleep(0.3)
    print(f"\\rwarming up {step}/6", end="", flush=True)


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
"""Starts in 3 s, never silent for more than 0.3 s; then answers 200 on ``/health`` at the port it is given."""

Spawn = Callable[[str], tuple[subprocess.Popen, Path]]


@pytest.fixture
def spawn(tmp_path) -> Iterator[Spawn]:
    """``spawn(source, *args)``: ``python -c source`` with its stdout and stderr in a log of its own (as
    `run_servers` starts a server), once its first output is there; every process is killed at the end."""
    processes = []

    def start(source: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"process-{len(processes)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(source), *args], stdout=out,
                                       stderr=subprocess.STDOUT)
        processes.append(process)
        deadline = time.monotonic() + 30  # Python's own start, before any window of the test counts
        while not log.stat().st_size and process.poll() is None:
            assert time.monotonic() < deadline, "the stand-in process wrote nothing"
            time.sleep(0.02)
        return process, log

    yield start
    for process in processes:
        process.kill()
        process.wait()


def never() -> bool:
    return False


def test_a_process_that_exits_fails_at_once_with_its_log(spawn):
    process, log = spawn("import sys; print('the model is not there', flush=True); sys.exit(3)")
    began = time.monotonic()
    with pytest.raises(ServerDidNotStart) as failure:
        wait_for_start(process, log, never, stall_s=30, limit_s=30)
    assert time.monotonic() - began < 5  # not the stall window's 30 s
    assert failure.value.reason == "exited"
    assert "exited with code 3" in str(failure.value) and "the model is not there" in str(failure.value)


def test_a_log_that_keeps_advancing_is_waited_for_past_the_stall_window(spawn):
    port = free_port()
    process, log = spawn(HEALTHY_LATER, str(port))
    waited = wait_for_start(process, log, partial(healthy, f"http://127.0.0.1:{port}"), stall_s=1.0, limit_s=30)
    assert waited > 2.5 and process.poll() is None  # longer than the stall window, healthy at the end
    assert "warming up 6/6" in log.read_text()


def test_a_silent_process_fails_after_the_stall_window(spawn):
    process, log = spawn("import time; print('imported', flush=True); time.sleep(60)")
    began = time.monotonic()
    with pytest.raises(ServerDidNotStart) as failure:
        wait_for_start(process, log, never, stall_s=1.0, limit_s=30)
    assert 1.0 <= time.monotonic() - began < 5
    assert failure.value.reason == "stalled" and process.poll() is None
    assert "stalled: no new output in its log for 1 s" in str(failure.value) and "imported" in str(failure.value)


def test_the_lines_the_wait_makes_ray_write_are_not_progress(spawn):
    """Ray Serve's proxy logs a line for every ``/health`` probe that gives up on an application not ready: a
    stalled Ray start-up writes these and nothing else, as often as it is probed."""
    process, log = spawn("""
        import time
        print("Started Serve in namespace 'serve'.", flush=True)
        while True:
            time.sleep(0.1)
            print("(ProxyActor pid=1) INFO proxy 1.2.3.4 9d40f6bb -- Client for request 9d40f6bb disconnected, "
                  "cancelling request.", flush=True)
        """)
    with pytest.raises(ServerDidNotStart) as failure:
        wait_for_start(process, log, never, stall_s=1.0, limit_s=30)
    assert failure.value.reason == "stalled"


def test_a_process_still_advancing_fails_at_the_overall_limit(spawn):
    process, log = spawn("""
        import time
        for step in range(1000):
            print(f"step {step}", flush=True)
            time.sleep(0.1)
        """)
    began = time.monotonic()
    with pytest.raises(ServerDidNotStart) as failure:
        wait_for_start(process, log, never, stall_s=1.0, limit_s=1.5)
    assert 1.5 <= time.monotonic() - began < 5
    assert failure.value.reason == "limit" and "was not ready after 1.5 s (the start-up limit)" in str(failure.value)
    assert "step 1" in str(failure.value)
