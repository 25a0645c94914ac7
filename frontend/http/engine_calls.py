"""Calls to the engine on a caller's connection, and the HTTP error for each way a call
can end without an image; the images routes and the batch runner share them."""
from __future__ import annotations

import asyncio
import logging
import uuid

from engine.protocol import Canceled, Completed, Failed, GenerateParams, Rejected
from frontend.async_client import AsyncClient
from frontend.client import EngineDeadError
from frontend.http.errors import APIError, engine_unavailable, from_rejected
from frontend.http.link import EngineLink
from frontend.http.metrics import GatewayMetrics

log = logging.getLogger("diffslot.http")


def request_id() -> str:
    return uuid.uuid4().hex[:16]


def internal_error(request_id: str, code: str = "internal_error") -> APIError:
    """A 500 that says nothing of what went wrong, but under which id the log says it."""
    return APIError(500, f"The server had an error while processing your request (request id {request_id}).",
                    type="server_error", code=code, headers={"x-request-id": request_id})


def outcome_error(result, link: EngineLink, metrics: GatewayMetrics) -> APIError:
    """The HTTP error for a request that did not complete."""
    if isinstance(result, Rejected):
        link.saw_rejection(result)
        error = from_rejected(result)
        metrics.images.labels("busy" if error.status == 429 else "rejected").inc()
        return error
    if isinstance(result, Failed):
        metrics.images.labels("failed").inc()
        rid = request_id()
        log.error("request %s: the engine failed generation request %s: %s", rid, result.request_id, result.error)
        return internal_error(rid, "generation_failed")
    if isinstance(result, Canceled):
        metrics.images.labels("canceled").inc()
        return engine_unavailable("the engine canceled the request (shutting down?)")
    if isinstance(result, (EngineDeadError, ConnectionError, RuntimeError)):
        metrics.images.labels("engine_dead").inc()
        return link.lost(result)
    raise result  # a bug: let the 500 handler log it


async def generate_all(client: AsyncClient, params: tuple[GenerateParams, ...], link: EngineLink,
                       metrics: GatewayMetrics) -> list[Completed]:
    """Submit every image's request (they share the engine's batches), await them all;
    the first that does not complete cancels the rest and becomes the error."""
    tasks = [asyncio.ensure_future(client.generate(p)) for p in params]
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                result = error if error is not None else task.result()
                if not isinstance(result, Completed):
                    raise outcome_error(result, link, metrics)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    metrics.images.labels("completed").inc(len(tasks))
    return [task.result() for task in tasks]
