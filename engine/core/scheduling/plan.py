"""What the scheduler and the runner hand each other (torch-free): plain data, no shared
mutable state. The scheduler returns an `AdmissionPlan` (what to place, allocate, drop
and free in the runner's slot storage) and a `StepPlan` (which group's slots run next,
at which steps); the runner returns a `StepOutcome` (what it launched, which rows failed
and why), from which the scheduler updates its own state."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class AdmissionPlan:
    """One step boundary's changes to the slot storage, in the order the runner applies them."""

    # (group key, slot, request): running requests to park — the slot's state to host memory
    # (`request.parked`), then the slot is free
    parked: list[tuple[tuple, int, Any]] = dataclasses.field(default_factory=list)
    released: list[tuple[tuple, int]] = dataclasses.field(default_factory=list)  # (group key, slot) now free
    evicted: list[tuple] = dataclasses.field(default_factory=list)  # group keys whose storage goes
    new_groups: list[tuple[tuple, tuple[int, int, int]]] = dataclasses.field(default_factory=list)  # (key, shape)
    # Requests, each with its group and slot; a resumed one brings `request.parked`
    placed: list[Any] = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)  # requests that ended at admission


@dataclasses.dataclass
class StepPlan:
    """One denoiser step for one group: the slots that get rows and each one's step."""

    key: tuple
    slots: np.ndarray  # int64, the runnable slots, ascending
    steps: np.ndarray  # int64, each slot's step index (steps launched so far)
    requests: list  # the Request in each of `slots`
    slot_count: int  # the group's slots (the padded layout computes them all)
    row_limit: int | None  # rows per denoiser call, once the device ran out of memory

    def request_at(self, slot: int):
        return self.requests[int(np.searchsorted(self.slots, slot))]

    def step_at(self, slot: int) -> int:
        return int(self.steps[int(np.searchsorted(self.slots, slot))])


@dataclasses.dataclass
class StepOutcome:
    """What the runner did with a `StepPlan`: per-slot results, read by the scheduler."""

    fence: Any  # completes when the device is done with this step's buffers
    advanced: np.ndarray  # slots whose step was launched (the plan's, less `failed`)
    failed: dict[int, str]  # slot → why its rows made the denoiser raise
    useful_rows: int
    padded_rows: int
    previews: dict[int, Any]  # slot → the x0 estimate after this step, where a preview is due
    finite: Any  # per-slot finite flags of the group's latents, read only after `fence`
    row_limit: int | None = None  # set when the device ran out of memory: the rows per call that fit
    step_seconds: float = 0.0  # the device's recent time per step (a moving average)
    cached: dict = dataclasses.field(default_factory=dict)  # slot → share of its rows' work its step cache skipped
