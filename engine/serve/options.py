"""The engine process's configuration (`ProcConfig`), its flags, and the files its
secrets come from.

ProcConfig's fields that are flags carry `cli(...)` metadata (engine.flags), so each
default is written once, on its field. Secrets are read from files (`--auth-token-file`,
`--curve-secret-key`) by `proc_config_from_args`, never taken on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import stat
import sys

from engine.flags import add_config_arguments, cli, config_from_args
from engine.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger("diffslot.engine")


@dataclasses.dataclass
class ProcConfig:
    """Everything the engine process around the core is told (sockets, lifecycle, limits, auth)."""

    address: str
    allow_remote_bind: bool = dataclasses.field(default=False, metadata=cli(
        "--allow-remote-bind", help="allow a non-loopback tcp address (use --curve-secret-key or "
                                    "--auth-token-file with it)"))
    heartbeat_interval_s: float = dataclasses.field(default=0.5, metadata=cli(
        "--heartbeat-interval", "--heartbeat", metavar="S", help="heartbeat period, both directions"))
    peer_timeout_s: float = dataclasses.field(default=3.0, metadata=cli(
        "--peer-timeout", metavar="S", help="silence after which a client is written off (clients use it too)"))
    output_budget_bytes: int = dataclasses.field(default=64 << 20, metadata=cli(
        "--output-budget-bytes", "--output-budget", metavar="B",
        help="per client: output bytes reserved (final images and previews), unsent, or sent and not "
             "acknowledged; a Submit beyond it is Rejected with retry_after_s"))
    sndhwm: int = dataclasses.field(default=256, metadata=cli(
        "--sndhwm", metavar="N", help="messages ZMQ queues per client before the engine keeps them in its backlog"))
    max_backlog_messages: int = dataclasses.field(default=4096, metadata=cli(
        "--max-backlog-messages", metavar="N", help="per client: messages held back for a client that does not "
                                                     "read; beyond it the client is written off"))
    metrics_port: int | None = dataclasses.field(default=None, metadata=cli(
        "--metrics-port", metavar="P", help="serve Prometheus /metrics on 127.0.0.1:P"))
    model_name: str = ""  # what Welcome.model says, when the core's ModelInfo has no name
    step_timeout_s: float = dataclasses.field(default=120.0, metadata=cli(
        "--step-timeout", metavar="S",
        help="a denoising step running longer ends the engine with EngineDead to every client and exit code 3, "
             "so a supervisor restarts it; health reports dead when the busy loop is stuck this long "
             "(0: no watchdog, health uses 120)"))
    drain_timeout_s: float = dataclasses.field(default=30.0, metadata=cli(
        "--drain-timeout", metavar="S",
        help="on SIGTERM, requests in flight get this long to finish, then the rest are canceled; a second "
             "SIGTERM or a Ctrl-C stops at once"))
    max_queue_per_client: int | None = dataclasses.field(default=None, metadata=cli(
        "--max-queue-per-client", metavar="N",
        help="requests one client may have waiting for a slot, so no client fills the queue alone (default: no "
             "cap beyond --max-queue; set it when several clients share an engine: the HTTP server and Ray "
             "replicas are one client each)"))
    max_backlog_bytes: int = dataclasses.field(default=512 << 20, metadata=cli(
        "--max-backlog-bytes", metavar="B",
        help="output bytes held for all clients together (reserved, unsent or unacknowledged, previews "
             "included); beyond it a client over its fair share is Rejected with retry_after_s"))
    max_pending_per_client: int = dataclasses.field(default=64, metadata=cli(
        "--max-pending-per-client", metavar="N",
        help="messages of one client waiting for the busy loop; beyond it its Submit and Stats are Rejected "
             "with retry_after_s by the IO thread (Cancel and Delivered still pass, up to 16x this, then the "
             "client is written off)"))
    max_client_frames_per_s: float = dataclasses.field(default=5000.0, metadata=cli(
        "--max-client-frames-per-s", metavar="R",
        help="frames one client may send a second (a quarter of a second's worth at once); past it the engine "
             "stops reading that client until it is back within the rate, so the client's own sends block "
             "(a request costs a client two or three frames)"))
    max_input_bytes_per_client: int = dataclasses.field(default=256 << 20, metadata=cli(
        "--max-input-bytes-per-client", metavar="B",
        help="image input bytes one client's requests may hold from their arrival until they end (each image "
             "and mask counted as its encoded bytes plus its decoded pixels, 4 bytes each); a Submit beyond it "
             "is Rejected with retry_after_s by the IO thread. A client holding nothing is always let one "
             "request in, however large"))
    max_input_bytes_total: int = dataclasses.field(default=1 << 30, metadata=cli(
        "--max-input-bytes-total", metavar="B",
        help="the same, all clients together; beyond it a Submit with image inputs is Rejected with "
             "retry_after_s (one request is always let in when nothing is held)"))
    rcvhwm: int = dataclasses.field(default=64, metadata=cli(
        "--rcvhwm", metavar="N",
        help="messages ZMQ takes in per client before that client's sends block (the transport's own bound, "
             "in messages: with image inputs each may carry up to two frames of --max-input-bytes)"))
    inputs_per_iteration: int = 64  # client messages the busy loop handles between two steps, round robin
    inputs_per_client_per_iteration: int = 4  # of which one client's: a flood delays the others by this many
    max_clients: int = dataclasses.field(default=1024, metadata=cli(
        "--max-clients", metavar="N", help="connected clients; a Hello beyond it is Rejected with retry_after_s"))
    auth_token: str = ""  # required in Hello when set (from --auth-token-file)
    curve_public_key: bytes = b""  # CURVE: the engine's key pair (from --curve-secret-key); b"": no CURVE
    curve_secret_key: bytes = b""
    curve_authorized_keys: str | None = dataclasses.field(default=None, metadata=cli(
        "--curve-authorized-keys", metavar="DIR",
        help="with --curve-secret-key: accept only clients whose public key is in DIR (zmq.auth certificate "
             "files, *.key); default: any client that knows the engine's public key"))
    max_message_bytes: int = dataclasses.field(default=MAX_MESSAGE_BYTES, metadata=cli(
        "--max-message-bytes", metavar="B", help="larger client messages are Rejected naming this limit"))
    coalesce_progress: bool = True  # one progress message per client per step (False: one per request)


# --------------------------------------------------------------------- the engine process's flags


@dataclasses.dataclass
class SecretFiles:
    """Where the engine process's secrets are read from: the command line names the files,
    never the secrets themselves (command lines show in process lists)."""

    auth_token_file: str | None = dataclasses.field(default=None, metadata=cli(
        "--auth-token-file", metavar="PATH",
        help="require this shared token (the file's first line) in every client's Hello; clients pass "
             "Client(address, token=...) or $DIFFSLOT_TOKEN. Sent in clear text: over a network prefer "
             "--curve-secret-key"))
    curve_secret_key: str | None = dataclasses.field(default=None, metadata=cli(
        "--curve-secret-key", metavar="FILE",
        help="encrypt and authenticate the ZeroMQ connection with CURVE: FILE is the engine's secret certificate "
             "(zmq.auth.create_certificates writes NAME.key_secret); clients need the public one (NAME.key)"))


def add_proc_arguments(ap: argparse.ArgumentParser, *, defaults: dict | None = None) -> None:
    """ProcConfig's flags (all but --address), and the files its secrets come from."""
    group = ap.add_argument_group("engine process")
    add_config_arguments(group, ProcConfig, defaults=defaults)
    add_config_arguments(group, SecretFiles)


