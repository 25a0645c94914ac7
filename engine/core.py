"""EngineCore: the pure, in-process heart of the engine (no sockets, no threads).

`add_request` validates and queues; `abort_requests` marks; `step` runs one denoising
step for one group of slots and reaps completed fences; `decode_done` returns a decode
reservation. The engine process (`engine.proc`) drives exactly these calls, so tests run
the same core in-process.

A request's life: QUEUED → (admission reserves trajectory, decode buffer and output
bytes) → RUNNING in a slot → FINISHING (last step launched, its fence pending) → the
reaper publishes the final latents, releases the slot (epoch + 1) → DECODING (decode
reservation held) → decode_done. A cancel marks the request at once; no new work is
scheduled for it; its slot is released only when the fence of the last launch that
touched it is done.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import time
from typing import Iterable

import numpy as np
import torch

from engine.fences import fences_for
from engine.kernels import update_slots
from engine.model import LoadedModel
from engine.outputs import DenoiseFinished, RequestCanceled, RequestFailed, RequestRejected, StepProgress  # noqa: F401
from engine.protocol import OUTPUT_KINDS, GenerateParams, Timings
from engine.solvers import G, NUM_COEFS, SAMPLERS, Schedule, Trajectory, UnsupportedSampler, build_schedule

log = logging.getLogger("diffslot.core")

LAYOUTS = ("compact", "padded", "bucketed")
ADMISSIONS = ("continuous", "static")
MAX_GUIDANCE = 100.0


@dataclasses.dataclass
class CoreConfig:
    slots: int = 16  # slots per group (latent shape)
    layout: str = "compact"
    admission: str = "continuous"
    max_queue: int = 64  # requests waiting in front of admission; beyond it: Rejected
    decode_buffers: int | None = None  # decode-arena buffers, one held per request from admission
    # until decoded; default 2 × slots, so decoding never caps the batch on its own
    max_steps: int = 500
    trajectory_budget_bytes: int | None = None  # default: `slots` requests at the native size
    output_budget_bytes: int | None = None  # default: `slots + decode_buffers` native outputs
    device: str = "cpu"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {self.layout!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, not {self.admission!r}")
        if self.decode_buffers is None:
            self.decode_buffers = 2 * self.slots
        if self.slots < 1 or self.max_queue < 0 or self.decode_buffers < 1 or self.max_steps < 1:
            raise ValueError("slots, decode_buffers and max_steps must be positive, max_queue non-negative")


# ---- request and slot state ----------------------------------------------------------

class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHING = "finishing"  # last step launched, fence pending
    DECODING = "decoding"  # final latents published; decode reservation held
    DONE = "done"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    params: GenerateParams
    latent_shape: tuple[int, int, int]
    cond_index: int
    arrival: float
    reservation: "Reservation"
    state: State = State.QUEUED
    canceled: bool = False
    trajectory: Trajectory | None = None
    group: "Group | None" = None
    slot: int = -1
    admitted_at: float = 0.0
    timings: Timings = dataclasses.field(default_factory=Timings)

    @property
    def rows_per_step(self) -> int:
        return 1 if self.params.guidance == 1.0 else 2


@dataclasses.dataclass
class Reservation:
    trajectory_bytes: int
    output_bytes: int
    decode_buffers: int = 1


class Ledger:
    """Admission's accounting (R8): trajectory memory, decode buffers, output bytes."""

    def __init__(self, trajectory_bytes: int, decode_buffers: int, output_bytes: int):
        self.capacity = Reservation(trajectory_bytes, output_bytes, decode_buffers)
        self.used = Reservation(0, 0, 0)

    def could_ever_fit(self, r: Reservation) -> bool:
        c = self.capacity
        return r.trajectory_bytes <= c.trajectory_bytes and r.output_bytes <= c.output_bytes

    def fits(self, r: Reservation) -> bool:
        c, u = self.capacity, self.used
        return (u.trajectory_bytes + r.trajectory_bytes <= c.trajectory_bytes
                and u.output_bytes + r.output_bytes <= c.output_bytes
                and u.decode_buffers + r.decode_buffers <= c.decode_buffers)

    def take(self, r: Reservation) -> None:
        self.used.trajectory_bytes += r.trajectory_bytes
        self.used.output_bytes += r.output_bytes
        self.used.decode_buffers += r.decode_buffers

    def give_back_trajectory(self, r: Reservation) -> None:
        self.used.trajectory_bytes -= r.trajectory_bytes
        r.trajectory_bytes = 0

    def give_back_decode(self, r: Reservation) -> None:
        self.used.output_bytes -= r.output_bytes
        self.used.decode_buffers -= r.decode_buffers
        r.output_bytes = r.decode_buffers = 0


