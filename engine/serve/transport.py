"""Addresses and small ZMQ plumbing shared by the engine process and the client library.

The default engine address is an ipc socket `diffslot-<pid>.sock` in the user's
runtime directory ($XDG_RUNTIME_DIR, else a private /tmp/diffslot-<uid> folder), so
clients on the same machine find a running engine without being told its address.

CURVE (ZeroMQ's encryption and authentication, `zmq.auth` certificate files): the
engine's socket is a CURVE server with its key pair, so only clients that know its
public key complete the handshake, and everything on the wire is encrypted; with an
authenticator (a ZAP handler on the engine's context) only listed client keys pass.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import pathlib
import re
import socket
import tempfile

import zmq

from engine.processes import pid_alive
from engine.protocol import SEGMENT_PREFIX

SOCKET_PATTERN = re.compile(r"^diffslot-(\d+)\.sock$")
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def runtime_dir() -> pathlib.Path:
    """Where engines put their ipc sockets: private to the user."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return pathlib.Path(xdg)
    path = pathlib.Path(tempfile.gettempdir()) / f"diffslot-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():  # someone else planted it: do not use it
        raise PermissionError(f"{path} is not owned by this user")
    return path


def default_address(pid: int | None = None) -> str:
    return f"ipc://{runtime_dir() / f'diffslot-{pid or os.getpid()}.sock'}"


def ipc_path(address: str) -> pathlib.Path | None:
    return pathlib.Path(address[len("ipc://"):]) if address.startswith("ipc://") else None


def normalize_address(address: str) -> str:
    """`address` with its scheme: HOST:PORT (no scheme) is tcp://HOST:PORT; anything else
    without `ipc://` or `tcp://` is refused, naming both forms."""
    if "://" in address:
        return address
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit():
        return f"tcp://{address}"
    raise ValueError(f"address {address!r}: use ipc://PATH or tcp://HOST:PORT")


def check_bind_address(address: str, allow_remote: bool = False) -> None:
    """Refuse to expose the engine beyond this machine unless asked to."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(f"address {address!r} lacks a scheme (ipc://PATH or tcp://HOST:PORT)")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        raise ValueError(f"unsupported transport {scheme!r}: use ipc:// or tcp://")
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    if allow_remote or host in LOOPBACK_NAMES:
        return
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing to bind {address}: not loopback (pass --allow-remote-bind to expose "
                     "the engine to the network, with --curve-secret-key to encrypt and authenticate it)")


def ipc_in_use(path: pathlib.Path) -> bool:
    """Whether something listens on this unix socket (binding would steal its address)."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def sweep_stale_sockets(directory: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Remove default-named ipc sockets left by engines that were killed."""
    directory = directory or runtime_dir()
    removed = []
    for path in directory.glob("diffslot-*.sock"):
        match = SOCKET_PATTERN.match(path.name)
        if match and not pid_alive(int(match.group(1))) and not ipc_in_use(path):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def discover_address() -> str:
    """The address a client uses when given none: $DIFFSLOT_ADDRESS, else the one
    engine listening on a default socket in the runtime directory."""
    if os.environ.get("DIFFSLOT_ADDRESS"):
        return os.environ["DIFFSLOT_ADDRESS"]
    live = []
    for path in sorted(runtime_dir().glob("diffslot-*.sock")):
        match = SOCKET_PATTERN.match(path.name)
        if match and pid_alive(int(match.group(1))):
            live.append(f"ipc://{path}")
    if len(live) == 1:
        return live[0]
    if not live:
        raise ConnectionError("no running diffslot engine found; start one with "
                              "`python -m engine serve` or pass --address")
    raise ConnectionError("several engines are running, pass --address: " + ", ".join(live))


# --------------------------------------------------------------------- CURVE (encryption and authentication)

@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """A client's CURVE keys (Z85 text, 40 bytes each): the engine's public key, and this
    client's own pair (a fresh one when the engine accepts any client that knows its key)."""

    server_public: bytes
    public: bytes = b""
    secret: bytes = b""

    def with_pair(self) -> "CurveKeys":
        if self.public and self.secret:
            return self
        public, secret = zmq.curve_keypair()
        return dataclasses.replace(self, public=public, secret=secret)


def load_curve_keys(server_public_file: str, client_secret_file: str | None = None) -> CurveKeys:
    """CurveKeys from zmq.auth certificate files: the engine's public one (NAME.key) and,
    where the engine only accepts known clients, this client's secret one (NAME.key_secret)."""
    import zmq.auth

    server_public, _ = zmq.auth.load_certificate(server_public_file)
    if client_secret_file is None:
        return CurveKeys(server_public)
    public, secret = zmq.auth.load_certificate(client_secret_file)
    if not secret:
        raise ValueError(f"{client_secret_file} holds no secret key (pass the NAME.key_secret file)")
    return CurveKeys(server_public, public, secret)


def make_curve_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    keys = keys.with_pair()
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def make_curve_server(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
    """Before bind: every connection to `sock` is encrypted, and only peers that know
    `public` complete the handshake."""
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def start_curve_authenticator(ctx: zmq.Context, authorized_keys_dir: str):
    """A ZAP handler on `ctx` that admits only the client public keys found in the
    directory (zmq.auth certificate files). Stop it before `ctx.term()`."""
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=authorized_keys_dir)
    return authenticator


class Waker:
    """Wakes a thread blocked in zmq.Poller from any thread (or a signal handler):
    a non-blocking pipe whose read end the poller watches. Not a ZMQ socket, because
    those must not be shared between threads."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is already pending; closed: shutting down
            pass

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


# --------------------------------------------------------------------- shared memory and children

SHM_DIR = pathlib.Path("/dev/shm")


def own_segments(pid: int | None = None) -> list[pathlib.Path]:
    """This engine's shared memory segments (names carry its pid)."""
    prefix = f"{SEGMENT_PREFIX}{pid or os.getpid()}-"
    try:
        return [path for path in SHM_DIR.iterdir() if path.name.startswith(prefix)]
    except FileNotFoundError:
        return []


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of `pid` (default: this process), from a /proc scan."""
    root = pid or os.getpid()
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text[text.rindex(")") + 2:].split()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found
