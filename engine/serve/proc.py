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
canceled. With `auth_token` set, a Hello must carry it (compared in constant time).

Shutdown (R15): the first SIGTERM drains — new Submits get `Rejected("engine shutting
down", retry_after_s)`, requests in flight get `drain_timeout_s` to finish, the rest
are canceled (`Canceled`), then every client gets `EngineDead` and the process exits 0.
A second SIGTERM, or SIGINT (Ctrl-C), stops at once: every request is aborted,
`EngineDead`, exit 0. A step running longer than `step_timeout_s` trips the watchdog
(engine.serve.watchdog): `EngineDead` to every client from the IO thread, decode
workers killed, shared memory and socket removed, exit code 3 (EXIT_HUNG).

Slow clients (R8): sends never block (NOBLOCK + ROUTER_MANDATORY: a full pipe raises
EAGAIN instead of blocking or silently dropping). What does not fit waits in that
client's backlog, where Progress messages are coalesced to the latest one per
request. Each client has an output budget: the worst-case output bytes of its
unfinished requests plus the bytes it has been sent but has not acknowledged with
`Delivered`. A Submit that would exceed it is Rejected, so a client that stops
reading holds at most its own budget and never the engine or other clients. Across
clients, `max_backlog_bytes` caps those bytes together: past it, a client holding more
than its fair share (cap / clients holding bytes) is Rejected with retry_after_s, so
the clients that read stay served. `max_queue_per_client` caps the requests one client
may have waiting for a slot, so no client fills the core's queue alone.

Progress is coalesced: the busy loop sends one message per client per step (`Progress`
for one request, `ProgressBatch` for several), and a client that is behind keeps only
one pending progress entry, holding the latest step of each of its requests.

Frames: ZMQ drops a connection whose message exceeds MAXMSGSIZE, which a client can
only read as "engine died"; so MAXMSGSIZE is set far above `max_message_bytes`
(HARD_FRAME_LIMIT) and the IO thread answers a frame over `max_message_bytes` with a
`Rejected` that names the limit and, where the frame carries one, the request id.
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
from typing import Callable

import msgspec
import zmq

from engine.serve import transport
from engine.serve.io_thread import HARD_FRAME_LIMIT, WAKE, IOThread, ProcConfig
from engine.serve.watchdog import StepWatchdog
from engine.core.interface import CoreInterface
from engine.decode.arena import sweep_stale as sweep_stale_segments
from engine.decode.stage import DecodedOutput, DecodeStage
from engine.core.outputs import (
    DenoiseFinished, PreviewReady, RequestCanceled, RequestFailed, RequestRejected, StepProgress,
)
from engine.serve.metrics import EngineMetrics
from engine.protocol import (
    PROTOCOL_VERSION, Accepted, Cancel, Canceled, Completed, Delivered, EngineDead, Failed, GenerateParams,
    PartialImage, Progress, ProgressBatch, Rejected, Stats, StatsReply, Submit, Timings,
    Welcome,
)

log = logging.getLogger("diffslot.engine")

EXIT_HUNG = 3  # exit code when the step watchdog fires
SHUTDOWN_RETRY_S = 1.0  # retry_after_s of "shutting down" rejections: a restarted engine or another replica
STATS_INTERVAL_S = 0.5  # metrics gauges refresh at most this often
PREVIEW_PARAMS = GenerateParams(prompt="", output="png")  # partial images are PNGs, as OpenAI's

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
    previews: set[str] = dataclasses.field(default_factory=set)  # preview decodes in the decode stage
    held_final: tuple | None = None  # (message, payload) waiting for its previews to go out first


@dataclasses.dataclass
class _Client:
    identity: bytes
    tag: str  # namespaces request ids in the core, so clients cannot clash or cancel each other's
    requests: set = dataclasses.field(default_factory=set)  # engine request ids
    used_bytes: int = 0  # reserved + sent-but-unacknowledged output bytes
    undelivered: dict = dataclasses.field(default_factory=dict)  # client request id → bytes sent


