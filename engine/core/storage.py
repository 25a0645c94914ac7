"""The runner's state: each group's slot storage, one step's batch (the row map and the
gathered model inputs), and the records of launches and copies in flight. The runner
and the reaper act on it; the scheduler never sees it."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from engine.core.solvers import NUM_COEFS
from engine.models.inputs import ModelInputs


def upload(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy host data into device storage without blocking the host: a `non_blocking` copy
    from pageable memory is a synchronous staged copy on CUDA, so the source is put in
    page-locked memory first (torch's host allocator keeps that block until the copy's
    stream has passed it)."""
    if destination.is_cuda and not source.is_cuda and not source.is_pinned():
        source = source.contiguous().pin_memory()
    destination.copy_(source, non_blocking=True)


class SlotStorage:
    """The runner's storage behind one group's slots: latents, history, per-slot solver
    tables, the slots' prompt-row references, request-input rows and each input kind's
    slot state. Written only by `place`, `release` and `unpark`, and by the runner's step."""

    def __init__(self, key: tuple, latent_shape: tuple[int, int, int], slots: int, max_steps: int,
                 device: torch.device):
        self.key, self.latent_shape, self.slots, self.max_steps = key, latent_shape, slots, max_steps
        self.device = device
        self.numel = math.prod(latent_shape)
        self.latents = torch.zeros(slots, self.numel, device=device, dtype=torch.float32)
        self.history = torch.zeros_like(self.latents)
        self.two_rows = np.zeros(slots, dtype=bool)  # the slot's request runs classifier-free guidance
        # references to each slot's prompt rows: [slot, 0] the prompt's, [slot, 1] the negative prompt's
        self.conditioning = np.full((slots, 2), None, dtype=object)
        # per-request model inputs, one row per (slot, branch): row 2·slot + branch
        self.request_inputs: dict[str, torch.Tensor] = {}
        self.stochastic = np.zeros(slots, dtype=bool)
        self.generic = np.zeros(slots, dtype=bool)  # stepped by its own diffusers scheduler object
        self.coef_table = np.zeros((slots, max_steps, NUM_COEFS), dtype=np.float32)
        self.timestep_table = np.zeros((slots, max_steps), dtype=np.float32)
        self.divisor_table = np.ones((slots, max_steps), dtype=np.float32)
        # the slot's request is one whose pipeline keeps channels-last latents (SD/SDXL img2img)
        self.channels_last = np.zeros(slots, dtype=bool)
        self.kind_states: dict[str, object] = {}  # input kind name → its slot state, made on first use
        self.staging = None  # the step's page-locked upload buffers (CUDA), made on first use

    @property
    def nbytes(self) -> int:
        """Device and host bytes the storage holds whatever its slots hold."""
        tables = self.coef_table.nbytes + self.timestep_table.nbytes + self.divisor_table.nbytes
        inputs = sum(t.numel() * t.element_size() for t in self.request_inputs.values())
        states = sum(state.nbytes for state in self.kind_states.values())
        return 2 * self.latents.numel() * 4 + tables + inputs + states

    def place(self, slot: int, request) -> None:
        """Everything a newly admitted request's slot starts with, from the request's
        prepared data: its schedule, first latents, prompt rows, request-input rows and
        each input kind's state."""
        schedule = request.trajectory.schedule
        n = schedule.steps
        self.two_rows[slot] = request.cfg_scale is not None
        self.stochastic[slot] = schedule.stochastic
        self.generic[slot] = schedule.scheduler is not None
        self.coef_table[slot, :n] = schedule.coefs
        self.timestep_table[slot, :n] = schedule.timesteps
        self.divisor_table[slot, :n] = schedule.input_divisor
        start = request.start
        upload(self.latents[slot], (request.trajectory.initial_latents() if start is None else start.latents)
               .reshape(-1))
        self.channels_last[slot] = start is not None and start.channels_last
        self.history[slot].zero_()
        self.conditioning[slot] = request.conditioning
        self._write_rows(slot, request.request_inputs)
        self._place_kinds(slot, request.slot_inputs)

    def _place_kinds(self, slot: int, values: dict) -> None:
        """Each input kind's value into its state (made for this storage on first use)."""
        for name, value in values.items():
            state = self.kind_states.get(name)
            if state is None:
                state = self.kind_states[name] = value.slot_state(self)
            state.place(slot, value)

    def _write_rows(self, slot: int, rows: dict[str, torch.Tensor]) -> None:
        for name, value in rows.items():
            table = self.request_inputs.get(name)
            if table is None:
                table = self.request_inputs[name] = torch.zeros(
                    (2 * self.slots, *value.shape[1:]), dtype=value.dtype, device=self.device)
            upload(table[2 * slot: 2 * slot + 2], value)

    def release(self, slot: int) -> None:
        """After the fence of the slot's last launch: nothing reads its storage any more."""
        self.conditioning[slot] = None
        self.channels_last[slot] = False
        for state in self.kind_states.values():
            state.release(slot)

    def park(self, slot: int) -> "ParkedSlot":
        """The slot's whole state in host memory (call after the fence of its last launch):
        what `unpark` needs to go on in any slot of storage with the same key."""
        rows = {name: to_host(table[2 * slot: 2 * slot + 2]) for name, table in self.request_inputs.items()}
        return ParkedSlot(
            latents=to_host(self.latents[slot]), history=to_host(self.history[slot]),
            tables=(self.two_rows[slot], self.stochastic[slot], self.generic[slot], self.coef_table[slot].copy(),
                    self.timestep_table[slot].copy(), self.divisor_table[slot].copy(), self.channels_last[slot]),
            conditioning=tuple(None if c is None else _moved(c, "cpu") for c in self.conditioning[slot]), rows=rows,
            kinds={name: state.park(slot) for name, state in self.kind_states.items() if state.holds(slot)})

    def unpark(self, slot: int, parked: "ParkedSlot") -> None:
        upload(self.latents[slot], parked.latents)
        upload(self.history[slot], parked.history)
        (self.two_rows[slot], self.stochastic[slot], self.generic[slot], self.coef_table[slot],
         self.timestep_table[slot], self.divisor_table[slot], self.channels_last[slot]) = parked.tables
        self.conditioning[slot] = tuple(None if c is None else _moved(c, self.device) for c in parked.conditioning)
        self._write_rows(slot, parked.rows)
        self._place_kinds(slot, parked.kinds)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: page-locked and asynchronous from a CUDA tensor (ordered on the
    stream before anything that later writes the slot), a plain copy from a CPU one."""
    if not tensor.is_cuda:
        return tensor.to("cpu", copy=True)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _moved(conditioning, device):
    """A copy of prompt rows on `device` (the host while parked: the cache's own entry may be
    evicted meanwhile, and its device bytes are not the parked request's to hold)."""
    move = to_host if torch.device(device).type == "cpu" else (lambda t: t.to(device, copy=True))
    pooled = conditioning.pooled
    return dataclasses.replace(conditioning, hidden=move(conditioning.hidden),
                               pooled=None if pooled is None else move(pooled))


@dataclasses.dataclass
class ParkedSlot:
    """A slot's state in host memory, from `SlotStorage.park` (bit for bit what it held)."""

    latents: torch.Tensor
    history: torch.Tensor
    tables: tuple
    conditioning: tuple
    rows: dict[str, torch.Tensor]
    kinds: dict[str, object]  # input kind name → the value its slot state places again

    @property
    def nbytes(self) -> int:
        rows = [t for c in self.conditioning if c is not None for t in (c.hidden, c.pooled) if t is not None]
        tensors = [self.latents, self.history, *self.rows.values(), *rows]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(
            getattr(v, "nbytes", 0) for v in self.kinds.values())


@dataclasses.dataclass
class Batch:
    """One step's row map, model inputs and per-slot update for one group."""

    slots: np.ndarray  # slots updated this step
    slot_rows: np.ndarray  # per slot of `slots`: its cond row and uncond row (-1: none)
    index: torch.Tensor  # kernel entries × 4 int32: slot, cond row, uncond row, noise row
    index_host: np.ndarray  # the same on the host (read without a device sync)
    coefs: torch.Tensor  # kernel entries × NUM_COEFS float32
    generic: np.ndarray  # generic-path entries × 3: slot, cond row, uncond row (-1: none)
    row_slot: np.ndarray  # rows × slot feeding each row's input
    row_index: torch.Tensor  # the same, on the device
    row_divisor: torch.Tensor
    inputs: ModelInputs  # every per-row input but `sample`, which is scaled from the latents per call
    noise: torch.Tensor
    useful_rows: int
    padded_rows: int


@dataclasses.dataclass
class Report:
    """What the reaper does for one slot when a launch's fence completes, tagged with (slot, epoch)."""

    group: object  # the scheduler's SlotMap (its epochs and owners)
    slot: int
    epoch: int
    request: object
    step: int  # steps completed by this launch
    final: bool
    preview: torch.Tensor | None = None  # the x0 estimate of this step, when a preview is due


@dataclasses.dataclass
class Launch:
    """One denoiser step in flight: its fence, the slots it advanced, and the group's
    per-slot finite flags on the device (read only after the fence)."""

    fence: object
    reports: list[Report]
    finite: torch.Tensor


@dataclasses.dataclass
class HostCopy:
    """Final latents on their way to page-locked host memory, complete with `fence`."""

    fence: object
    request: object
    host: torch.Tensor
