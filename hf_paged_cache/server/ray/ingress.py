"""`Ingress`: the OpenAI app (`build_app`, unchanged) as the HTTP ingress of a Ray Serve application.

Its engine is a `ReplicaClient` on the engine deployment, so every endpoint, parameter, error and stream is
the single-process server's. It loads no model: the tokenizer and the model's limits come from a replica.
``/metrics`` counts the requests this ingress ran and reports each engine replica's pool (labelled
``replica``), as the replicas last posted it to the `PoolBoard`.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import Any

from fastapi import FastAPI
from ray import serve

from ..http.app import build_app
from ..http.engine import EngineClient
from ..http.metrics import LabelledStats, ServerMetrics
from ..launch import server_settings
from .client import ReplicaClient
from .replica import REPORT_PERIOD_S

logger = logging.getLogger("hf_paged_cache.serve")


@serve.deployment
@serve.ingress()
class Ingress:
    """The HTTP app of the serve command's `options`, running requests on `engine` (an `EngineReplica` handle)."""

    def __init__(self, options: argparse.Namespace, chat_template: str | None, engine: Any, board: Any):
        self._options = options
        self._chat_template = chat_template
        self._engine = engine
        self._board = board
        self._pool_stats: list[LabelledStats] = []
        self._closed = threading.Event()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(server_settings(self._options), self._load_engine, pool_stats=lambda: self._pool_stats)

    def _load_engine(self, metrics: ServerMetrics) -> EngineClient:
        """On the app's loading thread: the engine's facts from a replica, then the client on its replicas."""
        facts = self._engine.facts.remote().result()
        threading.Thread(target=self._read_board, name="read-pool-board", daemon=True).start()
        return EngineClient(ReplicaClient(self._engine, facts), facts.tokenizer,
                            max_model_len=self._options.max_model_len, chat_template=self._chat_template,
                            metrics=metrics)

    def _read_board(self) -> None:
        """Keep `_pool_stats` to what the replicas last posted (``/metrics`` reads it without waiting)."""
        while not self._closed.wait(REPORT_PERIOD_S):
            try:
                posted = self._board.read.remote().result(timeout_s=10)
            except Exception:  # noqa: BLE001 (the board is restarting, or the app shutting down: keep the last)
                logger.debug("could not read the pool board", exc_info=True)
                continue
            self._pool_stats = [({"replica": replica}, stats) for replica, stats in posted]

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self._closed.set()
