"""EngineCore: the pure, in-process heart of the engine (no sockets, no threads).

`add_request` validates and queues; `abort_requests` marks; `step` admits (and encodes
the prompts of what it admits), runs one denoising step for one group of slots and
reaps completed fences; `decode_done` returns a decode reservation. The engine process
(`engine.serve.proc`) drives exactly these calls (`engine.core.interface.CoreInterface`),
so tests run the same core in-process.

A request's life: QUEUED → (admission reserves trajectory and conditioning memory,
decode buffer and output bytes) → (encode: its prompt rows from the embedding cache or
one batched pass of the text encoder for everything admitted at this boundary) →
RUNNING in a slot → FINISHING (last step launched, its fence pending) → the
reaper publishes the final latents, releases the slot (epoch + 1) → DECODING (decode
reservation held) → decode_done. A cancel marks the request at once; no new work is
scheduled for it; its slot is released only when the fence of the last launch that
touched it is done.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Iterable

import numpy as np
import torch

from engine.core.config import CoreConfig
from engine.core.device import PinnedBuffers, RunAhead, StepTimer
from engine.core.encode import EmbeddingCache
from engine.core.fences import fences_for
from engine.core.graphs import CudaGraphCapture, GraphedDenoiser
from engine.core.interface import ModelInfo
from engine.core.kernels import update_slots
from engine.core.ledger import Ledger, reservation_for
from engine.core.slots import Batch, Group, Report, Request, State
from engine.core.validation import checked_size
from engine.core.outputs import (  # noqa: F401
    DenoiseFinished, PreviewReady, RequestCanceled, RequestFailed, RequestRejected, StepProgress,
)
from engine.core.solvers import G, NUM_COEFS, P, Q, Schedule, Trajectory, UnsupportedSampler, build_schedule
from engine.models.loading import DiffusionModel
from engine.protocol import OUTPUT_KINDS, GenerateParams, Timings

log = logging.getLogger("diffslot.core")

MAX_PARTIAL_IMAGES = 3  # as OpenAI's images API


class EngineCore:
    def __init__(self, model: DiffusionModel, config: CoreConfig | None = None, fences=None,
                 clock=time.monotonic):
        self.model = model
        self.config = config or CoreConfig()
        self.device = torch.device(self.config.device)
        self.fences = fences or fences_for(self.device)
        self.clock = clock
        self.groups: dict[tuple, Group] = {}
        self.requests: dict[str, Request] = {}
        self.queue: collections.deque[Request] = collections.deque()
        self.inflight: list[tuple] = []  # (fence, [Report], the group's per-slot finite flags on the device)
        self.outputs: list = []
        self.embeddings = EmbeddingCache(model, self.config.embedding_cache_entries)
        native = model.native_size
        native_shape = model.latent_shape(native, native)
        native_trajectory = reservation_for(native_shape, native, native, "uint8",
                                            2 * model.conditioning_nbytes).trajectory_bytes
        # The default output budget is `slots + decode_buffers` native outputs of the
        # *largest* kind, so that free slots never idle for want of output bytes.
        native_output_bytes = max(reservation_for(native_shape, native, native, kind).output_bytes
                                  for kind in OUTPUT_KINDS)
        self.ledger = Ledger(
            self.config.trajectory_budget_bytes or self.config.slots * native_trajectory,
            self.config.decode_buffers,
            self.config.output_budget_bytes
            or (self.config.slots + self.config.decode_buffers) * native_output_bytes,
        )
        self.size_multiple = model.size_multiple
        self.max_size = 4 * native
        self.batches = 0
        self.stats_counters = collections.Counter()
        self.group_wait_max = 0  # head-of-line blocking: most batches a runnable group waited
        self.denoiser_s = 0.0  # host seconds inside one-call denoiser steps: on a CPU, its busy time
        self.timer = StepTimer(self.device)  # device time per step (host time says nothing on CUDA)
        # CUDA: the host prepares step n+1 while the device runs step n, at most two launches ahead
        self.window = RunAhead(2) if self.device.type == "cuda" else None
        self.async_copies = self.device.type == "cuda"  # tests turn it on with deferred fences
        self.staged_uploads = self.device.type == "cuda"  # and this one on CPU tensors
        self.copies: list[tuple] = []  # (fence, group, slot, request, host buffer): final latents on their way out
        self._schedules: dict[tuple[str, int], Schedule] = {}  # (sampler, steps) → schedule at guidance 1
        self.row_limit: int | None = None  # rows per denoiser call, once the device ran out of memory
        # bucketed layout on CUDA: each bucket's denoiser call is captured once and replayed
        self.graphed: GraphedDenoiser | None = None
        if self.config.cuda_graphs and self.config.layout == "bucketed" and self.device.type == "cuda" \
                and GraphedDenoiser.supports(model):
            self.graphed = GraphedDenoiser(model, CudaGraphCapture(self.device))
        # denoiser evaluations a schedule may take: generic schedulers may run more than one per
        # step (PNDM one more, Heun 2 × steps − 1)
        self.schedule_capacity = 2 * self.config.max_steps + 1

    # ---- public interface ------------------------------------------------------

    def add_request(self, request_id: str, params: GenerateParams, arrival_time: float | None = None,
                    partial_images: int = 0) -> None:
        """Validate and queue; raises RequestRejected naming the field, or when full.
        `partial_images` (0–3): previews of the clean-image estimate at evenly spaced steps."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("must be a non-empty string", "request_id")
        if request_id in self.requests:
            raise RequestRejected(f"{request_id!r} is already in flight", "request_id")
        if type(partial_images) is not int or not 0 <= partial_images <= MAX_PARTIAL_IMAGES:
            raise RequestRejected(f"must be an integer in [0, {MAX_PARTIAL_IMAGES}]", "partial_images")
        request = self._validate(request_id, params, self.clock() if arrival_time is None else arrival_time)
        total = request.trajectory.total
        request.preview_steps = tuple(sorted({max(1, round(total * (k + 1) / (partial_images + 1)))
                                              for k in range(partial_images)} - {total}))
        if len(self.queue) >= self.config.max_queue:
            self.stats_counters["rejected_full"] += 1
            raise RequestRejected(f"queue full ({self.config.max_queue} waiting)", None, self._retry_after())
        self.requests[request_id] = request
        self.queue.append(request)
        log.debug("request %s queued (%s)", request_id, params)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Cancel: idempotent, and safe to race with completion."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.canceled or request.state is State.DONE:
                continue
            request.canceled = True
            self.stats_counters["canceled"] += 1
            self.stats_counters["canceled_evals"] += request.timings.evals
            log.info("request %s canceled while %s", rid, request.state.value)
            if request.state is State.QUEUED:
                self.queue.remove(request)
                self._finish(request, canceled=True)
            elif request.state is State.RUNNING:
                group, slot = request.group, request.slot
                group.runnable[slot] = False
                self._drain_slot(group, slot, request)
            elif request.state is State.DECODING:
                # the decode stage drops its output; decode_done returns the buffer
                self.outputs.append(RequestCanceled(rid, self._final_timings(request)))
            # FINISHING: the reaper sees `canceled` when the final fence completes

    cancel = abort_requests

    def step(self) -> list:
        """Encode, admit, run one batch for one group, reap completed fences; return outputs."""
        self._reap()
        self._admit()
        group = self._pick_group()
        if group is not None and (self.window is None or self.window.wait_for_room()):
            self._run_batch(group)
        elif group is None and not self.outputs:
            self._wait_for_device()
        self._reap()
        outputs, self.outputs = self.outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Any request not yet ended (queued, denoising, or awaiting decode_done)."""
        return bool(self.requests) or bool(self.inflight) or bool(self.copies)

    def has_work(self) -> bool:
        """Something for step() to do right now (a batch to run or a fence to reap)."""
        return bool(self.queue) or bool(self.inflight) or any(g.runnable.any() for g in self.groups.values()) \
            or bool(self.outputs) or bool(self.copies)

    def output_bytes(self, params: GenerateParams) -> int:
        """Worst-case output bytes of a request (0 for sizes it will reject anyway)."""
        native = self.model.native_size
        height, width = params.height or native, params.width or native
        if not (type(height) is int and type(width) is int and 0 < height <= self.max_size
                and 0 < width <= self.max_size) or params.output not in OUTPUT_KINDS:
            return 0
        return reservation_for(self.model.latent_shape(height, width), height, width, params.output).output_bytes

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model.path.name, native_size=self.model.native_size,
                         prompts=tuple(self.model.prompts), pipeline=self.model.pipeline_class)

    def decode_done(self, request_id: str) -> bool:
        """The decode stage finished (or dropped) the request: return its decode buffer and
        output bytes. True: deliver the output; False: it was canceled meanwhile."""
        request = self.requests.get(request_id)
        if request is None or request.state is not State.DECODING:
            return False
        self.ledger.give_back_decode(request.reservation)
        request.state = State.DONE
        del self.requests[request_id]
        return not request.canceled

    def stats(self) -> dict:
        total_slots = sum(g.slots for g in self.groups.values()) or self.config.slots
        c = self.stats_counters
        rows = c["useful_rows"] + c["padded_rows"]
        return {
            "slots": total_slots,
            "slots_busy": sum(g.active for g in self.groups.values()),
            "slot_occupancy": sum(g.active for g in self.groups.values()) / total_slots,
            "queue_depth": len(self.queue),
            "batches": self.batches,
            "useful_evals": c["useful_rows"],
            "padded_evals": c["padded_rows"],
            "useful_ratio": c["useful_rows"] / rows if rows else 1.0,
            "canceled_requests": c["canceled"],
            "failed_requests": c["failed"],
            "oom_splits": c["oom_splits"],
            "canceled_evals": c["canceled_evals"],
            "stale_reports": c["stale"],
            "rejected_full": c["rejected_full"],
            "completed": c["completed"],
            "max_group_wait_batches": self.group_wait_max,
            "denoiser_s": self.denoiser_s,
            "reserved_trajectory_bytes": self.ledger.used.trajectory_bytes,
            "reserved_output_bytes": self.ledger.used.output_bytes,
            "reserved_decode_buffers": self.ledger.used.decode_buffers,
            **self.embeddings.stats(),
        }

    # ---- validation and admission ------------------------------------------------

    def _validate(self, request_id: str, p: GenerateParams, arrival: float) -> Request:
        model = self.model
        height, width = checked_size(model, p, self.config.max_steps)
        try:
            schedule = self._schedule(p.sampler, p.steps, float(p.guidance))
        except UnsupportedSampler as exc:
            raise RequestRejected(str(exc), "sampler") from None
        if schedule.steps > self.schedule_capacity:
            raise RequestRejected(f"this sampler takes {schedule.steps} evaluations for {p.steps} steps, more than "
                                  f"{self.schedule_capacity}", "steps")
        latent_shape = model.latent_shape(height, width)
        rows = 2 if model.guided(float(p.guidance)) else 1
        reservation = reservation_for(latent_shape, height, width, p.output,
                                      rows * model.conditioning_nbytes)
        if not self.ledger.could_ever_fit(reservation):
            field = "height" if height >= width else "width"
            raise RequestRejected("needs more memory than the engine holds at all", field)
        request = Request(request_id, p, latent_shape, rows, arrival, reservation)
        request.trajectory = Trajectory(schedule, p.seed, latent_shape)
        return request

    def _schedule(self, sampler: str, steps: int, guidance: float) -> Schedule:
        """Building a diffusers scheduler costs milliseconds on the busy loop; a schedule
        depends only on (sampler, steps) but for the guidance column, so keep one each."""
        key = (sampler, steps)
        base = self._schedules.get(key)
        if base is None:
            if len(self._schedules) >= 4096:
                self._schedules.clear()
            base = self._schedules[key] = build_schedule(sampler, self.model.scheduler_config, steps, 1.0)
        coefs = base.coefs.copy()
        coefs[:, G] = guidance
        return dataclasses.replace(base, coefs=coefs)

    def _retry_after(self) -> float:
        waiting_steps = sum(r.params.steps for r in self.queue)
        return round(max(0.05, self.timer.poll() * waiting_steps / self.config.slots), 3)

    def _admit(self) -> None:
        if self.config.admission == "static" and any(g.busy.any() for g in self.groups.values()):
            return  # a new batch only when the last one is finished, as a pipeline call
        # FIX (R2, tests/test_core.py): a request whose group has no free slot is skipped, not
        # waited on; it used to stop admission, so a request of another group with free slots
        # queued behind it was starved until the full group drained. FIFO holds within a group
        # (once a group is full, its later requests are skipped too), and a request that does
        # not fit in memory still stops admission for everyone behind it, as before.
        skipped: list[Request] = []
        full_groups: set[tuple] = set()
        placed: list[Request] = []
        while self.queue:
            request = self.queue[0]
            group = self._group_for(request)
            slot = -1 if group.key in full_groups or group.active >= self._slot_cap() else group.free_slot()
            if slot < 0:
                full_groups.add(group.key)
                skipped.append(self.queue.popleft())
                continue
            if not self.ledger.fits(request.reservation):
                break  # FIFO: the head waits for memory; a known boundary, not a crash
            self.queue.popleft()
            self.ledger.take(request.reservation)
            self._place(request, group, slot)
            placed.append(request)
        self.queue.extendleft(reversed(skipped))
        if placed:
            self._encode(placed)

    def _group_for(self, request: Request) -> Group:
        model = self.model
        key = (model.revision, request.latent_shape, str(model.dtype), model.conditioning_layout,
               model.prediction_type)
        group = self.groups.get(key)
        if group is None:
            group = Group(key, request.latent_shape, self.config.slots, self.schedule_capacity,
                          self.device, model.dtype)
            self.groups[key] = group
        return group

    def _place(self, request: Request, group: Group, slot: int) -> None:
        schedule = request.trajectory.schedule
        n = schedule.steps
        group.requests[slot] = request
        group.busy[slot] = group.runnable[slot] = True
        group.step_index[slot] = 0
        group.total_steps[slot] = n
        group.two_rows[slot] = request.rows_per_step == 2
        group.stochastic[slot] = schedule.stochastic
        group.generic[slot] = schedule.scheduler is not None
        group.coef_table[slot, :n] = schedule.coefs
        group.timestep_table[slot, :n] = schedule.timesteps
        group.divisor_table[slot, :n] = schedule.input_divisor
        group.latents[slot].copy_(request.trajectory.initial_latents().reshape(-1), non_blocking=True)
        group.history[slot].zero_()
        request.group, request.slot, request.state = group, slot, State.RUNNING
        request.admitted_at = self.clock()  # moved past its encode pass by `_encode`
        request.timings.queue_s = request.admitted_at - request.arrival
        log.info("request %s admitted to slot %d (epoch %d)", request.request_id, slot, group.epoch[slot])

    # ---- one step ----------------------------------------------------------------

    def _pick_group(self) -> Group | None:
        """Fair across groups: the runnable group served longest ago goes next."""
        runnable = [g for g in self.groups.values() if g.runnable.any()]
        if not runnable:
            return None
        group = min(runnable, key=lambda g: g.last_served)
        for g in runnable:
            if g is not group:
                self.group_wait_max = max(self.group_wait_max, self.batches - g.last_served)
        return group

    def _build_batch(self, group: Group) -> Batch:
        layout = self.config.layout
        act = np.flatnonzero(group.runnable)
        steps = group.step_index[act]
        two = group.two_rows[act]
        if layout == "padded":
            # a fixed batch: every slot, both branches, whatever it holds
            row_slot = np.repeat(np.arange(group.slots), 2)
            row_branch_uncond = np.tile([False, True], group.slots)
            cond_row, uncond_row = 2 * act, np.where(two, 2 * act + 1, -1)
        else:
            rows_each = 1 + two
            start = np.cumsum(rows_each) - rows_each
            row_slot = np.repeat(act, rows_each)
            row_branch_uncond = np.zeros(len(row_slot), dtype=bool)
            row_branch_uncond[start[two] + 1] = True
            cond_row, uncond_row = start, np.where(two, start + 1, -1)
            if layout == "bucketed":
                target = _bucket(len(row_slot), 2 * group.slots)
                pad = target - len(row_slot)
                row_slot = np.concatenate([row_slot, np.full(pad, act[0])])
                row_branch_uncond = np.concatenate([row_branch_uncond, np.ones(pad, dtype=bool)])
        useful = int(act.size + two.sum())
        # per-row input divisor and timestep at the row's slot's own step (idle slots: step 0)
        row_step = group.step_index[row_slot]
        row_step = np.where(group.runnable[row_slot], row_step, 0)
        row_divisor = group.divisor_table[row_slot, row_step]
        row_timestep = group.timestep_table[row_slot, row_step]
        # each row's conditioning: its slot's prompt rows (the negative prompt on the uncond
        # branch); padding rows and idle slots borrow an active slot's, their output unused
        cond_slot = np.where(group.runnable[row_slot], row_slot, act[0])
        branch = (row_branch_uncond & group.two_rows[cond_slot]).astype(np.int64)
        row_conditioning = group.conditioning[cond_slot, branch].tolist()
        # noise, drawn from each stochastic request's own generator, in its own order
        generic = group.generic[act]
        kernel = ~generic
        noisy = np.flatnonzero(group.stochastic[act][kernel])
        noise_row = np.full(int(kernel.sum()), -1, dtype=np.int64)
        noise_row[noisy] = np.arange(noisy.size)
        kernel_slots = act[kernel]
        if noisy.size:
            requests = group.requests
            noise = torch.stack([requests[s].trajectory.step_noise() for s in kernel_slots[noisy].tolist()])
            noise = noise.to(self.device, non_blocking=True)
        else:
            noise = torch.empty(0, device=self.device)
        index = np.stack([kernel_slots, cond_row[kernel], uncond_row[kernel], noise_row], axis=1).astype(np.int32)
        coefs = group.coef_table[kernel_slots, steps[kernel]]
        arrays = {"index": index, "coefs": coefs, "row_slot": row_slot, "row_divisor": row_divisor,
                  "row_timestep": row_timestep}
        dev = self._upload(group, arrays)
        return Batch(
            slots=act,
            index=dev["index"],
            index_host=index,
            coefs=dev["coefs"],
            generic=np.stack([act[generic], cond_row[generic], uncond_row[generic]], axis=1),
            row_slot=row_slot,
            row_index=dev["row_slot"],
            row_divisor=dev["row_divisor"],
            row_timestep=dev["row_timestep"],
            row_conditioning=row_conditioning,
            noise=noise,
            useful_rows=useful,
            padded_rows=len(row_slot) - useful,
        )

    def _upload(self, group: Group, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The step's small arrays on the device. On CUDA through persistent page-locked
        staging, packed: one asynchronous host-to-device copy a step (a `non_blocking` copy
        from pageable memory would be synchronous); on CPU the arrays themselves."""
        if not self.staged_uploads:
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        if group.staging is None:
            rows, entries = 2 * group.slots, group.slots
            group.staging = PinnedBuffers({
                "index": (np.int32, (entries, 4)), "coefs": (np.float32, (entries, NUM_COEFS)),
                "row_slot": (np.int64, (rows,)), "row_divisor": (np.float32, (rows,)),
                "row_timestep": (np.float32, (rows,))}, self.device)
        staged = group.staging.acquire()
        for name, array in arrays.items():
            staged.host[name][:len(array)] = array
        return staged.upload({name: len(array) for name, array in arrays.items()})

    @torch.no_grad()
    def _run_batch(self, group: Group) -> None:
        timing = self.timer.start()
        batch = self._build_batch(group)
        x_in = group.latents.index_select(0, batch.row_index) / batch.row_divisor[:, None]  # as scale_model_input
        x_in = x_in.view(len(batch.row_slot), *group.latent_shape)
        for slot, cond_row, uncond_row in batch.generic.tolist():  # the scheduler's own scaling
            trajectory, t = group.requests[slot].trajectory, self._generic_timestep(group, slot)
            scaled = trajectory.scale_model_input(group.latents[slot].view(1, *group.latent_shape), t)
            x_in[cond_row] = scaled[0]
            if uncond_row >= 0:
                x_in[uncond_row] = scaled[0]
        try:
            out = self._denoise_fitting(batch, x_in)
        except Exception as exc:  # R15: find the requests that cause it; the others go on
            out, batch = self._isolate_failure(group, batch, x_in, exc)
        previews = self._previews(group, batch, out)
        update_slots(out, group.latents, group.history, batch.noise, batch.index, batch.coefs)
        if len(batch.generic):
            self._step_generic(group, batch, out, previews)
        if previews and self.async_copies:  # to the host behind this step's fence, not by a draining .to("cpu")
            previews = {slot: None if x0 is None else self._copy_to_host(x0) for slot, x0 in previews.items()}
        # one reduction per step over the group's slots, read by the reaper after the fence: no
        # per-slot device sync, no host-to-device copy
        finite = torch.isfinite(group.latents).all(1)
        fence = self.fences.record()
        self.batches += 1
        group.last_served = self.batches
        self.stats_counters["useful_rows"] += batch.useful_rows
        self.stats_counters["padded_rows"] += batch.padded_rows
        reports = []
        for slot in batch.slots.tolist():
            request = group.requests[slot]
            request.timings.evals += request.rows_per_step
            request.timings.padded_evals += batch.padded_rows
            group.step_index[slot] += 1
            group.last_fence[slot] = fence
            step = int(group.step_index[slot])
            final = step == group.total_steps[slot]
            request.trajectory.step = step
            if final:
                group.runnable[slot] = False
                request.state = State.FINISHING
            reports.append(Report(group, slot, int(group.epoch[slot]), request, step, final, previews.get(slot)))
        self.inflight.append((fence, reports, finite))
        self.timer.stop(timing)
        if self.window is not None:
            self.window.admit(fence)

    def _denoise(self, batch: Batch, x_in: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """The denoiser over the batch's rows (or a subset), in chunks of `row_limit` rows
        once the device has run out of memory for more."""
        n = len(batch.row_slot)
        if rows is None and (self.row_limit is None or self.row_limit >= n):  # the common case: one call
            denoise = self.graphed or self.model.denoise
            started = time.perf_counter()
            out = denoise(x_in.to(self.model.dtype), batch.row_timestep, batch.row_conditioning)
            self.denoiser_s += time.perf_counter() - started  # on CUDA: the launches' host time
            return out.reshape(n, -1)
        rows = list(range(n)) if rows is None else rows
        limit = self.row_limit or len(rows)
        outs = []
        for start in range(0, len(rows), limit):
            chunk = rows[start:start + limit]
            index = torch.tensor(chunk, device=self.device)
            outs.append(self.model.denoise(x_in.index_select(0, index).to(self.model.dtype),
                                           batch.row_timestep.index_select(0, index),
                                           [batch.row_conditioning[r] for r in chunk]).reshape(len(chunk), -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _denoise_fitting(self, batch: Batch, x_in: torch.Tensor) -> torch.Tensor:
        """Device out of memory: halve the rows per denoiser call (and, through admission,
        the slots in use) until the step fits; never die of it."""
        while True:
            try:
                return self._denoise(batch, x_in)
            except Exception as exc:
                rows = self.row_limit or len(batch.row_slot)
                if not _out_of_memory(exc) or rows == 1:
                    raise
                self.row_limit = max(1, rows // 2)
                self.stats_counters["oom_splits"] += 1
                log.warning("device out of memory at %d rows: now at most %d rows a call and %d slots a group",
                            rows, self.row_limit, self._slot_cap())
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _isolate_failure(self, group: Group, batch: Batch, x_in: torch.Tensor, exc: Exception):
        """The batch raised: run its requests' rows again in halves until the requests that
        raise alone are found; fail those, keep every other row's output. Noise was drawn
        before the denoiser, once, so no request's random stream shifts."""
        rows_of = {}
        for slot in batch.slots.tolist():
            rows_of[slot] = np.flatnonzero(batch.row_slot == slot).tolist()
            if not group.two_rows[slot] and self.config.layout != "compact":
                rows_of[slot] = rows_of[slot][:1]  # padded layouts: only the cond row is useful
        out = torch.zeros(len(batch.row_slot), group.numel, device=self.device, dtype=self.model.dtype)
        culprits: dict[int, Exception] = {}

        def probe(slots: list[int]) -> None:
            rows = [r for s in slots for r in rows_of[s]]
            try:
                out[rows] = self._denoise(batch, x_in, rows)
            except Exception as error:
                if len(slots) == 1:
                    culprits[slots[0]] = error
                    return
                probe(slots[: len(slots) // 2])
                probe(slots[len(slots) // 2:])

        probe(list(rows_of))
        log.warning("batch of %d requests raised %s: %d request(s) fail alone", len(rows_of), exc, len(culprits))
        for slot, error in culprits.items():
            request = group.requests[slot]
            self._fail(request, f"the denoiser raised {type(error).__name__}: {error}")
            self._drain_slot(group, slot, request)  # now, or when the fence of its last launch is done
        if not culprits:
            return out, batch
        keep_entries = ~np.isin(batch.index_host[:, 0], list(culprits))
        keep_generic = ~np.isin(batch.generic[:, 0], list(culprits)) if len(batch.generic) else np.ones(0, bool)
        keep = torch.from_numpy(keep_entries).to(self.device)
        batch = dataclasses.replace(batch, index=batch.index[keep], index_host=batch.index_host[keep_entries],
                                    coefs=batch.coefs[keep],
                                    generic=batch.generic[keep_generic],
                                    slots=batch.slots[~np.isin(batch.slots, list(culprits))])
        return out, batch

    def _fail(self, request: Request, reason: str) -> None:
        """Fail one request (R15): no new work for it; its slot is released after the fence
        of its last launch, as a cancel's, and it ends with RequestFailed(reason)."""
        if request.canceled:
            return
        request.canceled, request.failure = True, reason
        self.stats_counters["failed"] += 1
        log.warning("request %s failed: %s", request.request_id, reason)
        if request.state is State.RUNNING:
            request.group.runnable[request.slot] = False

    def _slot_cap(self) -> int:
        """Slots a group may use: all, until the device ran out of memory."""
        return self.config.slots if self.row_limit is None else max(1, self.row_limit // 2)

    def _previews(self, group: Group, batch: Batch, out: torch.Tensor) -> dict[int, torch.Tensor]:
        """x0 estimates of the slots whose preview is due after this step: the guided output
        converted to the data prediction, x0 = p·x + q·out (the kernel's own first stage)."""
        due = {}
        for j, (slot, cond_row, uncond_row, _) in enumerate(batch.index_host.tolist()):
            request = group.requests[slot]
            if int(group.step_index[slot]) + 1 not in request.preview_steps:
                continue
            guided = out[cond_row] if uncond_row < 0 else \
                out[uncond_row] + batch.coefs[j, G] * (out[cond_row] - out[uncond_row])
            due[slot] = batch.coefs[j, P] * group.latents[slot] + batch.coefs[j, Q] * guided.float()
        for slot, cond_row, uncond_row in batch.generic.tolist():
            if int(group.step_index[slot]) + 1 in group.requests[slot].preview_steps:
                due[slot] = None  # filled from the scheduler's own x0 in `_step_generic`
        return due

    def _generic_timestep(self, group: Group, slot: int) -> torch.Tensor:
        trajectory = group.requests[slot].trajectory
        return trajectory.scheduler.timesteps[int(group.step_index[slot])]

    def _step_generic(self, group: Group, batch: Batch, out: torch.Tensor, previews: dict) -> None:
        """Slots whose scheduler the kernel does not express: the guidance combine as the
        pipeline writes it, then the request's own scheduler's `step`."""
        shape = (1, *group.latent_shape)
        for slot, cond_row, uncond_row in batch.generic.tolist():
            request = group.requests[slot]
            guided = out[cond_row]
            if uncond_row >= 0:
                uncond = out[uncond_row]
                guided = uncond + request.params.guidance * (guided - uncond)
            x = group.latents[slot].view(shape).clone()  # schedulers keep references (PNDM's cur_sample)
            x_next, x0 = request.trajectory.scheduler_step(guided.view(shape).float(),
                                                           self._generic_timestep(group, slot), x)
            group.latents[slot].copy_(x_next.reshape(-1))
            if slot in previews:  # the scheduler's own x0 where it reports one (PNDM does not)
                previews[slot] = (x0 if x0 is not None else x_next).reshape(-1).clone()

    # ---- the encode phase ----------------------------------------------------------

    def _encode(self, requests: list[Request]) -> None:
        """The encode phase (R14), between admission and a request's first step: its prompt
        rows from the embedding cache, the misses of all newly admitted requests in one
        batched pass of the model's own encoder(s). The slot then references the rows."""
        try:
            self._attach_conditioning(requests)
        except Exception as exc:  # R15: an encoder failure fails the requests it belongs to
            log.warning("encoding the prompts of %d requests raised %s: one at a time", len(requests), exc)
            for request in requests:
                try:
                    self._attach_conditioning([request])
                except Exception as error:
                    self._fail(request, f"the text encoder raised {type(error).__name__}: {error}")
                    self._drain_slot(request.group, request.slot, request)

    def _attach_conditioning(self, requests: list[Request]) -> None:
        texts = []
        for request in requests:
            texts.append(request.params.prompt)
            if request.rows_per_step == 2:
                texts.append(request.params.negative_prompt)
        started = self.clock()
        rows = self.embeddings.get_many(texts)
        now = self.clock()
        k = 0
        for request in requests:
            negative = rows[k + 1] if request.rows_per_step == 2 else None
            request.conditioning = (rows[k], negative)
            k += request.rows_per_step
            request.group.conditioning[request.slot] = request.conditioning
            request.timings.encode_s = now - started
            request.admitted_at = now

    # ---- the reaper ----------------------------------------------------------------

    def _wait_for_device(self) -> None:
        """Nothing to launch, only launches or copies in flight: sleep on the oldest fence
        for at most `fence_wait_s` instead of letting the busy loop spin on `query()`. The
        bound keeps new submissions and cancels waiting no longer than that."""
        pending = [entry[0] for entry in self.inflight[:1] + self.copies[:1]]
        if pending:
            min(pending, key=lambda fence: fence.seq).wait(self.config.fence_wait_s)

    def _reap(self) -> None:
        """Act on every launch whose fence is done; a report whose (slot, epoch) no longer
        matches is stale: dropped and counted."""
        if self.copies:
            self._finish_copies()
        if not self.inflight:
            return
        still = []
        for fence, reports, finite in self.inflight:
            if not fence.done():
                still.append((fence, reports, finite))
                continue
            flags = finite.tolist()
            for rep in reports:
                ok = flags[rep.slot]
                if rep.group.epoch[rep.slot] != rep.epoch or rep.group.requests[rep.slot] is not rep.request:
                    self.stats_counters["stale"] += 1
                    log.debug("stale report for slot %d epoch %d dropped", rep.slot, rep.epoch)
                    continue
                request = rep.request
                if not ok:
                    self._fail(request, f"non-finite latents at step {rep.step}")
                if request.canceled:
                    if rep.final or rep.group.last_fence[rep.slot] is fence:
                        self._drain_slot(rep.group, rep.slot, request)
                    continue
                self.outputs.append(StepProgress(request.request_id, rep.step, request.trajectory.total))
                if rep.preview is not None:
                    self.outputs.append(PreviewReady(
                        request.request_id, request.preview_steps.index(rep.step), rep.step, request.trajectory.total,
                        rep.preview.to("cpu").view(request.latent_shape)))  # on CUDA already on the host
                if rep.final:
                    self._publish(rep.group, rep.slot, request)
        self.inflight = still

    def _publish(self, group: Group, slot: int, request: Request) -> None:
        """The final latents leave the slot. On CUDA as an asynchronous copy into page-locked
        memory gated by its own fence (a synchronous `.to("cpu")` would drain the stream,
        including the step launched since); the slot is released when the copy is done."""
        if not self.async_copies:
            self._published(group, slot, request, group.latents[slot].to("cpu", copy=True))
            return
        host = self._copy_to_host(group.latents[slot])
        self.copies.append((self.fences.record(), group, slot, request, host))

    def _copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy into fresh page-locked memory, complete once the next fence
        recorded on this stream is done."""
        host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        host.copy_(tensor, non_blocking=True)
        return host

    def _finish_copies(self) -> None:
        still = []
        for copy in self.copies:
            fence, group, slot, request, host = copy
            if not fence.done():
                still.append(copy)
            elif request.canceled:  # canceled while its latents were on their way out
                self._release_slot(group, slot, request)
                self._finish(request, canceled=True)
            else:
                self._published(group, slot, request, host)
        self.copies = still

    def _published(self, group: Group, slot: int, request: Request, host: torch.Tensor) -> None:
        latents = host.view(request.latent_shape)
        now = self.clock()
        request.timings.denoise_s = now - request.admitted_at
        request.state = State.DECODING
        self._release_slot(group, slot, request)
        self.stats_counters["completed"] += 1
        self.outputs.append(DenoiseFinished(request.request_id, latents, request.params, request.timings, now))

    def _drain_slot(self, group: Group, slot: int, request: Request) -> None:
        """Release a canceled request's slot once no launch touching it is in flight."""
        fence = group.last_fence[slot]
        if fence is not None and not fence.done():
            return  # the reaper comes back when that fence completes
        self._release_slot(group, slot, request)
        self._finish(request, canceled=True)

    def _release_slot(self, group: Group, slot: int, request: Request) -> None:
        group.requests[slot] = None
        group.conditioning[slot] = None  # after the fence: no launch reads these rows any more
        group.busy[slot] = group.runnable[slot] = False
        group.last_fence[slot] = None
        group.epoch[slot] += 1
        self.ledger.give_back_trajectory(request.reservation)
        log.debug("slot %d released (epoch now %d) by %s", slot, group.epoch[slot], request.request_id)

    def _finish(self, request: Request, canceled: bool) -> None:
        """End a request that never reaches the decode stage."""
        if request.state is not State.QUEUED:  # a queued request holds no reservation yet
            self.ledger.give_back_trajectory(request.reservation)
            self.ledger.give_back_decode(request.reservation)
        request.state = State.DONE
        self.requests.pop(request.request_id, None)
        if request.failure is not None:
            self.outputs.append(RequestFailed(request.request_id, request.failure))
        elif canceled:
            self.outputs.append(RequestCanceled(request.request_id, self._final_timings(request)))

    def _final_timings(self, request: Request) -> Timings:
        t = request.timings
        now = self.clock()
        if request.state is State.QUEUED:
            t.queue_s = now - request.arrival
        elif request.admitted_at and not t.denoise_s:
            t.denoise_s = now - request.admitted_at
        t.total_s = now - request.arrival
        return t


def _out_of_memory(exc: Exception) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)  # the CPU allocator's words


def _bucket(rows: int, limit: int) -> int:
    """Round up to a power of two (at most `limit`): few shapes, stable graphs."""
    size = 1
    while size < rows:
        size *= 2
    return max(rows, min(size, limit))
