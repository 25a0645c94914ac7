"""The gateway's options, each a dataclass field with its flag (engine.flags):

- `GatewayLimits`: what one app enforces on its callers (`create_app`);
- `LinkOptions`: how the app reaches its engine (`EngineLink`'s defaults);
- `ServerOptions`: which engine `python -m frontend http` fronts and where it listens;
- `StoreOptions`: the state dir (batch jobs) and the output store (files, image links);
- `BatchOptions`: the Batch API's limits and its webhooks.

`python -m frontend http` offers them all; `frontend.ray_app` offers some of them to
every replica. No server imports here: `python -m frontend` builds its parser from
this module without paying for FastAPI.
"""
from __future__ import annotations

import dataclasses

from engine.flags import cli
from engine.protocol import FRAME_FIELDS, MAX_INPUT_BYTES

# JSON bodies: a prompt is at most the engine's message limit (MAX_MESSAGE_BYTES) anyway
MAX_BODY_BYTES = 1 << 20
# the edits form: every frame field (an image, a mask) at the engine's largest, and a JSON body's worth of text
MAX_UPLOAD_BYTES = len(FRAME_FIELDS) * MAX_INPUT_BYTES + MAX_BODY_BYTES
# a batch input file: thousands of lines of JSON bodies
MAX_FILE_BYTES = 64 << 20
# body bytes held at once: one caller, two full edit forms; all callers, sixteen
MAX_CALLER_BODY_BYTES = 2 * MAX_UPLOAD_BYTES
MAX_BODY_BYTES_TOTAL = 16 * MAX_UPLOAD_BYTES
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass
class GatewayLimits:
    """What one app allows each caller (frontend.http.callers): API keys, body sizes, rate."""

    api_keys: list[str] = dataclasses.field(default_factory=list, metadata=cli(
        "--api-key", metavar="KEY", dest="api_keys",
        help="require 'Authorization: Bearer KEY' on every /v1 route; repeat for several keys, each its own "
             "caller; /health and /metrics stay open. Flags show in process lists: prefer DIFFSLOT_API_KEYS "
             "(comma-separated)"))
    max_body_bytes: int = dataclasses.field(default=MAX_BODY_BYTES, metadata=cli(
        "--max-body-bytes", metavar="B", help="largest request body; larger ones get 413"))
    max_upload_bytes: int = dataclasses.field(default=MAX_UPLOAD_BYTES, metadata=cli(
        "--max-upload-bytes", metavar="B",
        help="largest /v1/images/edits form (image and mask files, each up to the engine's default "
             "--max-input-bytes); larger ones get 413"))
    rate_limit: float = dataclasses.field(default=0.0, metadata=cli(
        "--rate-limit", metavar="R",
        help="requests per second per caller (API key, else client address); 0 = no limit"))
    rate_burst: float | None = dataclasses.field(default=None, metadata=cli(
        "--rate-burst", metavar="N",
        help="requests a caller may send at once before the rate applies, the bucket's size (default: one "
             "second's worth, at least 1)"))
    key_classes: list[str] = dataclasses.field(default_factory=list, metadata=cli(
        "--key-class", metavar="KEY=CLASS[:CEILING]", dest="key_classes",
        help="the priority class (batch, default, interactive, or an integer) of an API key's requests, and the "
             "most it may ask for (default: the larger of CLASS and default); KEY '*' sets it for every other "
             "caller, otherwise default:default. Repeatable; DIFFSLOT_KEY_CLASSES takes the same, comma-separated"))
    max_file_bytes: int = dataclasses.field(default=MAX_FILE_BYTES, metadata=cli(
        "--max-file-bytes", metavar="B", help="largest file upload (POST /v1/files, a batch's input); larger get 413"))
    body_timeout_s: float = dataclasses.field(default=30.0, metadata=cli(
        "--body-timeout", metavar="S",
        help="seconds a request body may pause between two of its chunks; past it 408 and the body is dropped"))
    max_caller_body_bytes: int = dataclasses.field(default=MAX_CALLER_BODY_BYTES, metadata=cli(
        "--max-caller-body-bytes", metavar="B",
        help="request body bytes one caller's requests may hold at once (counted as they arrive, before they "
             "are buffered, until the request ends); beyond it 429. A caller holding none may always send one "
             "body up to its route's limit"))
    max_body_bytes_total: int = dataclasses.field(default=MAX_BODY_BYTES_TOTAL, metadata=cli(
        "--max-body-bytes-total", metavar="B",
        help="request body bytes all callers' requests may hold at once; beyond it 503"))


@dataclasses.dataclass
class LinkOptions:
    """How the app reaches its engine (frontend.http.link.EngineLink)."""

    connect_timeout_s: float = dataclasses.field(default=10.0, metadata=cli(
        "--connect-timeout", metavar="S", dest="connect_timeout",
        help="seconds one handshake attempt waits for the engine; the gateway serves 503s and keeps trying in the "
             "background while it has no engine"))
    model_name: str | None = dataclasses.field(default=None, metadata=cli(
        "--model-name", help="the model id to advertise (default: the engine's model name)"))
    max_callers: int = dataclasses.field(default=64, metadata=cli(
        "--max-callers", metavar="N", help="callers with their own engine connection at once; more get 429"))


