"""The decode stage on a thread of the engine process (`--decode-workers 0`).

Each decode has a deadline (`decode_timeout_s`, as the worker processes have). A thread
cannot be killed, so a decode past its deadline is abandoned: its request gets a failed
`DecodedOutput` at the next poll, a fresh thread takes over the work behind it, and
whatever the abandoned thread produces, should it ever return, is dropped. Each stuck
thread keeps its latents alive, so after `MAX_STUCK_THREADS` of them the stage starts
no more and fails every decode: a model whose decode always hangs needs a restart.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import msgspec
import torch

from engine.decode.stage import CANCELED, DecodedOutput, postprocess
from engine.protocol import GenerateParams, Timings

log = logging.getLogger("diffslot.decode")

MAX_STUCK_THREADS = 4


@dataclasses.dataclass
class _Job:
    request_id: str
    latents: object
    params: GenerateParams
    timings: Timings
    ready_at: float


@dataclasses.dataclass
class _Decoder:
    """One decode thread and the job it is on (written under the stage's lock)."""

    thread: threading.Thread | None = None
    job: _Job | None = None
    started: float = 0.0
    abandoned: bool = False


class InProcessDecodeStage:
    """Decodes one request at a time on a background thread."""

    def __init__(self, model, on_ready: Callable[[], None] | None = None, *,
                 decode_timeout_s: float | None = 120.0) -> None:
        self.model = model
        self.decode_timeout_s = decode_timeout_s or None
        self._on_ready = on_ready or (lambda: None)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._canceled: set[str] = set()  # decodes whose output is dropped when it comes
        self._lock = threading.Lock()
        self._abandoned: list[_Decoder] = []
        self._broken: str | None = None
        self.dropped = 0
        self.timeouts = 0
        self._decoder = self._start_decoder()

    def submit(self, request_id: str, latents, params: GenerateParams, timings: Timings,
               ready_at: float | None = None) -> None:
        self._todo.put(_Job(request_id, latents, params, timings, ready_at or time.monotonic()))

    def cancel(self, request_id: str) -> None:
        self._canceled.add(request_id)

    def poll(self) -> list[DecodedOutput]:
        self._check_deadline()
        if self._broken is not None:
            self._fail_queued()
        done = []
        while True:
            try:
                output = self._done.get_nowait()
            except queue.Empty:
                return done
            if output.request_id in self._canceled:  # its output is dropped; the reservation still comes back
                self._canceled.discard(output.request_id)
                self.dropped += 1
                output = dataclasses.replace(output, payload=None, error=CANCELED)
            done.append(output)

    def stats(self) -> dict:
        stuck = sum(1 for d in self._abandoned if d.thread.is_alive())
        return {"decode_dropped": self.dropped, "decode_timeouts": self.timeouts, "decode_threads_stuck": stuck}

    def close(self) -> None:
        self._todo.put(None)
        self._decoder.thread.join(timeout=10)

    # ------------------------------------------------------------------ deadline
    def _check_deadline(self) -> None:
        timeout = self.decode_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        with self._lock:
            decoder = self._decoder
            job = decoder.job
            if job is None or now - decoder.started <= timeout:
                return
            decoder.abandoned = True
            self._abandoned.append(decoder)
            self.timeouts += 1
            log.error("request %s: decode gave no result %gs after it started; abandoning its thread",
                      job.request_id, timeout)
            self._done.put(self._failed(job, f"decode timed out: no result {timeout:g}s after it started "
                                             f"(--decode-timeout)", decoder.started, now))
            stuck = sum(1 for d in self._abandoned if d.thread.is_alive())
            if stuck >= MAX_STUCK_THREADS:
                self._broken = (f"decode stage stopped: {stuck} decodes hung past --decode-timeout; "
                                "restart the engine")
                log.critical("%s", self._broken)
                return
            self._decoder = self._start_decoder()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                now = time.monotonic()
                self._done.put(self._failed(job, self._broken, now, now))

    @staticmethod
    def _failed(job: _Job, error: str, start: float, end: float) -> DecodedOutput:
        timings = msgspec.structs.replace(job.timings, decode_wait_s=max(0.0, start - job.ready_at),
                                          decode_s=end - start)
        return DecodedOutput(job.request_id, job.params.output, (), "", None, timings, end, error)

    # ------------------------------------------------------------------ decode thread
    def _start_decoder(self) -> _Decoder:
        decoder = _Decoder()
        decoder.thread = threading.Thread(target=self._run, args=(decoder,), name="diffslot-decode", daemon=True)
        decoder.thread.start()
        return decoder

    def _run(self, decoder: _Decoder) -> None:
        # On CUDA the decode gets a stream of its own, so it runs beside the denoising steps
        # instead of queueing behind them on the default stream (and its `.cpu()` waits for
        # the decode alone).
        device = getattr(self.model, "device", None)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        stream = torch.cuda.Stream(device) if on_cuda else None
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            self._decode_loop(decoder)

    def _decode_loop(self, decoder: _Decoder) -> None:
        while (job := self._todo.get()) is not None:
            start = time.monotonic()
            with self._lock:  # a decoder is abandoned only while it holds a job: never here
                decoder.job, decoder.started = job, start
            try:
                payload, shape, dtype = postprocess(self.model, job.latents, job.params.output)
                error = None
            except Exception as exc:  # a bad decode fails its request, not the engine
                log.exception("request %s: decode failed", job.request_id)
                payload, shape, dtype, error = None, (), "", f"decode failed: {exc}"
            end = time.monotonic()
            timings = msgspec.structs.replace(job.timings, decode_wait_s=start - job.ready_at, decode_s=end - start)
            with self._lock:
                if decoder.abandoned:  # its request was failed at the deadline: drop this late result
                    log.warning("request %s: a decode abandoned at its deadline returned after %.1fs; dropped",
                                job.request_id, end - start)
                    return
                decoder.job = None
                self._done.put(DecodedOutput(job.request_id, job.params.output, tuple(shape), dtype, payload,
                                             timings, end, error))
            self._on_ready()
