"""The runner's state: slot groups with their device storage, one step's batch (the row
map and the gathered model inputs), and the records of launches and copies in flight.
Plain data; the runner and the reaper act on it."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from engine.core.slot_map import SlotMap
from engine.core.solvers import NUM_COEFS
from engine.models.inputs import ModelInputs


class Group(SlotMap):
    """Slot storage for one group key: latents, history, per-slot solver tables, the
    slots' prompt-row references and request inputs. Written only by `place` / `release`."""

    def __init__(self, key: tuple, latent_shape: tuple[int, int, int], slots: int, max_steps: int,
                 device: torch.device):
        super().__init__(key, latent_shape, slots)
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
        self.staging = None  # the step's page-locked upload buffers (CUDA), made on first use

    @property
    def nbytes(self) -> int:
        """Device and host bytes the group holds whatever its slots hold."""
        tables = self.coef_table.nbytes + self.timestep_table.nbytes + self.divisor_table.nbytes
        inputs = sum(t.numel() * t.element_size() for t in self.request_inputs.values())
        return 2 * self.latents.numel() * 4 + tables + inputs

    def place(self, request, slot: int) -> None:
        super().place(request, slot)
        schedule = request.trajectory.schedule
        n = schedule.steps
        self.two_rows[slot] = request.cfg_scale is not None
        self.stochastic[slot] = schedule.stochastic
        self.generic[slot] = schedule.scheduler is not None
        self.coef_table[slot, :n] = schedule.coefs
        self.timestep_table[slot, :n] = schedule.timesteps
        self.divisor_table[slot, :n] = schedule.input_divisor
        self.latents[slot].copy_(request.trajectory.initial_latents().reshape(-1), non_blocking=True)
        self.history[slot].zero_()
        for name, value in request.request_inputs.items():
            table = self.request_inputs.get(name)
            if table is None:
                table = self.request_inputs[name] = torch.zeros(
                    (2 * self.slots, *value.shape[1:]), dtype=value.dtype, device=self.device)
            table[2 * slot: 2 * slot + 2].copy_(value, non_blocking=True)

    def attach_conditioning(self, slot: int, prompt, negative) -> None:
        self.conditioning[slot] = (prompt, negative)

    def release(self, slot: int) -> None:
        super().release(slot)
        self.conditioning[slot] = None  # after the fence: no launch reads these rows any more


@dataclasses.dataclass
class Batch:
    """One step's row map, model inputs and per-slot update for one group."""

    slots: np.ndarray  # slots updated this step
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

    group: Group
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
    group: Group
    slot: int
    request: object
    host: torch.Tensor
