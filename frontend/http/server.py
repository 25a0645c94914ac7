"""`python -m frontend http`: serve the images API with uvicorn.

    python -m frontend http --engine ipc:///run/user/1000/diffslot/engine.sock --port 8000

Binds 127.0.0.1 unless told otherwise (`--host 0.0.0.0` to expose it; put TLS and
authentication in front). SIGTERM / Ctrl-C shut it down gracefully: uvicorn stops
accepting, in-flight responses finish, then the engine connection closes (the engine
cancels whatever of ours is left).
"""
from __future__ import annotations

import argparse
import logging
import sys


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
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    return ap


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m frontend http",
                                                 description="OpenAI-compatible images API for a diffslot engine"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from frontend.http.app import create_app
    from frontend.http.link import EngineLink

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    link = EngineLink(args.engine, connect_timeout_s=args.connect_timeout, model_name=args.model_name)
    app = create_app(link)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def main(argv=None) -> int:
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
