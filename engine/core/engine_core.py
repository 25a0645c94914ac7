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

import logging
import time
from typing import Iterable

import torch

from engine.core.config import CoreConfig
from engine.core.device import RunAhead
from engine.core.encode import EmbeddingCache
from engine.core.encode_phase import EncodePhase
from engine.core.fences import fences_for
from engine.core.image_inputs import header_size
from engine.core.intake import Intake
from engine.core.interface import ModelInfo
from engine.core.ledger import Ledger, image_input_nbytes, reservation_for
from engine.core.outputs import RequestRejected
from engine.core.reaper import Reaper
from engine.core.requests import Request
from engine.core.runner import Runner
from engine.core.scheduler import Scheduler
from engine.models.loading import DiffusionModel, model_inputs
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
        self.embeddings = EmbeddingCache(model, self.config.embedding_cache_entries, self.config.embedding_cache_bytes,
                                         adapters)
        self.ledger = self._make_ledger()
        self.intake = Intake(model, self.geometry, self.config, self.ledger, adapters)
        self.scheduler = Scheduler(self.config, self.ledger, self._make_group, clock, self.outputs,
                                   acquire=None if adapters is None else self._acquire_adapters)
        self.runner = Runner(model, self.config, self.device, self.fences, self.scheduler,
                             self.intake.schedule_capacity)
        self.reaper = Reaper(self.scheduler, self.runner, self.fences, clock, self.outputs)
        self.reaper.on_release = self._released
        self.encode = EncodePhase(model, self.embeddings, self.scheduler, self.reaper, self.ledger, clock)
        if adapters is not None and self.runner.graphed is not None:  # a graph reads the pool's layout
            self.runner.graphed.layout_version = lambda: adapters.layout_version
        if self.runner.graphed is not None:
            self.capture_graphs()
        # CUDA: the host prepares step n+1 while the device runs step n, at most two launches ahead
        self.window = RunAhead(2) if self.device.type == "cuda" else None

    def _make_ledger(self) -> Ledger:
        """Budgets by default: `slots` native requests' trajectories (with their image rows,
        `_image_headroom`), and the output bytes of `slots + decode_buffers` native outputs
        of the largest kind, so that free slots never idle for want of output bytes."""
        native = self.geometry.native_size
        shape = self.geometry.latent_shape(native, native)
        trajectory = reservation_for(shape, native, native, "uint8", 2 * self.model.conditioning_nbytes)
        output = max(reservation_for(shape, native, native, kind).output_bytes for kind in OUTPUT_KINDS)
        c = self.config
        return Ledger(c.trajectory_budget_bytes or c.slots * trajectory.trajectory_bytes + self._image_headroom(shape),
                      c.decode_buffers, c.output_budget_bytes or (c.slots + c.decode_buffers) * output)

    def _image_headroom(self, shape: tuple) -> int:
        """A model with an image path: room for every slot's image rows (latents, and with
        inpainting noise and mask) and for one native image and mask's encoded bytes at
        admission, raw-sized (spent in the encode phase)."""
        model = self.model
        if model.image_support("image") is not None:
            return 0
        native = self.geometry.native_size
        masked = model.image_support("mask") is None
        return self.config.slots * image_input_nbytes(shape, 0, masked) + 4 * native * native

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
        request = self.intake.request(request_id, params, self.clock() if arrival_time is None else arrival_time)
        total = request.total_steps
        request.preview_steps = tuple(sorted({max(1, round(total * (k + 1) / (partial_images + 1)))
                                              for k in range(partial_images)} - {total}))
        if request.preview_steps:  # each preview is a PNG the client holds too (R8)
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
        for request in [r for r in placed if r.stopping]:  # failed as it was admitted (its adapter)
            request.group.runnable[request.slot] = False
            placed.remove(request)
            self.reaper.drain(request)
        if placed:
            self.encode.prompts(placed)
            self.encode.images([r for r in placed if r.image_inputs is not None and not r.stopping])
        return placed

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture every bucket's graph of the native size before serving: a first capture
        mid-serving costs a device synchronise and a cache flush on the busy loop."""
        native = self.geometry.native_size
        shape = self.geometry.latent_shape(native, native)
        params = GenerateParams(prompt="")
        prompt = self.model.encode([""])[0]
        extras = self.model.request_inputs(params, native, native)
        if self.adapters is not None:
            extras.update(self.adapters.row_inputs([], []))
        limit = 2 * self.config.slots  # the buckets `Runner.build_batch` rounds up to
        sizes = sorted({min(1 << k, limit) for k in range(limit.bit_length() + 1)})
        for rows in sizes:
            inputs = model_inputs(torch.zeros(rows, *shape, device=self.device, dtype=self.model.dtype),
                                  torch.full((rows,), 500.0, device=self.device), [prompt] * rows,
                                  **{name: value[:1].expand(rows, *value.shape[1:]) for name, value in extras.items()})
            self.runner.graphed(inputs)
        log.info("captured %d CUDA graphs of the denoiser before serving", len(self.runner.graphed.graphs))

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
        from_image = None if params.image is None else header_size(params.image)
        if from_image is not None:  # an image request's sides not given are the image's (at most)
            height, width = params.height or from_image[0], params.width or from_image[1]
        else:
            height, width = params.height or geometry.native_size, params.width or geometry.native_size
        if not (type(height) is int and type(width) is int and 0 < height <= geometry.max_size
                and 0 < width <= geometry.max_size) or params.output not in OUTPUT_KINDS:
            return 0
        return reservation_for(geometry.latent_shape(height, width), height, width, params.output).output_bytes

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model.name, native_size=self.geometry.native_size,
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
            "schedules_cached": len(self.intake.schedules),
            **self.embeddings.stats(),
        }
        if self.adapters is not None:
            stats.update({f"adapter_{name}": value for name, value in self.adapters.stats().items()})
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

    def _retry_after(self) -> float:
        waiting_steps = sum(r.params.steps for r in self.scheduler.queue)
        return round(max(0.05, self.runner.timer.poll() * waiting_steps / self.config.slots), 3)

    # ---- one step ---------------------------------------------------------------------

    def _run(self, group) -> None:
        launch, culprits = self.runner.run(group)
        self.reaper.inflight.append(launch)
        for slot, error in culprits.items():
            request = group.requests[slot]
            self.scheduler.fail(request, f"the denoiser raised {type(error).__name__}: {error}")
            self.reaper.drain(request)  # now, or when the fence of its last launch is done
        if self.window is not None:
            self.window.admit(launch.fence)

    def _acquire_adapters(self, request: Request) -> bool:
        """Admission: make the request's adapters resident and reference them (False: they
        cannot all be resident now; it waits, as for memory). Their pool slots become the
        request's `lora_index` rows."""
        loras = request.params.loras
        if not loras:
            return True
        try:
            slots = self.adapters.acquire(list(loras))
        except Exception as exc:  # the file changed or broke since validation: this request fails
            self.scheduler.fail(request, f"adapter could not be loaded: {exc}")
            return True  # placed and drained at once by the encode phase
        if slots is None:
            return False
        request.adapters = tuple(slots)
        request.request_inputs.update(self.adapters.row_inputs(slots, list(loras.values())))
        return True

    def _released(self, request: Request) -> None:
        if request.adapters and self.adapters is not None:
            self.adapters.release(request.adapters)
            request.adapters = ()
