"""The core's state: requests, slot groups (the slot map), one step's batch (the row map),
and what the reaper does for each slot of a launch. Plain data; `EngineCore` acts on it."""
from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np
import torch

from engine.core.ledger import Reservation
from engine.core.solvers import NUM_COEFS, Trajectory
from engine.models.loading import Conditioning
from engine.protocol import GenerateParams, Timings


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
    rows_per_step: int  # 2 with classifier-free guidance (cond and uncond rows), else 1
    arrival: float
    reservation: Reservation
    conditioning: tuple[Conditioning, Conditioning | None] | None = None  # (prompt, negative) once encoded
    preview_steps: tuple[int, ...] = ()  # steps after which the x0 estimate is published
    failure: str | None = None  # why it failed (R15); a failed request is also `canceled`: no new work
    state: State = State.QUEUED
    canceled: bool = False
    trajectory: Trajectory | None = None
    group: "Group | None" = None
    slot: int = -1
    admitted_at: float = 0.0
    timings: Timings = dataclasses.field(default_factory=Timings)


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
        # references to each slot's prompt rows: [slot, 0] the prompt's, [slot, 1] the negative prompt's
        self.conditioning = np.full((slots, 2), None, dtype=object)
        self.stochastic = np.zeros(slots, dtype=bool)
        self.generic = np.zeros(slots, dtype=bool)  # stepped by its own diffusers scheduler object
        self.coef_table = np.zeros((slots, max_steps, NUM_COEFS), dtype=np.float32)
        self.timestep_table = np.zeros((slots, max_steps), dtype=np.float32)
        self.divisor_table = np.ones((slots, max_steps), dtype=np.float32)
        self.last_fence = [None] * slots  # fence of the last launch that touched the slot
        self.staging = None  # the step's page-locked upload buffers (CUDA), made on first use
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
    index: torch.Tensor  # kernel entries × 4 int32: slot, cond row, uncond row, noise row
    index_host: np.ndarray  # the same on the host (read without a device sync)
    coefs: torch.Tensor  # kernel entries × NUM_COEFS float32
    generic: np.ndarray  # generic-path entries × 3: slot, cond row, uncond row (-1: none)
    row_slot: np.ndarray  # rows × slot feeding each row's input
    row_index: torch.Tensor  # the same, on the device
    row_divisor: torch.Tensor
    row_timestep: torch.Tensor
    row_conditioning: list[Conditioning]  # the prompt (or negative prompt) rows of each row
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
    preview: torch.Tensor | None = None  # the x0 estimate of this step, when a preview is due