class EngineCoreProc:
    """Runs an EngineCore behind a ROUTER socket until SIGTERM/SIGINT."""

    def __init__(self, core: CoreInterface, config: ProcConfig,
                 make_decode_stage: Callable[[Callable[[], None]], DecodeStage]):
        self.core = core
        self.config = config
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is reentrant: signal handlers use it
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.metrics = EngineMetrics()
        self._requests: dict[str, _Request] = {}  # engine request id → record
        self._clients: dict[bytes, _Client] = {}
        self._step_needed = False  # an abort happened: step so the core can report it
        self._stopping: str | None = None
        self._draining: str | None = None  # SIGTERM: finish what is in flight, accept nothing new
        self._drain_deadline = 0.0
        self._progress_out: dict[bytes, list] = {}  # this step's progress, one message per client
        self.fault_stats = collections.Counter()
        self._pending_outputs = False
        self._started_at = time.monotonic()
        self._last_stats = 0.0
        self._ipc_file: str | None = None
        self._previews: dict[str, tuple[str, int, int, int]] = {}  # preview decode id → (request, index, step, total)
        self.preview_stats = collections.Counter()
        self._output_handlers = {
            PreviewReady: self._on_preview_ready,
            StepProgress: self._on_step_progress,
            DenoiseFinished: self._on_denoise_finished,
            RequestCanceled: self._on_request_canceled,
            RequestFailed: self._on_request_failed,
        }

        transport.check_bind_address(config.address, config.allow_remote_bind)
        for name in sweep_stale_segments():  # R10: what an engine killed by SIGKILL left
            log.warning("removed stale shared memory segment /dev/shm/%s (its engine is gone)", name)
        path = transport.ipc_path(config.address)
        if path is not None:
            if transport.ipc_in_use(path):
                raise OSError(errno.EADDRINUSE, f"another process listens on {config.address}")
            path.parent.mkdir(parents=True, exist_ok=True)
        self.ctx = zmq.Context()
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, config.sndhwm)
        router.setsockopt(zmq.MAXMSGSIZE, max(HARD_FRAME_LIMIT, 2 * config.max_message_bytes))
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
        info = core.model_info()
        welcome = Welcome(
            version=PROTOCOL_VERSION, engine_pid=os.getpid(), heartbeat_interval_s=config.heartbeat_interval_s,
            peer_timeout_s=config.peer_timeout_s, output_budget_bytes=config.output_budget_bytes,
            model=config.model_name or info.name, prompts=list(info.prompts), native_size=info.native_size,
            pipeline=info.pipeline, max_message_bytes=config.max_message_bytes)
        self.io = IOThread(router, config, welcome, self.input_queue, self.output_queue, self.waker)
        self.decode_stage = make_decode_stage(lambda: self.input_queue.put(WAKE))
        if config.metrics_port is not None:
            self.metrics.start_server(config.metrics_port)
        self.watchdog = StepWatchdog(config.step_timeout_s, self._on_hang) if config.step_timeout_s > 0 else None
        if self.watchdog is not None:
            watchdog = self.watchdog
            self.metrics.watch_step(lambda: 0.0 if (t := watchdog.step_started) is None else time.monotonic() - t)
        self.io.start()
        if self.watchdog is not None:
            self.watchdog.start()

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
        """First SIGTERM: drain. SIGINT, or a SIGTERM while draining: stop at once (the
        step in progress ends first). While shutting down: nothing more to do."""
        name = signal.Signals(signum).name
        if self._stopping:
            return
        if signum == signal.SIGTERM and self._draining is None:
            self.input_queue.put(("drain", f"engine shutting down ({name})"))
            return
        self._stopping = f"engine shutting down at once ({name})"
        self.input_queue.put(WAKE)

    def _on_hang(self, reason: str) -> None:
        """The watchdog thread, while the busy loop is stuck in a step: tell every client,
        release what outlives us, exit non-zero. No lock of the busy loop's is taken."""
        self.fault_stats["watchdog_fired"] += 1
        self.output_queue.put((None, EngineDead(reason), None))
        self.output_queue.put(None)
        self.waker.wake()
        self.io.join(timeout=2.0)
        for pid in transport.descendants():  # decode workers (and multiprocessing helpers)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in transport.own_segments():
            try:
                path.unlink()
            except OSError:
                pass
        if self._ipc_file:
            try:
                os.unlink(self._ipc_file)
            except OSError:
                pass
        log.critical("watchdog: exiting with code %d", EXIT_HUNG)
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:
                pass
        os._exit(EXIT_HUNG)

    def shutdown(self) -> None:
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        if self.watchdog is not None:
            self.watchdog.stop()
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
            if self._draining is not None:
                self._check_drain()
            self._publish()

    # ------------------------------------------------------------------ drain (SIGTERM)
    def _begin_drain(self, reason: str) -> None:
        if self._draining is not None or self._stopping:
            return
        self._draining = reason
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        live = sum(1 for r in self._requests.values() if not r.terminal)
        log.info("%s: draining %d request(s) in flight for up to %gs; new submissions are rejected",
                 reason, live, self.config.drain_timeout_s)

    def _check_drain(self) -> None:
        live = [(rid, r) for rid, r in self._requests.items() if not r.terminal]
        if not live:
            self._stopping = f"{self._draining}: drained"
            return
        if time.monotonic() < self._drain_deadline:
            return
        log.warning("drain timeout (%gs): canceling %d request(s) still in flight",
                    self.config.drain_timeout_s, len(live))
        self.fault_stats["drain_canceled"] += len(live)
        for rid, record in live:
            record.cancel_requested = True
            if record.in_decode:
                self.decode_stage.cancel(rid)
            timings = msgspec.structs.replace(record.timings or Timings(),
                                              total_s=time.monotonic() - record.arrival)
            self.metrics.finished("canceled", timings)
            self._finish(rid, record, Canceled(record.client_request_id, timings))
        try:
            self.core.abort_requests([rid for rid, _ in live])
        except Exception:
            log.exception("abort after the drain timeout failed")
        self._stopping = f"{self._draining}: drain timeout of {self.config.drain_timeout_s:g}s"

    def _has_work(self) -> bool:
        """Whether step() has something to do now. Requests that only await their decode
        do not count: the decode stage wakes the loop when it is done."""
        return self._step_needed or self.core.has_work()

    def _process_input_queue(self, block: bool) -> None:
        if block:  # idle: sleep until a message, a decode, or a signal (or refresh gauges now and then)
            if self.watchdog is not None:
                self.watchdog.idle()
            timeout = STATS_INTERVAL_S * 2
            if self._draining is not None:
                timeout = min(timeout, max(0.01, self._drain_deadline - time.monotonic()))
            try:
                self._handle_input(self.input_queue.get(timeout=timeout))
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
        if self._has_work():
            watchdog = self.watchdog
            if watchdog is not None:
                watchdog.begin()
            try:
                outputs = self.core.step()
            finally:
                if watchdog is not None:
                    watchdog.end()
        else:
            outputs = []
        self._step_needed = False
        # Cancels that arrived while the step ran take effect before its outputs are
        # published, so a canceled request does not report progress it will never use.
        self._process_input_queue(block=False)
        for output in outputs:
            self._handle_core_output(output)
        if self._progress_out:
            self._send_progress()
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
        elif kind == "drain":
            self._begin_drain(item[1])

    def _submit(self, client: _Client, msg: Submit, arrival: float) -> None:
        rid = f"{client.tag}:{msg.request_id}"
        if self._draining is not None:
            self._reject(client, msg.request_id, f"{self._draining}: not accepting new requests", None,
                         retry_after_s=SHUTDOWN_RETRY_S)
            return
        if rid in self._requests:
            self._reject(client, msg.request_id, "request_id is already in use by an unfinished request",
                         "request_id")
            return
        limit = self.config.max_queue_per_client
        if limit:
            waiting = sum(1 for r in client.requests if not self._requests[r].started
                          and not self._requests[r].terminal)
            if waiting >= limit:
                self.fault_stats["rejected_client_queue_share"] += 1
                self._reject(client, msg.request_id,
                             f"this client already has {waiting} requests waiting for a slot: its share of the "
                             f"queue is {limit} (--max-queue-per-client)", None, retry_after_s=0.5)
                return
        reserve = self.core.output_bytes(msg.params)
        if client.used_bytes + reserve > self.config.output_budget_bytes:
            self._reject(client, msg.request_id,
                         f"client output budget exhausted: {client.used_bytes} of "
                         f"{self.config.output_budget_bytes} bytes undelivered or reserved "
                         f"(read results and acknowledge them)", None, retry_after_s=1.0)
            return
        cap = self.config.max_backlog_bytes
        if cap:
            held = sum(c.used_bytes for c in self._clients.values())
            if held + reserve > cap:
                holders = sum(1 for c in self._clients.values() if c.used_bytes > 0 or c is client)
                share = cap // max(1, holders)
                if client.used_bytes + reserve > share:
                    self.fault_stats["rejected_backlog_bytes"] += 1
                    self._reject(client, msg.request_id,
                                 f"engine output backlog full: {held} of {cap} bytes held for clients "
                                 f"(--max-backlog-bytes); this client holds {client.used_bytes}, over its fair "
                                 f"share of {share} (read results and acknowledge them)", None, retry_after_s=1.0)
                    return
        try:
            self.core.add_request(rid, msg.params, arrival_time=arrival, partial_images=msg.partial_images)
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
        log.info("request %s accepted: %s %s×%d g=%g seed=%d → %s", rid, msg.params.prompt, msg.params.sampler,
                 msg.params.steps, msg.params.guidance, msg.params.seed, msg.params.output)

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
                self._progress_out.setdefault(record.identity, []).append(
                    (output.request_id, record.client_request_id, output.step, output.total))

    def _send_progress(self) -> None:
        """This step's progress: one message per client (issue 14)."""
        out, self._progress_out = self._progress_out, {}
        for identity, entries in out.items():
            items = []
            for rid, client_request_id, step, total in entries:
                record = self._requests.get(rid)
                if record is not None and not record.terminal and not record.cancel_requested:
                    items.append((client_request_id, step, total))
            if len(items) == 1 or not self.config.coalesce_progress:
                for item in items:
                    self._send(identity, Progress(*item))
            elif items:
                self._send(identity, ProgressBatch(items))

    def _on_preview_ready(self, output: PreviewReady, record: _Request | None) -> None:
        """Decode the x0 estimate off the busy loop, in the decode stage, as a PNG."""
        if record is None or record.terminal or record.cancel_requested:
            return
        preview_id = f"{output.request_id}#preview{output.index}"
        record.previews.add(preview_id)
        self._previews[preview_id] = (output.request_id, output.index, output.step, output.total)
        self.decode_stage.submit(preview_id, output.latents, PREVIEW_PARAMS, Timings())

    def _preview_decoded(self, decoded: DecodedOutput) -> None:
        rid, index, step, total = self._previews.pop(decoded.request_id)
        self.preview_stats["preview_decodes"] += 1
        self.preview_stats["preview_decode_s"] += decoded.timings.decode_s
        record = self._requests.get(rid)
        if record is None:
            return
        record.previews.discard(decoded.request_id)
        if decoded.error is None and not record.terminal and not record.cancel_requested:
            self._send(record.identity, PartialImage(record.client_request_id, index, step, total),
                       decoded.payload)
        if not record.previews and record.held_final is not None:
            message, payload = record.held_final
            record.held_final = None
            self._finish(rid, record, message, payload)

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
        if record is not None and record.in_decode:
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
        if decoded.request_id in self._previews:
            self._preview_decoded(decoded)
            return
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
        if record.previews:  # partial images go out before the completed image
            record.held_final = (message, decoded.payload)
            return
        self._finish(rid, record, message, decoded.payload)

    def _finish(self, rid: str, record: _Request, message, payload=None) -> None:
        """Send the request's one final message and release what it holds."""
        record.terminal = True
        for preview_id in record.previews:  # nobody wants them any more
            self.decode_stage.cancel(preview_id)
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
            "outbound_backlog_bytes": self.io.backlog_bytes,
            "io_thread_cpu_s": self.io.cpu_s,
            "io_messages_sent": self.io.messages_sent,
            "io_messages_received": self.io.messages_received,
            "oversized_frames": self.io.oversized_frames,
            "auth_failures": self.io.auth_failures,
            "draining": int(self._draining is not None),
            "longest_step_s": self.watchdog.longest_step_s if self.watchdog is not None else 0.0,
            "step_timeout_s": self.config.step_timeout_s,
            **self.fault_stats,
            **self.preview_stats,
            **self.decode_stage.stats(),
        }


def run_engine(core: CoreInterface, config: ProcConfig, make_decode_stage) -> int:
    """Bind, serve until SIGTERM/SIGINT, clean up. Prints one 'ready' line on stdout."""
    try:
        proc = EngineCoreProc(core, config, make_decode_stage)
    except (OSError, ValueError, zmq.ZMQError) as exc:
        log.error("cannot serve on %s: %s", config.address, exc)
        return 2
    print(f"diffslot engine ready on {proc.address} (pid {os.getpid()})", flush=True)
    return proc.run()


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")


__all__ = ["EngineCoreProc", "ProcConfig", "run_engine", "configure_logging"]
