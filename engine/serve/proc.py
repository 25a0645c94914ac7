"""EngineCoreProc: the engine process around the pure core.

    client DEALERs ──▶ ROUTER ──▶ IO thread: recv, decode, validate ──▶ per-client inboxes
                                                                          │
           busy loop (main thread): take inputs → core.step() → outputs (engine.serve.delivery)
                                                                          │
    client DEALERs ◀── ROUTER ◀── IO thread: encode, send, backlog ◀── output queue

The core knows nothing of sockets, threads or signals; this module owns them. It drives
the core only through `engine.core.interface.CoreInterface` and reads only the output
types of `engine.core.outputs`. One ZMQ socket carries both directions and a ZMQ socket
must stay on one thread, so a single IO thread owns the ROUTER: it decodes client frames
and encodes engine messages off the busy loop, and answers health probes from the busy
loop's heartbeat (engine.serve.heartbeat), so a probe is answered during a long step.
The busy loop blocks on its control queue only when the core has no work and no client
message waits; the decode stage and signal handlers wake it through that queue.

Bounded work: the busy loop takes at most `inputs_per_iteration` client messages between
two steps, one client at a time in turn (engine.serve.handoff), and the IO thread keeps
each client's inbox under `max_pending_per_client` (engine.serve.io_thread).

Lifecycle: clients `Hello` → `Welcome`; both sides send `Heartbeat` every
`heartbeat_interval_s`. A client is written off when it says `Goodbye`, when it is
silent for `peer_timeout_s`, or at once when ZMQ reports its connection gone
(ROUTER_MANDATORY makes a send to it fail with EHOSTUNREACH); its requests are then
canceled. With `auth_token` set, a Hello must carry it (compared in constant time);
with a CURVE key pair the connection itself is encrypted and authenticated.

Shutdown: the first SIGTERM drains — new Submits get `Rejected("engine shutting
down", retry_after_s)`, requests in flight get `drain_timeout_s` to finish, the rest
are canceled (`Canceled`), then every client gets `EngineDead` and the process exits 0.
A second SIGTERM, or SIGINT (Ctrl-C), stops at once: every request is aborted,
`EngineDead`, exit 0. A step running longer than `step_timeout_s` trips the watchdog
(engine.serve.watchdog): `EngineDead` to every client from the IO thread, decode
workers killed, shared memory and socket removed, exit code 3 (EXIT_HUNG).

Slow clients: sends never block (NOBLOCK + ROUTER_MANDATORY: a full pipe raises
EAGAIN instead of blocking or silently dropping). What does not fit waits in that
client's backlog, where Progress messages are coalesced to the latest one per request.
Each client's output bytes are bounded by its budget, and all clients' together by
`max_backlog_bytes` (engine.serve.bookkeeping).

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
import pathlib
import queue
import re
import signal
import threading
import time
from typing import Callable

import msgspec
import zmq

from engine.core.interface import CoreInterface
from engine.core.outputs import RequestRejected
from engine.decode.arena import sweep_stale as sweep_stale_segments
from engine.decode.stage import DecodeStage
from engine.protocol import (
    MAX_INPUT_BYTES, PROTOCOL_VERSION, Accepted, Cancel, Delivered, EngineDead, Rejected, Stats, StatsReply, Submit,
    Welcome,
)
from engine.serve import transport
from engine.serve.bookkeeping import ClientRecord, RequestBook, RequestRecord
from engine.serve.delivery import Delivery
from engine.serve.handoff import (
    WAKE, Broadcast, ClientConnected, ClientGone, ControlItem, Drain, FromClient, InputBytes, InputQueues, Send,
    Shutdown, StopIO, Wake,
)
from engine.serve.heartbeat import LoopHeartbeat
from engine.serve.io_thread import HARD_FRAME_LIMIT, FrameRate, IOThread
from engine.serve.metrics import EngineMetrics
from engine.serve.options import ProcConfig
from engine.serve.watchdog import StepWatchdog

log = logging.getLogger("diffslot.engine")

EXIT_HUNG = 3  # exit code when the step watchdog fires
SHUTDOWN_RETRY_S = 1.0  # retry_after_s of "shutting down" rejections: a restarted engine or another replica
STATS_INTERVAL_S = 0.5  # metrics gauges and the health snapshot refresh at most this often
IDLE_WAIT_S = 1.0  # longest sleep of an idle busy loop: it beats at least this often
REJECTIONS_LOGGED_PER_S = 10  # at INFO; the rest at DEBUG (all of them are counted in the metrics)


class StartupError(RuntimeError):
    """The engine cannot start, for the reason the message gives in one line (what it tried)."""


def model_label(name: str) -> str:
    """What clients are told the model is: its folder's name, never the path on this host;
    a hub id (org/name, as a model loaded from the hub's cache names itself) whole."""
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name) and not pathlib.Path(name).exists():
        return name
    return pathlib.PurePath(name).name or name


