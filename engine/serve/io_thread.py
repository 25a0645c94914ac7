"""The engine process's IO thread: the one thread that owns the ROUTER socket (a ZMQ
socket must stay on one thread). It receives and decodes client frames, answers
oversized ones, encodes and sends engine messages without ever blocking on a client
(per-client backlogs, coalesced progress), runs heartbeats and client liveness, and
answers health probes from the busy loop's heartbeat. The busy loop
(`engine.serve.proc`) talks to it through `engine.serve.handoff`.

Inputs are bounded per client, twice. A client may send `max_client_frames_per_s`
frames a second (with a quarter second's burst); past it the thread stops reading the
socket until the client is back within its rate (`_pace`), so what it sends waits in
its own ZMQ pipe, whose high-water mark then blocks the sender: a flood costs the engine
a bounded share of this thread, and the other clients' frames, which ZMQ fair-queues
with the flood's, are read in their turn. And a client with `max_pending_per_client`
messages still waiting for the busy loop gets its further Submits and Stats answered
here with `Rejected(retry_after_s)`, never queued; Cancel and Delivered, which release
resources, still pass, up to 16 times that bound, past which the client is written off.

Byte inputs: a Submit's body may be followed by one frame per path in `Submit.inputs`
(`engine.protocol.frame_paths`: "image", "mask"); they are received zero-copy (only the identity and the body are
copied), checked here against `Welcome.max_input_bytes` and the names, and attached to
the params as memoryviews over the received frames before the busy loop sees the
request. Anything wrong is a `Rejected` naming the field, sent from this thread. What
they hold (encoded bytes and decoded pixels, `held_nbytes`) is counted against the
client's and the engine's image-input bounds (`engine.serve.handoff.InputBytes`) from
here until the request ends; past either, the Submit is `Rejected(retry_after_s)` here.

A stall of this thread itself (the process stopped, or starved) is not its clients'
silence: `_beat` credits them with the time it did not run.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import hmac
import io
import logging
import math
import queue
import select
import threading
import time
import warnings

import msgspec
import zmq

from engine.protocol import (
    PROTOCOL_VERSION, Cancel, Delivered, EngineDead, Goodbye, Health, HealthReply, Heartbeat, Hello,
    Progress, ProgressBatch, Rejected, Stats, Submit, Welcome, attach_frames, client_decoder, describe_decode_error,
    encoder, path_problem,
)
from engine.models.geometry import MAX_SIZE_FACTOR
from engine.serve import transport
from engine.serve.frames import peek_request_id
from engine.serve.handoff import (
    Broadcast, ClientConnected, ClientGone, FromClient, InputQueues, Send, Shutdown, StopIO,
)
from engine.serve.heartbeat import LoopHeartbeat
from engine.serve.options import ProcConfig

log = logging.getLogger("diffslot.engine")

HARD_FRAME_LIMIT = 16 << 20  # ZMQ's MAXMSGSIZE: past it ZMQ drops the connection unanswered
RECEIVE_BATCH = 64  # frames read before the outputs are looked at again
FRAME_BURST_S = 0.25  # a client may send a quarter of a second's frames at once
RELEASE_MESSAGES_FACTOR = 16  # Cancel / Delivered pending beyond 16x max_pending_per_client: written off
PENDING_RETRY_S = 0.1
INPUT_BYTES_RETRY_S = 0.5  # image inputs are held until their requests end: seconds, not steps
HEADER_PREFIX_BYTES = 64 << 10  # an image's size is read from at most this much of its start
DECODED_BYTES_PER_PIXEL = 4  # PIL keeps RGB, RGBA and 16-bit grey pixels in 4 bytes each
GONE_MEMORY_S = 600.0  # how long a written-off identity is refused


@dataclasses.dataclass
class _Queued:
    """A message a client has not taken yet. A progress entry has no frames of its own: it
    stands for the peer's pending (coalesced) progress, encoded when it is sent."""

    frames: list | None
    nbytes: int = 0

    @property
    def is_progress(self) -> bool:
        return self.frames is None


@dataclasses.dataclass
class FrameRate:
    """A token bucket: `rate` a second, `burst` at once."""

    rate: float
    burst: float
    tokens: float = 0.0
    refilled_at: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float) -> float:
        """Count one frame; the seconds until the next one is within the rate (0: now)."""
        self._refill(now)
        self.tokens -= 1.0
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def try_take(self, now: float) -> bool:
        """Count one if the rate allows it now."""
        self._refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.refilled_at) * self.rate)
        self.refilled_at = now


