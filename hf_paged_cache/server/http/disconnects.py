"""A non-streamed answer raced against its client: a client that goes away cancels the requests it started.

A streamed answer's generator is cancelled by the server when its client goes; a whole answer is awaited, so
it is raced against the connection's ``http.disconnect`` instead.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from .errors import api_error_for
from .generation import ChoiceResult, Generation

logger = logging.getLogger("hf_paged_cache.serve")


async def results_unless_disconnected(request: Request, generation: Generation) -> list[ChoiceResult] | None:
    """Every choice whole, or None if the client disconnects first (its requests are then cancelled)."""
    results = asyncio.ensure_future(generation.results())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        generation.cancel()  # nothing for choices that finished; frees the rest
        if not results.done():
            results.cancel()
    if results not in done:
        logger.info("client went away: request cancelled")
        return None
    try:
        return results.result()
    except Exception as error:
        raise api_error_for(error) from error


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the body was read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
