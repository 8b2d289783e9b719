"""Where a server stands: loading its model, ready, failed to load, or shutting down.

The model loads on a thread of its own started with the app, so the server answers at once (``/health``
503) and the event loop never waits on it. Shutting down (a signal, then the app's shutdown) refuses new
requests (503), gives those in flight the grace period to finish, and closes the batcher.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from ...engine.batcher import ContinuousBatcher
from .engine import EngineClient
from .errors import APIError

logger = logging.getLogger("hf_paged_cache.serve")


class ServerLifecycle:
    """The engine once loaded, and whether requests may come.

    Args:
        load: builds the engine (loads the model); called once, on a thread of its own.
        shutdown_grace: seconds the batcher gives requests in flight when the app shuts down.
        on_load_failure: called (on the loading thread) with the error if `load` fails, e.g. to stop the server.
    """

    def __init__(
        self, load: Callable[[], EngineClient], *, shutdown_grace: float = 30.0,
        on_load_failure: Callable[[BaseException], None] | None = None,
    ):
        self._load = load
        self.shutdown_grace = shutdown_grace
        self._on_load_failure = on_load_failure
        self._lock = threading.Lock()  # guards the three fields below
        self._engine: EngineClient | None = None
        self._failure: BaseException | None = None
        self._shutting_down = False

    @property
    def phase(self) -> str:
        """``"loading"``, ``"ready"``, ``"failed"`` or ``"shutting down"``."""
        with self._lock:
            if self._shutting_down:
                return "shutting down"
            if self._failure is not None:
                return "failed"
            return "loading" if self._engine is None else "ready"

    def engine(self) -> EngineClient:
        """The engine, or `APIError` 503 while the model loads, after it failed to, or once shutting down."""
        with self._lock:
            engine, shutting_down, failure = self._engine, self._shutting_down, self._failure
        if shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if failure is not None:
            raise APIError(503, "the model failed to load", code="model_not_loaded")
        if engine is None:
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading")
        return engine

    @property
    def batcher(self) -> ContinuousBatcher | None:
        """The engine's batcher once loaded (even while shutting down), else None."""
        with self._lock:
            return None if self._engine is None else self._engine.batcher

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (those in flight go on)."""
        with self._lock:
            self._shutting_down = True

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan: start loading, serve, then close the engine with the grace period."""
        threading.Thread(target=self._load_engine, name="load-model", daemon=True).start()
        try:
            yield
        finally:
            self.begin_shutdown()
            with self._lock:
                engine = self._engine
            if engine is not None:
                await asyncio.to_thread(engine.close, self.shutdown_grace)
                logger.info("batcher closed")

    def _load_engine(self) -> None:
        try:
            engine = self._load()
        except BaseException as error:  # noqa: BLE001 (reported, and the server told to stop)
            logger.error("loading the model failed", exc_info=error)
            with self._lock:
                self._failure = error
            if self._on_load_failure is not None:
                self._on_load_failure(error)
            return
        with self._lock:
            closing = self._shutting_down
            if not closing:
                self._engine = engine
        if closing:
            engine.close()
        else:
            logger.info("ready to serve")