@dataclasses.dataclass
class _Peer:
    """The IO thread's view of a client connection."""

    last_seen: float
    frame_rate: FrameRate
    backlog: collections.deque = dataclasses.field(default_factory=collections.deque)  # of _Queued
    pending_progress: dict = dataclasses.field(default_factory=dict)  # request id → (step, total), coalesced
    backlog_bytes: int = 0


def _nbytes(frames: list) -> int:
    total = 0
    for frame in frames[1:]:
        total += frame.nbytes if hasattr(frame, "nbytes") else len(frame)
    return total


def held_nbytes(data: memoryview, max_side: int) -> int:
    """What one image input frame holds in the engine until its request ends: its encoded
    bytes and its decoded pixels, sized from the image's header (read from the frame's
    first bytes, not copied whole); where the header cannot be read there, the largest
    image the core takes (its request may still be refused at intake, which releases it)."""
    from PIL import Image

    side_w = side_h = max_side
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            side_w, side_h = Image.open(io.BytesIO(data[:HEADER_PREFIX_BYTES])).size
    except Exception:
        pass
    return data.nbytes + DECODED_BYTES_PER_PIXEL * min(side_w, max_side) * min(side_h, max_side)


class IOThread(threading.Thread):
    """Owns the ROUTER socket: receives and decodes client frames, encodes and sends
    engine messages, runs heartbeats and client liveness, never blocks on a client."""

    def __init__(self, router: zmq.Socket, config: ProcConfig, welcome: Welcome, inputs: InputQueues,
                 output_queue: queue.SimpleQueue, waker: transport.Waker, heartbeat: LoopHeartbeat):
        super().__init__(name="diffslot-io", daemon=True)
        self.router = router
        self.config = config
        self.welcome = welcome
        self.inputs = inputs
        self.output_queue = output_queue
        self.waker = waker
        self.heartbeat = heartbeat
        self.peers: dict[bytes, _Peer] = {}
        self.gone: dict[bytes, float] = {}  # written-off identities → when
        self.backlog_messages = 0  # read by the busy loop for stats (an int store is atomic)
        self.backlog_bytes = 0
        self.cpu_s = 0.0  # this thread's CPU time (time.thread_time), for the IO-cost measurement
        self.messages_sent = 0
        self.messages_received = 0
        self.oversized_frames = 0
        self.auth_failures = 0
        self.rejected_pending = 0  # Submits and Stats refused: their client had too many waiting
        self.health_probes = 0
        self.rejected_inputs = 0  # Submits whose image input frames were refused (count, names, size)
        self.rejected_input_bytes = 0  # Submits refused: their client, or the engine, held too many input bytes
        self._max_side = MAX_SIZE_FACTOR * max(1, welcome.native_size)  # the largest image side the core takes
        self._token = config.auth_token.encode()
        self._decoder = client_decoder()
        self._encoder = encoder()
        self._heartbeat_frame = self._encoder.encode(Heartbeat())
        self._release_limit = RELEASE_MESSAGES_FACTOR * config.max_pending_per_client
        self._paused_until = 0.0  # no reading before then: a client sent faster than its frame rate
        self._sessionless_rate = self._frame_rate()  # frames of identities without a session share one
        self.paused_s = 0.0  # time reading was paused for clients over their frame rate
        self.stalled_s = 0.0  # time this thread did not run at all (the process stopped or starved)
        self._beat_at = 0.0

    def _frame_rate(self) -> FrameRate:
        rate = self.config.max_client_frames_per_s
        return FrameRate(rate, max(1.0, rate * FRAME_BURST_S))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.waker.read_fd, zmq.POLLIN)
        next_beat = time.monotonic()
        stopping = False
        try:
            while not stopping:
                now = time.monotonic()
                wait_s = max(0.0, next_beat - now)
                if self.backlog_messages:
                    wait_s = min(wait_s, 0.005)  # retry full pipes soon, without spinning
                if now < self._paused_until:  # outputs only, woken at once for them (select's timeout is fine-grained)
                    woken, _, _ = select.select([self.waker.read_fd], [], [], min(wait_s, self._paused_until - now))
                    readable = False
                else:
                    events = dict(poller.poll(math.ceil(wait_s * 1000)))
                    woken, readable = self.waker.read_fd in events, self.router in events
                if woken:
                    self.waker.drain()
                if readable:
                    self._receive()
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
            self.inputs.control.put(Shutdown("IO thread crashed"))
        finally:
            self.router.close(linger=500)

    def _receive(self) -> None:
        """Read up to RECEIVE_BATCH frames, fewer if a flood pauses reading."""
        for _ in range(RECEIVE_BATCH):
            try:
                frames = self._recv_message()
            except zmq.Again:
                return
            self.messages_received += 1
            arrival = time.monotonic()
            try:
                self._handle_frames(frames, arrival)
            except Exception:  # one odd frame must not take the socket down
                log.exception("failed to handle a client frame")
                self._send_now(frames[0], Rejected("", "internal error on this message (the engine's log has "
                                                       "the details)"))
            if self._paused_until > arrival:
                return

    def _recv_message(self) -> list:
        """One client message: [identity, body, *input frames]. The identity and the body
        are bytes; frames after the body (a Submit's image inputs) are zmq.Frames, not
        copied. Raises zmq.Again when nothing waits (the parts of a message arrive together)."""
        frames = [self.router.recv(zmq.NOBLOCK)]
        while self.router.getsockopt(zmq.RCVMORE):
            frames.append(self.router.recv() if len(frames) < 2 else self.router.recv(copy=False))
        return frames

    def _handle_frames(self, frames: list, arrival: float) -> None:
        identity = frames[0]
        peer = self.peers.get(identity)
        self._pace(peer.frame_rate if peer is not None else self._sessionless_rate, arrival)
        if identity in self.gone:
            self._send_now(identity, EngineDead("this client was written off by the engine (silent, "
                                                "too far behind, or said goodbye); reconnect"))
            return
        if peer is not None:
            peer.last_seen = arrival
        if len(frames) < 2:
            self._send_now(identity, Rejected("", "malformed message: expected one frame, got 0"))
            return
        body, extra = frames[1], frames[2:]
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
        input_bytes = 0
        if isinstance(msg, Submit) and (msg.inputs or extra):
            msg = self._attach_inputs(identity, msg, extra)
            if msg is None:
                return
            input_bytes = sum(held_nbytes(frame.buffer, self._max_side) for frame in extra)
        elif extra:
            self._send_now(identity, Rejected(getattr(msg, "request_id", ""), f"malformed message: expected one "
                                                                              f"frame, got {len(frames) - 1}"))
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
        if isinstance(msg, Health):
            self._answer_health(identity, msg)
            return
        self._forward(identity, msg, arrival, input_bytes)

    def _attach_inputs(self, identity: bytes, msg: Submit, extra: list) -> Submit | None:
        """The Submit with its input frames set on its params, or None once it has been
        Rejected naming the field (the frame count, the names, a frame's size)."""
        names, limit = msg.inputs, self.welcome.max_input_bytes
        problem = None
        for position, name in enumerate(names):
            if not isinstance(name, str) or name in names[:position]:
                problem = f"input {name!r} named twice in Submit.inputs", "inputs"
            else:
                why = path_problem(msg.params, name)
                field = name.split(".")[0]
                if why is not None:
                    problem = why, field if why.startswith("given both") else "inputs"
                elif position >= len(extra):
                    problem = (f"Submit.inputs names {len(names)} frame(s) ({', '.join(names)}) but {len(extra)} "
                               f"followed the message: no frame for {name!r}", field)
                elif len(extra[position]) > limit:
                    problem = (f"{len(extra[position])} bytes, more than the engine takes ({limit} bytes per input "
                               f"frame, Welcome.max_input_bytes)", field)
            if problem is not None:
                break
        if problem is None and len(extra) > len(names):
            problem = (f"{len(extra)} frame(s) followed the message but Submit.inputs names {len(names)}",
                       "inputs")
        if problem is not None:
            self.rejected_inputs += 1
            log.info("request %r: image inputs rejected (field %s): %s", msg.request_id, problem[1], problem[0])
            if identity in self.peers:  # before Hello: refused by the session check
                self._send(identity, Rejected(msg.request_id, problem[0], problem[1]), None)
            else:
                self._send_now(identity, Rejected(msg.request_id, "send Hello before anything else", "version"))
            return None
        params = attach_frames(msg.params, names, [frame.buffer for frame in extra])
        return msgspec.structs.replace(msg, params=params, inputs=())

    def _forward(self, identity: bytes, msg: Submit | Cancel | Delivered | Stats, arrival: float,
                 input_bytes: int = 0) -> None:
        pending = self.inputs.pending(identity)
        if isinstance(msg, (Cancel, Delivered)):
            if pending >= self._release_limit:
                self._write_off(identity, f"more than {self._release_limit} messages waiting for the engine")
                return
        elif pending >= self.config.max_pending_per_client:
            self.rejected_pending += 1
            self._send(identity, Rejected(getattr(msg, "request_id", ""),
                                          f"{pending} messages of this client are waiting for the engine, its limit "
                                          f"(--max-pending-per-client); slow down", None, PENDING_RETRY_S), None)
            return
        if input_bytes:
            why = self.inputs.input_bytes.hold(identity, input_bytes)
            if why is not None:
                self.rejected_input_bytes += 1
                self._send(identity, Rejected(msg.request_id, f"{why}; retry when earlier requests have ended",
                                              None, INPUT_BYTES_RETRY_S), None)
                return
        self.inputs.put(FromClient(identity, msg, arrival, input_bytes))

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
            if len(self.peers) >= self.config.max_clients:
                self._send_now(identity, Rejected("", f"the engine serves {len(self.peers)} clients, its limit "
                                                      f"(--max-clients)", None, 1.0))
                return
            self.peers[identity] = _Peer(arrival, self._frame_rate())
            self.inputs.put(ClientConnected(identity, msg))
        self._send_now(identity, self.welcome)

    def _pace(self, frame_rate: FrameRate, now: float) -> None:
        """Past its frame rate, a client is not read until it is back within it: ZMQ holds
        what it sends in its pipe, whose high-water mark then blocks the sender, and when
        reading resumes ZMQ fair-queues the other clients' frames with its."""
        wait_s = frame_rate.take(now)
        if wait_s > 0:
            self._paused_until = max(self._paused_until, now + wait_s)
            self.paused_s += wait_s

    def _answer_health(self, identity: bytes, msg: Health) -> None:
        self.health_probes += 1
        beat = self.heartbeat
        verdict = beat.verdict()
        stats_at = beat.stats_at
        self._send(identity, HealthReply(
            msg.token, verdict.alive, beat.draining, verdict.reason, verdict.step_running_s, verdict.loop_silent_s,
            beat.stall_limit_s, beat.stats, time.monotonic() - stats_at if stats_at else 0.0), None)

    # ------------------------------------------------------------------ sending
    def _send_outputs(self) -> bool:
        """Drain the busy loop's output queue. True once it says stop."""
        while True:
            try:
                item = self.output_queue.get_nowait()
            except queue.Empty:
                return False
            if isinstance(item, Send):
                self._send(item.identity, item.message, item.payload)
            elif isinstance(item, Broadcast):
                for identity in list(self.peers):
                    self._send(identity, item.message, None)
            elif isinstance(item, StopIO):
                return True

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
        elif outcome == "full":
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
            entry = _Queued(None)
        else:
            entry = _Queued(frames, _nbytes(frames))
            peer.backlog_bytes += entry.nbytes
            self.backlog_bytes += entry.nbytes
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
                entry = peer.backlog[0]
                frames = self._progress_frames(identity, peer) if entry.is_progress else entry.frames
                outcome = self._try_send(frames)
                if outcome == "full":
                    break
                if outcome == "gone":
                    self._write_off(identity, "connection closed")
                    break
                peer.backlog.popleft()
                self.backlog_messages -= 1
                self.messages_sent += 1
                if entry.is_progress:
                    peer.pending_progress.clear()
                else:
                    peer.backlog_bytes -= entry.nbytes
                    self.backlog_bytes -= entry.nbytes

    def _beat(self, now: float) -> None:
        # Beats come every heartbeat interval; a longer gap means this thread itself did not
        # run (the process was stopped, or starved of CPU): its clients' silence over that
        # gap is not theirs, and a stall must not write them off.
        lost = now - self._beat_at - 2 * self.config.heartbeat_interval_s if self._beat_at else 0.0
        self._beat_at = now
        if lost > 0:
            self.stalled_s += lost
            for peer in self.peers.values():
                peer.last_seen = min(now, peer.last_seen + lost)
        for identity, peer in list(self.peers.items()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                self._write_off(identity, f"no message for {self.config.peer_timeout_s:g}s")
            elif not peer.backlog and self._try_send([identity, self._heartbeat_frame]) == "gone":
                self._write_off(identity, "connection closed")
        for identity, when in list(self.gone.items()):  # remember write-offs for a while only
            if now - when > GONE_MEMORY_S:
                del self.gone[identity]

    def _write_off(self, identity: bytes, reason: str) -> None:
        peer = self.peers.pop(identity, None)
        if peer is None:
            return
        self.backlog_messages -= len(peer.backlog)
        self.backlog_bytes -= peer.backlog_bytes
        self.gone[identity] = time.monotonic()
        self.inputs.put_gone(ClientGone(identity, reason))