@dataclasses.dataclass
class ServerOptions:
    """Which engine `python -m frontend http` fronts, and where and how it listens."""

    engine: str | None = dataclasses.field(default=None, metadata=cli(
        "--engine", metavar="ADDR", help="the engine's address (default: the local engine's ipc socket)"))
    host: str = dataclasses.field(default="127.0.0.1", metadata=cli(
        "--host", help="interface to bind (0.0.0.0 to expose it, with --api-key and TLS in front)"))
    port: int = dataclasses.field(default=8000, metadata=cli("--port", help="port to bind"))
    log_level: str = dataclasses.field(default="info", metadata=cli(
        "--log-level", choices=LOG_LEVELS, help="the gateway's and uvicorn's log level"))
    access_log: bool = dataclasses.field(default=False, metadata=cli(
        "--access-log", help="log every request (uvicorn's access log)"))
    max_connections: int = dataclasses.field(default=900, metadata=cli(
        "--max-connections", metavar="N",
        help="open HTTP connections at once; a connection beyond it is answered 503 and closed before anything "
             "is read (the open-files soft limit is raised to the hard one at start, and must exceed this)"))
    max_connections_per_address: int = dataclasses.field(default=256, metadata=cli(
        "--max-connections-per-address", metavar="N",
        help="open connections from one client address, counted before authentication; beyond it 503 and "
             "closed (0: no limit; behind a reverse proxy every caller has the proxy's address)"))
    header_timeout_s: float = dataclasses.field(default=10.0, metadata=cli(
        "--header-timeout", metavar="S",
        help="seconds a connection has to send a request's headers, from its first byte (or its opening); "
             "past it the connection is closed"))
    keep_alive_s: float = dataclasses.field(default=5.0, metadata=cli(
        "--keep-alive", metavar="S", help="seconds an idle kept-alive connection stays open"))


@dataclasses.dataclass
class StoreOptions:
    """Where the gateway keeps batch jobs (SQLite) and outputs (files, linked images)."""

    state_dir: str | None = dataclasses.field(default=None, metadata=cli(
        "--state-dir", metavar="DIR",
        help="batch jobs' database and the local output store; gateways sharing it share the jobs (default: "
             "$XDG_DATA_HOME/diffslot/gateway)"))
    output_store: str | None = dataclasses.field(default=None, metadata=cli(
        "--output-store", metavar="DIR|s3://BUCKET/PREFIX",
        help="where files and images asked for with response_format=url go: a directory, or S3-compatible "
             "object storage (needs boto3: the [s3] extra) (default: STATE_DIR/outputs)"))
    s3_endpoint_url: str | None = dataclasses.field(default=None, metadata=cli(
        "--s3-endpoint-url", metavar="URL", help="the S3 API's URL (MinIO, Ceph, ...; default: AWS)"))
    s3_region: str | None = dataclasses.field(default=None, metadata=cli(
        "--s3-region", metavar="REGION", help="the bucket's region (default: boto3's configuration)"))
    link_ttl_s: float = dataclasses.field(default=3600.0, metadata=cli(
        "--link-ttl", metavar="S", dest="link_ttl",
        help="seconds an image link (response_format=url) stays valid; local images are deleted after it"))
    public_url: str | None = dataclasses.field(default=None, metadata=cli(
        "--public-url", metavar="URL",
        help="the gateway's URL as clients reach it, for links to the local store (default: the request's own)"))


@dataclasses.dataclass
class BatchOptions:
    """The Batch API's bounds and its webhooks."""

    max_batch_lines: int = dataclasses.field(default=5000, metadata=cli(
        "--max-batch-lines", metavar="N", help="requests in one batch's input file; more get 400"))
    max_files_per_key: int = dataclasses.field(default=1000, metadata=cli(
        "--max-files-per-key", metavar="N",
        help="files one API key (or, without keys, everyone) may keep, outputs included; past it uploads get 400 "
             "until some are deleted"))
    max_active_batches: int = dataclasses.field(default=32, metadata=cli(
        "--max-active-batches", metavar="N",
        help="batches not yet ended, over all callers of the state dir; past it batches.create gets 429"))
    batch_concurrency: int = dataclasses.field(default=8, metadata=cli(
        "--batch-concurrency", metavar="N",
        help="batch lines this gateway runs on its engine at once (each at batch priority)"))
    webhook_url: str | None = dataclasses.field(default=None, metadata=cli(
        "--webhook-url", metavar="URL", help="POST a signed event here when any batch ends (needs a webhook secret)"))
    webhook_url_prefixes: list[str] = dataclasses.field(default_factory=list, metadata=cli(
        "--webhook-url-prefix", metavar="PREFIX", dest="webhook_url_prefixes",
        help="allow batches.create's metadata webhook_url when it starts with PREFIX (repeatable); without it a "
             "caller cannot make the gateway POST anywhere"))
    webhook_secret_file: str | None = dataclasses.field(default=None, metadata=cli(
        "--webhook-secret-file", metavar="FILE",
        help="the secret webhooks are signed with (whsec_... or plain text); or DIFFSLOT_WEBHOOK_SECRET"))
    webhook_attempts: int = dataclasses.field(default=8, metadata=cli(
        "--webhook-attempts", metavar="N", help="deliveries tried per event before giving up"))
    webhook_backoff_s: float = dataclasses.field(default=1.0, metadata=cli(
        "--webhook-backoff", metavar="S", dest="webhook_backoff",
        help="seconds before the first retry; doubled for each next one (at most 5 minutes)"))
