"""EngineCore: the pure, in-process heart of the engine (no sockets, no threads).

A short conductor over parts that pass data (`engine.core.scheduling.plan`):

- the scheduler (`scheduler.py`, torch-free) decides what runs: the queue, admission
  against the ledger, groups and their slot maps, fairness, every request's state; it
  returns plans and updates from the runner's outcomes;
- the preparation phase (`preparation.py`) readies what admission placed: prompt rows
  and each per-request input kind (`input_kinds/`);
- the runner (`runner.py`) executes how, on its own slot storage: the row map, the
  gathered per-row model inputs, the denoiser call, the fused update, failure isolation,
  previews;
- the reaper (`reaper.py`) acts on completed fences: progress, publish, release.

`add_request` validates and queues; `abort_requests` marks; `step` reaps, admits (and
prepares what it admitted), runs one group's step and reaps again;
`decode_done` returns a decode reservation. The engine process (`engine.serve.proc`)
drives exactly these calls (`engine.core.interface.CoreInterface`), so tests run the
same core in-process.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from engine.core.config import CoreConfig
from engine.core.device import RunAhead
from engine.core.embedding_cache import EmbeddingCache
from engine.core.fences import fences_for
from engine.core.input_kinds import input_kinds_for
from engine.core.intake import Intake
from engine.core.interface import ModelInfo
from engine.core.scheduling.ledger import Ledger, reservation_for
from engine.core.outputs import RequestRejected
from engine.core.scheduling.plan import StepPlan
from engine.core.preparation import Preparation
from engine.core.reaper import Reaper
from engine.core.scheduling.requests import Request
from engine.core.runner import Runner
from engine.core.scheduling.scheduler import Scheduler
from engine.core.storage import Launch, Report
from engine.models.model import DiffusionModel, model_inputs
from engine.protocol import MAX_PARTIAL_IMAGES, OUTPUT_KINDS, GenerateParams

log = logging.getLogger("diffslot.core")


class EngineCore:
    def __init__(self, model: DiffusionModel, config: CoreConfig | None = None, fences=None,
                 clock=time.monotonic, adapters=None):
        self._pending: list = []  # outputs of calls between steps (cancels), returned by the next step
        self.model = model
        self.config = config or CoreConfig()
        self.device = torch.device(self.config.device)
        self.fences = fences or fences_for(self.device)
        self.clock = clock
        self.geometry = model.geometry
        self.adapters = adapters  # engine.lora.interface.AdapterResidency, or None
        self.kinds = input_kinds_for(model, self.geometry, self.config, adapters)
        self.embeddings = EmbeddingCache(model, self.config.embedding_cache_entries, self.config.embedding_cache_bytes,
                                         adapters)
        self.ledger = self._make_ledger()
        self.intake = Intake(model, self.geometry, self.config, self.ledger, self.kinds)
        self.scheduler = Scheduler(self.config, self.ledger, clock, adapters)
        self.runner = Runner(model, self.config, self.device, self.fences, self.intake.schedule_capacity,
                             None if adapters is None else (lambda: adapters.layout_version))
        self.reaper = Reaper(self.scheduler, self.runner, self.fences, clock)
        self.preparation = Preparation(model, self.embeddings, self.kinds, self.ledger, clock)
        if self.runner.graphed is not None:
            self.capture_graphs()
        # CUDA: the host prepares step n+1 while the device runs step n, at most two launches ahead
        self.window = RunAhead(2) if self.device.type == "cuda" else None

    def _make_ledger(self) -> Ledger:
        """Budgets by default: `slots` native requests' trajectories (with what each input
        kind sets aside for them), and the output bytes of `slots + decode_buffers` native
        outputs of the largest kind, so that free slots never idle for want of output bytes."""
        native, largest = self.geometry.native_size, self.geometry.max_size
        shape = self.geometry.latent_shape(native, native)
        conditioning = 2 * self.model.conditioning_nbytes
        trajectory = reservation_for(shape, native, native, "uint8", conditioning)
        output = max(reservation_for(shape, native, native, kind).output_bytes for kind in OUTPUT_KINDS)
        # and never less than one request at the largest size with the largest inputs: every
        # request valid under the documented limits is admitted, one at a time if need be
        big_shape = self.geometry.latent_shape(largest, largest)
        biggest = reservation_for(big_shape, largest, largest, "uint8", conditioning,
                                  sum(kind.largest_nbytes(big_shape) for kind in self.kinds))
        biggest_output = max(reservation_for(big_shape, largest, largest, kind).output_bytes for kind in OUTPUT_KINDS)
        c = self.config
        headroom = sum(kind.headroom(shape, c.slots) for kind in self.kinds)
        trajectory_budget = c.trajectory_budget_bytes or max(c.slots * trajectory.trajectory_bytes + headroom,
                                                             biggest.trajectory_bytes)
        output_budget = c.output_budget_bytes or max((c.slots + c.decode_buffers) * output, biggest_output)
        return Ledger(trajectory_budget, c.decode_buffers, output_budget,
                      trajectory_budget if c.parked_budget_bytes is None else c.parked_budget_bytes)

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
        request = self.intake.request(request_id, params, self.clock() if arrival_time is None else arrival_time)
        total = request.total_steps
        request.preview_steps = tuple(sorted({max(1, round(total * (k + 1) / (partial_images + 1)))
                                              for k in range(partial_images)} - {total}))
        if request.preview_steps:  # each preview is a PNG the client holds too
            _, h, w = request.latent_shape
            scale = self.geometry.vae_scale
            preview = reservation_for(request.latent_shape, h * scale, w * scale, "png").output_bytes
            request.reservation.output_bytes += len(request.preview_steps) * preview
            if not self.ledger.could_ever_fit(request.reservation):
                raise RequestRejected("its previews need more output memory than the engine holds at all",
                                      "partial_images")
        try:
            self.scheduler.add(request)
        except RequestRejected as exc:
            if exc.field is None:  # full: say when to come back
                raise RequestRejected(exc.reason, None, self._retry_after()) from None
            raise
        log.debug("request %s queued (%s)", request_id, params)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Cancel: idempotent, and safe to race with completion. What ends at once is
        returned by the next `step()`."""
        running, outputs = self.scheduler.abort(request_ids)
        self._pending += outputs
        for request in running:
            self._pending += self.reaper.drain(request)

    def step(self) -> list:
        """Reap, admit and prepare, run one batch for one group, reap; return outputs."""
        outputs, self._pending = self._pending, []
        outputs += self.reaper.reap()
        outputs += self._carry_out(self.scheduler.admit())
        plan = self.scheduler.next_step()
        if plan is not None and (self.window is None or self.window.wait_for_room()):
            outputs += self._run(plan)
        elif plan is None and not outputs:
            self.reaper.wait(self.config.fence_wait_s)
            if self.adapters is not None:  # waiting only for a load: spinning here would starve its thread
                self.adapters.wait_for_loads(self.config.fence_wait_s)
        outputs += self.reaper.reap()
        return outputs

    def admit(self) -> list[Request]:
        """Admission at a step boundary and the preparation of what it placed; returns the
        requests placed (their outputs, if any ended, come with the next `step()`)."""
        plan = self.scheduler.admit()
        self._pending += self._carry_out(plan)
        return plan.placed

    def _carry_out(self, plan) -> list:
        """An admission plan through the storage, the preparation phase and placement;
        returns the outputs of the requests that ended on the way."""
        outputs = list(plan.outputs)
        for key, error in self.runner.apply(plan).items():
            outputs += self.scheduler.storage_failed(key, error)
        placed = [r for r in plan.placed if not r.stopping]
        fresh = [r for r in placed if r.parked is None]  # a resumed request brings its prepared state
        for request, why in self.preparation.run(fresh).items():
            self.scheduler.fail(request, why)
        self.runner.place([r for r in placed if not r.stopping])
        for request in placed:
            if request.stopping:
                outputs += self.reaper.drain(request)
        return outputs

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture every bucket's graph of the native size before serving: a first capture
        mid-serving costs a device synchronise and a cache flush on the busy loop."""
        native = self.geometry.native_size
        shape = self.geometry.latent_shape(native, native)
        params = GenerateParams(prompt="")
        prompt = self.model.encode([""])[0]
        extras = self.model.request_inputs(params, native, native)
        variants = [extras]  # calls whose rows have no adapter leave the adapter rows out: a graph each
        if self.adapters is not None:
            variants.append({**extras, **self.adapters.row_inputs([], [])})
        limit = 2 * self.config.slots  # the buckets `Runner.build_batch` rounds up to
        sizes = sorted({min(1 << k, limit) for k in range(limit.bit_length() + 1)})
        for rows in sizes:
            for fields in variants:
                inputs = model_inputs(torch.zeros(rows, *shape, device=self.device, dtype=self.model.dtype),
                                      torch.full((rows,), 500.0, device=self.device), [prompt] * rows,
                                      **{name: value[:1].expand(rows, *value.shape[1:]).contiguous()
                                         for name, value in fields.items()})  # as serving's (a graph key)
                self.runner.graphed(inputs)
        log.info("captured %d CUDA graphs of the denoiser before serving", len(self.runner.graphed.graphs))

    def has_unfinished_requests(self) -> bool:
        """Any request not yet ended (queued, denoising, or awaiting decode_done)."""
        return bool(self.scheduler.requests) or self.reaper.pending()

    def has_work(self) -> bool:
        """Something for step() to do right now (a batch to run or a fence to reap)."""
        return bool(self.scheduler.queue) or self.reaper.pending() or bool(self._pending) \
            or any(g.runnable.any() for g in self.scheduler.groups.values())

    def output_bytes(self, params: GenerateParams) -> int:
        """Worst-case output bytes of a request (0 for sizes it will reject anyway)."""
        geometry = self.geometry
        implied = next((size for size in (kind.header_size(params) for kind in self.kinds) if size), None)
        if implied is not None:  # sides not given are the input's (at most)
            height, width = params.height or implied[0], params.width or implied[1]
        else:
            height, width = params.height or geometry.native_size, params.width or geometry.native_size
        if not (type(height) is int and type(width) is int and 0 < height <= geometry.max_size
                and 0 < width <= geometry.max_size) or params.output not in OUTPUT_KINDS:
            return 0
        return reservation_for(geometry.latent_shape(height, width), height, width, params.output).output_bytes

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model.name, native_size=self.geometry.native_size,
                         prompts=tuple(self.model.prompts), pipeline=self.model.pipeline_class,
                         controlnets=tuple(sorted(getattr(self.model, "controlnets", None) or {})))

    def adapter_names(self) -> list[str]:
        return [] if self.adapters is None else list(self.adapters.names())

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
            "park_s": runner.park_s,
            "cache_decisions": runner.cache_decisions,
            "cache_hits": runner.cache_hits,
            "cache_hit_rate": runner.cache_hits / runner.cache_decisions if runner.cache_decisions else 0.0,
            "cache_rows_skipped": runner.cache_rows_skipped,
            "schedules_cached": len(self.intake.schedules),
            **self.embeddings.stats(),
        }
        if self.adapters is not None:
            stats.update({f"adapter_{name}": value for name, value in self.adapters.stats().items()})
        return stats

    # ---- views of the parts' state (tests and benchmarks read these) ---------------

    requests = property(lambda self: self.scheduler.requests)
    queue = property(lambda self: self.scheduler.queue)
    groups = property(lambda self: self.scheduler.groups)  # the slot maps, by group key
    storage = property(lambda self: self.runner.storage)  # each group's slot storage, by group key
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

    def _retry_after(self) -> float:
        waiting_steps = sum(r.params.steps for r in self.scheduler.queue)
        return round(max(0.05, self.runner.timer.poll() * waiting_steps / self.config.slots), 3)

    # ---- one step ---------------------------------------------------------------------

    def _run(self, plan: StepPlan) -> list:
        outcome = self.runner.execute(plan)
        group = self.scheduler.groups[plan.key]
        reports = [Report(group, slot, int(group.epoch[slot]), request, step, final, outcome.previews.get(slot))
                   for slot, step, request, final in self.scheduler.update_from_output(plan, outcome)]
        self.reaper.inflight.append(Launch(outcome.fence, reports, outcome.finite))
        outputs = []
        for slot in outcome.failed:
            outputs += self.reaper.drain(group.requests[slot])  # now, or when its last launch's fence is done
        if self.window is not None:
            self.window.admit(outcome.fence)
        return outputs
