"""`python -m frontend http`: serve the images API with uvicorn.

    python -m frontend http --engine ipc:///run/user/1000/diffslot/engine.sock --port 8000

Binds 127.0.0.1 unless told otherwise (`--host 0.0.0.0` to expose it, with
`--api-key` and TLS in front). SIGTERM / Ctrl-C shut it down gracefully: uvicorn stops
accepting, in-flight responses finish, then the engine connections close (the engine
cancels whatever of ours is left).

Connections are bounded before anything is read (frontend.http.connections:
`--max-connections`, `--max-connections-per-address`, `--header-timeout`,
`--keep-alive`), and the open-files soft limit is raised to the hard one at start, so
that the connection limit, not the file table, is what a flood of connections meets.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import resource
import sys

from engine.flags import add_config_arguments, config_from_args
from frontend.http.options import BatchOptions, GatewayLimits, LinkOptions, ServerOptions, StoreOptions

log = logging.getLogger("diffslot.http")


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for options in (ServerOptions, LinkOptions, GatewayLimits):
        add_config_arguments(ap, options)
    add_config_arguments(ap.add_argument_group("state and outputs"), StoreOptions)
    add_config_arguments(ap.add_argument_group("batch jobs and webhooks"), BatchOptions)
    return ap


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


#: files the gateway keeps open besides its connections (engine sockets, the state dir, logs, threads' pipes)
SPARE_FILES = 100


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one (no privilege needed); the new
    soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 62
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft and _set_nofile(target, hard):
        return target
    return soft


def _set_nofile(soft: int, hard: int) -> bool:
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return True
    except (ValueError, OSError):
        return False


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m frontend http",
                                                 description="OpenAI-compatible images API for a diffslot engine"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from frontend.http.app import create_app
    from frontend.http.callers import api_keys
    from frontend.http.link import EngineLink
    from frontend.http.priorities import key_class_specs

    server = config_from_args(ServerOptions, args)
    limits = config_from_args(GatewayLimits, args, api_keys=list(api_keys(args.api_keys)),
                              key_classes=key_class_specs(args.key_classes))
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not limits.api_keys and not _loopback(server.host):
        log.warning("serving on %s without --api-key: anyone who reaches the port can generate images", server.host)
    link = EngineLink(server.engine, **dataclasses.asdict(config_from_args(LinkOptions, args)))
    try:
        app = create_app(link, limits, store=config_from_args(StoreOptions, args),
                         batch=config_from_args(BatchOptions, args))
    except (ValueError, RuntimeError, OSError) as exc:  # a flag that cannot work: say which, before binding
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from frontend.http.connections import guarded_protocol

    open_files = raise_open_files_limit()
    if server.max_connections + SPARE_FILES > open_files:
        log.warning("--max-connections %d is close to the open-files limit of %d: a flood of connections may "
                    "exhaust it before the connection limit applies (raise `ulimit -Hn`)", server.max_connections,
                    open_files)
    protocol = guarded_protocol(server.max_connections, server.max_connections_per_address, server.header_timeout_s)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                            access_log=server.access_log, timeout_graceful_shutdown=30, http=protocol,
                            timeout_keep_alive=server.keep_alive_s)
    uvicorn_server = uvicorn.Server(config)
    uvicorn_server.run()
    return 0 if uvicorn_server.started else 1


def main(argv=None) -> int:
    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
