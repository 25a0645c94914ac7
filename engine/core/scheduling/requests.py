"""A request inside the core and its state machine (torch-free).

    QUEUED ──admit──▶ RUNNING ──last step launched──▶ FINISHING ──fence, latents out──▶ DECODING ──decode_done──▶ DONE
       │              │  ▲                                 │
       │   preempted, │  │ admitted again (any free slot of its group)
       │  after fence ▼  │
       │             PARKED (whole slot state in host memory, queued)
       └─cancel─▶ DONE   └─cancel / fail─▶ (stays until the fence of its last launch) ─▶ DONE

`status` is where the request is; `ending` says why it stops early (a cancel or a
failure), set at once and acted on at the next safe point; `parking` marks a running
request chosen to make room for a higher priority, parked once its last launch's fence
is done.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from engine.protocol import GenerateParams, Timings


class RequestStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"  # in a slot, gets a row in its group's next batch
    FINISHING = "finishing"  # last step launched, its fence pending
    DECODING = "decoding"  # final latents published; decode reservation held
    PARKED = "parked"  # preempted: its slot's state in host memory, queued to resume
    DONE = "done"


class Ending(enum.Enum):
    CANCELED = "canceled"
    FAILED = "failed"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    params: GenerateParams
    latent_shape: tuple[int, int, int]
    cfg_scale: float | None  # classifier-free guidance: two rows a step (cond, uncond); None: one row
    arrival: float
    reservation: Any  # engine.core.scheduling.ledger.Reservation
    group_key: tuple = ()  # what must agree for requests to share a denoiser call
    trajectory: Any = None  # engine.core.solvers.Trajectory: schedule and random stream
    # each input kind's checked value (kind name → value), until its preparation at admission
    inputs: dict = dataclasses.field(default_factory=dict)
    # what preparation leaves for the slot: per-request model inputs (2 × field each: the
    # conditional branch's row, the unconditional one's), its prompt rows (prompt, negative),
    # its first latents where they are not its initial noise, and each kind's slot value
    request_inputs: dict = dataclasses.field(default_factory=dict)
    conditioning: tuple = (None, None)
    start: Any = None  # engine.core.input_kinds.image.StartLatents, or None: the initial noise
    slot_inputs: dict = dataclasses.field(default_factory=dict)
    adapters: tuple[int, ...] = ()  # adapter-pool slots it references (released after its fence)
    preview_steps: tuple[int, ...] = ()  # steps after which the x0 estimate is published
    status: RequestStatus = RequestStatus.QUEUED
    ending: Ending | None = None
    failure: str | None = None  # why it failed
    group: Any = None  # the scheduler's SlotMap it runs in
    slot: int = -1
    admitted_at: float = 0.0
    bypassed: int = 0  # requests admitted past it while it waited for memory (bounded)
    work_ahead: int = 0  # evaluations queued ahead of it when it arrived (SRPT's aging bound)
    admitted_mark: int = 0  # the scheduler's admitted evaluations when it arrived
    steps_at_release: int = 0  # its slot's step index when the slot was released
    parking: bool = False  # chosen to be parked: no new work, parked after its last launch's fence
    parked: Any = None  # engine.core.storage.ParkedSlot while PARKED (the runner's copy of its slot)
    parks: int = 0  # times it was parked
    admitted_batch: int = 0  # the scheduler's batch count at its last (re)admission
    parked_at: float = 0.0
    timings: Timings = dataclasses.field(default_factory=Timings)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def deadline(self) -> float | None:
        """When it should be done (clock seconds), where the request gives a deadline."""
        return None if self.params.deadline_s is None else self.arrival + self.params.deadline_s

    @property
    def rows_per_step(self) -> int:
        return 1 if self.cfg_scale is None else 2

    @property
    def stopping(self) -> bool:
        """Canceled or failed: no new work is scheduled for it."""
        return self.ending is not None

    @property
    def step(self) -> int:
        """Steps launched so far (its slot's step index; 0 before admission)."""
        if self.slot < 0:
            return 0
        if self.group.requests[self.slot] is not self:
            return self.steps_at_release
        return int(self.group.step_index[self.slot])

    @property
    def total_steps(self) -> int:
        return self.trajectory.total

    @property
    def remaining_evals(self) -> int:
        return (self.total_steps - self.step) * self.rows_per_step
