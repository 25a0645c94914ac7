"""The engine process's own flags (sockets, lifecycle, limits, auth), shared by
`python -m engine serve` and the tests' fake-core engine."""
from __future__ import annotations

import argparse
import logging
import os
import stat
import sys

log = logging.getLogger("diffslot.engine")


def add_proc_arguments(ap: argparse.ArgumentParser, *, defaults: dict | None = None) -> None:
    d = {"step_timeout": 120.0, "drain_timeout": 30.0, "max_queue_per_client": None,
         "max_backlog_bytes": 512 << 20, **(defaults or {})}
    ap.add_argument("--step-timeout", type=float, default=d["step_timeout"], metavar="S",
                    help="a denoising step running longer ends the engine with EngineDead to every client and "
                         "exit code 3, so a supervisor restarts it (0: no watchdog; default %(default)s)")
    ap.add_argument("--drain-timeout", type=float, default=d["drain_timeout"], metavar="S",
                    help="on SIGTERM, requests in flight get this long to finish, then the rest are canceled "
                         "(default %(default)s); a second SIGTERM or a Ctrl-C stops at once")
    ap.add_argument("--max-queue-per-client", type=int, default=d["max_queue_per_client"], metavar="N",
                    help="requests one client may have waiting for a slot, so no client fills the queue alone "
                         "(default: no cap beyond --max-queue; set it when several clients share an engine: the "
                         "HTTP server and Ray replicas are one client each)")
    ap.add_argument("--max-backlog-bytes", type=int, default=d["max_backlog_bytes"], metavar="B",
                    help="output bytes held for all clients together (reserved, unsent or unacknowledged); "
                         "beyond it a client over its fair share is Rejected with retry_after_s "
                         "(default %(default)s)")
    ap.add_argument("--auth-token-file", default=None, metavar="PATH",
                    help="require this shared token (the file's first line) in every client's Hello; clients "
                         "pass Client(address, token=...) or $DIFFSLOT_TOKEN")


def read_token(path: str) -> str:
    """The token in `path` (its first line, stripped); warns if others can read it."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("auth token file %s is readable by other users (chmod 600 it)", path)
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if len(token) < 16:
        raise ValueError(f"auth token in {path} is shorter than 16 characters")
    return token


def proc_config_from_args(args: argparse.Namespace, **fields):
    """A ProcConfig from the flags above and the caller's own fields (address, ...).
    Raises ValueError (to be reported as a usage error) for an unusable token file."""
    from engine.serve.proc import ProcConfig

    token = ""
    if args.auth_token_file:
        try:
            token = read_token(args.auth_token_file)
        except OSError as exc:
            raise ValueError(f"cannot read --auth-token-file: {exc}") from None
    per_client = args.max_queue_per_client
    config = ProcConfig(step_timeout_s=args.step_timeout, drain_timeout_s=args.drain_timeout,
                        max_queue_per_client=per_client, max_backlog_bytes=args.max_backlog_bytes,
                        auth_token=token, **fields)
    if config.allow_remote_bind and not token:
        message = ("WARNING: --allow-remote-bind without --auth-token-file: anyone who can reach "
                   f"{config.address} can submit work and read results; pass --auth-token-file")
        print(message, file=sys.stderr, flush=True)
        log.warning("%s", message)
    return config
