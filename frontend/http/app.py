"""The OpenAI-compatible images API as a FastAPI app that is an AsyncClient of one engine.

    POST /v1/images/generations   OpenAI's body + steps, sampler, guidance, seed, negative_prompt
                                  (and the extras loras, true_cfg, original_size, crops_coords_top_left,
                                  target_size)
    POST /v1/images/edits         OpenAI's multipart form (image, mask files) + strength and the same knobs
    GET  /v1/models               the engine's model (from its Welcome) and its LoRA adapters
    GET  /health                  200 when the engine answers, 503 when it does not or drains
    GET  /metrics                 the gateway's own Prometheus metrics
    /v1/files, /v1/batches        OpenAI's Files and Batch API for generation jobs (batches.py)
    GET  /outputs/{name}          a signed, expiring link to an image or file in the local output store

`create_app(link, GatewayLimits(api_keys=..., max_body_bytes=..., rate_limit=...))` builds it
around an `EngineLink` (with `StoreOptions` and `BatchOptions` for its state dir, output
store and batch jobs); `python -m frontend http` serves it with uvicorn, and
`frontend.ray_app` serves the same app from Ray Serve replicas. `callers.py` fences
callers from each other (API keys, rate buckets, the body limit); each caller's
images are generated on its own engine connection (`EngineLink.lease`). The statuses
each route answers are in its OpenAPI document (`app.openapi()`).

A 500 never carries internals (exception texts, engine failure reasons): its message
is generic and names a request id, also sent as `x-request-id`, under which the
gateway logs the details.

Cancellation: while a request waits for the engine, a watcher reads the ASGI
`receive` channel; `http.disconnect` (the client went away) cancels the waiting
task, which cancels every engine request it submitted (AsyncClient.generate cancels
on CancelledError). A handler cancelled from outside (Ray Serve does this when its
proxy sees the disconnect) unwinds the same way.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
from typing import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engine.protocol import Completed, frame_field_descriptions
from frontend.async_client import AsyncClient
from frontend.client import EngineDeadError
from frontend.http.batch_runner import BatchRunner
from frontend.http.batches import BATCH_SCHEMAS, FILES_PATH, add_batch_routes
from frontend.http.callers import (
    EDITS_PATH, BodyBudget, CallerGate, ClientDisconnect, KeyRing, RateLimiter, caller_of, read_body,
)
from frontend.http.engine_calls import generate_all, internal_error, outcome_error, request_id
from frontend.http.errors import APIError, bad_request, engine_unavailable
from frontend.http.gateway_state import GatewayState
from frontend.http.link import EngineLink
from frontend.http.metrics import GatewayMetrics, MetricsMiddleware
from frontend.http.options import BatchOptions, GatewayLimits, StoreOptions
from frontend.http.priorities import PRIORITY_HEADER, PriorityPolicy
from frontend.http.responses import (
    Health, ImagesResponse, ModelList, completed_event, error_responses, images_response, models_response,
    ok_response, openapi_components, partial_image_event, schema_ref,
)
from frontend.http.schemas import (
    Generation, ImageEditRequest, ImageGenerationRequest, check_fits, parse_edit, parse_generation,
)
from frontend.http.webhooks import WebhookSender, webhook_secret

log = logging.getLogger("diffslot.http")

JSON = "application/json"
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in metrics, never seen by the client
PARSER_THREADS = 2  # multipart forms parsed at once (a form's parse is CPU: more threads would not help)


class ClientGone(Exception):
    """The HTTP client disconnected; its engine requests were canceled."""


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

    def __init__(self, client: AsyncClient, gen: Generation, link: EngineLink, metrics: GatewayMetrics,
                 on_done=None):
        self.gen, self.link, self.metrics = gen, link, metrics
        self.previews: asyncio.Queue = asyncio.Queue()
        kwargs = {}
        if gen.partial_images:
            kwargs = {"partial_images": gen.partial_images, "on_partial_image": self.previews.put_nowait}
        self.task = asyncio.ensure_future(client.generate(gen.params[0], **kwargs))
        if on_done is not None:  # the engine request is over, however it ended
            self.task.add_done_callback(lambda _: on_done())

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
                                       preview.total, self.gen.event)
        task, self.task = self.task, None
        error = task.exception()
        result = error if error is not None else task.result()
        if not isinstance(result, Completed):
            return outcome_error(result, self.link, self.metrics)
        self.metrics.images.labels("completed").inc()
        return completed_event(_b64(result.output), self.gen.size, result.timings, self.gen.params[0].seed,
                               self.gen.event)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class EventStreamResponse(Response):
    """Server-sent events from an ImageStream whose first event is already known (so
    that errors before it are plain HTTP errors); a disconnect cancels the generation."""

    def __init__(self, stream: ImageStream, first: bytes, priority: int):
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no"),  # no content-length: chunked
                            (PRIORITY_HEADER.encode(), str(priority).encode())]
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


def create_app(link: EngineLink, limits: GatewayLimits | None = None, *, own_link: bool = True,
               store: StoreOptions | None = None, batch: BatchOptions | None = None) -> FastAPI:
    """The gateway around `link`, enforcing `limits` (default: GatewayLimits' defaults).
    With `own_link` the app's lifespan starts connecting it (in the background) and
    closes it at shutdown; a Ray replica that owns its engine passes its own link and
    own_link=False. `limits.api_keys`: bearer keys, each its own caller (none: every /v1
    route is open and each client address is a caller); `max_body_bytes`: the largest
    request body (`max_upload_bytes` for the edits form, which carries the image and
    mask); `rate_limit`: requests per second per caller (0: no limit), `rate_burst`
    banked (default: one second's worth, at least 1); `key_classes`: each key's priority
    class and ceiling (priorities.py). `store`: the state dir and output store (batch jobs,
    image links); `batch`: the Batch API's bounds and webhooks."""
    limits = limits or GatewayLimits()
    store, batch = store or StoreOptions(), batch or BatchOptions()
    api_keys = tuple(limits.api_keys)
    metrics = GatewayMetrics()
    policy = PriorityPolicy(limits.key_classes, api_keys)
    secret = webhook_secret(batch.webhook_secret_file)
    if (batch.webhook_url or batch.webhook_url_prefixes) and secret is None:
        raise ValueError("webhooks need a secret to sign them: --webhook-secret-file or DIFFSLOT_WEBHOOK_SECRET")
    webhooks = WebhookSender(secret, attempts=batch.webhook_attempts, backoff_s=batch.webhook_backoff_s) \
        if secret else None
    state = GatewayState(store, api_keys)
    runner = BatchRunner(state, link, metrics, policy, batch, webhooks)
    state.on_open = runner.start  # the first file, batch or image link starts it

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # connect in the background: the port opens at once and /health says 503
        # while the engine is still loading its model
        if own_link:
            link.start()
        # jobs left unfinished by a previous gateway resume now; jobs that another gateway
        # on the same state dir creates later (a Ray replica's) are noticed when they appear
        watcher = asyncio.ensure_future(state.open_when_it_exists())
        try:
            yield
        finally:
            watcher.cancel()
            await runner.close()
            state.close()
            if own_link:
                await link.close()
            parser.shutdown(wait=False)

    app = FastAPI(title="diffslot images API", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.link, app.state.metrics, app.state.gateway_state = link, metrics, state
    # the gate runs inside the metrics middleware, so that its 401/413/429 are counted
    bodies = BodyBudget(limits.max_caller_body_bytes, limits.max_body_bytes_total, limits.body_timeout_s)
    app.state.bodies = bodies
    app.add_middleware(CallerGate, keys=KeyRing(api_keys), limiter=RateLimiter(limits.rate_limit, limits.rate_burst),
                       max_body_bytes=limits.max_body_bytes,
                       path_limits={EDITS_PATH: limits.max_upload_bytes, FILES_PATH: limits.max_file_bytes},
                       bodies=bodies)
    # forms are parsed here, off the event loop: a large one must not hold up other callers
    parser = concurrent.futures.ThreadPoolExecutor(PARSER_THREADS, thread_name_prefix="diffslot-forms")
    app.state.parse = lambda fn, *args: asyncio.get_running_loop().run_in_executor(parser, fn, *args)
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="OpenAI's images API, served by a diffslot engine")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components(BATCH_SCHEMAS))
            for operations in schema["paths"].values():  # FastAPI's 422: the gateway answers 400 instead
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(unused, None)
            if api_keys:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in schema["paths"].items():
                    if path.startswith("/v1"):
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        metrics.images.labels("client_gone").inc()
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; the metrics do

    @app.exception_handler(ClientDisconnect)
    async def client_gone_mid_body(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nothing was submitted

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=kind).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> Response:
        rid = request_id()
        log.exception("request %s: unhandled error on %s %s", rid, request.method, request.url.path)
        return internal_error(rid).response()

    body_doc = {"requestBody": {"required": True,
                                "content": {"application/json": {"schema": schema_ref(ImageGenerationRequest)}}}}
    images_ok = ok_response("The images (or, with `stream`, server-sent image events)",
                    {"application/json": {"schema": schema_ref(ImagesResponse)},
                     "text/event-stream": {"schema": {"type": "string"}}})

    edit_doc = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "allOf": [schema_ref(ImageEditRequest), {
            "type": "object", "required": ["image", "prompt"],
            "properties": {name: {"type": "string", "format": "binary", "description": description}
                           for name, description in frame_field_descriptions().items()}}]}}}}}

    @app.post("/v1/images/generations", openapi_extra=body_doc,
              responses={**images_ok, **error_responses(400, 401, 404, 413, 429, 500, 503)})
    async def generations(request: Request) -> Response:
        body = await read_body(request, limits.max_body_bytes)
        await link.client()  # 503 at once without an engine; its Welcome names the model and budgets
        return await serve(request, parse_generation(body, link.models, adapters_as_models=True))

    @app.post(EDITS_PATH, openapi_extra=edit_doc,
              responses={**images_ok, **error_responses(400, 401, 404, 413, 429, 500, 503)})
    async def edits(request: Request) -> Response:
        body = await read_body(request, limits.max_upload_bytes)
        await link.client()
        gen = await app.state.parse(parse_edit, request.headers.get("content-type", ""), body, link.models,
                                    link.welcome.max_input_bytes, True)  # adapters named as the model
        del body  # the form's bytes: its image and mask live on in `gen` only
        return await serve(request, gen)

    async def serve(request: Request, gen: Generation) -> Response:
        if gen.adapter is not None and gen.adapter not in await adapter_names():
            raise APIError(404, f"The model '{gen.adapter}' does not exist; this server serves "
                                f"{link.models[0]!r} and its LoRA adapters (GET /v1/models).", param="model",
                           code="model_not_found")
        welcome = link.welcome
        check_fits(gen, welcome.output_budget_bytes, welcome.native_size)
        caller = caller_of(request.scope)
        priority = policy.of(caller).priority(gen.priority)
        gen = gen.with_priority(priority)
        lease = await link.lease(caller)
        if gen.stream:
            stream = ImageStream(lease.client, gen, link, metrics, on_done=lease.release)
            try:
                first = await until_disconnect(request, stream.next_event())
            except BaseException:
                stream.cancel()
                raise
            if isinstance(first, APIError):  # nothing sent yet: a plain HTTP error
                raise first
            return EventStreamResponse(stream, first, priority)
        try:
            results = await until_disconnect(request, generate_all(lease.client, gen.params, link, metrics))
        finally:
            lease.release()
        values = await state.image_values(results, gen.response_format, str(request.base_url))
        images = [(value, p.seed, r.timings) for value, r, p in zip(values, results, gen.params)]
        return Response(images_response(images, gen.size, image_field="url" if gen.response_format == "url"
                                        else "b64_json"),
                        media_type=JSON, headers={PRIORITY_HEADER: str(priority)})

    add_batch_routes(app, state, link, limits, batch, webhooks is not None, runner.wake)

    async def adapter_names() -> list[str]:
        try:
            return await link.adapters()  # a round trip: adapters come and go in the engine's folder
        except (EngineDeadError, ConnectionError, RuntimeError) as exc:
            raise link.lost(exc) from None
        except TimeoutError:
            raise engine_unavailable("the engine did not answer in time") from None

    @app.get("/v1/models", responses={**ok_response("The served model", {JSON: {"schema": schema_ref(ModelList)}}),
                                      **error_responses(401, 429, 503)})
    async def models() -> Response:
        adapters = await adapter_names()
        controlnets = link.welcome.controlnets if link.welcome is not None else []
        return Response(models_response(link.models[:1], link.created, adapters, controlnets), media_type=JSON)

    @app.get("/health", responses={**ok_response("The engine answers and takes work", {JSON: {"schema": schema_ref(Health)}}),
                                   **error_responses(503)})
    async def health() -> Response:
        try:
            await link.client()
        except APIError as exc:
            return exc.response()
        if await link.draining():
            return APIError(503, "the diffslot engine is draining (shutting down): send new requests elsewhere",
                            type="service_unavailable", code="engine_draining").response()
        welcome = link.welcome
        return Response(json.dumps({"status": "ok", "engine_pid": welcome.engine_pid, "model": link.models[0]}),
                        media_type=JSON)

    @app.get("/metrics", responses=ok_response("The gateway's Prometheus metrics",
                                       {"text/plain": {"schema": {"type": "string"}}}))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
