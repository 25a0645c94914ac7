"""OpenAI's Files and Batch API on the gateway, for `POST /v1/images/generations` jobs:

    POST   /v1/files                  multipart: file (JSONL), purpose "batch"
    GET    /v1/files[?purpose&after&limit&order]    GET /v1/files/{id}    DELETE /v1/files/{id}
    GET    /v1/files/{id}/content     the file's bytes (a batch's output and error files too)
    POST   /v1/batches                {input_file_id, endpoint, completion_window "24h", metadata}
    GET    /v1/batches[?after&limit]  GET /v1/batches/{id}    POST /v1/batches/{id}/cancel
    GET    /outputs/{name}?expires&signature   a signed, expiring link into the local store

Each line of an input file is `{"custom_id", "method": "POST", "url": endpoint, "body"}`;
the whole file is checked when the batch is created (its format, its size, one
custom_id per line: a 400 naming `input_file_id` and the line), and each body is parsed
as the generations route parses it: a body that route would refuse becomes that line's
error line at once, the rest run (batch_runner.py). A caller sees only its own files
and batches (its API key's; without keys, everyone's).
"""
from __future__ import annotations

import asyncio
import json
import mimetypes
from typing import Annotated

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from frontend.http.batch_runner import refused_line
from frontend.http.callers import caller_of, read_body
from frontend.http.errors import APIError, bad_request, not_found
from frontend.http.gateway_state import GatewayState
from frontend.http.job_store import batch_object, file_object, new_id
from frontend.http.link import EngineLink
from frontend.http.options import BatchOptions, GatewayLimits
from frontend.http.output_store import LOCAL_LINK_PREFIX, LocalStore, checked_name
from frontend.http.responses import error_responses, ok_response, schema_ref
from frontend.http.schemas import check_fits, decode_error, form_parts, parse_generation

FILES_PATH = "/v1/files"
BATCH_ENDPOINTS = ("/v1/images/generations",)
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_LIST_LIMIT = 100
MAX_CUSTOM_ID_CHARS = 512
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata bounds
WEBHOOK_METADATA_KEY = "webhook_url"
JSON = "application/json"


class BatchCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: Annotated[str, msgspec.Meta(description="A 'batch' file (POST /v1/files): one request a line.")]
    endpoint: Annotated[str, msgspec.Meta(description="The route every line calls.",
                                          extra_json_schema={"enum": list(BATCH_ENDPOINTS)})]
    completion_window: Annotated[str, msgspec.Meta(description="Lines not run within it end as 'batch_expired'.",
                                                   extra_json_schema={"enum": list(COMPLETION_WINDOWS)})]
    metadata: Annotated[dict[str, str] | None, msgspec.Meta(
        description="Up to 16 pairs; 'webhook_url' asks for a signed POST when the batch ends (only to URLs the "
                    "server allows).")] = None
    output_expires_after: Annotated[dict | None, msgspec.Meta(description="Not supported: outputs are kept until "
                                                                          "deleted.")] = None


_batch_decoder = msgspec.json.Decoder(BatchCreateRequest)


# the responses, for the OpenAPI document only: the routes encode job_store's dicts (the same fields)
class FileObject(msgspec.Struct):
    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    expires_at: int | None
    status_details: str | None


class FileList(msgspec.Struct):
    object: str
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(msgspec.Struct):
    id: str
    object: str
    deleted: bool


class RequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class Batch(msgspec.Struct):
    id: str
    object: str
    endpoint: str
    errors: dict | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(msgspec.Struct):
    object: str
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


BATCH_SCHEMAS = (BatchCreateRequest, FileObject, FileList, FileDeleted, Batch, BatchList)


def _doc(description: str, struct: type, *errors: int, notes: dict[int, str] | None = None) -> dict:
    return {**ok_response(description, {JSON: {"schema": schema_ref(struct)}}), **error_responses(*errors, notes=notes)}


FILE_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "The batch's JSONL"},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}}
BATCH_BODY = {"requestBody": {"required": True, "content": {JSON: {"schema": schema_ref(BatchCreateRequest)}}}}
NOTES = {400: "A malformed request or input file (`param` names it: `input_file_id` with the line)",
         413: "The request body is larger than the server's limit (--max-file-bytes for files, else "
              "--max-body-bytes; any /v1 route refuses a body over its limit)",
         404: "No such file or batch of this caller's", 429: "This caller's rate limit, or too many batches at once"}


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body), status_code=status, media_type=JSON)


