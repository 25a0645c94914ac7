"""`python -m frontend http`: serve the images API with uvicorn.

    python -m frontend http --engine ipc:///run/user/1000/diffslot/engine.sock --port 8000

Binds 127.0.0.1 unless told otherwise (`--host 0.0.0.0` to expose it, with
`--api-key` and TLS in front). SIGTERM / Ctrl-C shut it down gracefully: uvicorn stops
accepting, in-flight responses finish, then the engine connections close (the engine
cancels whatever of ours is left).
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

log = logging.getLogger("diffslot.http")


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--engine", default=None, metavar="ADDR",
                    help="the engine's address (default: the local engine's ipc socket)")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                    help="seconds one handshake attempt waits for the engine; the gateway serves 503s "
                         "and keeps trying in the background while it has no engine")
    ap.add_argument("--model-name", default=None,
                    help="the model id to advertise (default: the engine's model name)")
    ap.add_argument("--api-key", action="append", default=[], metavar="KEY", dest="api_keys",
                    help="require 'Authorization: Bearer KEY' on every /v1 route; repeat for several keys, each "
                         "its own caller; /health and /metrics stay open. Flags show in process lists: prefer "
                         "DIFFSLOT_API_KEYS (comma-separated)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="B",
                    help="largest request body; larger ones get 413 (default 1 MiB)")
    ap.add_argument("--max-upload-bytes", type=int, default=33 << 20, metavar="B",
                    help="largest /v1/images/edits form (image and mask files); larger ones get 413 "
                         "(default 33 MiB: two of the engine's 16 MiB inputs)")
    ap.add_argument("--rate-limit", type=float, default=0.0, metavar="R",
                    help="requests per second per caller (API key, else client address); 0 = no limit")
    ap.add_argument("--rate-burst", type=float, default=None, metavar="N",
                    help="requests a caller may send at once before the rate applies, the bucket's size "
                         "(default: one second's worth, at least 1)")
    ap.add_argument("--max-callers", type=int, default=64, metavar="N",
                    help="callers with their own engine connection at once; more get 429 (default 64)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    return ap


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m frontend http",
                                                 description="OpenAI-compatible images API for a diffslot engine"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from frontend.http.app import create_app
    from frontend.http.callers import api_keys
    from frontend.http.link import EngineLink

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    keys = api_keys(args.api_keys)
    if not keys and not _loopback(args.host):
        log.warning("serving on %s without --api-key: anyone who reaches the port can generate images", args.host)
    link = EngineLink(args.engine, connect_timeout_s=args.connect_timeout, model_name=args.model_name,
                      max_callers=args.max_callers)
    app = create_app(link, api_keys=keys, max_body_bytes=args.max_body_bytes, rate_limit=args.rate_limit,
                     rate_burst=args.rate_burst, max_upload_bytes=args.max_upload_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def main(argv=None) -> int:
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