class Group:
    """Slot storage for one latent shape: latents, history and per-slot solver tables.

    The slot map is explicit: `requests[slot]` is the request-owned state of a slot,
    `epoch[slot]` increments on every release; a batch is built from the row map
    row → (slot, branch). There is no shared loop counter: each slot has its own
    `step_index`.
    """

    def __init__(self, key: tuple, latent_shape: tuple[int, int, int], slots: int, max_steps: int,
                 device: torch.device, dtype: torch.dtype):
        self.key = key
        self.latent_shape = latent_shape
        self.numel = math.prod(latent_shape)
        self.slots = slots
        self.latents = torch.zeros(slots, self.numel, device=device, dtype=torch.float32)
        self.history = torch.zeros_like(self.latents)
        self.requests: list[Request | None] = [None] * slots
        self.epoch = np.zeros(slots, dtype=np.int64)
        self.busy = np.zeros(slots, dtype=bool)  # owned by a request (running, finishing or draining)
        self.runnable = np.zeros(slots, dtype=bool)  # gets a row in the next batch
        self.step_index = np.zeros(slots, dtype=np.int64)
        self.total_steps = np.zeros(slots, dtype=np.int64)
        self.two_rows = np.zeros(slots, dtype=bool)
        self.cond_index = np.zeros(slots, dtype=np.int64)
        self.stochastic = np.zeros(slots, dtype=bool)
        self.coef_table = np.zeros((slots, max_steps, NUM_COEFS), dtype=np.float32)
        self.timestep_table = np.zeros((slots, max_steps), dtype=np.float32)
        self.divisor_table = np.ones((slots, max_steps), dtype=np.float32)
        self.last_fence = [None] * slots  # fence of the last launch that touched the slot
        self.last_served = -1  # step counter of the last batch, for fairness

    def free_slot(self) -> int:
        free = np.flatnonzero(~self.busy)
        return int(free[0]) if len(free) else -1

    @property
    def active(self) -> int:
        return int(self.busy.sum())


@dataclasses.dataclass
class Batch:
    """One step's row map and per-slot update for one group."""

    slots: np.ndarray  # slots updated this step
    index: torch.Tensor  # entries × 4 int32: slot, cond row, uncond row, noise row
    coefs: torch.Tensor  # entries × NUM_COEFS float32
    row_slot: np.ndarray  # rows × slot feeding each row's input
    row_divisor: torch.Tensor
    row_timestep: torch.Tensor
    row_class: torch.Tensor
    noise: torch.Tensor
    useful_rows: int
    padded_rows: int


@dataclasses.dataclass
class Report:
    """What the reaper does when a launch's fence completes, tagged with (slot, epoch)."""

    group: Group
    slot: int
    epoch: int
    request: Request
    step: int  # steps completed by this launch
    final: bool


