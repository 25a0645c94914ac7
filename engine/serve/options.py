"""The engine process's configuration (`ProcConfig`) and the command-line flags made from
configuration dataclasses, so that each default is written once, on its field.

A field that is a flag carries `cli(...)` metadata (its flag names and help);
`add_config_arguments` turns those fields into argparse options whose defaults are the
dataclass's, and `config_from_args` builds the dataclass back from the parsed flags.
`ProcConfig` (here), `DecodeConfig` (engine.decode.stage) and `CoreConfig`
(engine.core.config, whose flags' names and help `engine.__main__` supplies) all go
through it. Secrets are read from files (`--auth-token-file`, `--curve-secret-key`) by
`proc_config_from_args`, never taken on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import stat
import sys
import types
import typing

from engine.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger("diffslot.engine")


def flag(*flags: str, help: str, metavar: str | None = None, choices: typing.Sequence[str] | None = None,
         negate: bool = False, dest: str | None = None) -> dict:
    """A field's flag: `flags[0]` (the others are aliases), parsed into `dest` (default:
    the field's name). `negate`: a bool field that defaults to True, turned off by the flag."""
    return {"flags": flags, "help": help, "metavar": metavar, "choices": choices, "negate": negate, "dest": dest}


def cli(*flags: str, **options) -> dict:
    """Field metadata making the field a flag (see `flag`)."""
    return {"cli": flag(*flags, **options)}


def _spec(field: dataclasses.Field, specs: dict[str, dict] | None) -> dict | None:
    return (specs or {}).get(field.name) or field.metadata.get("cli")


def _dest(field: dataclasses.Field, spec: dict) -> str:
    return spec.get("dest") or field.name


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


# --------------------------------------------------------------------- flags from fields


def _flag_type(hint) -> type:
    """int for `int | None`, etc."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def add_config_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                         specs: dict[str, dict] | None = None, defaults: dict | None = None,
                         only: typing.Collection[str] | None = None) -> None:
    """One option per field of `cls` that has `cli` metadata (or an entry in `specs`, for a
    dataclass defined elsewhere), with dest = the field's name and the field's default
    (or `defaults[name]`, for a caller such as the tests' fake engine that wants others)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        spec = _spec(field, specs)
        if spec is None or (only is not None and field.name not in only):
            continue
        default = (defaults or {}).get(field.name, field.default)
        kind = _flag_type(hints[field.name])
        help_text = spec["help"]
        if kind is bool:
            action = "store_false" if spec.get("negate") else "store_true"
            parser.add_argument(*spec["flags"], dest=_dest(field, spec), action=action, default=default,
                                help=help_text)
            continue
        if default is not None:
            help_text += " (default %(default)s)"
        parser.add_argument(*spec["flags"], dest=_dest(field, spec), type=kind, default=default,
                            metavar=spec.get("metavar"), choices=spec.get("choices"), help=help_text)


def config_from_args(cls: type, args: argparse.Namespace, *, specs: dict[str, dict] | None = None, **fields):
    """`cls` from the parsed flags of its fields (those `add_config_arguments` made), and
    `fields` for the rest."""
    values = {}
    for field in dataclasses.fields(cls):
        spec = _spec(field, specs)
        if field.name in fields or spec is None or not hasattr(args, _dest(field, spec)):
            continue
        values[field.name] = getattr(args, _dest(field, spec))
    return cls(**values, **fields)


# --------------------------------------------------------------------- the engine process's flags


def add_proc_arguments(ap: argparse.ArgumentParser, *, defaults: dict | None = None) -> None:
    """ProcConfig's flags (all but --address), and the files its secrets come from."""
    group = ap.add_argument_group("engine process")
    add_config_arguments(group, ProcConfig, defaults=defaults)
    group.add_argument("--auth-token-file", default=None, metavar="PATH",
                       help="require this shared token (the file's first line) in every client's Hello; clients "
                            "pass Client(address, token=...) or $DIFFSLOT_TOKEN. Sent in clear text: over a "
                            "network prefer --curve-secret-key")
    group.add_argument("--curve-secret-key", default=None, metavar="FILE",
                       help="encrypt and authenticate the ZeroMQ connection with CURVE: FILE is the engine's "
                            "secret certificate (zmq.auth.create_certificates writes NAME.key_secret); clients "
                            "need the public one (NAME.key)")


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
    if args.auth_token_file:
        try:
            fields["auth_token"] = read_token(args.auth_token_file)
        except OSError as exc:
            raise ValueError(f"cannot read --auth-token-file: {exc}") from None
    if args.curve_secret_key:
        try:
            fields["curve_public_key"], fields["curve_secret_key"] = read_curve_secret(args.curve_secret_key)
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