class EngineCoreProc:
    """Runs a core behind a ROUTER socket until SIGTERM/SIGINT."""

    def __init__(self, core: CoreInterface, config: ProcConfig,
                 make_decode_stage: Callable[[Callable[[], None]], DecodeStage]):
        self.core = core
        self.config = config
        self.inputs = InputQueues(InputBytes(config.max_input_bytes_per_client, config.max_input_bytes_total))
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.metrics = EngineMetrics()
        self.heartbeat = LoopHeartbeat(config.step_timeout_s)
        self.book = RequestBook(config, self.inputs.input_bytes)
        self.fault_stats = collections.Counter()
        self._step_needed = False  # an abort happened: step so the core can report it
        self._stopping: str | None = None
        self._draining: str | None = None  # SIGTERM: finish what is in flight, accept nothing new
        self._drain_deadline = 0.0
        self._pending_outputs = False
        self._last_stats = 0.0
        self._ipc_file: str | None = None
        self._authenticator = None
        self._shut_down = False
        self._rejection_log = FrameRate(REJECTIONS_LOGGED_PER_S, REJECTIONS_LOGGED_PER_S)

        transport.check_bind_address(config.address, config.allow_remote_bind)
        for name in sweep_stale_segments():  # what an engine killed by SIGKILL left behind
            log.warning("removed stale shared memory segment /dev/shm/%s (its engine is gone)", name)
        path = transport.ipc_path(config.address)
        if path is not None:
            if transport.ipc_in_use(path):
                raise OSError(errno.EADDRINUSE, f"another process listens on {config.address}")
            path.parent.mkdir(parents=True, exist_ok=True)
        self.ctx = zmq.Context()
        # each image input frame (Submit.inputs) at most this, checked by the IO thread
        self.max_input_bytes = int(getattr(getattr(core, "config", None), "max_input_bytes", MAX_INPUT_BYTES))
        router = self._bind(path)
        info = core.model_info()
        welcome = Welcome(
            version=PROTOCOL_VERSION, engine_pid=os.getpid(), heartbeat_interval_s=config.heartbeat_interval_s,
            peer_timeout_s=config.peer_timeout_s, output_budget_bytes=config.output_budget_bytes,
            model=model_label(info.name or config.model_name), prompts=list(info.prompts),
            native_size=info.native_size, pipeline=info.pipeline, max_message_bytes=config.max_message_bytes,
            max_input_bytes=self.max_input_bytes, controlnets=list(getattr(info, "controlnets", ())))
        self.waker = transport.Waker()
        self.io = IOThread(router, config, welcome, self.inputs, self.output_queue, self.waker, self.heartbeat)
        self.decode_stage = None
        try:  # what fails here must not leave the socket, its file or decode workers behind
            if config.metrics_port is not None:  # before the decode workers: the cheap failure first
                try:
                    self.metrics.start_server(config.metrics_port)
                except OSError as exc:
                    raise StartupError(f"cannot serve metrics on 127.0.0.1:{config.metrics_port}: "
                                       f"{exc.strerror or exc}") from exc
            self.decode_stage = make_decode_stage(lambda: self.inputs.control.put(WAKE))
        except BaseException:
            self._close_unstarted(router)
            raise
        self.delivery = Delivery(self.book, core, self.decode_stage, self.metrics, self._send,
                                 coalesce_progress=config.coalesce_progress)
        self.metrics.watch_step(self.heartbeat.step_running_s)
        self.watchdog = StepWatchdog(self.heartbeat, config.step_timeout_s, self._on_hang) \
            if config.step_timeout_s > 0 else None
        self.io.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def _bind(self, ipc_file: pathlib.Path | None) -> zmq.Socket:
        config = self.config
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, config.sndhwm)
        router.setsockopt(zmq.RCVHWM, config.rcvhwm)  # what ZMQ takes in per client before its sends block
        router.setsockopt(zmq.MAXMSGSIZE, max(HARD_FRAME_LIMIT, 2 * config.max_message_bytes,
                                              2 * self.max_input_bytes))  # an oversized input is Rejected too
        try:
            if config.curve_secret_key:
                transport.make_curve_server(router, config.curve_public_key, config.curve_secret_key)
                if config.curve_authorized_keys:
                    self._authenticator = transport.start_curve_authenticator(self.ctx, config.curve_authorized_keys)
            router.bind(config.address)
        except (zmq.ZMQError, OSError):
            router.close(linger=0)
            if self._authenticator is not None:
                self._authenticator.stop()
            self.ctx.term()
            raise
        self.address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        if ipc_file is not None:
            self._ipc_file = str(ipc_file)
        return router

    def _close_unstarted(self, router: zmq.Socket) -> None:
        """Undo a start that failed before the IO thread ran: the metrics server, the decode
        stage if it started, the socket and its file, so the process can exit at once."""
        self.metrics.stop_server()
        if self.decode_stage is not None:
            try:
                self.decode_stage.close()
            except Exception:
                log.exception("closing the decode stage failed")
        router.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.ctx.term()
        self.waker.close()
        if self._ipc_file and os.path.exists(self._ipc_file):
            try:
                os.unlink(self._ipc_file)
            except OSError:
                pass

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
            self._stopping = self._stopping or f"engine failed: {type(exc).__name__}: {exc}"
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
            self.inputs.control.put(Drain(f"engine shutting down ({name})"))
            return
        self._stopping = f"engine shutting down at once ({name})"
        self.inputs.control.put(WAKE)

    def _on_hang(self, reason: str) -> None:
        """The watchdog thread, while the busy loop is stuck in a step: tell every client,
        release what outlives us, exit non-zero. No lock of the busy loop's is taken."""
        self.fault_stats["watchdog_fired"] += 1
        self.output_queue.put(Broadcast(EngineDead(reason)))
        self.output_queue.put(StopIO())
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
        if self._shut_down:
            return
        self._shut_down = True
        if self.watchdog is not None:
            self.watchdog.stop()
        reason = self._stopping or "engine shutting down"
        log.info("shutting down: %s", reason)
        try:
            self.core.abort_requests([record.rid for record in self.book.live()])
        except Exception:
            log.exception("abort on shutdown failed")
        self.output_queue.put(Broadcast(EngineDead(reason)))
        self.output_queue.put(StopIO())
        self.waker.wake()
        self.io.join(timeout=5)
        try:
            self.decode_stage.close()
        except Exception:
            log.exception("closing the decode stage failed")
        self.metrics.stop_server()
        if self._authenticator is not None:
            self._authenticator.stop()
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
            self.heartbeat.beat()
            self._process_inputs(block=not self._has_work())
            self._publish()  # Accepted/Rejected/StatsReply leave now, not after the step
            self._process_engine_step()
            if self._draining is not None:
                self._check_drain()
            self._publish()

    def _has_work(self) -> bool:
        """Whether the loop has something to do now. Requests that only await their decode
        do not count: the decode stage wakes the loop when it is done."""
        return self._step_needed or self.inputs.has_client_items() or self.core.has_work()

    def _process_inputs(self, block: bool) -> None:
        if block:  # idle: sleep until a message, a decode, or a signal (or refresh gauges now and then)
            if self.watchdog is not None:
                self.watchdog.idle()
            timeout = IDLE_WAIT_S
            if self._draining is not None:
                timeout = min(timeout, max(0.01, self._drain_deadline - time.monotonic()))
            try:
                self._handle_control(self.inputs.control.get(timeout=timeout))
            except queue.Empty:
                pass
            self.heartbeat.beat()
        while not self._stopping:  # few and cheap: wake-ups, a drain, a fatal error
            try:
                self._handle_control(self.inputs.control.get_nowait())
            except queue.Empty:
                break
        for item in self.inputs.take(self.config.inputs_per_iteration, self.config.inputs_per_client_per_iteration):
            if self._stopping:
                return
            self._handle_client_item(item)
            self._publish()  # each answer leaves now, not after the other clients' messages

    def _process_engine_step(self) -> None:
        if self._stopping:
            return
        if self._step_needed or self.core.has_work():
            self.heartbeat.step_begin()
            if self.watchdog is not None:
                self.watchdog.arm()
            try:
                outputs = self.core.step()
            finally:
                self.heartbeat.step_end()
        else:
            outputs = []
        self._step_needed = False
        # Cancels that arrived while the step ran take effect before its outputs are
        # published, so a canceled request does not report progress it will never use.
        self._process_inputs(block=False)
        for output in outputs:
            self.delivery.handle_core_output(output)
        self.delivery.send_progress()
        for decoded in self.decode_stage.poll():
            self.delivery.handle_decoded(decoded)
        now = time.monotonic()
        if now - self._last_stats > STATS_INTERVAL_S:
            self._last_stats = now
            core_stats, process_stats = self._core_stats(), self._process_stats()
            self.metrics.refresh(core_stats, process_stats)
            self.heartbeat.publish_stats(core_stats | process_stats)

    def _publish(self) -> None:
        if self._pending_outputs:
            self._pending_outputs = False
            self.waker.wake()

    def _send(self, identity: bytes, msg, payload=None) -> None:
        self.output_queue.put(Send(identity, msg, payload))
        self._pending_outputs = True

    # ------------------------------------------------------------------ drain (SIGTERM)
    def _begin_drain(self, reason: str) -> None:
        if self._draining is not None or self._stopping:
            return
        self._draining = reason
        self.heartbeat.draining = True
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        log.info("%s: draining %d request(s) in flight for up to %gs; new submissions are rejected",
                 reason, len(self.book.live()), self.config.drain_timeout_s)

    def _check_drain(self) -> None:
        live = self.book.live()
        if not live:
            self._stopping = f"{self._draining}: drained"
            return
        if time.monotonic() < self._drain_deadline:
            return
        log.warning("drain timeout (%gs): canceling %d request(s) still in flight",
                    self.config.drain_timeout_s, len(live))
        self.fault_stats["drain_canceled"] += len(live)
        for record in live:
            self.delivery.cancel_now(record)
        try:
            self.core.abort_requests([record.rid for record in live])
        except Exception:
            log.exception("abort after the drain timeout failed")
        self._stopping = f"{self._draining}: drain timeout of {self.config.drain_timeout_s:g}s"

    # ------------------------------------------------------------------ inputs
    def _handle_control(self, item: ControlItem) -> None:
        if isinstance(item, Wake):
            return
        if isinstance(item, Drain):
            self._begin_drain(item.reason)
        elif isinstance(item, Shutdown):
            self._stopping = item.reason

    def _handle_client_item(self, item: ClientConnected | FromClient | ClientGone) -> None:
        if isinstance(item, ClientConnected):
            self.book.connect(item.identity)
            log.info("client %s connected (pid %d%s)", item.identity.hex(), item.hello.pid,
                     f", {item.hello.name}" if item.hello.name else "")
            return
        if isinstance(item, ClientGone):
            self._client_gone(item.identity, item.reason)
            return
        client = self.book.clients.get(item.identity)
        msg = item.message
        if client is None or not isinstance(msg, Submit):
            self.inputs.input_bytes.release(item.identity, item.input_bytes)
        if client is None:
            return
        if isinstance(msg, Submit):
            if not self._submit(client, msg, item.arrival, item.input_bytes):
                self.inputs.input_bytes.release(item.identity, item.input_bytes)
        elif isinstance(msg, Cancel):
            self._cancel(client, msg.request_id)
        elif isinstance(msg, Delivered):
            self.book.delivered(client, msg.request_id)
        elif isinstance(msg, Stats):
            self._send(client.identity, StatsReply(msg.token, self._core_stats() | self._process_stats(),
                                                   self._adapter_names()))

    def _submit(self, client: ClientRecord, msg: Submit, arrival: float, input_bytes: int = 0) -> bool:
        """Accept the request into the core, or reject it; whether it was accepted."""
        if self._draining is not None:
            self._reject(client, msg.request_id, f"{self._draining}: not accepting new requests", None,
                         retry_after_s=SHUTDOWN_RETRY_S)
            return False
        params = msg.params
        output_bytes = self.core.output_bytes(params)
        preview_bytes = self.core.output_bytes(msgspec.structs.replace(params, output="png")) \
            if msg.partial_images else 0
        refusal = self.book.refusal(client, msg.request_id, output_bytes, preview_bytes, msg.partial_images)
        if refusal is not None and refusal.field == "height" and params.image is not None \
                and params.height is None and params.width is None:  # the output size is the image's own
            refusal = dataclasses.replace(refusal, field="image")
        if refusal is not None:
            if refusal.counter:
                self.fault_stats[refusal.counter] += 1
            self._reject(client, msg.request_id, refusal.reason, refusal.field, refusal.retry_after_s)
            return False
        rid = self.book.rid(client, msg.request_id)
        try:
            self.core.add_request(rid, params, arrival_time=arrival, partial_images=msg.partial_images)
        except RequestRejected as exc:
            self._reject(client, msg.request_id, exc.reason, exc.field, exc.retry_after_s)
            return False
        except Exception:  # a core bug on odd input must not take the engine down
            log.exception("request %s: add_request failed", rid)
            self._reject(client, msg.request_id, "internal error (the engine's log has the details)", None)
            return False
        self.book.add(client, RequestRecord(rid, client.identity, msg.request_id, arrival, msg.progress,
                                            output_bytes + msg.partial_images * preview_bytes, preview_bytes,
                                            input_bytes=input_bytes))
        self._send(client.identity, Accepted(msg.request_id, self.book.waiting()))
        log.info("request %s accepted: %s %s×%d g=%g seed=%d → %s", rid, params.prompt, params.sampler,
                 params.steps, params.guidance, params.seed, params.output)
        return True

    def _reject(self, client: ClientRecord, request_id: str, reason: str, field: str | None,
                retry_after_s: float = 0.0) -> None:
        # a flood of refused Submits must not become a flood of log lines: a few a second
        level = logging.INFO if self._rejection_log.try_take(time.monotonic()) else logging.DEBUG
        log.log(level, "request %s:%s rejected: %s%s", client.tag, request_id, reason,
                f" (field {field})" if field else "")
        self.metrics.finished("rejected")
        self._send(client.identity, Rejected(request_id, reason, field, float(retry_after_s or 0.0)))

    def _cancel(self, client: ClientRecord, request_id: str) -> None:
        rid = self.book.rid(client, request_id)
        record = self.book.requests.get(rid)
        if record is None or record.terminal or record.cancel_requested:
            return  # unknown, finished or already canceling: cancel is idempotent
        record.cancel_requested = True
        log.info("request %s: cancel requested", rid)
        self.core.abort_requests([rid])
        self._step_needed = True

    def _client_gone(self, identity: bytes, reason: str) -> None:
        client = self.book.disconnect(identity)
        if client is None:
            return
        records = [self.book.requests[rid] for rid in client.requests]
        live = [record.rid for record in records if not record.terminal]
        log.info("client %s gone (%s): canceling %d request(s)", client.tag, reason, len(live))
        for record in records:
            record.cancel_requested = True
        if live:
            self.core.abort_requests(live)
            self._step_needed = True

    # ------------------------------------------------------------------ stats
    def _core_stats(self) -> dict:
        try:
            stats = self.core.stats()
        except Exception:
            log.exception("core.stats() failed")
            return {}
        return {str(k): v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
                for k, v in stats.items()}

    def _adapter_names(self) -> list[str]:
        """The LoRA adapters the core serves now (its pool rescans its folder)."""
        try:
            return self.core.adapter_names()
        except Exception:
            log.exception("listing the adapters failed")
            return []

    def _process_stats(self) -> dict:
        io = self.io
        return {
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self.heartbeat.started_at,
            "clients": len(self.book.clients),
            "requests_in_flight": len(self.book.live()),
            "undelivered_output_bytes": self.book.held_bytes(),
            "outbound_backlog_messages": io.backlog_messages,
            "outbound_backlog_bytes": io.backlog_bytes,
            "io_thread_cpu_s": io.cpu_s,
            "io_messages_sent": io.messages_sent,
            "io_messages_received": io.messages_received,
            "oversized_frames": io.oversized_frames,
            "rejected_image_inputs": io.rejected_inputs,
            "auth_failures": io.auth_failures,
            "rejected_pending_inputs": io.rejected_pending,
            "rejected_input_bytes": io.rejected_input_bytes,
            "input_bytes_held": self.inputs.input_bytes.held_total,
            "inputs_waiting": self.inputs.waiting(),
            "io_paused_for_frame_rate_s": io.paused_s,
            "io_stalled_s": io.stalled_s,
            "health_probes": io.health_probes,
            "draining": int(self._draining is not None),
            "longest_step_s": self.heartbeat.longest_step_s,
            "step_timeout_s": self.config.step_timeout_s,
            **self.fault_stats,
            **self.delivery.preview_stats,
            **self.decode_stage.stats(),
        }


def run_engine(core: CoreInterface, config: ProcConfig, make_decode_stage) -> int:
    """Bind, serve until SIGTERM/SIGINT, clean up. Prints one 'ready' line on stdout."""
    try:
        proc = EngineCoreProc(core, config, make_decode_stage)
    except StartupError as exc:
        log.error("%s", exc)
        return 2
    except (OSError, ValueError, zmq.ZMQError) as exc:
        log.error("cannot serve on %s: %s", config.address, exc)
        return 2
    print(f"diffslot engine ready on {proc.address} (pid {os.getpid()})", flush=True)
    return proc.run()


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")


__all__ = ["EngineCoreProc", "run_engine", "configure_logging"]