def read_token(path: str) -> str:
    """The token in `path` (its first line, stripped); warns if others can read it."""
    _warn_if_shared(path, "auth token file")
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if len(token) < 16:
        raise ValueError(f"auth token in {path} is shorter than 16 characters")
    return token


def read_curve_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) of a zmq.auth secret certificate file."""
    import zmq.auth

    _warn_if_shared(path, "CURVE secret key file")
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path} holds no secret key (pass the NAME.key_secret file, not NAME.key)")
    return public, secret


def _warn_if_shared(path: str, what: str) -> None:
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s is readable by other users (chmod 600 it)", what, path)


def proc_config_from_args(args: argparse.Namespace, **fields) -> ProcConfig:
    """A ProcConfig from the flags above and the caller's own fields (address, ...).
    Raises ValueError (to be reported as a usage error) for an unusable secret file."""
    files = config_from_args(SecretFiles, args)
    if files.auth_token_file:
        try:
            fields["auth_token"] = read_token(files.auth_token_file)
        except OSError as exc:
            raise ValueError(f"cannot read --auth-token-file: {exc}") from None
    if files.curve_secret_key:
        try:
            fields["curve_public_key"], fields["curve_secret_key"] = read_curve_secret(files.curve_secret_key)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot use --curve-secret-key: {exc}") from None
    config = config_from_args(ProcConfig, args, **fields)
    if config.curve_authorized_keys and not config.curve_secret_key:
        raise ValueError("--curve-authorized-keys needs --curve-secret-key")
    if config.curve_authorized_keys and not os.path.isdir(config.curve_authorized_keys):
        raise ValueError(f"--curve-authorized-keys {config.curve_authorized_keys}: not a directory")
    if config.allow_remote_bind and not (config.auth_token or config.curve_secret_key):
        message = ("WARNING: --allow-remote-bind without --curve-secret-key or --auth-token-file: anyone who can "
                   f"reach {config.address} can submit work and read results")
        print(message, file=sys.stderr, flush=True)
        log.warning("%s", message)
    return config
