"""EngineCoreProc: the engine process around the pure `EngineCore`.

    client DEALERs ──▶ ROUTER ──▶ IO thread: recv, decode, validate ──▶ input queue
                                                                          │
           busy loop (main thread): process inputs → core.step() → process outputs
                                                                          │
    client DEALERs ◀── ROUTER ◀── IO thread: encode, send, backlog ◀── output queue

`EngineCore` knows nothing of sockets, threads or signals; this module owns them. It
drives the core only through add_request (which raises RequestRejected(reason, field,
retry_after_s)), abort_requests, step (→ StepProgress, DenoiseFinished,
RequestCanceled, RequestFailed), has_work, decode_done and stats.
One ZMQ socket carries both directions and a ZMQ socket must stay on one thread, so
a single IO thread owns the ROUTER: it decodes client frames and encodes engine
messages off the busy loop. The busy loop blocks on its input queue only when the
core has no work; the decode stage and signal handlers wake it through that queue.

Lifecycle (R10): clients `Hello` → `Welcome`; both sides send `Heartbeat` every
`heartbeat_interval_s`. A client is written off when it says `Goodbye`, when it is
silent for `peer_timeout_s`, or at once when ZMQ reports its connection gone
(ROUTER_MANDATORY makes a send to it fail with EHOSTUNREACH); its requests are then
canceled. SIGTERM/SIGINT abort every request, tell every client `EngineDead`, and
exit 0.

Slow clients (R8): sends never block (NOBLOCK + ROUTER_MANDATORY: a full pipe raises
EAGAIN instead of blocking or silently dropping). What does not fit waits in that
client's backlog, where Progress messages are coalesced to the latest one per
request. Each client has an output budget: the worst-case output bytes of its
unfinished requests plus the bytes it has been sent but has not acknowledged with
`Delivered`. A Submit that would exceed it is Rejected, so a client that stops
reading holds at most its own budget and never the engine or other clients.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from engine import transport
from engine.decode_stage import DecodedOutput
from engine.outputs import DenoiseFinished, RequestCanceled, RequestFailed, RequestRejected, StepProgress
from engine.proc_metrics import EngineMetrics
from engine.protocol import (
    PROTOCOL_VERSION, Accepted, Cancel, Canceled, Completed, Delivered, EngineDead, Failed, GenerateParams,
    Goodbye, Heartbeat, Hello, Progress, Rejected, Stats, StatsReply, Submit, Timings, Welcome,
    client_decoder, describe_decode_error, encoder, output_nbytes,
)

log = logging.getLogger("diffslot.engine")

MAX_BODY_BYTES = 64 * 1024  # a client message is a few hundred bytes; more is abuse
STATS_INTERVAL_S = 0.5  # metrics gauges refresh at most this often


@dataclasses.dataclass
class ProcConfig:
    address: str
    allow_remote_bind: bool = False
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 3.0  # silence after which a client is written off (clients use it too)
    output_budget_bytes: int = 64 << 20  # per client (R8)
    sndhwm: int = 256  # messages ZMQ may queue per client before EAGAIN
    max_backlog_messages: int = 4096  # per client; beyond it the client is written off
    metrics_port: int | None = None
    model_name: str = ""


# Items on the busy loop's input queue besides ("msg", identity, message, arrival).
_WAKE = ("wake",)


@dataclasses.dataclass
class _Request:
    identity: bytes
    client_request_id: str
    arrival: float
    reserved_bytes: int  # counted against the client's budget until it acknowledges delivery
    want_progress: bool
    started: bool = False  # a denoising step has run
    cancel_requested: bool = False
    in_decode: bool = False  # the decode stage holds it: keep the record until it comes back
    terminal: bool = False  # its final message is out (or its client is gone)
    timings: Timings | None = None


@dataclasses.dataclass
class _Client:
    identity: bytes
    tag: str  # namespaces request ids in the core, so clients cannot clash or cancel each other's
    requests: set = dataclasses.field(default_factory=set)  # engine request ids
    used_bytes: int = 0  # reserved + sent-but-unacknowledged output bytes
    undelivered: dict = dataclasses.field(default_factory=dict)  # client request id → bytes sent


@dataclasses.dataclass
class _Peer:
    """The IO thread's view of a client connection."""

    last_seen: float
    backlog: collections.deque = dataclasses.field(default_factory=collections.deque)
    pending_progress: dict = dataclasses.field(default_factory=dict)  # request id → its backlog entry


