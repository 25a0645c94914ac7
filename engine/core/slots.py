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


def upload(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy host data into device storage without blocking the host: a `non_blocking` copy
    from pageable memory is a synchronous staged copy on CUDA, so the source is put in
    page-locked memory first (torch's host allocator keeps that block until the copy's
    stream has passed it)."""
    if destination.is_cuda and not source.is_cuda and not source.is_pinned():
        source = source.contiguous().pin_memory()
    destination.copy_(source, non_blocking=True)


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
        # inpainting (4-channel denoisers): the slot keeps the image's latents, its initial
        # noise and the mask (1 = repaint, broadcast over the channels), and per step the
        # add_noise coefficients of the timestep it reaches next. Made on the group's first
        # masked request; a slot's rows are its own from `attach_image` to its release
        self.masked = np.zeros(slots, dtype=bool)
        # the slot's request is one whose pipeline keeps channels-last latents (SD/SDXL img2img)
        self.channels_last = np.zeros(slots, dtype=bool)
        self.image_latents = self.image_noise = self.mask = None
        self.noising_table: np.ndarray | None = None
        self.max_steps = max_steps

    @property
    def nbytes(self) -> int:
        """Device and host bytes the group holds whatever its slots hold."""
        tables = self.coef_table.nbytes + self.timestep_table.nbytes + self.divisor_table.nbytes
        inputs = sum(t.numel() * t.element_size() for t in self.request_inputs.values())
        if self.mask is not None:
            tables += 3 * self.latents.numel() * 4 + self.noising_table.nbytes
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
        self.masked[slot] = self.channels_last[slot] = False
        if request.image_inputs is None:
            upload(self.latents[slot], request.trajectory.initial_latents().reshape(-1))
        # else: the image-encode phase starts the slot (`attach_image`), its draws after the VAE's
        self.history[slot].zero_()
        for name, value in request.request_inputs.items():
            table = self.request_inputs.get(name)
            if table is None:
                table = self.request_inputs[name] = torch.zeros(
                    (2 * self.slots, *value.shape[1:]), dtype=value.dtype, device=self.device)
            upload(table[2 * slot: 2 * slot + 2], value)

    def attach_conditioning(self, slot: int, prompt, negative) -> None:
        self.conditioning[slot] = (prompt, negative)

    def attach_image(self, slot: int, start: torch.Tensor, known: tuple | None = None,
                     channels_last: bool = False) -> None:
        """An image request's first latents (its image's latents noised to its first
        timestep); for inpainting `known` = (image latents, noise, mask at latent
        resolution 1 × h × w, per-step add_noise coefficients steps × 2)."""
        upload(self.latents[slot], start.reshape(-1))
        self.channels_last[slot] = channels_last
        if known is None:
            return
        image_latents, noise, mask, noising = known
        if self.mask is None:
            self.image_latents = torch.zeros_like(self.latents)
            self.image_noise = torch.zeros_like(self.latents)
            self.mask = torch.zeros_like(self.latents)
            self.noising_table = np.zeros((self.slots, self.max_steps, 2), dtype=np.float32)
        shape = self.latent_shape
        upload(self.image_latents[slot], image_latents.reshape(-1))
        upload(self.image_noise[slot], noise.reshape(-1))
        upload(self.mask[slot].view(shape), mask.reshape(1, *shape[1:]).expand(shape))
        self.noising_table[slot, :len(noising)] = noising
        self.masked[slot] = True

    def release(self, slot: int) -> None:
        super().release(slot)
        self.conditioning[slot] = None  # after the fence: no launch reads these rows any more
        self.masked[slot] = self.channels_last[slot] = False  # its image rows are free for the next request


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
    # inpainting: the slots whose known region is kept after this step, and their add_noise
    # coefficients (entries × 2) at the timestep each reaches next
    masked_slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    masked_index: torch.Tensor | None = None  # the same slots, int32, on the device
    masked_coefs: torch.Tensor | None = None


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
