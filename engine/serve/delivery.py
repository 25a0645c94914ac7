"""From the core's outputs to each client's messages: progress (one message per client
per step), partial images and final outputs through the decode stage, and each
request's one final message.

The decode stage knows jobs by a key the engine gives them, `<n>:<request id>` with n a
counter of this process: unique whatever a client names its requests, so a partial
image can never be taken for another request's output. The job table maps each key to
what it is (`FinalDecode` or `PreviewDecode`) and to the request's record itself, so
an output that comes back after its request ended (and its id was reused) finds that
request terminal and is dropped. Every submitted job comes back exactly once, decoded,
failed or canceled.

All of a request's partial images go out before its final message: a final output that
is ready while partial images are still decoding waits (`HeldFinal`).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Callable

import msgspec

from engine.core.interface import CoreInterface
from engine.core.outputs import DenoiseFinished, PreviewReady, RequestCanceled, RequestFailed, StepProgress
from engine.decode.stage import DecodedOutput, DecodeStage
from engine.protocol import Canceled, Completed, Failed, GenerateParams, PartialImage, Progress, ProgressBatch, Timings
from engine.serve.bookkeeping import HeldFinal, RequestBook, RequestRecord
from engine.serve.metrics import EngineMetrics

log = logging.getLogger("diffslot.engine")

PREVIEW_PARAMS = GenerateParams(prompt="", output="png")  # partial images are PNGs, as OpenAI's


@dataclasses.dataclass
class FinalDecode:
    record: RequestRecord


@dataclasses.dataclass
class PreviewDecode:
    record: RequestRecord
    index: int
    step: int
    total: int


@dataclasses.dataclass
class _ProgressEntry:
    record: RequestRecord
    step: int
    total: int


def payload_nbytes(payload) -> int:
    return len(payload) if isinstance(payload, (bytes, bytearray)) else payload.nbytes


class Delivery:
    def __init__(self, book: RequestBook, core: CoreInterface, decode_stage: DecodeStage, metrics: EngineMetrics,
                 send: Callable[..., None], *, coalesce_progress: bool = True) -> None:
        self.book = book
        self.core = core
        self.decode_stage = decode_stage
        self.metrics = metrics
        self.send = send  # send(identity, message, payload=None)
        self.coalesce_progress = coalesce_progress
        self.preview_stats = collections.Counter()
        self._jobs: dict[str, FinalDecode | PreviewDecode] = {}
        self._job_numbers = itertools.count()
        self._progress_out: dict[bytes, list[_ProgressEntry]] = {}
        self._handlers = {
            PreviewReady: self._on_preview_ready,
            StepProgress: self._on_step_progress,
            DenoiseFinished: self._on_denoise_finished,
            RequestCanceled: self._on_request_canceled,
            RequestFailed: self._on_request_failed,
        }

    # ------------------------------------------------------------------ core outputs
    def handle_core_output(self, output) -> None:
        handler = self._handlers.get(type(output))
        if handler is None:
            log.warning("unknown core output %r", output)
            return
        handler(output, self.book.requests.get(output.request_id))

    def _on_step_progress(self, output: StepProgress, record: RequestRecord | None) -> None:
        if record is not None:
            record.started = True
            if record.want_progress and not record.cancel_requested and not record.terminal:
                self._progress_out.setdefault(record.identity, []).append(
                    _ProgressEntry(record, output.step, output.total))

    def send_progress(self) -> None:
        """This step's progress: one message per client."""
        out, self._progress_out = self._progress_out, {}
        for identity, entries in out.items():
            items = [(e.record.client_request_id, e.step, e.total) for e in entries
                     if not e.record.terminal and not e.record.cancel_requested]
            if len(items) == 1 or not self.coalesce_progress:
                for item in items:
                    self.send(identity, Progress(*item))
            elif items:
                self.send(identity, ProgressBatch(items))

    def _on_preview_ready(self, output: PreviewReady, record: RequestRecord | None) -> None:
        """Decode the x0 estimate off the busy loop, in the decode stage, as a PNG."""
        if record is None or record.terminal or record.cancel_requested:
            return
        job = PreviewDecode(record, output.index, output.step, output.total)
        record.preview_keys.add(self._submit(job, output.latents, PREVIEW_PARAMS, Timings()))

    def _on_denoise_finished(self, output: DenoiseFinished, record: RequestRecord | None) -> None:
        if record is not None:
            record.started = True
            record.timings = output.timings
        if record is None or record.terminal or record.cancel_requested:
            self._decode_finished(output.request_id, record, None)  # nobody wants it: hand the reservation back
            return
        record.in_decode = True
        record.decode_key = self._submit(FinalDecode(record), output.latents, output.params, output.timings,
                                         output.finished_at)

    def _on_request_canceled(self, output: RequestCanceled, record: RequestRecord | None) -> None:
        # Canceled while its decode is in the stage: tell the stage, so a worker skips or
        # abandons it and the decode buffer comes back early (the stage still returns one
        # DecodedOutput for it, which hands the reservation back).
        if record is not None and record.in_decode:
            self.decode_stage.cancel(record.decode_key)
        if record is not None and not record.terminal:
            timings = msgspec.structs.replace(output.timings, total_s=time.monotonic() - record.arrival)
            self.metrics.finished("canceled", timings)
            log.info("request %s canceled after %d evals", record.rid, timings.evals)
            self.finish(record, Canceled(record.client_request_id, timings))

    def _on_request_failed(self, output: RequestFailed, record: RequestRecord | None) -> None:
        if record is not None and not record.terminal:
            log.warning("request %s failed: %s", record.rid, output.error)
            self.metrics.finished("failed")
            self.finish(record, Failed(record.client_request_id, output.error))

    # ------------------------------------------------------------------ the decode stage
    def _submit(self, job: FinalDecode | PreviewDecode, latents, params: GenerateParams, timings: Timings,
                ready_at: float | None = None) -> str:
        key = f"{next(self._job_numbers)}:{job.record.rid}"
        self._jobs[key] = job
        self.decode_stage.submit(key, latents, params, timings, ready_at)
        return key

    def handle_decoded(self, decoded: DecodedOutput) -> None:
        job = self._jobs.pop(decoded.request_id, None)
        if job is None:
            log.warning("the decode stage returned an unknown job %r; dropped", decoded.request_id)
        elif isinstance(job, PreviewDecode):
            self._preview_decoded(decoded, job)
        else:
            job.record.in_decode = False
            self._decode_finished(job.record.rid, job.record, decoded)

    def _preview_decoded(self, decoded: DecodedOutput, job: PreviewDecode) -> None:
        self.preview_stats["preview_decodes"] += 1
        self.preview_stats["preview_decode_s"] += decoded.timings.decode_s
        record = job.record
        record.preview_keys.discard(decoded.request_id)
        if record.terminal:
            return
        if decoded.error is None and not record.cancel_requested:
            self.book.sent(record, payload_nbytes(decoded.payload), min(record.preview_bytes, record.reserved_bytes))
            self.send(record.identity, PartialImage(record.client_request_id, job.index, job.step, job.total),
                      decoded.payload)
        if not record.preview_keys and record.held_final is not None:
            held, record.held_final = record.held_final, None
            self.finish(record, held.message, held.payload)

    def _decode_finished(self, rid: str, record: RequestRecord | None, decoded: DecodedOutput | None) -> None:
        deliver = self.core.decode_done(rid)
        if record is None:
            return
        if record.terminal:
            self.book.forget(record)
            return
        if not deliver or decoded is None or record.cancel_requested:
            # Canceled while decoding: the core may still report it; answer now either way.
            timings = msgspec.structs.replace(record.timings or Timings(), total_s=time.monotonic() - record.arrival)
            self.metrics.finished("canceled", timings)
            log.info("request %s canceled during decode", rid)
            self.finish(record, Canceled(record.client_request_id, timings))
            return
        if decoded.error is not None:
            self.metrics.finished("failed")
            self.finish(record, Failed(record.client_request_id, decoded.error))
            return
        timings = msgspec.structs.replace(decoded.timings, total_s=decoded.done_at - record.arrival)
        self.metrics.finished("completed", timings)
        log.info("request %s completed in %.3fs (queue %.3f, denoise %.3f, decode wait %.3f, decode %.3f; "
                 "%d evals, %d padded)", rid, timings.total_s, timings.queue_s, timings.denoise_s,
                 timings.decode_wait_s, timings.decode_s, timings.evals, timings.padded_evals)
        message = Completed(record.client_request_id, timings, decoded.output_kind, decoded.shape, decoded.dtype)
        if record.preview_keys:  # partial images go out before the completed image
            record.held_final = HeldFinal(message, decoded.payload)
            return
        self.finish(record, message, decoded.payload)

    # ------------------------------------------------------------------ the end of a request
    def finish(self, record: RequestRecord, message, payload=None) -> None:
        """Send the request's one final message and release what it holds; the bytes of its
        payload are held from now until the client's Delivered."""
        record.terminal = True
        for key in record.preview_keys:  # nobody wants them any more
            self.decode_stage.cancel(key)
        if payload is not None:
            self.book.sent(record, payload_nbytes(payload), 0)
        self.book.release(record)
        if record.identity in self.book.clients:
            self.send(record.identity, message, payload)
        self.book.forget(record)

    def cancel_now(self, record: RequestRecord) -> None:
        """Answer Canceled at once (the drain timeout), whatever the core still does."""
        record.cancel_requested = True
        if record.in_decode:
            self.decode_stage.cancel(record.decode_key)
        timings = msgspec.structs.replace(record.timings or Timings(), total_s=time.monotonic() - record.arrival)
        self.metrics.finished("canceled", timings)
        self.finish(record, Canceled(record.client_request_id, timings))
