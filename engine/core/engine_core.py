"""EngineCore: the pure, in-process heart of the engine (no sockets, no threads).

A short conductor over three parts (R18):

- the scheduler (`scheduler.py`, torch-free) decides what runs: the queue, admission
  against the ledger, groups and their slot maps, fairness, every request's state;
- the runner (`runner.py`) executes how: the row map, the gathered per-row model
  inputs, the denoiser call, the fused update, failure isolation, previews;
- the reaper (`reaper.py`) acts on completed fences: progress, publish, release.

`add_request` validates and queues; `abort_requests` marks; `step` reaps, admits (and
encodes the prompts of what it admitted), runs one group's step and reaps again;
`decode_done` returns a decode reservation. The engine process (`engine.serve.proc`)
drives exactly these calls (`engine.core.interface.CoreInterface`), so tests run the
same core in-process.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Iterable

import torch

from engine.core.config import CoreConfig
from engine.core.device import RunAhead
from engine.core.encode import EmbeddingCache
from engine.core.fences import fences_for
from engine.core.interface import ModelInfo
from engine.core.ledger import Ledger, reservation_for
from engine.core.outputs import RequestRejected
from engine.core.reaper import Reaper
from engine.core.requests import Request
from engine.core.runner import Runner
from engine.core.scheduler import Scheduler
from engine.core.solvers import G, Schedule, Trajectory, UnsupportedSampler, build_schedule
from engine.core.validation import checked_size
from engine.models.loading import DiffusionModel
from engine.protocol import OUTPUT_KINDS, GenerateParams

log = logging.getLogger("diffslot.core")

MAX_PARTIAL_IMAGES = 3  # as OpenAI's images API


class EngineCore:
    def __init__(self, model: DiffusionModel, config: CoreConfig | None = None, fences=None,
                 clock=time.monotonic, adapters=None):
        self.model = model
        self.config = config or CoreConfig()
        self.device = torch.device(self.config.device)
        self.fences = fences or fences_for(self.device)
        self.clock = clock
        self.geometry = model.geometry
        self.adapters = adapters  # engine.lora.AdapterPool, or None
        self.outputs: list = []
        self.embeddings = EmbeddingCache(model, self.config.embedding_cache_entries, self.config.embedding_cache_bytes)
        self.ledger = self._make_ledger()
        # denoiser evaluations a schedule may take: generic schedulers may run more than one per
        # step (PNDM one more, Heun 2 × steps − 1)
        self.schedule_capacity = 2 * self.config.max_steps + 1
        self.scheduler = Scheduler(self.config, self.ledger, self._make_group, clock, self.outputs)
        self.runner = Runner(model, self.config, self.device, self.fences, self.scheduler, self.schedule_capacity)
        self.reaper = Reaper(self.scheduler, self.runner, self.fences, clock, self.outputs)
        self.reaper.on_release = self._released
        # CUDA: the host prepares step n+1 while the device runs step n, at most two launches ahead
        self.window = RunAhead(2) if self.device.type == "cuda" else None
        self._schedules: collections.OrderedDict[tuple, Schedule] = collections.OrderedDict()

    def _make_ledger(self) -> Ledger:
        """Budgets by default: `slots` native requests' trajectories, and the output bytes of
        `slots + decode_buffers` native outputs of the largest kind, so that free slots never
        idle for want of output bytes."""
        native = self.geometry.native_size
        shape = self.geometry.latent_shape(native, native)
        trajectory = reservation_for(shape, native, native, "uint8", 2 * self.model.conditioning_nbytes)
        output = max(reservation_for(shape, native, native, kind).output_bytes for kind in OUTPUT_KINDS)
        c = self.config
        return Ledger(c.trajectory_budget_bytes or c.slots * trajectory.trajectory_bytes, c.decode_buffers,
                      c.output_budget_bytes or (c.slots + c.decode_buffers) * output)

    def _make_group(self, key: tuple, latent_shape: tuple):
        return self.runner.make_group(key, latent_shape)

    # ---- public interface ------------------------------------------------------

    def add_request(self, request_id: str, params: GenerateParams, arrival_time: float | None = None,
                    partial_images: int = 0) -> None:
        """Validate and queue; raises RequestRejected naming the field, or when full.
        `partial_images` (0–3): previews of the clean-image estimate at evenly spaced steps."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("must be a non-empty string", "request_id")
        if request_id in self.scheduler.requests:
            raise RequestRejected(f"{request_id!r} is already in flight", "request_id")
        if type(partial_images) is not int or not 0 <= partial_images <= MAX_PARTIAL_IMAGES:
            raise RequestRejected(f"must be an integer in [0, {MAX_PARTIAL_IMAGES}]", "partial_images")
        request = self._validate(request_id, params, self.clock() if arrival_time is None else arrival_time)
        total = request.total_steps
        request.preview_steps = tuple(sorted({max(1, round(total * (k + 1) / (partial_images + 1)))
                                              for k in range(partial_images)} - {total}))
        try:
            self.scheduler.add(request)
        except RequestRejected as exc:
            if exc.field is None:  # full: say when to come back
                raise RequestRejected(exc.reason, None, self._retry_after()) from None
            raise
        log.debug("request %s queued (%s)", request_id, params)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Cancel: idempotent, and safe to race with completion."""
        for request in self.scheduler.abort(request_ids):
            self.reaper.drain(request)

    def step(self) -> list:
        """Reap, admit and encode, run one batch for one group, reap; return outputs."""
        self.reaper.reap()
        self.admit()
        group = self.scheduler.pick_group()
        if group is not None and (self.window is None or self.window.wait_for_room()):
            self._run(group)
        elif group is None and not self.outputs:
            self.reaper.wait(self.config.fence_wait_s)
        self.reaper.reap()
        outputs = self.outputs[:]
        self.outputs.clear()  # the scheduler and reaper append to this very list
        return outputs

    def admit(self) -> list[Request]:
        """Admission at a step boundary and the encode phase of what it placed."""
        placed = self.scheduler.admit()
        if placed:
            self._encode(placed)
        return placed

    def has_unfinished_requests(self) -> bool:
        """Any request not yet ended (queued, denoising, or awaiting decode_done)."""
        return bool(self.scheduler.requests) or self.reaper.pending()

    def has_work(self) -> bool:
        """Something for step() to do right now (a batch to run or a fence to reap)."""
        return bool(self.scheduler.queue) or self.reaper.pending() or bool(self.outputs) \
            or any(g.runnable.any() for g in self.scheduler.groups.values())

    def output_bytes(self, params: GenerateParams) -> int:
        """Worst-case output bytes of a request (0 for sizes it will reject anyway)."""
        geometry = self.geometry
        height, width = params.height or geometry.native_size, params.width or geometry.native_size
        if not (type(height) is int and type(width) is int and 0 < height <= geometry.max_size
                and 0 < width <= geometry.max_size) or params.output not in OUTPUT_KINDS:
            return 0
        return reservation_for(geometry.latent_shape(height, width), height, width, params.output).output_bytes

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model.path.name, native_size=self.geometry.native_size,
                         prompts=tuple(self.model.prompts), pipeline=self.model.pipeline_class)

    def decode_done(self, request_id: str) -> bool:
        """The decode stage finished (or dropped) the request: return its decode buffer and
        output bytes. True: deliver the output; False: it was canceled meanwhile."""
        return self.scheduler.decode_done(request_id)

    def stats(self) -> dict:
        runner = self.runner
        rows = runner.useful_rows + runner.padded_rows
        stats = {
            **self.scheduler.stats(),
            "useful_evals": runner.useful_rows,
            "padded_evals": runner.padded_rows,
            "useful_ratio": runner.useful_rows / rows if rows else 1.0,
            "stale_reports": self.reaper.stale_reports,
            "denoiser_s": runner.denoiser_s,
            "schedules_cached": len(self._schedules),
            **self.embeddings.stats(),
        }
        if self.adapters is not None:
            stats.update(self.adapters.stats())
        return stats

    # ---- views of the parts' state (tests and benchmarks read these) ---------------

    requests = property(lambda self: self.scheduler.requests)
    queue = property(lambda self: self.scheduler.queue)
    groups = property(lambda self: self.scheduler.groups)
    batches = property(lambda self: self.scheduler.batches)
    row_limit = property(lambda self: self.scheduler.row_limit)
    inflight = property(lambda self: self.reaper.inflight)
    copies = property(lambda self: self.reaper.copies)
    timer = property(lambda self: self.runner.timer)

    @property
    def graphed(self):
        return self.runner.graphed

    @graphed.setter
    def graphed(self, value) -> None:
        self.runner.graphed = value

    @property
    def async_copies(self) -> bool:
        return self.runner.async_copies

    @async_copies.setter
    def async_copies(self, value: bool) -> None:
        self.runner.async_copies = value

    @property
    def staged_uploads(self) -> bool:
        return self.runner.staged_uploads

    @staged_uploads.setter
    def staged_uploads(self, value: bool) -> None:
        self.runner.staged_uploads = value

    # ---- validation ----------------------------------------------------------------

    def _validate(self, request_id: str, p: GenerateParams, arrival: float) -> Request:
        model = self.model
        height, width = checked_size(model, self.geometry, p, self.config.max_steps)
        unusable = model.check_params(p)
        if unusable:
            raise RequestRejected(unusable[1], unusable[0])
        adapters = self._check_adapters(p)
        cfg_scale = model.cfg_scale(p)
        try:
            schedule = self._schedule(p.sampler, p.steps, cfg_scale or 1.0, model.schedule_options(height, width, p.steps))
        except UnsupportedSampler as exc:
            raise RequestRejected(str(exc), "sampler") from None
        if schedule.steps > self.schedule_capacity:
            raise RequestRejected(f"this sampler takes {schedule.steps} evaluations for {p.steps} steps, more than "
                                  f"{self.schedule_capacity}", "steps")
        latent_shape = self.geometry.latent_shape(height, width)
        rows = 1 if cfg_scale is None else 2
        reservation = reservation_for(latent_shape, height, width, p.output,
                                      rows * model.conditioning_nbytes + adapters)
        if not self.ledger.could_ever_fit(reservation):
            field = "height" if height >= width else "width"
            raise RequestRejected("needs more memory than the engine holds at all", field)
        key = (model.revision, latent_shape, str(model.dtype), model.conditioning_layout, model.prediction_type)
        request = Request(request_id, p, latent_shape, cfg_scale, arrival, reservation, key)
        request.trajectory = Trajectory(schedule, p.seed, latent_shape)
        request.request_inputs = model.request_inputs(p, height, width)
        return request

    def _check_adapters(self, p: GenerateParams) -> int:
        """Adapter bytes a request references (0 without adapters); rejects bad `loras`."""
        if not p.loras:
            return 0
        if self.adapters is None:
            raise RequestRejected("this engine serves no adapters (start it with --lora-dir)", "loras")
        why = self.adapters.check(p.loras)
        if why:
            raise RequestRejected(why, "loras")
        return self.adapters.nbytes(list(p.loras))

    def _schedule(self, sampler: str, steps: int, cfg_scale: float, options: tuple) -> Schedule:
        """Building a diffusers scheduler costs milliseconds on the busy loop; a schedule
        depends on (sampler, steps, size options) and, in its guidance column only, on the
        request: keep one per key, least recently used out."""
        key = (sampler, steps, options)
        base = self._schedules.get(key)
        if base is None:
            base = self._schedules[key] = build_schedule(sampler, self.model.scheduler_config, steps, 1.0, options)
            while len(self._schedules) > self.config.max_schedules:
                self._schedules.popitem(last=False)
        else:
            self._schedules.move_to_end(key)
        coefs = base.coefs.copy()
        coefs[:, G] = cfg_scale
        return dataclasses.replace(base, coefs=coefs)

    def _retry_after(self) -> float:
        waiting_steps = sum(r.params.steps for r in self.scheduler.queue)
        return round(max(0.05, self.runner.timer.poll() * waiting_steps / self.config.slots), 3)

    # ---- the encode phase and one step ------------------------------------------------

    def _encode(self, requests: list[Request]) -> None:
        """The encode phase (R14), between admission and a request's first step: its prompt
        rows from the embedding cache, the misses of all newly admitted requests in one
        batched pass of the model's own encoder(s); its request inputs and adapters. The
        slot then references them. A failure fails the requests it belongs to (R15)."""
        try:
            self._attach(requests)
        except Exception as exc:
            log.warning("encoding the prompts of %d requests raised %s: one at a time", len(requests), exc)
            for request in requests:
                try:
                    self._attach([request])
                except Exception as error:
                    self.scheduler.fail(request, f"the text encoder raised {type(error).__name__}: {error}")
                    self.reaper.drain(request)

    def _attach(self, requests: list[Request]) -> None:
        texts = []
        for request in requests:
            texts.append(request.params.prompt)
            if request.cfg_scale is not None:
                texts.append(self.model.negative_text(request.params))
        started = self.clock()
        rows = self.embeddings.get_many(texts)
        now = self.clock()
        k = 0
        for request in requests:
            negative = rows[k + 1] if request.cfg_scale is not None else None
            request.group.attach_conditioning(request.slot, rows[k], negative)
            k += request.rows_per_step
            request.timings.encode_s = now - started
            request.admitted_at = now

    def _run(self, group) -> None:
        launch, culprits = self.runner.run(group)
        self.reaper.inflight.append(launch)
        for slot, error in culprits.items():
            request = group.requests[slot]
            self.scheduler.fail(request, f"the denoiser raised {type(error).__name__}: {error}")
            self.reaper.drain(request)  # now, or when the fence of its last launch is done
        if self.window is not None:
            self.window.admit(launch.fence)

    def _released(self, request: Request) -> None:
        if request.adapters and self.adapters is not None:
            self.adapters.release(request.adapters)
            request.adapters = ()