class EngineCore:
    def __init__(self, model: LoadedModel, config: CoreConfig | None = None, fences=None,
                 clock=time.monotonic):
        self.model = model
        self.config = config or CoreConfig()
        self.device = torch.device(self.config.device)
        self.fences = fences or fences_for(self.device)
        self.clock = clock
        self.groups: dict[tuple, Group] = {}
        self.requests: dict[str, Request] = {}
        self.queue: collections.deque[Request] = collections.deque()
        self.inflight: list[tuple] = []  # (fence, [Report])
        self.outputs: list = []
        native = model.native_size
        native_reservation = self._reservation(model.latent_shape(native, native), native, native, "uint8")
        # FIX (tests/test_core.py): the default output budget is `slots + decode_buffers` native
        # outputs of the *largest* kind. Sized for "uint8" only, it fit fewer "latent" (or "png")
        # outputs than slots where those are bigger (a model without a VAE: 4 float32 channels
        # per pixel vs 3 bytes), so free slots stayed idle while requests queued.
        native_output_bytes = max(self._reservation(model.latent_shape(native, native), native, native,
                                                    kind).output_bytes for kind in OUTPUT_KINDS)
        self.ledger = Ledger(
            self.config.trajectory_budget_bytes or self.config.slots * native_reservation.trajectory_bytes,
            self.config.decode_buffers,
            self.config.output_budget_bytes
            or (self.config.slots + self.config.decode_buffers) * native_output_bytes,
        )
        self.size_multiple = model.vae_scale * 2 ** (len(model.unet.config.block_out_channels) - 1)
        self.max_size = 4 * native
        self.batches = 0
        self.stats_counters = collections.Counter()
        self.group_wait_max = 0  # head-of-line blocking: most batches a runnable group waited
        self.step_time_ema = 0.0
        self._schedules: dict[tuple[str, int], Schedule] = {}  # (sampler, steps) → schedule at guidance 1

    # ---- public interface ------------------------------------------------------

    def add_request(self, request_id: str, params: GenerateParams, arrival_time: float | None = None) -> None:
        """Validate and queue; raises RequestRejected naming the field, or when full."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected("must be a non-empty string", "request_id")
        if request_id in self.requests:
            raise RequestRejected(f"{request_id!r} is already in flight", "request_id")
        request = self._validate(request_id, params, self.clock() if arrival_time is None else arrival_time)
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
        """Admit, run one batch for one group, reap completed fences; return outputs."""
        self._reap()
        self._admit()
        group = self._pick_group()
        if group is not None:
            self._run_batch(group)
        self._reap()
        outputs, self.outputs = self.outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Any request not yet ended (queued, denoising, or awaiting decode_done)."""
        return bool(self.requests) or bool(self.inflight)

    def has_work(self) -> bool:
        """Something for step() to do right now (a batch to run or a fence to reap)."""
        return bool(self.queue) or bool(self.inflight) or any(g.runnable.any() for g in self.groups.values()) \
            or bool(self.outputs)

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
            "canceled_evals": c["canceled_evals"],
            "stale_reports": c["stale"],
            "rejected_full": c["rejected_full"],
            "completed": c["completed"],
            "max_group_wait_batches": self.group_wait_max,
            "reserved_trajectory_bytes": self.ledger.used.trajectory_bytes,
            "reserved_output_bytes": self.ledger.used.output_bytes,
            "reserved_decode_buffers": self.ledger.used.decode_buffers,
        }

    # ---- validation and admission ------------------------------------------------

    def _validate(self, request_id: str, p: GenerateParams, arrival: float) -> Request:
        model = self.model
        if not isinstance(p.condition, str) or p.condition not in model.conditions:
            raise RequestRejected(f"unknown condition {p.condition!r}", "condition")
        if type(p.steps) is not int or not 1 <= p.steps <= self.config.max_steps:
            raise RequestRejected(f"must be an integer in [1, {self.config.max_steps}]", "steps")
        if p.sampler not in SAMPLERS:
            raise RequestRejected(f"unknown sampler {p.sampler!r}; one of {', '.join(SAMPLERS)}", "sampler")
        if not isinstance(p.guidance, (int, float)) or not math.isfinite(p.guidance) \
                or not 0.0 <= p.guidance <= MAX_GUIDANCE:
            raise RequestRejected(f"must be a finite number in [0, {MAX_GUIDANCE:g}]", "guidance")
        if type(p.seed) is not int or not 0 <= p.seed < 2**63:
            raise RequestRejected("must be an integer in [0, 2**63)", "seed")
        if p.output not in OUTPUT_KINDS:
            raise RequestRejected(f"must be one of {', '.join(OUTPUT_KINDS)}", "output")
        size = {}
        for field in ("height", "width"):
            value = getattr(p, field)
            value = model.native_size if value is None else value
            if type(value) is not int or not self.size_multiple <= value <= self.max_size \
                    or value % self.size_multiple:
                raise RequestRejected(f"must be a multiple of {self.size_multiple} in "
                                      f"[{self.size_multiple}, {self.max_size}]", field)
            size[field] = value
        try:
            schedule = self._schedule(p.sampler, p.steps, float(p.guidance))
        except UnsupportedSampler as exc:
            raise RequestRejected(str(exc), "sampler") from None
        latent_shape = model.latent_shape(size["height"], size["width"])
        reservation = self._reservation(latent_shape, size["height"], size["width"], p.output)
        if not self.ledger.could_ever_fit(reservation):
            field = "height" if size["height"] >= size["width"] else "width"
            raise RequestRejected("needs more memory than the engine holds at all", field)
        request = Request(request_id, p, latent_shape, model.condition_index(p.condition), arrival, reservation)
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

    @staticmethod
    def _reservation(latent_shape, height: int, width: int, output: str) -> Reservation:
        numel = math.prod(latent_shape)
        # latents + multistep history + noise workspace + two model-input rows + two output rows
        trajectory = 4 * numel * 7
        if output == "latent":
            out_bytes = 4 * numel
        else:  # uint8 pixels; a PNG of them is smaller in practice but may not be
            out_bytes = height * width * 3 + (1024 if output == "png" else 0)
        return Reservation(trajectory, out_bytes)

    def _retry_after(self) -> float:
        waiting_steps = sum(r.params.steps for r in self.queue)
        return round(max(0.05, self.step_time_ema * waiting_steps / self.config.slots), 3)

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
        while self.queue:
            request = self.queue[0]
            group = self._group_for(request)
            slot = -1 if group.key in full_groups else group.free_slot()
            if slot < 0:
                full_groups.add(group.key)
                skipped.append(self.queue.popleft())
                continue
            if not self.ledger.fits(request.reservation):
                break  # FIFO: the head waits for memory; a known boundary, not a crash
            self.queue.popleft()
            self.ledger.take(request.reservation)
            self._place(request, group, slot)
        self.queue.extendleft(reversed(skipped))

    def _group_for(self, request: Request) -> Group:
        model = self.model
        key = (model.revision, request.latent_shape, str(model.dtype), "class", model.prediction_type)
        group = self.groups.get(key)
        if group is None:
            group = Group(key, request.latent_shape, self.config.slots, self.config.max_steps,
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
        group.cond_index[slot] = request.cond_index
        group.stochastic[slot] = schedule.stochastic
        group.coef_table[slot, :n] = schedule.coefs
        group.timestep_table[slot, :n] = schedule.timesteps
        group.divisor_table[slot, :n] = schedule.input_divisor
        group.latents[slot].copy_(request.trajectory.initial_latents().reshape(-1), non_blocking=True)
        group.history[slot].zero_()
        request.group, request.slot, request.state = group, slot, State.RUNNING
        request.admitted_at = self.clock()
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
        row_class = np.where(row_branch_uncond, self.model.null_index, group.cond_index[row_slot])
        # noise, drawn from each stochastic request's own generator, in its own order
        noisy = np.flatnonzero(group.stochastic[act])
        noise_row = np.full(act.size, -1, dtype=np.int64)
        noise_row[noisy] = np.arange(noisy.size)
        if noisy.size:
            noise = torch.cat([group.requests[s].trajectory.step_noise().reshape(1, -1) for s in act[noisy]])
            noise = noise.to(self.device, non_blocking=True)
        else:
            noise = torch.empty(0, device=self.device)
        index = np.stack([act, cond_row, uncond_row, noise_row], axis=1).astype(np.int32)
        coefs = group.coef_table[act, steps]
        return Batch(
            slots=act,
            index=torch.from_numpy(index).to(self.device, non_blocking=True),
            coefs=torch.from_numpy(coefs).to(self.device, non_blocking=True),
            row_slot=row_slot,
            row_divisor=torch.from_numpy(row_divisor).to(self.device, non_blocking=True),
            row_timestep=torch.from_numpy(row_timestep).to(self.device, non_blocking=True),
            row_class=torch.from_numpy(row_class).to(self.device, non_blocking=True),
            noise=noise,
            useful_rows=useful,
            padded_rows=len(row_slot) - useful,
        )

    @torch.no_grad()
    def _run_batch(self, group: Group) -> None:
        started = time.perf_counter()
        batch = self._build_batch(group)
        rows = torch.from_numpy(batch.row_slot).to(self.device, non_blocking=True)
        x_in = group.latents.index_select(0, rows) / batch.row_divisor[:, None]  # as scale_model_input
        x_in = x_in.view(len(batch.row_slot), *group.latent_shape).to(self.model.dtype)
        out = self.model.denoise(x_in, batch.row_timestep, batch.row_class)
        update_slots(out.reshape(len(batch.row_slot), -1), group.latents, group.history, batch.noise,
                     batch.index, batch.coefs)
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
            reports.append(Report(group, slot, int(group.epoch[slot]), request, step, final))
        self.inflight.append((fence, reports))
        elapsed = time.perf_counter() - started
        self.step_time_ema = elapsed if self.step_time_ema == 0 else 0.9 * self.step_time_ema + 0.1 * elapsed

    # ---- the reaper ----------------------------------------------------------------

    def _reap(self) -> None:
        """Act on every launch whose fence is done; a report whose (slot, epoch) no longer
        matches is stale: dropped and counted."""
        if not self.inflight:
            return
        still = []
        for fence, reports in self.inflight:
            if not fence.done():
                still.append((fence, reports))
                continue
            for rep in reports:
                if rep.group.epoch[rep.slot] != rep.epoch or rep.group.requests[rep.slot] is not rep.request:
                    self.stats_counters["stale"] += 1
                    log.debug("stale report for slot %d epoch %d dropped", rep.slot, rep.epoch)
                    continue
                request = rep.request
                if request.canceled:
                    if rep.final or rep.group.last_fence[rep.slot] is fence:
                        self._drain_slot(rep.group, rep.slot, request)
                    continue
                self.outputs.append(StepProgress(request.request_id, rep.step, request.trajectory.total))
                if rep.final:
                    self._publish(rep.group, rep.slot, request)
        self.inflight = still

    def _publish(self, group: Group, slot: int, request: Request) -> None:
        latents = group.latents[slot].to("cpu", copy=True).view(request.latent_shape)
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
        if canceled:
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


def _bucket(rows: int, limit: int) -> int:
    """Round up to a power of two (at most `limit`): few shapes, stable graphs."""
    size = 1
    while size < rows:
        size *= 2
    return max(rows, min(size, limit))
