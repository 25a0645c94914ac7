"""Client library: talk to a diffslot engine over ZMQ.

    with Client(address) as c:
        h = c.submit(GenerateParams(prompt="a red circle", steps=20))
        for p in h.progress(): ...
        r = h.result(timeout=60)        # Completed | Canceled | Rejected | Failed

One background thread per Client owns its DEALER socket (ZMQ sockets must stay on one
thread): it sends what user threads queue, receives everything, and routes each
message to its request's handle by request id. It also keeps the engine honest: the
engine sends a Heartbeat every `heartbeat_interval_s`; if the connection drops (ZMQ
socket monitor) every unfinished request fails at once with EngineDeadError — no
request timeouts involved. Silence is not death: an engine silent for `peer_timeout_s`
whose process is on this machine and still there (stopped by SIGSTOP, paused by a
debugger or the kernel, starved of CPU) is only stalled, and its requests are kept
until `stall_timeout` of silence (the engine's own step watchdog ends a hung one before
that, which drops the connection); a local engine whose process is gone, or a remote
one silent for `peer_timeout_s`, is dead. The
thread sends heartbeats of its own, so the engine cancels the requests of a client
that died.

An engine started with `--auth-token-file` wants its token in Hello: pass
`Client(address, token=...)` or set $DIFFSLOT_TOKEN; a wrong or missing token fails
`connect()` with AuthenticationError. An engine started with `--curve-secret-key`
talks only CURVE: pass `Client(address, curve=load_curve_keys(server_key_file[,
client_secret_file]))`, or set $DIFFSLOT_CURVE_SERVER_KEY (and
$DIFFSLOT_CURVE_CLIENT_KEY) to those files; a failed CURVE handshake also fails
`connect()` with AuthenticationError. A Submit larger than the engine's
`Welcome.max_message_bytes` is not sent: its handle ends at once with a `Rejected`
naming the limit (the engine answers a raw oversized frame the same way).

Image inputs (`GenerateParams.image`, `.mask`) are not put in the Submit's body: the
client sends them as their own frames after it (`Submit.inputs` names them), zero-copy
from the caller's bytes; one larger than the engine's `Welcome.max_input_bytes` (or not
bytes at all) ends its handle at once with a `Rejected` naming the field, unsent.

Every final message that follows bytes the engine sent (a Completed, or a Canceled or
Failed after partial images) is acknowledged with `Delivered`, which returns those
bytes to this client's budget on the engine.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.protocol import (
    PROTOCOL_VERSION, TERMINAL, Cancel, Canceled, Completed, Delivered, EngineDead, Failed,
    GenerateParams, Goodbye, Health, HealthReply, Heartbeat, Hello, PartialImage, Progress, ProgressBatch, Rejected,
    Stats, StatsReply, Submit, Welcome, encoder, engine_decoder, frame_paths, split_frames,
)
from engine.serve import transport
from engine.serve.transport import CurveKeys, load_curve_keys
from frontend.request_handle import RequestHandle, Result

log = logging.getLogger("diffslot.client")

_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
CURVE_SERVER_KEY_ENV = "DIFFSLOT_CURVE_SERVER_KEY"
CURVE_CLIENT_KEY_ENV = "DIFFSLOT_CURVE_CLIENT_KEY"
#: silence a local engine process that is still there may keep before its client gives up on
#: it: the engine's default step watchdog (--step-timeout 120) ends a hung engine before this
STALL_TIMEOUT_S = 150.0


def curve_keys_from_env() -> CurveKeys | None:
    server = os.environ.get(CURVE_SERVER_KEY_ENV)
    return load_curve_keys(server, os.environ.get(CURVE_CLIENT_KEY_ENV) or None) if server else None


class EngineDeadError(ConnectionError):
    """The engine died, shut down, or wrote this client off; unfinished requests are lost."""


class AuthenticationError(ConnectionError):
    """The engine refused this client's token (or wants one and got none)."""


#: how long a client waits for something to listen at its address before it fails: an
#: engine binds its socket only once its model is loaded, so nothing there is a wrong
#: address, or an engine not started yet (whose starter retries, as the launcher does)
LISTEN_WAIT_S = 2.0


