"""What the HTTP app needs to know of its deployment (the engine's own settings go to the engine)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_SCHEMA_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """Settings of one server app.

    Attributes:
        model_name: the name it serves the model under (``/v1/models``, the ``model`` field of requests).
        model_root: where the model came from (a path or Hub id), reported by ``/v1/models``.
        api_key: the bearer key every route but ``/health`` needs (None: no key).
        metrics_need_key: whether ``/metrics`` needs the key too.
        max_n: the most choices one request may ask for.
        max_body_bytes: the largest request body accepted (413 beyond it).
        shutdown_grace: seconds requests in flight get to finish once shutting down.
        max_schema_bytes: the largest JSON schema, regular expression or grammar a request may constrain its
            answer with (400 beyond it).
        tool_call_parser: how the model writes tool calls (`server.http.tools.PARSERS`).
        grammar_compile_timeout: seconds a request's grammar may take to compile (400 beyond; the first
            constrained request also reads the tokenizer's vocabulary, about 0.5 s for 49,152 tokens).
    """

    model_name: str
    model_root: str
    api_key: str | None = None
    metrics_need_key: bool = False
    max_n: int = 16
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_grace: float = 30.0
    max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES
    tool_call_parser: str = "hermes"
    grammar_compile_timeout: float = 10.0
