"""The engine process's IO thread and its configuration: the one thread that owns the
ROUTER socket (a ZMQ socket must stay on one thread). It receives and decodes client
frames, answers oversized ones, encodes and sends engine messages without ever blocking
on a client (per-client backlogs, coalesced progress), and runs heartbeats and client
liveness. The busy loop (`engine.serve.proc`) talks to it through two queues."""
from __future__ import annotations

import collections
import dataclasses
import errno
import hmac
import logging
import queue
import threading
import time

import zmq

from engine.protocol import (
    PROTOCOL_VERSION, EngineDead, Goodbye, Heartbeat, Hello, Progress, ProgressBatch, Rejected, Welcome, client_decoder, describe_decode_error, encoder,
)
from engine.serve import transport
from engine.serve.frames import peek_request_id

log = logging.getLogger("diffslot.engine")

MAX_BODY_BYTES = 64 * 1024  # a client message is a few hundred bytes; more is abuse
HARD_FRAME_LIMIT = 16 << 20  # ZMQ's MAXMSGSIZE: past it ZMQ drops the connection unanswered


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
    step_timeout_s: float = 120.0  # watchdog on core.step(); 0: none
    drain_timeout_s: float = 30.0  # SIGTERM: time for requests in flight to finish
    max_queue_per_client: int | None = None  # requests of one client waiting for a slot; None: no cap
    max_backlog_bytes: int = 512 << 20  # output bytes held for all clients together (soft cap, fair shares)
    auth_token: str = ""  # required in Hello when set
    max_message_bytes: int = MAX_BODY_BYTES
    coalesce_progress: bool = True  # one progress message per client per step (False: one per request)


# Items on the busy loop's input queue besides ("msg", identity, message, arrival).
WAKE = ("wake",)
_PROGRESS = object()  # a peer's backlog entry standing for its pending (coalesced) progress


@dataclasses.dataclass
class _Peer:
    """The IO thread's view of a client connection."""

    last_seen: float
    backlog: collections.deque = dataclasses.field(default_factory=collections.deque)  # [kind, frames, nbytes]
    pending_progress: dict = dataclasses.field(default_factory=dict)  # request id → (step, total), coalesced
    backlog_bytes: int = 0


def _nbytes(frames: list) -> int:
    total = 0
    for frame in frames[1:]:
        total += frame.nbytes if hasattr(frame, "nbytes") else len(frame)
    return total


class IOThread(threading.Thread):
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
        self.backlog_bytes = 0
        self.cpu_s = 0.0  # this thread's CPU time (time.thread_time), for the IO-cost measurement
        self.messages_sent = 0
        self.messages_received = 0
        self.oversized_frames = 0
        self.auth_failures = 0
        self._token = config.auth_token.encode()
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
                self.cpu_s = time.thread_time()
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
            self.messages_received += 1
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
        limit = self.config.max_message_bytes
        if len(body) > limit:
            self.oversized_frames += 1
            request_id = peek_request_id(body)
            log.info("rejected an oversized frame of %d bytes (request %r)", len(body), request_id)
            self._send_now(identity, Rejected(request_id, f"message of {len(body)} bytes exceeds the engine's limit "
                                                          f"of {limit} bytes per message (Welcome.max_message_bytes)",
                                              "params" if request_id else None))
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
        if self._token and not hmac.compare_digest(msg.token.encode(), self._token):
            self.auth_failures += 1
            log.warning("client %s (pid %d) refused: %s token", identity.hex(), msg.pid,
                        "wrong" if msg.token else "no")
            self._send_now(identity, Rejected("", "authentication failed: this engine requires a token "
                                                  "(Client(address, token=...) or $DIFFSLOT_TOKEN)", "token"))
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
        if outcome == "sent":
            self.messages_sent += 1
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
        if isinstance(msg, (Progress, ProgressBatch)):  # only the latest step matters to a reader that is behind
            items = [(msg.request_id, msg.step, msg.total)] if isinstance(msg, Progress) else msg.items
            first = not peer.pending_progress
            for request_id, step, total in items:
                peer.pending_progress[request_id] = (step, total)
            if not first:
                return  # merged into the pending entry already in the backlog
            entry = [_PROGRESS, None, 0]
        else:
            entry = [None, frames, _nbytes(frames)]
            peer.backlog_bytes += entry[2]
            self.backlog_bytes += entry[2]
        peer.backlog.append(entry)
        self.backlog_messages += 1
        if len(peer.backlog) > self.config.max_backlog_messages:
            self._write_off(identity, f"more than {self.config.max_backlog_messages} messages behind")

    def _progress_frames(self, identity: bytes, peer: _Peer) -> list:
        items = [(rid, step, total) for rid, (step, total) in peer.pending_progress.items()]
        msg = Progress(*items[0]) if len(items) == 1 else ProgressBatch(items)
        return [identity, self._encoder.encode(msg)]

    def _flush_backlogs(self) -> None:
        for identity, peer in list(self.peers.items()):
            while peer.backlog:
                kind, frames, nbytes = peer.backlog[0]
                if kind is _PROGRESS:
                    frames = self._progress_frames(identity, peer)
                outcome = self._try_send(frames)
                if outcome == "full":
                    break
                if outcome == "gone":
                    self._write_off(identity, "connection closed")
                    break
                peer.backlog.popleft()
                self.backlog_messages -= 1
                self.messages_sent += 1
                if kind is _PROGRESS:
                    peer.pending_progress.clear()
                else:
                    peer.backlog_bytes -= nbytes
                    self.backlog_bytes -= nbytes

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
        self.backlog_bytes -= peer.backlog_bytes
        self.gone[identity] = time.monotonic()
        self.input_queue.put(("gone", identity, reason))