def _list(items: list[dict], has_more: bool) -> Response:
    return _json({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                  "last_id": items[-1]["id"] if items else None, "has_more": has_more})


def _limit(request: Request, default: int = 20) -> int:
    raw = request.query_params.get("limit")
    try:
        limit = default if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise bad_request(f"Invalid value for 'limit': {raw!r}; must be an integer in [1, {MAX_LIST_LIMIT}].", "limit")
    return limit


def _line_error(number: int, message: str, code: str = "invalid_line") -> APIError:
    return bad_request(f"Invalid 'input_file_id': line {number} of the file: {message}", "input_file_id", code)


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > METADATA_KEYS:
        raise bad_request(f"Invalid 'metadata': at most {METADATA_KEYS} keys.", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise bad_request(f"Invalid 'metadata': keys are at most {METADATA_KEY_CHARS} characters and values at "
                              f"most {METADATA_VALUE_CHARS}.", "metadata")


def add_batch_routes(app: FastAPI, state: GatewayState, link: EngineLink, limits: GatewayLimits,
                     options: BatchOptions, webhooks_enabled: bool, wake_runner) -> None:
    """The Files and Batch routes on `app`; `wake_runner()` tells the runner of new work."""

    def owner(request: Request) -> str:
        return state.owner(caller_of(request.scope))

    def file_or_404(request: Request, file_id: str) -> dict:
        row = state.jobs.get_file(owner(request), file_id)
        if row is None:
            raise not_found(f"No such File object: {file_id!r}.", "file_id")
        return row

    def batch_or_404(request: Request, batch_id: str) -> dict:
        row = state.jobs.get_batch(owner(request), batch_id)
        if row is None:
            raise not_found(f"No such Batch object: {batch_id!r}.", "batch_id")
        return row

    # ------------------------------------------------------------------ files
    @app.post(FILES_PATH, openapi_extra=FILE_FORM,
              responses=_doc("The uploaded file", FileObject, 400, 401, 413, 429, notes=NOTES))
    async def create_file(request: Request) -> Response:
        body = await read_body(request, limits.max_file_bytes)
        purpose, upload = None, None
        parts = await request.app.state.parse(form_parts, request.headers.get("content-type", ""), body,
                                              "the file and its purpose")
        for name, filename, content in parts:
            if name == "purpose":
                purpose = content.decode("utf-8", "replace").strip()
            elif name == "file":
                upload = (filename or "upload.jsonl", content)
            elif name.startswith("expires_after"):
                raise bad_request("Uploaded files are kept until deleted: 'expires_after' is not supported.",
                                  "expires_after", "unsupported_value")
            else:
                raise bad_request(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
        if purpose is None:
            raise bad_request("Missing required parameter: 'purpose'.", "purpose", "missing_required_parameter")
        if purpose != "batch":
            raise bad_request(f"Invalid value for 'purpose': {purpose!r}; this server takes 'batch' files only.",
                              "purpose", "unsupported_value")
        if upload is None or not upload[1]:
            raise bad_request("Missing required parameter: 'file' (the batch's JSONL, as a file).", "file",
                              "missing_required_parameter")
        if state.jobs.count_files(owner(request)) >= options.max_files_per_key:
            raise bad_request(f"This server keeps at most {options.max_files_per_key} files per API key; delete some "
                              f"(DELETE /v1/files/ID) first.", "file", "too_many_files")
        file_id = new_id("file-")
        await asyncio.to_thread(state.store.put, f"files/{file_id}", upload[1], "application/jsonl")
        row = state.jobs.add_file(owner(request), purpose, upload[0][:255], len(upload[1]), f"files/{file_id}",
                                  file_id)
        return _json(file_object(row))

    @app.get(FILES_PATH, responses=_doc("This caller's files", FileList, 400, 401, 413, 429, notes=NOTES))
    async def list_files(request: Request) -> Response:
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"Invalid value for 'order': {order!r}; 'asc' or 'desc'.", "order")
        rows, more = state.jobs.list_files(owner(request), request.query_params.get("purpose"),
                                           request.query_params.get("after"), _limit(request, 100),
                                           descending=order == "desc")
        return _list([file_object(r) for r in rows], more)

    @app.get(FILES_PATH + "/{file_id}", responses=_doc("The file", FileObject, 401, 404, 413, 429, notes=NOTES))
    async def retrieve_file(request: Request, file_id: str) -> Response:
        return _json(file_object(file_or_404(request, file_id)))

    @app.delete(FILES_PATH + "/{file_id}", responses=_doc("Deleted", FileDeleted, 401, 404, 413, 429, notes=NOTES))
    async def delete_file(request: Request, file_id: str) -> Response:
        row = file_or_404(request, file_id)
        state.jobs.delete_file(row["owner"], file_id)
        await asyncio.to_thread(state.store.delete, row["object"])
        return _json({"id": file_id, "object": "file", "deleted": True})

    @app.get(FILES_PATH + "/{file_id}/content", responses={
        **ok_response("The file's bytes", {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}),
        **error_responses(401, 404, 413, 429, notes=NOTES)})
    async def file_content(request: Request, file_id: str) -> Response:
        row = file_or_404(request, file_id)
        try:
            data = await asyncio.to_thread(state.store.get, row["object"])
        except KeyError:
            raise not_found(f"The content of {file_id!r} is gone from the output store.", "file_id") from None
        return Response(data, media_type="application/octet-stream")

    # ------------------------------------------------------------------ batches
    @app.post("/v1/batches", openapi_extra=BATCH_BODY,
              responses=_doc("The batch, validating", Batch, 400, 401, 413, 429, 503, notes=NOTES))
    async def create_batch(request: Request) -> Response:
        raw = await read_body(request, limits.max_body_bytes)
        try:
            req = _batch_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise decode_error(exc) from None
        if req.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"Invalid value for 'endpoint': {req.endpoint!r}; this server batches "
                              f"{', '.join(BATCH_ENDPOINTS)}.", "endpoint", "unsupported_value")
        if req.completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"Invalid value for 'completion_window': {req.completion_window!r}; supported: "
                              f"{', '.join(repr(w) for w in COMPLETION_WINDOWS)}.", "completion_window")
        if req.output_expires_after is not None:
            raise bad_request("Output files are kept until deleted: 'output_expires_after' is not supported.",
                              "output_expires_after", "unsupported_value")
        check_metadata(req.metadata)
        webhook_url = (req.metadata or {}).get(WEBHOOK_METADATA_KEY) or options.webhook_url
        if (req.metadata or {}).get(WEBHOOK_METADATA_KEY):
            if not webhooks_enabled:
                raise bad_request("Invalid 'metadata': webhook_url needs the server's webhook secret, which it does "
                                  "not have.", "metadata", "webhooks_disabled")
            if not any(webhook_url.startswith(prefix) for prefix in options.webhook_url_prefixes):
                raise bad_request("Invalid 'metadata': this server does not send webhooks to that webhook_url "
                                  "(see --webhook-url-prefix).", "metadata", "webhook_url_not_allowed")
        caller = caller_of(request.scope)
        who = owner(request)
        input_file = state.jobs.get_file(who, req.input_file_id)
        if input_file is None:
            raise bad_request(f"Invalid 'input_file_id': no file {req.input_file_id!r}.", "input_file_id")
        if input_file["purpose"] != "batch":
            raise bad_request(f"Invalid 'input_file_id': {req.input_file_id!r} is not a 'batch' file.",
                              "input_file_id")
        await link.client()  # 503 without an engine: its Welcome names the model the bodies may ask for
        try:
            data = await asyncio.to_thread(state.store.get, input_file["object"])
        except KeyError:
            raise bad_request(f"Invalid 'input_file_id': the content of {req.input_file_id!r} is gone.",
                              "input_file_id") from None
        lines, refused = read_lines(data, req.endpoint, options.max_batch_lines, link)
        row = state.jobs.create_batch(
            owner=who, caller=caller, endpoint=req.endpoint, input_file_id=req.input_file_id,
            completion_window=req.completion_window, window_s=COMPLETION_WINDOWS[req.completion_window],
            metadata=req.metadata, base_url=str(request.base_url), webhook_url=webhook_url, lines=lines,
            refused=refused, max_active=options.max_active_batches)
        if row is None:
            raise APIError(429, f"This server runs at most {options.max_active_batches} batches at once; retry when "
                                f"one has ended.", type="rate_limit_error", code="too_many_batches",
                           headers={"Retry-After": "60"})
        wake_runner()
        return _json(batch_object(row))

    @app.get("/v1/batches", responses=_doc("This caller's batches, newest first", BatchList, 400, 401, 413, 429,
                                            notes=NOTES))
    async def list_batches(request: Request) -> Response:
        rows, more = state.jobs.list_batches(owner(request), request.query_params.get("after"), _limit(request))
        return _list([batch_object(r) for r in rows], more)

    @app.get("/v1/batches/{batch_id}", responses=_doc("The batch", Batch, 401, 404, 413, 429, notes=NOTES))
    async def retrieve_batch(request: Request, batch_id: str) -> Response:
        return _json(batch_object(batch_or_404(request, batch_id)))

    @app.post("/v1/batches/{batch_id}/cancel",
              responses=_doc("The batch, cancelling", Batch, 401, 404, 409, 413, 429, notes=NOTES))
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        row = batch_or_404(request, batch_id)
        row = state.jobs.cancel_batch(row["owner"], batch_id)
        if row["status"] in ("completed", "failed", "expired"):
            raise APIError(409, f"Cannot cancel a batch that is {row['status']}.", param="batch_id",
                           code="batch_not_cancellable")
        wake_runner()
        return _json(batch_object(row))

    # ------------------------------------------------------------------ signed links
    @app.get(LOCAL_LINK_PREFIX + "{name:path}", responses={
        **ok_response("The image or file", {"image/png": {"schema": {"type": "string", "format": "binary"}}}),
        **error_responses(403, 404, notes={404: "No such output (it may have expired)"})})
    async def output_link(request: Request, name: str) -> Response:
        store = state.store
        query = request.query_params
        try:
            checked_name(name)
        except ValueError:
            raise not_found("No such output.") from None
        if not isinstance(store, LocalStore) or not store.signer.valid(name, query.get("expires", ""),
                                                                       query.get("signature", "")):
            raise APIError(403, "This link is invalid or has expired.", code="invalid_link")
        try:
            data = await asyncio.to_thread(store.get, name)
        except KeyError:
            raise not_found("No such output (it may have expired).") from None
        media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return Response(data, media_type=media_type, headers={"cache-control": "private, max-age=300"})


