"""Decode workers: N processes decode final latents out of the shared arena.

    engine busy loop                      arena (shared memory)             decode worker k
    submit(): latents → buffer i,         STATE FREE → READY(e)      ──▶    claim: CAS READY(e) → CLAIMED(e, k)
              header words, publish,      SUBMIT_SEQ += 1, wake 1           VAE decode, uint8 / PNG
              side table[i] = (id, e)                                       output → output area
    poll():   DONE(e) → copy output out,  ◀── DONE_SEQ += 1, wake    ◀──    CAS CLAIMED(e, k) → DONE(e, k)
              buffer FREE, DecodedOutput

`MultiProcessDecodeStage` has the same interface as `InProcessDecodeStage` (submit /
poll / close), plus `cancel(request_id)`. Request ids stay in the engine: the side
table maps buffer index → (request id, epoch); the header holds only a hash of the id.
A watcher thread in the engine sleeps on DONE_SEQ and calls `on_ready` (the busy
loop's wake-up), and also when a worker dies or overruns its deadline.

Outputs: "png" and "uint8" go through a worker; "latent" needs no VAE, so its payload
(the float32 C×H×W latents) is produced in the engine at submit and returned by the
next poll, without a process hop.

Faults (the choices):
- A worker that dies (any cause, kill -9 included) is noticed by poll() through its
  process sentinel; each buffer it had claimed is reclaimed and its request ends with
  `DecodedOutput(error="decode worker died ...")` → the client gets `Failed`. The
  request is not decoded again: a latent that crashes the VAE would otherwise take
  down every worker in turn; only that request fails, and it says why. The worker
  is replaced at once (a worker that dies before it has loaded its model three times in
  a row is not replaced again; with no worker left, decodes fail with that reason).
- A worker past its buffer's deadline (claim time + `decode_timeout_s`, in the header)
  is treated as hung: the hand-off is revoked (the epoch moves on, so if the worker
  finishes after all, its completion is a stale hand-off, dropped and counted), the
  worker is killed (SIGKILL) and, once reaped, handled as a death.
- `cancel(request_id)`: a READY buffer is taken back at once; a CLAIMED one gets its
  cancel word set and the worker abandons it at its next check (before and after the
  decode: a running VAE call is not interrupted). Either way the buffer comes back and
  poll() returns `DecodedOutput(error="canceled")` with no payload; the engine's core
  has already answered Canceled and its decode_done() returns False.
- close(): STOP word + wake all; join with a timeout, then SIGKILL; unlink the arena.

Test hooks: `decode_delay_s` (every decode) and `debug_delays[request_id]` (one
request) make a worker sleep before decoding — a slow or, past the deadline, a hung decode.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import signal
import threading
import time
from typing import Any, Callable, Sequence

import msgspec
import numpy as np

from engine.decode import arena as A
from engine.decode.stage import CANCELED, DecodedOutput
from engine.decode.worker_process import worker_main
from engine.models.geometry import geometry_of
from engine.protocol import OUTPUT_KINDS, output_nbytes

log = logging.getLogger("diffslot.decode")

START_FAILURES_BEFORE_GIVING_UP = 3
FAULT_CHECK_INTERVAL_S = 0.02
TEST_DELAY_ENV = "DIFFSLOT_TEST_DECODE_DELAY_S"


@dataclasses.dataclass
class _Job:
    request_id: str
    buffer: int
    epoch: int
    params: Any
    timings: Any
    ready_at: float
    req_hash: int
    canceled: bool = False
    fault: str | None = None  # why its worker was killed (hung)


@dataclasses.dataclass
class _Worker:
    index: int
    process: Any
    started_at: float
    ready: bool = False
    hung_reason: str | None = None


def _model_folder(model) -> pathlib.Path:
    """The folder of a model name, folder or loaded model (workers load the VAE from it)."""
    if hasattr(model, "geometry") and hasattr(model, "path"):  # a loaded DiffusionModel
        return pathlib.Path(getattr(model, "decode_folder", None) or model.path)
    from engine.models import EMBEDDED

    path = EMBEDDED.get(str(model)) or pathlib.Path(model).expanduser().resolve()
    if not (path / "vae" / "config.json").exists():
        raise FileNotFoundError(f"decode workers load the VAE from a model folder; {path} has no vae/config.json")
    return path


class MultiProcessDecodeStage:
    """`submit` / `poll` / `close` (+ `cancel`) over N decode worker processes and a
    shared-memory arena of `buffers` decode buffers.

    `model`: a model name ("shapes"), a diffusers folder (only `vae/` is needed) or a
    loaded model (its folder is used). Workers load the VAE themselves, each on its own
    device (`device`: one for all, or one per worker). `max_size`: the largest image
    side the arena holds (default 4× the native size, the core's limit). `buffers`
    should be at least the core's `decode_buffers` (admission reserves one per
    request); submits beyond the free buffers wait in the engine, never block.
    """

    def __init__(self, model, workers: int = 2, buffers: int = 8, device: str | Sequence[str] = "cpu", *,
                 on_ready: Callable[[], None] | None = None, max_size: int | None = None,
                 decode_timeout_s: float | None = 120.0, decode_delay_s: float | None = None,
                 debug_delays: dict[str, float] | None = None, threads_per_worker: int | None = None,
                 pin_memory: bool | None = None, start_timeout_s: float = 180.0, wait_ready: bool = True):
        if not 1 <= workers <= A.MAX_WORKERS:
            raise ValueError(f"workers must be in [1, {A.MAX_WORKERS}]")
        self.model_dir = _model_folder(model)
        geometry = geometry_of(self.model_dir)
        channels, scale = geometry.latent_channels, geometry.vae_scale
        self.latent_channels, self.vae_scale, self.native_size = channels, scale, geometry.native_size
        self.workers = workers
        self.devices = [device] * workers if isinstance(device, str) else list(device)
        if len(self.devices) != workers:
            raise ValueError("give one device, or one per worker")
        self.max_size = max_size or geometry.max_size
        largest = geometry.latent_shape(self.max_size, self.max_size)
        latent_bytes = output_nbytes("latent", self.max_size, self.max_size, largest)
        # the output bound of every kind, as the engine reserves it against a client's budget
        output_bytes = max(output_nbytes(kind, self.max_size, self.max_size, largest) for kind in OUTPUT_KINDS)
        self.decode_timeout_s = decode_timeout_s
        if decode_delay_s is None:
            decode_delay_s = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
        self.decode_delay_s = decode_delay_s
        self.debug_delays = debug_delays if debug_delays is not None else {}
        self.threads = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self._on_ready = on_ready
        self._ctx = multiprocessing.get_context("spawn")

        for name in A.sweep_stale():  # segments of engines that were killed
            log.info("swept stale segment %s", name)
        self.arena = A.Arena.create(buffers, latent_bytes, output_bytes)
        self.buffers = buffers
        use_cuda = any(str(d).startswith("cuda") for d in self.devices)
        if pin_memory if pin_memory is not None else use_cuda:
            self.arena.pin()
        self._free = collections.deque(range(buffers))
        self._jobs: dict[int, _Job] = {}  # the side table: buffer → request
        self._by_request: dict[str, _Job] = {}
        self._waiting: collections.deque = collections.deque()  # submits with no free buffer yet
        self._copies: list = []  # (job, latents, cuda event): async device→host copies in flight
        self._results: list[DecodedOutput] = []
        self._done_seen = self.arena.load_global(A.G_DONE_SEQ)
        self._last_fault_check = 0.0
        self._workers: list[_Worker | None] = [None] * workers
        self._start_failures = [0] * workers
        self._broken: str | None = None
        self._starting = wait_ready  # a worker that dies now fails the construction
        self._closed = False
        self.counters = collections.Counter()
        self.handoff_ns: collections.deque = collections.deque(maxlen=100_000)  # publish → claim
        try:
            for k in range(workers):
                self._spawn(k)
            if wait_ready:
                self._wait_ready(start_timeout_s)
            self._starting = False
        except BaseException:
            self.close()
            raise
        self._watcher = None
        if on_ready is not None:
            self._watcher = threading.Thread(target=self._watch, name="diffslot-decode-watch", daemon=True)
            self._watcher.start()

    # ---- workers ----------------------------------------------------------------------------
    def _spawn(self, k: int) -> None:
        self.arena.store_global(A.G_WORKERS + k, 0)
        process = self._ctx.Process(
            target=worker_main, name=f"diffslot-decode-{k}", daemon=False,
            args=(self.arena.name, k, str(self.model_dir), str(self.devices[k]), self.threads, os.getpid(),
                  self.arena.fd))
        process.start()
        self._workers[k] = _Worker(k, process, time.monotonic())
        log.info("decode worker %d started (pid %d) on %s", k, process.pid, self.devices[k])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_workers()
            if self._broken:
                raise RuntimeError(self._broken)
            if all(w is not None and w.ready for w in self._workers):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode workers not ready after {timeout:g}s")
            time.sleep(0.02)

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w is not None]

    def _check_workers(self) -> None:
        """Readiness, deaths (reclaim, fail, replace) and deadlines (revoke, kill)."""
        alive = [w for w in self._workers if w is not None]
        for w in alive:
            if not w.ready and self.arena.load_global(A.G_WORKERS + w.index):
                w.ready = True
                self._start_failures[w.index] = 0
        sentinels = {w.process.sentinel: w for w in alive}
        for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0) if sentinels else ():
            self._on_worker_death(sentinels[sentinel])
        if self.decode_timeout_s:
            now = time.monotonic_ns()
            for job in list(self._jobs.values()):
                state, wid, epoch = self.arena.state(job.buffer)
                if state != A.CLAIMED or epoch != job.epoch:
                    continue
                deadline = self.arena.load(job.buffer, A.H_DEADLINE_NS)
                if deadline and now > deadline and self.arena.revoke(job.buffer, epoch, wid):
                    worker = self._workers[wid - 1]
                    job.fault = (f"decode worker {wid - 1} (pid {worker.process.pid if worker else '?'}) hung: "
                                 f"no result {self.decode_timeout_s:g}s after it started decoding; killed")
                    log.error("request %s: %s", job.request_id, job.fault)
                    self.counters["hung"] += 1
                    if worker is not None:
                        worker.hung_reason = job.fault
                        try:
                            os.kill(worker.process.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass

    def _on_worker_death(self, w: _Worker) -> None:
        pid = w.process.pid
        w.process.join(timeout=1.0)
        code = w.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self._workers[w.index] = None
        wid = w.index + 1
        reclaimed = 0
        for job in list(self._jobs.values()):
            state, owner, _ = self.arena.state(job.buffer)
            if owner == wid and state in (A.CLAIMED, A.REVOKED):
                error = job.fault or (f"decode worker died (worker {w.index}, pid {pid}, {how}) "
                                      f"while decoding this request")
                claim = self.arena.load(job.buffer, A.H_CLAIM_NS) / 1e9 or None
                self._end(job, error=error, claim=claim)
                reclaimed += 1
        if w.hung_reason is None:
            self.counters["worker_deaths"] += 1
        log.log(logging.INFO if self._closed else logging.ERROR,
                "decode worker %d (pid %d) %s; %d request(s) failed", w.index, pid, how, reclaimed)
        try:
            w.process.close()
        except Exception:
            pass
        if self._closed:
            return
        if self._starting:
            self._broken = f"decode worker {w.index} (pid {pid}) failed to start: {how}; see its log"
            return
        if not w.ready:
            self._start_failures[w.index] += 1
        if self._start_failures[w.index] >= START_FAILURES_BEFORE_GIVING_UP:
            log.error("decode worker %d failed to start %d times; not replaced", w.index,
                      self._start_failures[w.index])
            if all(x is None for x in self._workers):
                self._broken = (f"decode workers cannot start (last: {how}; see the engine log) "
                                f"from {self.model_dir}")
                for job in list(self._jobs.values()):
                    self._end(job, error=self._broken)
            return
        self.counters["worker_restarts"] += 1
        self._spawn(w.index)

    def _watch(self) -> None:
        """Engine side: sleep on DONE_SEQ; wake the busy loop on a result, a worker's
        death or an overrun deadline (poll() then acts on it)."""
        seen = self.arena.load_global(A.G_DONE_SEQ)
        last_fault_wake = 0.0
        while not self._closed:
            self.arena.wait(A.G_DONE_SEQ, seen, 0.05)
            if self._closed:
                return
            now = self.arena.load_global(A.G_DONE_SEQ)
            if now != seen:
                seen = now
                self._on_ready()
                continue
            if time.monotonic() - last_fault_wake > 0.1 and self._fault_pending():
                last_fault_wake = time.monotonic()
                self._on_ready()

    def _fault_pending(self) -> bool:
        try:
            workers = [w for w in self._workers if w is not None]
            if multiprocessing.connection.wait([w.process.sentinel for w in workers], timeout=0):
                return True
            if any(not w.ready and self.arena.load_global(A.G_WORKERS + w.index) for w in workers):
                return True
            if self.decode_timeout_s:
                now = time.monotonic_ns()
                for i in range(self.buffers):
                    state, _, _ = self.arena.state(i)
                    deadline = self.arena.load(i, A.H_DEADLINE_NS)
                    if state == A.CLAIMED and deadline and now > deadline:
                        return True
        except (OSError, ValueError, AttributeError):  # a sentinel closed under us: look again in poll
            return True
        return False

    # ---- the interface --------------------------------------------------------------------------
    def submit(self, request_id: str, latents, params, timings, ready_at: float | None = None) -> None:
        """Never blocks: writes the latents into a free buffer and publishes it (or waits
        in the engine for a buffer when every one is taken)."""
        ready_at = ready_at or time.monotonic()
        kind = params.output
        job = _Job(request_id, -1, 0, params, timings, ready_at, A.request_hash(request_id))
        if self._closed or self._broken:
            self._results.append(self._output(job, error=self._broken or "the decode stage is closed"))
            return
        if kind == "latent":  # no VAE involved: the payload is the latents themselves
            start = time.monotonic()
            array = latents.detach().to("cpu") if hasattr(latents, "detach") else latents
            array = np.array(np.asarray(array, dtype=np.float32), order="C", copy=True)
            self._results.append(self._output(job, payload=array, shape=array.shape, dtype="float32",
                                              claim=start, done=time.monotonic()))
            return
        if kind not in A.KINDS:
            self._results.append(self._output(job, error=f"unknown output kind {kind!r}"))
            return
        if math.prod(latents.shape) * 4 > self.arena.latent_bytes or len(latents.shape) > 4:
            self._results.append(self._output(job, error=f"latents of shape {tuple(latents.shape)} exceed the decode "
                                                         f"arena's buffers (max image side {self.max_size})"))
            return
        self._by_request[request_id] = job
        if self._free:
            self._hand_off(job, latents, self._free.popleft())
        else:
            self.counters["waited_for_buffer"] += 1
            self._waiting.append((job, latents))

    def _hand_off(self, job: _Job, latents, i: int) -> None:
        job.buffer = i
        self._jobs[i] = job
        view = self.arena.latent_array(i, tuple(latents.shape))
        if hasattr(latents, "is_cuda") and latents.is_cuda:  # async D2H into the page-locked arena
            import torch

            torch.from_numpy(view).copy_(latents, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copies.append((job, tuple(latents.shape), event))
            return
        if hasattr(latents, "detach"):
            import torch

            torch.from_numpy(view).copy_(latents.detach())
        else:
            view[...] = latents
        del view
        self._publish(job, tuple(latents.shape))

    def _publish(self, job: _Job, shape: tuple[int, ...]) -> None:
        delay = self.debug_delays.get(job.request_id, self.decode_delay_s)
        job.epoch = self.arena.publish(job.buffer, kind=A.KINDS.index(job.params.output), shape=shape,
                                       req_hash=job.req_hash, delay_s=delay, timeout_s=self.decode_timeout_s)

    def cancel(self, request_id: str) -> None:
        """The request's decode output is not wanted: take its buffer back now if no
        worker has it, else ask the worker to abandon it. Idempotent."""
        job = self._by_request.get(request_id)
        if job is None or job.canceled:
            return
        job.canceled = True
        self.counters["canceled"] += 1
        for k, (waiting, _) in enumerate(self._waiting):
            if waiting is job:
                del self._waiting[k]
                self._end(job, error=CANCELED)
                return
        if job.epoch == 0:  # its device→host copy is still in flight: poll() ends it
            return
        if self.arena.unpublish(job.buffer, job.epoch):
            self._end(job, error=CANCELED)
        else:  # a worker has it (or has just finished): it checks the cancel word
            self.arena.store(job.buffer, A.H_CANCEL, job.epoch)

    def poll(self) -> list[DecodedOutput]:
        """Never blocks: finished outputs (copied out of the arena) and failures."""
        if self._closed:
            out, self._results = self._results, []
            return out
        if self._copies:
            self._finish_copies()
        seq = self.arena.load_global(A.G_DONE_SEQ)
        now = time.monotonic()
        fault_check = now - self._last_fault_check > FAULT_CHECK_INTERVAL_S
        if (seq != self._done_seen or fault_check) and self._jobs:
            self._done_seen = seq
            for job in list(self._jobs.values()):
                self._collect(job)
        if fault_check and not self._closed:
            self._last_fault_check = now
            self._check_workers()
        while self._waiting and self._free:
            job, latents = self._waiting.popleft()
            self._hand_off(job, latents, self._free.popleft())
        out, self._results = self._results, []
        return out

    def _finish_copies(self) -> None:
        still = []
        for job, shape, event in self._copies:
            if not event.query():
                still.append((job, shape, event))
            elif job.canceled:
                self._end(job, error=CANCELED)
            else:
                self._publish(job, shape)
        self._copies = still

    def _collect(self, job: _Job) -> None:
        arena, i = self.arena, job.buffer
        state, _, epoch = arena.state(i)
        if state not in (A.DONE, A.FAILED):
            return
        if epoch != job.epoch or arena.load(i, A.H_REQ_HASH) != job.req_hash:
            self.counters["stale_engine"] += 1  # not this request's hand-off: drop it
            log.error("buffer %d: stale hand-off (epoch %d, expected %d) dropped", i, epoch, job.epoch)
            self._end(job, error="decode failed: stale hand-off in the decode arena")
            return
        claim = arena.load(i, A.H_CLAIM_NS) / 1e9
        done = arena.load(i, A.H_DONE_NS) / 1e9
        self.handoff_ns.append(arena.load(i, A.H_CLAIM_NS) - arena.load(i, A.H_SUBMIT_NS))
        if state == A.FAILED or job.canceled:
            reason = arena.load(i, A.H_FAIL)
            if job.canceled or reason == A.FAIL_CANCELED:
                self._end(job, error=CANCELED, claim=claim, done=done)
            else:
                n = arena.load(i, A.H_OUT_LEN)
                message = bytes(arena.output_area(i)[:n]).decode(errors="replace")
                self._end(job, error=f"decode failed: {message}", claim=claim, done=done)
            return
        n = arena.load(i, A.H_OUT_LEN)
        dims = tuple(arena.load(i, A.H_OUT_DIMS + k) for k in range(arena.load(i, A.H_OUT_NDIM)))
        dtype = A.DTYPES[arena.load(i, A.H_OUT_DTYPE)]
        area = arena.output_area(i)
        if job.params.output == "png":
            payload = bytes(area[:n])
        else:
            payload = area[:n].view(dtype).reshape(dims).copy()  # one copy out, then the buffer is free
        del area
        self._end(job, payload=payload, shape=dims, dtype=dtype, claim=claim, done=done)

    def _end(self, job: _Job, *, error: str | None = None, payload=None, shape=(), dtype="",
             claim: float | None = None, done: float | None = None) -> None:
        """The request leaves the stage: its buffer is freed, one DecodedOutput queued."""
        if self._jobs.get(job.buffer) is job:
            del self._jobs[job.buffer]
            self.arena.free(job.buffer)
            self._free.append(job.buffer)
        self._by_request.pop(job.request_id, None)
        if error is not None and error != CANCELED:
            self.counters["failed"] += 1
        self._results.append(self._output(job, error=error, payload=payload, shape=shape, dtype=dtype,
                                          claim=claim, done=done))

    def _output(self, job: _Job, *, error: str | None = None, payload=None, shape=(), dtype="",
                claim: float | None = None, done: float | None = None) -> DecodedOutput:
        now = time.monotonic()
        claim = claim or now
        done = done or now
        timings = job.timings
        if timings is not None:
            timings = msgspec.structs.replace(timings, decode_wait_s=max(0.0, claim - job.ready_at),
                                              decode_s=max(0.0, done - claim))
        return DecodedOutput(job.request_id, job.params.output, tuple(int(d) for d in shape), dtype,
                             None if error is not None else payload, timings, now, error)

    # ---- introspection ------------------------------------------------------------------------
    def inflight(self) -> list[dict]:
        """One row per request in the arena: its buffer's state and worker (tests, debugging)."""
        rows = []
        for job in self._jobs.values():
            state, wid, epoch = self.arena.state(job.buffer)
            rows.append({"request_id": job.request_id, "buffer": job.buffer, "epoch": epoch,
                         "state": A.STATE_NAMES[state], "worker": wid - 1,
                         "worker_pid": self.arena.load(job.buffer, A.H_WORKER_PID) if wid else 0})
        return rows

    def free_buffers(self) -> int:
        return len(self._free)

    def stats(self) -> dict:
        c = self.counters
        return {
            "decode_workers": sum(1 for w in self._workers if w is not None),
            "decode_buffers": self.buffers,
            "decode_buffers_free": len(self._free),
            "decode_waiting_for_buffer": len(self._waiting),
            "decode_stale_handoffs": (self.arena.load_global(A.G_STALE) if not self.arena.closed else 0)
            + c["stale_engine"],
            "decode_worker_deaths": c["worker_deaths"],
            "decode_worker_hangs": c["hung"],
            "decode_worker_restarts": c["worker_restarts"],
            "decode_failed": c["failed"],
            "decode_canceled": c["canceled"],
        }

    # ---- shutdown --------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (join with a timeout, then SIGKILL) and remove the arena."""
        if self._closed:
            return
        self._closed = True
        arena = self.arena
        arena.store_global(A.G_STOP, 1)
        arena.ring(A.G_SUBMIT_SEQ, None)
        arena.ring(A.G_DONE_SEQ, None)  # the watcher
        deadline = time.monotonic() + timeout
        for w in self._workers:
            if w is not None:
                w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self._workers:
            if w is not None and w.process.is_alive():
                log.warning("decode worker %d (pid %d) did not stop; killing it", w.index, w.process.pid)
                w.process.kill()
                w.process.join(timeout=5.0)
        for k, w in enumerate(self._workers):
            if w is not None:
                try:
                    w.process.close()
                except ValueError:  # still running after SIGKILL + 5 s (stuck in the kernel)
                    log.error("decode worker %d (pid %d) could not be reaped", k, w.process.pid)
                self._workers[k] = None
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=1.0)
        self._copies.clear()
        self._waiting.clear()
        arena.close()
