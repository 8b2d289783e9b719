"""The API key: every route but ``/health`` (and ``/metrics``, unless asked) needs ``Authorization: Bearer KEY``.

Checked before anything else of the request is read, in constant time (`hmac.compare_digest`). Routes are
closed unless listed open, so a route added later is protected by default.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response


class ApiKeyMiddleware:
    """ASGI middleware answering 401 (an OpenAI error object) to a request without the right bearer key.

    Args:
        app: the app behind it.
        api_key: the key (None: every request passes).
        open_paths: paths that need no key.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: frozenset[str] = frozenset({"/health"})):
        self.app = app
        self.key = None if api_key is None else api_key.encode("utf-8")
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self.key):
            await self.app(scope, receive, send)
            return
        message = "a valid API key is needed: send 'Authorization: Bearer <key>'" if token else "missing API key"
        response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
