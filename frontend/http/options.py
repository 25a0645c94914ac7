"""The gateway's options, each a dataclass field with its flag (engine.flags):

- `GatewayLimits`: what one app enforces on its callers (`create_app`);
- `LinkOptions`: how the app reaches its engine (`EngineLink`'s defaults);
- `ServerOptions`: which engine `python -m frontend http` fronts and where it listens.

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