class _IOThread(threading.Thread):
    """Owns the ROUTER socket: receives and decodes client frames, encodes and sends
    engine messages, runs heartbeats and client liveness, never blocks on a client."""

    def __init__(self, router: zmq.Socket, config: ProcConfig, welcome: Welcome,
                 input_queue: queue.SimpleQueue, output_queue: queue.SimpleQueue, waker: transport.Waker):
        super().__init__(name="diffslot-io", daemon=True)
        self.router = router
        self.config = config
        self.welcome = welcome
        self.input_queue = input_queue
        self.output_queue = output_queue
        self.waker = waker
        self.peers: dict[bytes, _Peer] = {}
        self.gone: dict[bytes, float] = {}  # written-off identities → when
        self.backlog_messages = 0  # read by the busy loop for stats (an int store is atomic)
        self._decoder = client_decoder()
        self._encoder = encoder()
        self._heartbeat = self._encoder.encode(Heartbeat())

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.waker.read_fd, zmq.POLLIN)
        next_beat = time.monotonic()
        stopping = False
        try:
            while not stopping:
                wait_s = max(0.0, next_beat - time.monotonic())
                if self.backlog_messages:
                    wait_s = min(wait_s, 0.005)  # retry full pipes soon, without spinning
                events = dict(poller.poll(wait_s * 1000))
                if self.router in events:
                    self._receive()
                if self.waker.read_fd in events:
                    self.waker.drain()
                stopping = self._send_outputs()
                if self.backlog_messages:
                    self._flush_backlogs()
                now = time.monotonic()
                if now >= next_beat:
                    self._beat(now)
                    next_beat = now + self.config.heartbeat_interval_s
            deadline = time.monotonic() + 0.5  # give final messages a moment to leave
            while self.backlog_messages and time.monotonic() < deadline:
                self._flush_backlogs()
                time.sleep(0.005)
        except Exception:  # the engine cannot serve without its socket: bring it down loudly
            log.exception("IO thread crashed")
            self.input_queue.put(("shutdown", "IO thread crashed"))
        finally:
            self.router.close(linger=500)

    def _receive(self) -> None:
        for _ in range(512):  # then look at outputs again
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle_frames(frames, time.monotonic())
            except Exception as exc:  # one odd frame must not take the socket down (R11)
                log.exception("failed to handle a client frame")
                self._send_now(frames[0], Rejected("", f"internal error on this message: {exc!r}"))

    def _handle_frames(self, frames: list[bytes], arrival: float) -> None:
        identity = frames[0]
        if identity in self.gone:
            self._send_now(identity, EngineDead("this client was written off by the engine (silent, "
                                                "too far behind, or said goodbye); reconnect"))
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = arrival
        if len(frames) != 2:
            self._send_now(identity, Rejected("", f"malformed message: expected one frame, got {len(frames) - 1}"))
            return
        body = frames[1]
        if len(body) > MAX_BODY_BYTES:
            self._send_now(identity, Rejected("", f"message of {len(body)} bytes exceeds {MAX_BODY_BYTES}"))
            return
        try:
            msg = self._decoder.decode(body)
        except Exception as exc:  # ValidationError, DecodeError, and e.g. UnicodeDecodeError on bad UTF-8
            request_id, field = describe_decode_error(body, exc)
            log.info("rejected a malformed frame (request %s, field %s): %s", request_id, field, exc)
            self._send_now(identity, Rejected(request_id or "", f"invalid message: {exc}", field))
            return
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, Hello):
            self._hello(identity, msg, arrival)
            return
        if peer is None:
            request_id = getattr(msg, "request_id", "")
            self._send_now(identity, Rejected(request_id, "send Hello before anything else", "version"))
            return
        if isinstance(msg, Goodbye):
            self._write_off(identity, "client said goodbye")
            return
        self.input_queue.put(("msg", identity, msg, arrival))

    def _hello(self, identity: bytes, msg: Hello, arrival: float) -> None:
        if msg.version != PROTOCOL_VERSION:
            self._send_now(identity, Rejected("", f"protocol version {msg.version} is not supported; this engine "
                                                  f"speaks version {PROTOCOL_VERSION}", "version"))
            return
        if identity not in self.peers:
            self.peers[identity] = _Peer(last_seen=arrival)
            self.input_queue.put(("hello", identity, msg, arrival))
        self._send_now(identity, self.welcome)

    # ------------------------------------------------------------------ sending
    def _send_outputs(self) -> bool:
        """Drain the busy loop's output queue. True once it says stop."""
        while True:
            try:
                item = self.output_queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            identity, msg, payload = item
            if identity is None:  # broadcast
                for peer_identity in list(self.peers):
                    self._send(peer_identity, msg, None)
            else:
                self._send(identity, msg, payload)

    def _send(self, identity: bytes, msg, payload) -> None:
        """Send, or queue behind what this client has not taken yet."""
        peer = self.peers.get(identity)
        if peer is None:
            return  # written off: its requests are being canceled
        frames = [identity, self._encoder.encode(msg)]
        if payload is not None:
            frames.append(payload)
        if peer.backlog:
            self._enqueue(identity, peer, msg, frames)
            return
        outcome = self._try_send(frames)
        if outcome == "full":
            self._enqueue(identity, peer, msg, frames)
        elif outcome == "gone":
            self._write_off(identity, "connection closed")

    def _try_send(self, frames: list) -> str:
        try:
            self.router.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return "sent"
        except zmq.Again:
            return "full"
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return "gone"
            raise

    def _send_now(self, identity: bytes, msg) -> None:
        """Best effort, for replies outside a session (no backlog, no write-off)."""
        try:
            self.router.send_multipart([identity, self._encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _enqueue(self, identity: bytes, peer: _Peer, msg, frames: list) -> None:
        if isinstance(msg, Progress):  # only the latest step matters to a reader that is behind
            entry = peer.pending_progress.get(msg.request_id)
            if entry is not None:
                entry[1] = frames
                return
            entry = [msg.request_id, frames]
            peer.pending_progress[msg.request_id] = entry
        else:
            entry = [None, frames]
        peer.backlog.append(entry)
        self.backlog_messages += 1
        if len(peer.backlog) > self.config.max_backlog_messages:
            self._write_off(identity, f"more than {self.config.max_backlog_messages} messages behind")

    def _flush_backlogs(self) -> None:
        for identity, peer in list(self.peers.items()):
            while peer.backlog:
                request_id, frames = peer.backlog[0]
                outcome = self._try_send(frames)
                if outcome == "full":
                    break
                if outcome == "gone":
                    self._write_off(identity, "connection closed")
                    break
                peer.backlog.popleft()
                self.backlog_messages -= 1
                if request_id is not None:
                    del peer.pending_progress[request_id]

    def _beat(self, now: float) -> None:
        for identity, peer in list(self.peers.items()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                self._write_off(identity, f"no message for {self.config.peer_timeout_s:g}s")
            elif not peer.backlog and self._try_send([identity, self._heartbeat]) == "gone":
                self._write_off(identity, "connection closed")
        for identity, when in list(self.gone.items()):  # remember write-offs for a while only
            if now - when > 600:
                del self.gone[identity]

    def _write_off(self, identity: bytes, reason: str) -> None:
        peer = self.peers.pop(identity, None)
        if peer is None:
            return
        self.backlog_messages -= len(peer.backlog)
        self.gone[identity] = time.monotonic()
        self.input_queue.put(("gone", identity, reason))


class EngineCoreProc:
    """Runs an EngineCore behind a ROUTER socket until SIGTERM/SIGINT."""

    def __init__(self, core, model, config: ProcConfig,
                 make_decode_stage: Callable[[Callable[[], None]], Any]):
        self.core = core
        self.model = model
        self.config = config
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is reentrant: signal handlers use it
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.metrics = EngineMetrics()
        self._requests: dict[str, _Request] = {}  # engine request id → record
        self._clients: dict[bytes, _Client] = {}
        self._step_needed = False  # an abort happened: step so the core can report it
        self._stopping: str | None = None
        self._pending_outputs = False
        self._started_at = time.monotonic()
        self._last_stats = 0.0
        self._ipc_file: str | None = None
        self._core_has_work = getattr(core, "has_work", core.has_unfinished_requests)
        self._output_handlers = {
            StepProgress: self._on_step_progress,
            DenoiseFinished: self._on_denoise_finished,
            RequestCanceled: self._on_request_canceled,
            RequestFailed: self._on_request_failed,
        }

        transport.check_bind_address(config.address, config.allow_remote_bind)
        path = transport.ipc_path(config.address)
        if path is not None:
            if transport.ipc_in_use(path):
                raise OSError(errno.EADDRINUSE, f"another process listens on {config.address}")
            path.parent.mkdir(parents=True, exist_ok=True)
        self.ctx = zmq.Context()
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, config.sndhwm)
        router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        try:
            router.bind(config.address)
        except zmq.ZMQError:
            router.close(linger=0)
            self.ctx.term()
            raise
        self.address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        if path is not None:
            self._ipc_file = str(path)
        self.waker = transport.Waker()
        welcome = Welcome(
            version=PROTOCOL_VERSION, engine_pid=os.getpid(), heartbeat_interval_s=config.heartbeat_interval_s,
            peer_timeout_s=config.peer_timeout_s, output_budget_bytes=config.output_budget_bytes,
            model=config.model_name, conditions=list(getattr(model, "conditions", [])),
            native_size=int(getattr(model, "native_size", 0)))
        self.io = _IOThread(router, config, welcome, self.input_queue, self.output_queue, self.waker)
        self.decode_stage = make_decode_stage(lambda: self.input_queue.put(_WAKE))
        if config.metrics_port is not None:
            self.metrics.start_server(config.metrics_port)
        self.io.start()

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Serve until a signal or fatal error; always shut down cleanly. Returns the exit code."""
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._on_signal)
        code = 0
        try:
            log.info("diffslot engine ready on %s (pid %d)", self.address, os.getpid())
            self.run_busy_loop()
        except BaseException as exc:
            code = 1
            log.exception("engine failed")
            self._stopping = self._stopping or f"engine failed: {exc!r}"
        finally:
            self.shutdown()
        return code

    def _on_signal(self, signum, frame) -> None:
        if self._stopping:  # a second signal: stop waiting for the first shutdown
            raise KeyboardInterrupt
        self.input_queue.put(("shutdown", f"engine shutting down ({signal.Signals(signum).name})"))

    def shutdown(self) -> None:
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        reason = self._stopping or "engine shutting down"
        log.info("shutting down: %s", reason)
        live = [rid for rid, record in self._requests.items() if not record.terminal]
        try:
            self.core.abort_requests(live)
        except Exception:
            log.exception("abort on shutdown failed")
        self.output_queue.put((None, EngineDead(reason), None))
        self.output_queue.put(None)
        self.waker.wake()
        self.io.join(timeout=5)
        try:
            self.decode_stage.close()
        except Exception:
            log.exception("closing the decode stage failed")
        self.metrics.stop_server()
        if self.io.is_alive():  # its socket is still open: term() would wait forever
            log.error("IO thread did not stop; exiting without closing the ZMQ context")
        else:
            self.ctx.term()
        self.waker.close()
        if self._ipc_file and os.path.exists(self._ipc_file):
            try:
                os.unlink(self._ipc_file)
            except OSError:
                pass
        log.info("engine stopped")

    # ------------------------------------------------------------------ busy loop
    def run_busy_loop(self) -> None:
        while not self._stopping:
            self._process_input_queue(block=not self._has_work())
            self._publish()  # Accepted/Rejected/StatsReply leave now, not after the step
            self._process_engine_step()
            self._publish()

    def _has_work(self) -> bool:
        """Whether step() has something to do now. Requests that only await their decode
        do not count: the decode stage wakes the loop when it is done."""
        return self._step_needed or self._core_has_work()

    def _process_input_queue(self, block: bool) -> None:
        if block:  # idle: sleep until a message, a decode, or a signal (or refresh gauges now and then)
            try:
                self._handle_input(self.input_queue.get(timeout=STATS_INTERVAL_S * 2))
            except queue.Empty:
                pass
        while not self._stopping:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(item)

    def _process_engine_step(self) -> None:
        if self._stopping:
            return
        outputs = self.core.step() if self._has_work() else []
        self._step_needed = False
        # Cancels that arrived while the step ran take effect before its outputs are
        # published, so a canceled request does not report progress it will never use.
        self._process_input_queue(block=False)
        for output in outputs:
            self._handle_core_output(output)
        for decoded in self.decode_stage.poll():
            self._handle_decoded(decoded)
        now = time.monotonic()
        if now - self._last_stats > STATS_INTERVAL_S:
            self._last_stats = now
            self.metrics.refresh(self._core_stats(), self._process_stats())

    def _publish(self) -> None:
        if self._pending_outputs:
            self._pending_outputs = False
            self.waker.wake()

    def _send(self, identity: bytes, msg, payload=None) -> None:
        self.output_queue.put((identity, msg, payload))
        self._pending_outputs = True

    # ------------------------------------------------------------------ inputs
    def _handle_input(self, item) -> None:
        kind = item[0]
        if kind == "msg":
            _, identity, msg, arrival = item
            client = self._clients.get(identity)
            if client is None:  # written off between the IO thread forwarding and now
                return
            if isinstance(msg, Submit):
                self._submit(client, msg, arrival)
            elif isinstance(msg, Cancel):
                self._cancel(client, msg.request_id)
            elif isinstance(msg, Delivered):
                client.used_bytes -= client.undelivered.pop(msg.request_id, 0)
            elif isinstance(msg, Stats):
                self._send(identity, StatsReply(msg.token, self._core_stats() | self._process_stats()))
        elif kind == "hello":
            _, identity, msg, _ = item
            self._clients[identity] = _Client(identity, identity.hex())
            log.info("client %s connected (pid %d%s)", identity.hex(), msg.pid, f", {msg.name}" if msg.name else "")
        elif kind == "gone":
            self._client_gone(item[1], item[2])
        elif kind == "shutdown":
            self._stopping = item[1]

    def _submit(self, client: _Client, msg: Submit, arrival: float) -> None:
        rid = f"{client.tag}:{msg.request_id}"
        if rid in self._requests:
            self._reject(client, msg.request_id, "request_id is already in use by an unfinished request",
                         "request_id")
            return
        reserve = self._output_reservation(msg.params)
        if client.used_bytes + reserve > self.config.output_budget_bytes:
            self._reject(client, msg.request_id,
                         f"client output budget exhausted: {client.used_bytes} of "
                         f"{self.config.output_budget_bytes} bytes undelivered or reserved "
                         f"(read results and acknowledge them)", None, retry_after_s=1.0)
            return
        try:
            self.core.add_request(rid, msg.params, arrival_time=arrival)
        except RequestRejected as exc:
            self._reject(client, msg.request_id, exc.reason, exc.field, exc.retry_after_s)
            return
        except Exception as exc:  # a core bug on odd input must not take the engine down (R11)
            log.exception("request %s: add_request failed", rid)
            self._reject(client, msg.request_id, f"internal error: {exc!r}", None)
            return
        self._requests[rid] = _Request(client.identity, msg.request_id, arrival, reserve, msg.progress)
        client.requests.add(rid)
        client.used_bytes += reserve
        queued = sum(1 for r in self._requests.values() if not r.started and not r.terminal)
        self._send(client.identity, Accepted(msg.request_id, queued))
        log.info("request %s accepted: %s %s×%d g=%g seed=%d → %s", rid, msg.params.condition, msg.params.sampler,
                 msg.params.steps, msg.params.guidance, msg.params.seed, msg.params.output)

    def _output_reservation(self, params: GenerateParams) -> int:
        """Worst-case output bytes; 0 for sizes the core will reject anyway."""
        native = int(getattr(self.model, "native_size", 0))
        height, width = params.height or native, params.width or native
        if not (0 < height <= 1 << 14 and 0 < width <= 1 << 14):
            return 0
        try:
            latent_shape = tuple(self.model.latent_shape(height, width))
        except Exception:
            latent_shape = (4, height, width)
        return output_nbytes(params.output, height, width, latent_shape)

    def _reject(self, client: _Client, request_id: str, reason: str, field: str | None,
                retry_after_s: float = 0.0) -> None:
        log.info("request %s:%s rejected: %s%s", client.tag, request_id, reason, f" (field {field})" if field else "")
        self.metrics.finished("rejected")
        self._send(client.identity, Rejected(request_id, reason, field, float(retry_after_s or 0.0)))

    def _cancel(self, client: _Client, request_id: str) -> None:
        rid = f"{client.tag}:{request_id}"
        record = self._requests.get(rid)
        if record is None or record.terminal or record.cancel_requested:
            return  # unknown, finished or already canceling: cancel is idempotent
        record.cancel_requested = True
        log.info("request %s: cancel requested", rid)
        self.core.abort_requests([rid])
        self._step_needed = True

    def _client_gone(self, identity: bytes, reason: str) -> None:
        client = self._clients.pop(identity, None)
        if client is None:
            return
        live = [rid for rid in client.requests if not self._requests[rid].terminal]
        log.info("client %s gone (%s): canceling %d request(s)", client.tag, reason, len(live))
        for rid in client.requests:
            self._requests[rid].cancel_requested = True
        if live:
            self.core.abort_requests(live)
            self._step_needed = True

    # ------------------------------------------------------------------ outputs
    def _handle_core_output(self, output) -> None:
        handler = self._output_handlers.get(type(output))
        if handler is None:
            log.warning("unknown core output %r", output)
            return
        handler(output, self._requests.get(output.request_id))

    def _on_step_progress(self, output, record: _Request | None) -> None:
        if record is not None:
            record.started = True
            if record.want_progress and not record.cancel_requested and not record.terminal:
                self._send(record.identity, Progress(record.client_request_id, output.step, output.total))

    def _on_denoise_finished(self, output, record: _Request | None) -> None:
        if record is not None:
            record.started = True
            record.timings = output.timings
        if record is None or record.terminal or record.cancel_requested:
            self._decode_finished(output.request_id, record, None)  # nobody wants it: hand the reservation back
            return
        record.in_decode = True
        self.decode_stage.submit(output.request_id, output.latents, output.params, output.timings,
                                 output.finished_at)

    def _on_request_canceled(self, output, record: _Request | None) -> None:
        # [decode workers, issue 6] canceled while its decode is in the stage: tell the stage,
        # so a worker skips or abandons it and the decode buffer comes back early (the stage
        # still returns one DecodedOutput for it, which hands the reservation back).
        if record is not None and record.in_decode and hasattr(self.decode_stage, "cancel"):
            self.decode_stage.cancel(output.request_id)
        if record is not None and not record.terminal:
            timings = msgspec.structs.replace(output.timings, total_s=time.monotonic() - record.arrival)
            self.metrics.finished("canceled", timings)
            log.info("request %s canceled after %d evals", output.request_id, timings.evals)
            self._finish(output.request_id, record, Canceled(record.client_request_id, timings))

    def _on_request_failed(self, output, record: _Request | None) -> None:
        if record is not None and not record.terminal:
            log.warning("request %s failed: %s", output.request_id, output.error)
            self.metrics.finished("failed")
            self._finish(output.request_id, record, Failed(record.client_request_id, output.error))

    def _handle_decoded(self, decoded: DecodedOutput) -> None:
        rid = decoded.request_id
        record = self._requests.get(rid)
        if record is not None:
            record.in_decode = False
        self._decode_finished(rid, record, decoded)

    def _decode_finished(self, rid: str, record: _Request | None, decoded: DecodedOutput | None) -> None:
        deliver = self.core.decode_done(rid)
        if record is None:
            return
        if record.terminal:
            self._forget(rid, record)
            return
        if not deliver or decoded is None or record.cancel_requested:
            # Canceled while decoding: the core may still report it; answer now either way.
            timings = msgspec.structs.replace(record.timings or Timings(), total_s=time.monotonic() - record.arrival)
            self.metrics.finished("canceled", timings)
            log.info("request %s canceled during decode", rid)
            self._finish(rid, record, Canceled(record.client_request_id, timings))
            return
        if decoded.error is not None:
            self.metrics.finished("failed")
            self._finish(rid, record, Failed(record.client_request_id, decoded.error))
            return
        timings = msgspec.structs.replace(decoded.timings, total_s=decoded.done_at - record.arrival)
        nbytes = len(decoded.payload) if isinstance(decoded.payload, (bytes, bytearray)) else decoded.payload.nbytes
        client = self._clients.get(record.identity)
        if client is not None:  # the reservation becomes the real size, held until Delivered
            client.used_bytes += nbytes - record.reserved_bytes
            client.undelivered[record.client_request_id] = nbytes
            record.reserved_bytes = 0
        self.metrics.finished("completed", timings)
        log.info("request %s completed in %.3fs (queue %.3f, denoise %.3f, decode wait %.3f, decode %.3f; "
                 "%d evals, %d padded)", rid, timings.total_s, timings.queue_s, timings.denoise_s,
                 timings.decode_wait_s, timings.decode_s, timings.evals, timings.padded_evals)
        message = Completed(record.client_request_id, timings, decoded.output_kind, decoded.shape, decoded.dtype)
        self._finish(rid, record, message, decoded.payload)

    def _finish(self, rid: str, record: _Request, message, payload=None) -> None:
        """Send the request's one final message and release what it holds."""
        record.terminal = True
        client = self._clients.get(record.identity)
        if client is not None:
            client.used_bytes -= record.reserved_bytes
            record.reserved_bytes = 0
            self._send(record.identity, message, payload)
        self._forget(rid, record)

    def _forget(self, rid: str, record: _Request) -> None:
        if record.terminal and not record.in_decode:
            self._requests.pop(rid, None)
            client = self._clients.get(record.identity)
            if client is not None:
                client.requests.discard(rid)

    # ------------------------------------------------------------------ stats
    def _core_stats(self) -> dict:
        try:
            stats = self.core.stats()
        except Exception:
            log.exception("core.stats() failed")
            return {}
        return {str(k): v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
                for k, v in stats.items()}

    def _process_stats(self) -> dict:
        return {
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self._started_at,
            "clients": len(self._clients),
            "requests_in_flight": sum(1 for r in self._requests.values() if not r.terminal),
            "undelivered_output_bytes": sum(c.used_bytes for c in self._clients.values()),
            "outbound_backlog_messages": self.io.backlog_messages,
        }


def run_engine(core, model, config: ProcConfig, make_decode_stage) -> int:
    """Bind, serve until SIGTERM/SIGINT, clean up. Prints one 'ready' line on stdout."""
    try:
        proc = EngineCoreProc(core, model, config, make_decode_stage)
    except (OSError, ValueError, zmq.ZMQError) as exc:
        log.error("cannot serve on %s: %s", config.address, exc)
        return 2
    print(f"diffslot engine ready on {proc.address} (pid {os.getpid()})", flush=True)
    return proc.run()


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")


__all__ = ["EngineCoreProc", "ProcConfig", "run_engine", "configure_logging"]