def read_lines(data: bytes, endpoint: str, max_lines: int, link: EngineLink) -> tuple[list[tuple[str, str]],
                                                                                   dict[int, str]]:
    """An input file's lines as (custom_id, body JSON) and the error lines of those whose
    body the endpoint refuses, by index; a malformed file is a 400 naming the line."""
    lines: list[tuple[str, str]] = []
    refused: dict[int, str] = {}
    seen: set[str] = set()
    welcome = link.welcome
    for number, text in enumerate(data.splitlines(), start=1):
        if not text.strip():
            continue
        if len(lines) >= max_lines:
            raise bad_request(f"Invalid 'input_file_id': the file has more than {max_lines} requests, this "
                              f"server's limit per batch.", "input_file_id", "too_many_requests")
        try:
            entry = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            raise _line_error(number, "not a JSON object.") from None
        if not isinstance(entry, dict):
            raise _line_error(number, "not a JSON object.")
        unknown = set(entry) - {"custom_id", "method", "url", "body"}
        if unknown:
            raise _line_error(number, f"unknown field {sorted(unknown)[0]!r}.")
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
            raise _line_error(number, f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters.")
        if custom_id in seen:
            raise _line_error(number, f"the custom_id {custom_id!r} is used twice; each request needs its own.",
                              "duplicate_custom_id")
        seen.add(custom_id)
        if entry.get("method") != "POST":
            raise _line_error(number, "'method' must be 'POST'.")
        if entry.get("url") != endpoint:
            raise _line_error(number, f"'url' must be the batch's endpoint, {endpoint!r}.", "mismatched_url")
        body = entry.get("body")
        if not isinstance(body, dict):
            raise _line_error(number, "'body' must be a JSON object (the request's body).")
        index = len(lines)
        try:
            if body.get("stream"):
                raise bad_request("Batch requests cannot stream.", "stream", "unsupported_value")
            gen = parse_generation(json.dumps(body).encode(), link.models)
            check_fits(gen, welcome.output_budget_bytes, welcome.native_size)
            if body.get("seed") is None:  # chosen once, so that a line run again after a restart is the same image
                body = {**body, "seed": gen.params[0].seed}
        except APIError as error:
            refused[index] = refused_line(custom_id, error)
        lines.append((custom_id, json.dumps(body)))
    if not lines:
        raise bad_request("Invalid 'input_file_id': the file has no requests.", "input_file_id", "empty_file")
    return lines, refused
