"""The OpenAI-compatible images API as a FastAPI app that is an AsyncClient of one engine.

    POST /v1/images/generations   OpenAI's body + steps, sampler, guidance, seed, negative_prompt
    GET  /v1/models               the engine's model (from its Welcome)
    GET  /health                  200 when the engine answers, else 503
    GET  /metrics                 the gateway's own Prometheus metrics

`create_app(link)` builds it around an `EngineLink`; `python -m frontend http` serves
it with uvicorn, and `frontend.ray_app` serves the same app from Ray Serve replicas.

Cancellation: while a request waits for the engine, a watcher reads the ASGI
`receive` channel; `http.disconnect` (the client went away) cancels the waiting
task, which cancels every engine request it submitted (AsyncClient.generate cancels
on CancelledError). A handler cancelled from outside (Ray Serve does this when its
proxy sees the disconnect) unwinds the same way.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from typing import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engine.protocol import Canceled, Completed, Failed, GenerateParams, Rejected
from frontend.client import AsyncClient, EngineDeadError
from frontend.http.errors import APIError, bad_request, engine_unavailable, from_failed, from_rejected
from frontend.http.link import EngineLink
from frontend.http.metrics import GatewayMetrics, MetricsMiddleware
from frontend.http.schemas import (
    Generation, completed_event, images_response, models_response, parse_generation, partial_image_event,
)

log = logging.getLogger("diffslot.http")

JSON = "application/json"
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in metrics, never seen by the client


class ClientGone(Exception):
    """The HTTP client disconnected; its engine requests were canceled."""


# --------------------------------------------------------------------------- engine calls


def _outcome_error(result, link: EngineLink, metrics: GatewayMetrics) -> APIError:
    """The HTTP error for a request that did not complete."""
    if isinstance(result, Rejected):
        error = from_rejected(result)
        metrics.images.labels("busy" if error.status == 429 else "rejected").inc()
        return error
    if isinstance(result, Failed):
        metrics.images.labels("failed").inc()
        return from_failed(result)
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
                    raise _outcome_error(result, link, metrics)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    metrics.images.labels("completed").inc(len(tasks))
    return [task.result() for task in tasks]


async def _wait_disconnect(receive) -> None:
    """Return when the ASGI server reports that the client disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that answers at once with something else: do not spin


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


# --------------------------------------------------------------------------- streaming


class ImageStream:
    """One streamed generation: its engine task and the previews it produced so far."""

    def __init__(self, client: AsyncClient, gen: Generation, link: EngineLink, metrics: GatewayMetrics):
        self.gen, self.link, self.metrics = gen, link, metrics
        self.previews: asyncio.Queue = asyncio.Queue()
        kwargs = {}
        if gen.partial_images:
            kwargs = {"partial_images": gen.partial_images, "on_partial_image": self.previews.put_nowait}
        self.task = asyncio.ensure_future(client.generate(gen.params[0], **kwargs))

    async def next_event(self) -> bytes | APIError | None:
        """The next SSE event's bytes; an APIError if the request failed; None after the last."""
        if self.task is None:
            return None
        preview = None if self.previews.empty() else self.previews.get_nowait()
        if preview is None and not self.task.done():
            getter = asyncio.ensure_future(self.previews.get())
            try:
                await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                preview = getter.result()
            elif not self.previews.empty():
                preview = self.previews.get_nowait()
        if preview is not None:  # previews arrive before the result: send them first
            self.metrics.partial_images.inc()
            return partial_image_event(_b64(preview.image), preview.index, self.gen.size, preview.step,
                                       preview.total)
        task, self.task = self.task, None
        error = task.exception()
        result = error if error is not None else task.result()
        if not isinstance(result, Completed):
            return _outcome_error(result, self.link, self.metrics)
        self.metrics.images.labels("completed").inc()
        return completed_event(_b64(result.output), self.gen.size, result.timings, self.gen.params[0].seed)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class EventStreamResponse(Response):
    """Server-sent events from an ImageStream whose first event is already known (so
    that errors before it are plain HTTP errors); a disconnect cancels the generation."""

    def __init__(self, stream: ImageStream, first: bytes):
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # no content-length: chunked
        self.stream, self.first = stream, first

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            event = self.first
            while event is not None:
                chunk = event.sse() if isinstance(event, APIError) else event
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                next_event = asyncio.ensure_future(self.stream.next_event())
                await asyncio.wait({next_event, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not next_event.done():  # the client went away
                    next_event.cancel()
                    self.stream.metrics.images.labels("client_gone").inc()
                    return
                event = next_event.result()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the server could not write: the client is gone
            self.stream.metrics.images.labels("client_gone").inc()
        finally:
            watcher.cancel()
            self.stream.cancel()


# --------------------------------------------------------------------------- the app


def create_app(link: EngineLink, *, own_link: bool = True) -> FastAPI:
    """The gateway around `link`. With `own_link` the app's lifespan starts connecting it
    (in the background) and closes it at shutdown; a Ray
    replica that owns its engine passes its own link and own_link=False."""
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # connect in the background: the port opens at once and /health says 503
        # while the engine is still loading its model
        if own_link:
            link.start()
        try:
            yield
        finally:
            if own_link:
                await link.close()

    app = FastAPI(title="diffslot images API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.link, app.state.metrics = link, metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        metrics.images.labels("client_gone").inc()
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; the metrics do

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=kind).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {exc!r}", type="server_error", code="internal_error").response()

    @app.post("/v1/images/generations")
    async def generations(request: Request) -> Response:
        body = await request.body()
        client = await link.client()
        gen = parse_generation(body, link.models)
        if gen.stream:
            stream = ImageStream(client, gen, link, metrics)
            try:
                first = await until_disconnect(request, stream.next_event())
            except BaseException:
                stream.cancel()
                raise
            if isinstance(first, APIError):  # nothing sent yet: a plain HTTP error
                raise first
            return EventStreamResponse(stream, first)
        results = await until_disconnect(request, generate_all(client, gen.params, link, metrics))
        images = [(_b64(r.output), p.seed, r.timings) for r, p in zip(results, gen.params)]
        return Response(images_response(images, gen.size), media_type=JSON)

    @app.get("/v1/models")
    async def models() -> Response:
        await link.client()
        return Response(models_response(link.models[:1], link.created), media_type=JSON)

    @app.get("/health")
    async def health() -> Response:
        try:
            await link.client()
        except APIError as exc:
            return exc.response()
        welcome = link.welcome
        return Response(json.dumps({"status": "ok", "engine_pid": welcome.engine_pid, "model": link.models[0]}),
                        media_type=JSON)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
