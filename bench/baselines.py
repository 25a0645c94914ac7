"""Benchmark baselines as cores behind the engine's core Protocol (`CoreInterface`).

A baseline runs inside the same engine process, IO thread, client protocol and decode
stage as the engine itself; only the core differs:

    python -m engine serve --core bench.baselines:make_pipeline_batch_core [engine flags]

(the engine process runs with cwd = the repository root, so `bench.baselines` imports).

`PipelineBatchCore` ("diffusers-batched") is what a plain batched diffusers server does:
whenever it is idle it takes the oldest queued request and every other queued request
with the same (steps, sampler, guidance, height, width), up to `--slots` of them, and runs
ONE diffusers pipeline call for them to completion (`pipe(prompt_embeds=...,
negative_prompt_embeds=..., num_inference_steps=steps, guidance_scale=g,
generator=[one per request], output_type="latent")`, the folder's scheduler swapped for
the sampler as DESIGN.md section 3 writes it), so each result equals the pipeline's
own for that request. Requests that arrive meanwhile wait for the next call. The prompts
are encoded by the pipeline's own `encode_prompt` for every call (no embedding cache; its
time is the request's `encode_s`). Progress comes from the pipeline's
`callback_on_step_end`; the final latents go to the engine's decode stage like the
engine's own. A cancel of a queued request removes it; a cancel of a running one is
answered at once, but its rows keep being computed until the call ends (a pipeline call
cannot drop a row; they count as padded), unless every request of the call is canceled:
then the callback interrupts the call (`pipe._interrupt`, diffusers' own mechanism).

The static EngineCore configurations the benchmark compares (`static+padded`, the seed's
fixed batch, and `static+compact`) are engine flags, not cores:
`--admission static --layout padded|compact`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Iterable

import torch

from engine.core.config import CoreConfig
from engine.core.interface import ModelInfo
from engine.core.scheduling.ledger import reservation_for
from engine.core.validation import checked_size
from engine.core.outputs import DenoiseFinished, RequestCanceled, RequestFailed, RequestRejected, StepProgress
from engine.core.solvers import make_scheduler
from engine.protocol import GenerateParams, Timings

log = logging.getLogger("diffslot.baseline")

EVENT_WAIT_S = 0.05  # step() waits at most this long for the pipeline, then lets the IO path run


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    params: GenerateParams
    key: tuple  # (steps, sampler, guidance, height, width): what one pipeline call shares
    arrival: float
    timings: Timings = dataclasses.field(default_factory=Timings)
    canceled: bool = False
    state: str = "queued"  # queued → running → decoding → (removed)


@dataclasses.dataclass(eq=False)
class _Call:
    requests: list[_Request]
    rows_each: int  # 2 with classifier-free guidance, else 1
    started: float
    thread: threading.Thread | None = None
    interrupted: bool = False


class PipelineBatchCore:
    """A diffusers-style batched server's loop as a core (see the module docstring)."""

    def __init__(self, model, config: CoreConfig | None = None, clock=time.monotonic):
        pipe = getattr(model, "pipe", None)
        if pipe is None:
            raise ValueError(f"the diffusers-batched baseline runs a diffusers pipeline folder; "
                             f"{getattr(model, 'path', model)} is a {getattr(model, 'pipeline_class', '?')} model")
        self.model, self.pipe = model, pipe
        self.config = config or CoreConfig()
        self.clock = clock
        self.queue: collections.deque[_Request] = collections.deque()
        self.requests: dict[str, _Request] = {}
        self.outputs: list = []
        self.counters = collections.Counter()
        self._call: _Call | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = torch.get_num_threads()  # the pipeline thread uses the process's setting
        self._lock = threading.Lock()  # cancel flags, read by the pipeline thread's callback

    # ---- CoreInterface -------------------------------------------------------------

    def add_request(self, request_id: str, params: GenerateParams, arrival_time: float | None = None,
                    partial_images: int = 0) -> None:
        """Validate and queue. `partial_images` is accepted and ignored: a pipeline call
        sends no previews."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("must be a non-empty string", "request_id")
        if request_id in self.requests:
            raise RequestRejected(f"{request_id!r} is already in flight", "request_id")
        key = self._validate(params)
        if len(self.queue) >= self.config.max_queue:
            self.counters["rejected_full"] += 1
            raise RequestRejected(f"queue full ({self.config.max_queue} waiting)", None, 1.0)
        request = _Request(request_id, params, key, self.clock() if arrival_time is None else arrival_time)
        self.requests[request_id] = request
        self.queue.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.canceled:
                continue
            with self._lock:
                request.canceled = True
            self.counters["canceled_requests"] += 1
            self.counters["canceled_evals"] += request.timings.evals
            now = self.clock()
            t = request.timings
            if request.state == "queued":
                self.queue.remove(request)
                del self.requests[rid]
                t.queue_s = now - request.arrival
            elif request.state == "running":
                t.denoise_s = now - self._call.started  # its rows run on to the end of the call
            t.total_s = now - request.arrival
            self.outputs.append(RequestCanceled(rid, t))

    def step(self) -> list:
        if self._call is None and self.queue:
            self._start_call()
        if self._call is not None:
            wait = 0.0 if self.outputs else EVENT_WAIT_S
            try:
                self._on_event(self._events.get(timeout=wait) if wait else self._events.get_nowait())
                while self._call is not None:
                    self._on_event(self._events.get_nowait())
            except queue.Empty:
                pass
        outputs, self.outputs = self.outputs, []
        return outputs

    def has_work(self) -> bool:
        return bool(self.queue) or self._call is not None or bool(self.outputs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._call is not None

    def decode_done(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.state != "decoding":
            return False
        del self.requests[request_id]
        return not request.canceled

    def output_bytes(self, params: GenerateParams) -> int:
        try:
            _, _, _, height, width = self._validate(params)
        except RequestRejected:
            return 0
        return reservation_for(self.model.latent_shape(height, width), height, width, params.output).output_bytes

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model.name, native_size=self.model.native_size,
                         prompts=tuple(self.model.prompts), pipeline=self.model.pipeline_class)

    def adapter_names(self) -> list[str]:
        return []

    def stats(self) -> dict:
        c = self.counters
        rows = c["useful_evals"] + c["padded_evals"]
        busy = 0 if self._call is None else len(self._call.requests)
        return {
            "slots": self.config.slots, "slots_busy": busy, "slot_occupancy": busy / self.config.slots,
            "queue_depth": len(self.queue), "batches": c["batches"], "pipeline_calls": c["calls"],
            "useful_evals": c["useful_evals"], "padded_evals": c["padded_evals"],
            "useful_ratio": c["useful_evals"] / rows if rows else 1.0,
            "canceled_requests": c["canceled_requests"], "canceled_evals": c["canceled_evals"],
            "rejected_full": c["rejected_full"], "completed": c["completed"],
            # no embedding cache: every call encodes its prompts
            "embedding_cache_hits": 0, "embedding_cache_misses": c["prompts_encoded"],
            "embedding_cache_hit_rate": 0.0, "encoder_batches": c["calls"],
        }

    # ---- validation ----------------------------------------------------------------

    def _validate(self, p: GenerateParams) -> tuple:
        height, width = checked_size(self.model, self.model.geometry, p, self.config.max_steps)  # as EngineCore rejects it
        return (p.steps, p.sampler, float(p.guidance), height, width)

    # ---- one pipeline call -----------------------------------------------------------

    def _start_call(self) -> None:
        head = self.queue[0]
        batch = [r for r in self.queue if r.key == head.key][: self.config.slots]
        for r in batch:
            self.queue.remove(r)
        now = self.clock()
        for r in batch:
            r.state = "running"
            r.timings.queue_s = now - r.arrival
        guided = self.model.cfg_scale(head.params) is not None  # as the pipeline decides
        call = self._call = _Call(batch, 2 if guided else 1, now)
        self.counters["calls"] += 1
        self.counters["prompts_encoded"] += len(batch) * call.rows_each
        call.thread = threading.Thread(target=self._run_call, args=(call,), name="baseline-pipeline", daemon=True)
        call.thread.start()

    def _scheduler(self, sampler: str):
        original = self.pipe.scheduler
        if sampler == "default":
            return type(original).from_config(original.config)
        return make_scheduler(sampler, dict(original.config, _class_name=type(original).__name__))

    @torch.no_grad()
    def _run_call(self, call: _Call) -> None:
        """On the pipeline thread: one diffusers pipeline call for the whole batch."""
        torch.set_num_threads(self._threads)
        pipe = self.pipe
        steps, sampler, guidance, height, width = call.requests[0].key
        original = pipe.scheduler
        try:
            pipe.scheduler = self._scheduler(sampler)
            prompts = [r.params.prompt for r in call.requests]
            given = [r.params.negative_prompt for r in call.requests]
            # "not given" is None for the pipeline too (SDXL zeroes that branch); SD reads it as ""
            negatives = None if all(n is None for n in given) else [n or "" for n in given]
            started = time.perf_counter()
            if self.model.pipeline_class == "StableDiffusionPipeline":
                # what the pipeline's __call__ does first, done here so that it is timed
                embeds, negative_embeds = pipe.encode_prompt(prompts, self.model.device, 1, call.rows_each == 2,
                                                             negatives or [""] * len(prompts))
                inputs = dict(prompt_embeds=embeds, negative_prompt_embeds=negative_embeds)
            else:
                inputs = dict(prompt=prompts, negative_prompt=negatives)
            self._events.put(("encoded", time.perf_counter() - started))

            def on_step_end(pipeline, i, t, kwargs):
                self._events.put(("step", i + 1))
                with self._lock:
                    if all(r.canceled for r in call.requests):
                        pipeline._interrupt = True
                        call.interrupted = True
                return kwargs

            out = pipe(**inputs, num_inference_steps=steps, guidance_scale=guidance, height=height, width=width,
                       generator=[torch.Generator("cpu").manual_seed(r.params.seed) for r in call.requests],
                       output_type="latent", callback_on_step_end=on_step_end)
            self._events.put(("done", out.images.float().cpu()))
        except BaseException as exc:  # the call's requests fail; the engine goes on
            log.exception("pipeline call failed")
            self._events.put(("error", f"pipeline call failed: {exc!r}"))
        finally:
            pipe.scheduler = original

    def _on_event(self, event) -> None:
        kind, value = event
        call = self._call
        if kind == "encoded":
            for r in call.requests:
                r.timings.encode_s = value
        elif kind == "step":
            live = [r for r in call.requests if not r.canceled]
            rows = call.rows_each * len(call.requests)
            useful = call.rows_each * len(live)
            self.counters["batches"] += 1
            self.counters["useful_evals"] += useful
            self.counters["padded_evals"] += rows - useful
            for r in live:
                r.timings.evals += call.rows_each
                r.timings.padded_evals += rows - useful
                self.outputs.append(StepProgress(r.request_id, value, r.key[0]))
        else:  # "done" or "error": the call is over
            call.thread.join()
            self._call = None
            now = self.clock()
            for k, r in enumerate(call.requests):
                if r.canceled:
                    self.requests.pop(r.request_id, None)
                    continue
                r.timings.denoise_s = now - call.started - r.timings.encode_s
                if kind == "error":
                    del self.requests[r.request_id]
                    self.outputs.append(RequestFailed(r.request_id, value))
                    continue
                r.state = "decoding"
                self.counters["completed"] += 1
                self.outputs.append(DenoiseFinished(r.request_id, value[k], r.params, r.timings, now))


def make_pipeline_batch_core(model, config: CoreConfig) -> PipelineBatchCore:
    """`--core bench.baselines:make_pipeline_batch_core`."""
    return PipelineBatchCore(model, config)


#: Every baseline core, by the name the workload benchmark gives it (tests check each
#: against `engine.core.interface.CoreInterface`).
BASELINE_CORES = {"diffusers-batched": PipelineBatchCore}

__all__ = ["PipelineBatchCore", "make_pipeline_batch_core", "BASELINE_CORES"]
