"""The request body limit: 413, as an OpenAI error object, for a body over the server's ``--max-body-bytes``.

A body announced larger (Content-Length) is refused before any of it is read; one sent without a length
(chunked) is refused as soon as the bytes read pass the limit, so no request makes the server hold more.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response


class BodyLimitMiddleware:
    """ASGI middleware refusing request bodies over `max_bytes` with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            response = error_response(413, self._message(int(length)), code="body_too_large")
            await response(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException from reading the body to the app's handler (errors.py)
                    raise HTTPException(413, self._message(received, at_least=True))
            return message

        await self.app(scope, receive_within_limit, send)

    def _message(self, size: int, at_least: bool = False) -> str:
        return (f"the request body is {'over ' if at_least else ''}{size:,} bytes; this server takes at most "
                f"{self.max_bytes:,} (--max-body-bytes)")
