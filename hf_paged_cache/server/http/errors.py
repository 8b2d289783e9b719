"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` for every failure, never a traceback.

`APIError` is what handlers raise; `api_error_for` turns what the batcher raises into one; the handlers
`install_error_handlers` registers turn everything else (a malformed body, an unknown route, a bug) into
one too. Every 5xx is logged with its traceback; the client sees only the message.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ...errors import BatcherClosed, EngineUnavailable, PoolExhaustedError, QueueFullError
from .protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("hf_paged_cache.serve")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A failure to answer with an OpenAI error object: HTTP `status`, a `message` for the client, the request
    field it is about (`param`) and a short machine-readable `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=ERROR_TYPES.get(self.status, "invalid_request_error"),
            param=self.param, code=self.code,
        ))


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI error object as a JSON response."""
    body = APIError(status, message, param=param, code=code).body()
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def api_error_for(error: BaseException) -> APIError:
    """What the batcher raised (at `submit`, or at the end of a handle) as an error for the client.

    `ValueError` (an argument it refuses) and `PoolExhaustedError` (a request the pool cannot hold even
    alone) are the request's fault: 400. A full queue is 429. A closed batcher (`BatcherClosed`) and a replica
    that died with the request (`EngineUnavailable`) are 503.
    Anything else is a 500.
    """
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return APIError(400, str(error), code="invalid_value")
    if isinstance(error, PoolExhaustedError):
        return APIError(400, f"the request does not fit the server's KV cache: {error}", param="max_tokens",
                        code="too_large_for_kv_cache")
    if isinstance(error, QueueFullError):
        return APIError(429, f"the server is busy: {error}; retry later", code="queue_full")
    if isinstance(error, BatcherClosed):
        return APIError(503, f"the server is shutting down: {error}", code="shutting_down")
    if isinstance(error, EngineUnavailable):
        return APIError(503, f"{error}; retry", code="engine_unavailable")
    return APIError(500, "internal server error", code="internal_error")


def log_if_server_error(error: APIError, cause: BaseException | None) -> None:
    """Log a 5xx with the traceback of what caused it."""
    if error.status >= 500:
        exc_info = (type(cause), cause, cause.__traceback__) if cause is not None else None
        logger.error("%d %s", error.status, error.message, exc_info=exc_info)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error `app` answers an OpenAI error object: `APIError`, malformed or mistyped bodies (400,
    not FastAPI's 422), unknown routes and methods, bodies over the size limit, and any bug (500, logged)."""

    async def api_error(request: Request, error: APIError) -> JSONResponse:
        log_if_server_error(error, error.__cause__)
        return error.response()

    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(error)
        return error_response(400, message, param=param, code="invalid_request")

    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        messages = {
            404: f"no route {request.method} {request.url.path}",
            405: f"method {request.method} not allowed on {request.url.path}",
        }
        message = messages.get(error.status_code, str(error.detail))
        return error_response(error.status_code, message, headers=getattr(error, "headers", None))

    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.error("500 on %s %s", request.method, request.url.path, exc_info=error)
        return error_response(500, "internal server error", code="internal_error")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _describe_validation_error(error: RequestValidationError) -> tuple[str, str | None]:
    """The first problem FastAPI found in a body, as ``(message, param)``: `param` is the top-level field."""
    problems = error.errors()
    if not problems:
        return "invalid request", None
    first = problems[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc:
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    param = str(loc[0])
    path = ".".join(str(part) for part in loc if not _is_union_tag(part))
    return f"{path}: {first.get('msg')}", param


def _is_union_tag(part: object) -> bool:
    """Whether a location part names a member of a union (pydantic's ``str``, ``list[int]``...), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[")))
