"""Running the app under uvicorn with the server's limits, and draining on SIGTERM / SIGINT.

uvicorn stops accepting connections on a signal, waits up to ``timeout_graceful_shutdown`` for those in
flight, then runs the app's shutdown (which closes the batcher). `DrainingServer` also tells the app at the
signal itself, so that ``/health`` and requests arriving on open connections get 503 meanwhile.
"""

from __future__ import annotations

from types import FrameType

import uvicorn
from fastapi import FastAPI

from .lifecycle import ServerLifecycle

HEADER_LIMIT_BYTES = 64 * 1024  # the most one request's headers may take (h11_max_incomplete_event_size)
KEEP_ALIVE_SECONDS = 5  # an idle keep-alive connection is closed after this


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling `lifecycle` it is shutting down as soon as SIGTERM or SIGINT comes."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.lifecycle.begin_shutdown()
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, *, host: str, port: int, log_level: str, shutdown_grace: float) -> DrainingServer:
    """A server for `app` (built by `build_app`) with bounded headers, keep-alive and shutdown."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http="h11", lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_SECONDS, h11_max_incomplete_event_size=HEADER_LIMIT_BYTES,
        timeout_graceful_shutdown=shutdown_grace, server_header=False,
    )
    return DrainingServer(config, app.state.lifecycle)