def _check_listening(address: str, wait_s: float) -> None:
    """Raise ConnectionError, saying what was tried, unless something listens at `address`
    within `wait_s`: an ipc socket file that accepts, or a TCP port that accepts."""
    deadline = time.monotonic() + wait_s
    scheme, _, rest = address.partition("://")
    while True:
        if scheme == "ipc":
            path = transport.ipc_path(address)
            if transport.ipc_in_use(path):
                return
            why = "nothing listens on that socket file" if path.exists() else f"there is no socket file {path}"
        elif scheme == "tcp":
            host, _, port = rest.rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, wait_s)):
                    return
            except ValueError:
                raise ConnectionError(f"address {address!r}: tcp://HOST:PORT needs a numeric port") from None
            except socket.gaierror as exc:
                raise ConnectionError(f"no engine at {address}: cannot resolve {host!r} ({exc.strerror})") from None
            except OSError as exc:
                why = exc.strerror or str(exc) or type(exc).__name__
        else:  # inproc and the like: zmq itself says
            return
        if time.monotonic() >= deadline:
            raise ConnectionError(f"no diffslot engine at {address}: {why} (waited {wait_s:g}s; start one with "
                                  "`python -m engine serve`, which prints its address)")
        time.sleep(0.05)


class Client:
    """A connection to one engine. Use as a context manager, or call connect()/close()."""

    def __init__(self, address: str | None = None, *, connect_timeout: float = 30.0, name: str = "",
                 token: str | None = None, curve: CurveKeys | None = None, stall_timeout: float = STALL_TIMEOUT_S):
        self.address = transport.normalize_address(address or transport.discover_address())
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout  # silence a local engine process that is still there may keep
        self.stalls = 0  # silences past peer_timeout_s the engine came back from (or is in now)
        self.name = name
        self.token = token if token is not None else os.environ.get("DIFFSLOT_TOKEN", "")
        self.curve = curve if curve is not None else curve_keys_from_env()
        self.welcome: Welcome | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._waiters: dict[int, _Waiter] = {}  # Stats and Health round trips, by token
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._outbox: collections.deque = collections.deque()  # messages user threads want sent
        self._waker = transport.Waker()
        self._encoder = encoder()
        self._welcomed = threading.Event()
        self._handshake_error: BaseException | None = None
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Client":
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> Welcome:
        """Connect and complete the handshake; raises ConnectionError if no engine answers
        within `connect_timeout` (an engine still loading its model is waited for)."""
        if self._thread is not None:
            raise RuntimeError("already connected")
        _check_listening(self.address, min(LISTEN_WAIT_S, self.connect_timeout))
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            transport.make_curve_client(self._socket, self.curve)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                        | _HANDSHAKE_FAILED)
        self._socket.connect(self.address)
        self._thread = threading.Thread(target=self._run, name="diffslot-client-io", daemon=True)
        self._thread.start()
        if not self._welcomed.wait(self.connect_timeout) or self.welcome is None:
            error = self._handshake_error or self._dead or ConnectionError(
                f"no diffslot engine answered at {self.address} within {self.connect_timeout:g}s")
            self.close()
            raise error
        return self.welcome

    def close(self) -> None:
        """Tell the engine goodbye (it cancels our unfinished requests) and stop."""
        if self._thread is None or self._closing:
            return
        self._closing = True
        self._waker.wake()
        self._thread.join(timeout=10)
        self._waker.close()

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closing and self.welcome is not None

    # ------------------------------------------------------------ requests
    def submit(self, params: GenerateParams, *, request_id: str | None = None,
               progress: bool = True, partial_images: int = 0,
               on_partial_image: Callable[[PartialImage], None] | None = None) -> RequestHandle:
        """Queue a request; returns at once. `progress=False` asks the engine not to send
        Progress messages (handle.progress() then only ends). `partial_images` (0–3): that
        many decoded previews of the clean-image estimate (handle.partial_images(), or
        `on_partial_image` called on the IO thread, registered before the request is sent)."""
        request_id = request_id or uuid.uuid4().hex
        handle = RequestHandle(self._send_soon, request_id)
        if on_partial_image is not None:
            handle.on_partial_image(on_partial_image)
        params, inputs, frames, refusal = self._split_inputs(params)
        msg = Submit(request_id, params, progress, partial_images, tuple(inputs))
        limit = self.welcome.max_message_bytes if self.welcome is not None else 0
        size = len(self._encoder.encode(msg)) if limit else 0
        if refusal is None and limit and size > limit:  # the engine would refuse it: say so here, unsent
            # the field that makes it so large (a long prompt, thousands of adapters)
            longest = max(("prompt", "negative_prompt", "loras"),
                          key=lambda f: len(self._encoder.encode(getattr(params, f) or "")))
            refusal = (f"message of {size} bytes exceeds the engine's limit of {limit} bytes per message "
                       f"(Welcome.max_message_bytes)", longest)
        with self._lock:  # atomic with _take_handles: a handle is either failed by death/close or never made
            self._check_usable()
            if request_id in self._handles:
                raise ValueError(f"request id {request_id!r} is already in use")
            if refusal is None:
                self._handles[request_id] = handle
        if refusal is not None:
            handle._finish(Rejected(request_id, *refusal), None)
            return handle
        self._send_soon((msg, frames) if frames else msg)
        return handle

    def _split_inputs(self, params: GenerateParams):
        """(params without their frame fields' bytes, the paths, their frames, a refusal
        (reason, field) or None): byte inputs travel as their own frames (Submit.inputs)."""
        limit = self.welcome.max_input_bytes if self.welcome is not None else 0
        for path, data in frame_paths(params):
            field = path.split(".")[0]
            if not isinstance(data, (bytes, bytearray, memoryview)):
                return params, [], [], (f"must be the bytes of a PNG, JPEG or WebP image, not "
                                        f"{type(data).__name__}", field)
            nbytes = memoryview(data).nbytes
            if limit and nbytes > limit:
                return params, [], [], (f"{nbytes} bytes, more than the engine takes ({limit} bytes per input "
                                        f"frame, Welcome.max_input_bytes)", field)
        params, paths, frames = split_frames(params)
        return params, paths, frames, None

    def generate(self, params: GenerateParams, timeout: float | None = None) -> Result:
        """Submit and wait; on timeout or KeyboardInterrupt the request is canceled."""
        handle = self.submit(params, progress=False)
        try:
            return handle.result(timeout)
        except (TimeoutError, KeyboardInterrupt):
            handle.cancel()
            raise

    def cancel(self, request_id: str) -> None:
        self._send_soon(Cancel(request_id))

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Engine-wide counters: the core's stats and the process's own (a round trip
        through the engine's busy loop, answered between two steps)."""
        return self._round_trip(Stats, "stats", timeout).stats

    def adapters(self, timeout: float = 10.0) -> list[str]:
        """The LoRA adapters the engine serves now (its `--lora-dir`), by name; [] for none
        (the same round trip as stats())."""
        return list(self._round_trip(Stats, "stats", timeout).adapters)

    def health(self, timeout: float = 5.0) -> HealthReply:
        """The engine's IO thread's view of its busy loop (answered during a step too):
        `alive`, `draining`, and why not alive."""
        return self._round_trip(Health, "health answer", timeout)

    def _round_trip(self, message_type, what: str, timeout: float):
        token = next(self._tokens)
        waiter = _Waiter()
        with self._lock:
            self._check_usable()
            self._waiters[token] = waiter
        self._send_soon(message_type(token))
        if not waiter.done.wait(timeout):
            with self._lock:
                self._waiters.pop(token, None)
            raise TimeoutError(f"no {what} within {timeout}s")
        if isinstance(waiter.reply, BaseException):
            raise waiter.reply
        return waiter.reply

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closing or self._thread is None:
            raise RuntimeError("client is not connected")

    def _send_soon(self, msg) -> None:
        self._outbox.append(msg)  # deque.append is thread-safe
        self._waker.wake()

    # ------------------------------------------------------------ IO thread
    def _run(self) -> None:
        sock, monitor = self._socket, self._monitor
        decoder = engine_decoder()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._waker.read_fd, zmq.POLLIN)
        self._send(Hello(PROTOCOL_VERSION, os.getpid(), self.name, self.token))
        interval, timeout = 0.5, None  # until Welcome says otherwise; no liveness deadline before it
        last_heard = next_beat = time.monotonic()
        stalled_since = None  # when a silence past peer_timeout_s began, while the engine process is there
        unsent: collections.deque = collections.deque()
        try:
            while not self._closing and self._dead is None:
                wait_s = max(0.0, next_beat - time.monotonic())
                if unsent:
                    wait_s = min(wait_s, 0.005)  # our pipe was full: retry soon
                events = dict(poller.poll(wait_s * 1000))
                now = time.monotonic()
                if sock in events:
                    last_heard = now
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        # Each message is word from the engine: a long drain (a slow reader's
                        # handling, a GIL-starved thread) must not make a live engine look silent.
                        last_heard = time.monotonic()
                        self._handle(decoder, frames)
                        if self.welcome is not None and timeout is None:
                            interval, timeout = self.welcome.heartbeat_interval_s, self.welcome.peer_timeout_s
                if monitor in events:
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED and self.welcome is not None:
                        self._declare_dead("the connection to the engine was lost (engine process died?)")
                    elif event["event"] & _HANDSHAKE_FAILED and self.welcome is None:
                        self._handshake_error = AuthenticationError(
                            f"the security handshake with the engine at {self.address} failed: "
                            f"{'no CURVE keys given' if self.curve is None else 'wrong CURVE keys'} "
                            f"(or the engine does not use CURVE)")
                        self._closing = True
                        self._welcomed.set()
                if self._waker.read_fd in events:
                    self._waker.drain()
                while self._outbox:
                    unsent.append(self._outbox.popleft())
                while unsent and self._dead is None:
                    if not self._send(unsent[0]):
                        break  # pipe full: retry after the next poll
                    unsent.popleft()
                if now >= next_beat:
                    next_beat = now + interval
                    silent_s = now - last_heard
                    if timeout is not None and silent_s > timeout:
                        why = self._silence_verdict(silent_s, timeout, first=stalled_since is None)
                        if why is not None:
                            self._declare_dead(why)
                        stalled_since = last_heard
                    elif stalled_since is not None:
                        log.warning("the engine at %s answers again after %.1fs of silence", self.address,
                                    last_heard - stalled_since)
                        stalled_since = None
                    if self.welcome is not None and self._dead is None:
                        self._send(Heartbeat())
        except Exception as exc:
            log.exception("client IO thread crashed")
            self._declare_dead(f"client IO thread crashed: {exc!r}")
        finally:
            if self._dead is None and self.welcome is not None:
                self._send(Goodbye())
                sock.setsockopt(zmq.LINGER, 500)  # let Goodbye leave
            for handle in self._take_handles():
                handle._finish(Failed(handle.request_id, "client closed before the request finished"), None)
            self._welcomed.set()
            self._socket.disable_monitor()
            monitor.close(linger=0)
            sock.close()
            self._ctx.term()

    def _silence_verdict(self, silent_s: float, timeout: float, first: bool) -> str | None:
        """Why the engine counts as dead after `silent_s` of silence, or None while it is only
        stalled: its process is on this machine and still there, and the silence is shorter
        than `stall_timeout`."""
        state = local_process_state(self.address, self.welcome.engine_pid if self.welcome else 0)
        if state is None:
            return f"no word from the engine for {timeout:g}s (engine hung or died)"
        if state == "gone":
            return f"no word from the engine for {silent_s:.1f}s and its process ({self.welcome.engine_pid}) is gone"
        if silent_s > max(self.stall_timeout, timeout):
            return (f"no word from the engine for {silent_s:.1f}s, past the client's stall timeout of "
                    f"{self.stall_timeout:g}s (its process is {state})")
        if first:
            self.stalls += 1
            log.warning("the engine at %s has been silent for %.1fs but its process is %s: a stall, not a death; "
                        "waiting up to %gs", self.address, silent_s, state, self.stall_timeout)
        return None

    def _send(self, msg) -> bool:
        """Send a message, or a (message, extra frames) pair as one multipart message (the
        frames zero-copy). False when the pipe is full: nothing of it was sent."""
        try:
            if isinstance(msg, tuple):
                msg, frames = msg
                self._socket.send_multipart([self._encoder.encode(msg), *frames], zmq.NOBLOCK, copy=False)
            else:
                self._socket.send(self._encoder.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _handle(self, decoder, frames: list) -> None:
        try:
            msg = decoder.decode(frames[0].buffer)
        except Exception as exc:  # a broken engine message fails nothing else
            log.error("undecodable message from the engine: %s", exc)
            return
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, Welcome):
            if msg.version != PROTOCOL_VERSION:
                self._handshake_error = ConnectionError(f"engine speaks protocol {msg.version}, "
                                                        f"this client {PROTOCOL_VERSION}")
                self._closing = True
            else:
                self.welcome = msg
            self._welcomed.set()
            return
        if isinstance(msg, EngineDead):
            self._declare_dead(msg.reason)
            return
        if isinstance(msg, (StatsReply, HealthReply)):
            with self._lock:
                waiter = self._waiters.pop(msg.token, None)
            if waiter is not None:
                waiter.reply = msg
                waiter.done.set()
            return
        if isinstance(msg, PartialImage):
            msg.image = frames[1].bytes if len(frames) > 1 else b""
        if isinstance(msg, Completed):
            msg.output = _payload(msg, frames[1] if len(frames) > 1 else None)
            self._send(Delivered(msg.request_id))  # hands the bytes back to our budget on the engine
        if isinstance(msg, Rejected) and not msg.request_id:
            if self.welcome is None:  # our Hello was refused: a version, a token, the engine's client limit
                error = AuthenticationError if msg.field == "token" else ConnectionError
                self._handshake_error = error(f"engine at {self.address} refused the connection: {msg.reason}")
                self._closing = True
                self._welcomed.set()
            else:
                log.error("engine rejected a message: %s", msg.reason)
            return
        if isinstance(msg, ProgressBatch):  # one message per step for all our requests
            with self._lock:
                handles = [(self._handles.get(rid), Progress(rid, step, total)) for rid, step, total in msg.items]
            for handle, progress in handles:
                if handle is not None:
                    handle._deliver(progress)
            return
        with self._lock:
            handle = self._handles.get(msg.request_id)
            if handle is not None and isinstance(msg, TERMINAL):
                del self._handles[msg.request_id]
        if isinstance(msg, (Canceled, Failed)) and handle is not None and handle.partial_images_received:
            self._send(Delivered(msg.request_id))  # the partial images' bytes were ours until now
        if handle is not None:
            handle._deliver(msg)

    def _take_handles(self) -> list[RequestHandle]:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
            waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in waiters:
            waiter.reply = self._dead or RuntimeError("client closed")
            waiter.done.set()
        return handles

    def _declare_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(f"engine at {self.address} is gone: {reason}")
        log.warning("%s", self._dead)
        for handle in self._take_handles():
            handle._finish(None, self._dead)
        self._welcomed.set()


def local_process_state(address: str, pid: int) -> str | None:
    """"running", "stopped" (SIGSTOP, a debugger) or "gone" for an engine on this machine
    (an ipc address or a loopback one, with the pid its Welcome named); None where this
    cannot be told (a remote engine, no pid)."""
    if pid <= 0:
        return None
    try:
        transport.check_bind_address(address)
    except ValueError:
        return None  # not this machine's: its pid means nothing here
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pass
        return "running"
    if state in (b"Z", b"X", b"x"):  # exited, not reaped yet
        return "gone"
    return "stopped" if state in (b"T", b"t") else "running"


class _Waiter:
    """A Stats or Health round trip: the reply (or the error that ended it), once `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Any = None


def _payload(msg: Completed, frame) -> Any:
    if frame is None:
        return None
    if msg.output_kind == "png":
        return frame.bytes
    return np.frombuffer(frame, dtype=np.dtype(msg.dtype)).reshape(msg.shape)  # zero-copy, read-only
