"""The controls input kind: `controls` (ControlNets, each with its control image, scale
and start/end window) and `guess_mode`.

At intake (`ControlsKind.check`): each control's name must be a ControlNet the engine
serves (`--controlnet NAME=PATH`), its image a PNG, JPEG or WebP within the input bounds,
its scale finite, its window 0 ≤ start < end ≤ 1 (the pipeline's own check); anything else
is `Rejected` naming `controls`. Without a height or width, the first control image's size
(rounded down as the pipeline's control image processor rounds it) is the output's, as
the pipeline takes it.

At admission (`ControlsKind.prepare`, a batched phase beside the prompt encode): each
control image is prepared as the pipeline's `prepare_image` does (its control image
processor: resized to the output size, RGB, [0, 1]; FLUX's and SD3's then VAE-encoded), in
the ControlNet's dtype on the device, and each control's per-step window
(`controlnet_keep`) and per-block factors are fixed. The slot state (`ControlSlots`)
holds them; each step it gathers the call's `engine.models.controlnet.ControlCall` for the
rows at their own steps.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from engine.core.input_kinds.base import InputKind
from engine.core.input_kinds.image import _decode, image_header_size
from engine.core.outputs import RequestRejected

FIELD = "controls"
MAX_SCALE = 100.0


@dataclasses.dataclass(eq=False)
class ControlInputs:
    """A request's decoded controls, held from validation to its preparation."""

    images: list  # PIL images, RGB, one per control
    names: list[str]
    scales: list[float]
    windows: list[tuple[float, float]]
    guess_mode: bool
    input_bytes: int


class ControlsKind(InputKind):
    name = FIELD
    fields = ("controls", "guess_mode")

    def __init__(self, model, geometry, max_input_bytes: int, default_cache=None):
        self.model, self.geometry, self.max_input_bytes = model, geometry, max_input_bytes
        self.default_cache = default_cache  # the server's step cache (`--cache`), which controls turn away

    @property
    def controlnets(self) -> dict:
        return getattr(self.model, "controlnets", None) or {}

    def check(self, p) -> ControlInputs | None:
        from engine.models.controlnet import MAX_CONTROLS, check_pooling_order

        controls = p.controls
        if not controls:
            if p.guess_mode:
                raise RequestRejected("needs controls (ControlNets) to apply to", "guess_mode")
            return None
        served = self.controlnets
        if not served:
            raise RequestRejected("this engine serves no ControlNets (start it with --controlnet NAME=PATH)", FIELD)
        if not isinstance(controls, (tuple, list)) or len(controls) > MAX_CONTROLS:
            raise RequestRejected(f"at most {MAX_CONTROLS} controls", FIELD)
        if not isinstance(p.guess_mode, bool):
            raise RequestRejected("must be true or false", "guess_mode")
        if p.guess_mode and not self.model.takes_guess_mode:
            raise RequestRejected(f"{self.model.pipeline_class} ControlNets have no guess mode (SD/SDXL)", "guess_mode")
        if p.image is not None and not self.model.takes_controls_with_image:
            raise RequestRejected(f"{self.model.pipeline_class} ControlNets with an image are not served "
                                  "(text to image only)", FIELD)
        cache = p.cache if p.cache is not None else self.default_cache
        if cache is not None and cache.kind != "off":
            # a step cache gathers rows inside the denoiser, where the residuals of every row are added
            raise RequestRejected("cannot be combined with a step cache (send cache: {kind: off})", FIELD)
        images, names, scales, windows, size = [], [], [], [], 0
        for k, control in enumerate(controls):
            if control.name not in served:
                raise RequestRejected(f"{k}: unknown ControlNet {control.name!r}; this engine serves "
                                      f"{', '.join(sorted(served))}", FIELD)
            scale, start, end = control.scale, control.start, control.end
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                   for v in (scale, start, end)):
                raise RequestRejected(f"{k}: scale, start and end must be finite numbers", FIELD)
            if not -MAX_SCALE <= scale <= MAX_SCALE:
                raise RequestRejected(f"{k}: scale must lie in [{-MAX_SCALE:g}, {MAX_SCALE:g}]", FIELD)
            if not 0.0 <= start < end <= 1.0:
                raise RequestRejected(f"{k}: the window must be 0 ≤ start < end ≤ 1 (start {start:g}, end {end:g})",
                                      FIELD)
            try:
                image = _decode(control.image, FIELD, self.max_input_bytes, self.geometry.max_size)
            except RequestRejected as exc:
                raise RequestRejected(f"{k}: image {exc.reason}", FIELD) from None
            images.append(image.convert("RGB") if image.mode != "RGB" else image)
            names.append(control.name)
            scales.append(float(scale))
            windows.append((float(start), float(end)))
            size += memoryview(control.image).nbytes
        why = check_pooling_order([served[name] for name in names])
        if why:
            raise RequestRejected(why, FIELD)
        return ControlInputs(images, names, scales, windows, bool(p.guess_mode), size)

    def header_size(self, params) -> tuple[int, int] | None:
        """(height, width) the first control image's header states, or None."""
        controls = params.controls
        if not controls or not isinstance(controls, (tuple, list)):
            return None
        return image_header_size(controls[0].image)

    def output_size(self, value: ControlInputs) -> tuple[int | None, int | None]:
        """The first control image's size, rounded as the control image processor rounds it
        (SD, SDXL; FLUX's pipeline resizes it to its default size)."""
        return self.model.control_image_size(value.images[0])

    def nbytes(self, value: ControlInputs, latent_shape: tuple[int, ...]) -> int:
        """The encoded images until prepared, and each prepared control image (3 × H × W
        in the ControlNet's dtype, or SD3's two rows of latents) while the slot holds it."""
        return value.input_bytes + self._prepared_bytes(value, latent_shape)

    def _prepared_bytes(self, value: ControlInputs, latent_shape) -> int:
        return len(value.images) * self._image_bytes(latent_shape)

    def _image_bytes(self, latent_shape) -> int:
        """One prepared control at most: an image (3 × H × W) or two rows of control
        latents (SD3's, C × h × w each), in the model's dtype."""
        c, h, w = latent_shape
        scale = self.geometry.vae_scale
        item = torch.empty((), dtype=self.model.dtype).element_size()
        return max(3 * (h * scale) * (w * scale), 2 * c * h * w) * item

    def headroom(self, latent_shape: tuple[int, ...], slots: int) -> int:
        """Room for one prepared control image per slot and one native image's encoded bytes
        at admission, raw-sized (none when no ControlNet is served)."""
        if not self.controlnets:
            return 0
        _, h, w = latent_shape
        scale = self.geometry.vae_scale
        return slots * self._image_bytes(latent_shape) + 4 * (h * scale) * (w * scale)

    def spent(self, value: ControlInputs) -> int:
        return value.input_bytes

    def prepare(self, requests: list) -> dict:
        from engine.models.controlnet import ControlEntry, control_factors, request_guess_mode

        failed = {}
        for request in requests:
            value = request.inputs.get(self.name)
            if value is None:
                continue
            try:
                _, h, w = request.latent_shape
                height, width = h * self.geometry.vae_scale, w * self.geometry.vae_scale
                steps = request.trajectory.schedule.steps  # the pipeline's len(timesteps)
                i = np.arange(steps)
                guess_mode = request_guess_mode(value.guess_mode, [self.controlnets[n] for n in value.names])
                # FLUX samples its control latents from the request's generator, before its initial
                # noise; SD3 from a generator of its own (its pipeline's global one), one per row
                generator = self.model.control_generator(request.trajectory.generator)
                rows = 1 if request.cfg_scale is None else 2
                entries = []
                for image, name, scale, (start, end) in zip(value.images, value.names, value.scales, value.windows):
                    net = self.controlnets[name]
                    prepared = self.model.prepare_control_image(image, height, width, generator, net, rows)
                    keep = ~((i / steps < start) | ((i + 1) / steps > end))
                    entries.append(ControlEntry(name, prepared, keep, control_factors(scale, guess_mode, net)))
                shared = self.model.controls_on_prompt_row
                request.slot_inputs[self.name] = ControlSlot(entries, guess_mode or shared, shared,
                                                             self._prepared_bytes(value, request.latent_shape))
            except Exception as exc:
                failed[request] = exc
        return failed


@dataclasses.dataclass
class ControlSlot:
    """What a slot holds of its request's controls (its parked form: the same, on the host)."""

    entries: list
    prompt_row_only: bool  # the ControlNets run on the prompt's row only (guess mode; FLUX)
    to_both_rows: bool  # ... and their residuals go to the negative prompt's row too (FLUX's true CFG)
    nbytes: int

    def slot_state(self, storage) -> "ControlSlots":
        return ControlSlots(storage.device)

    def moved(self, move) -> "ControlSlot":
        return dataclasses.replace(self, entries=[e.moved(move) for e in self.entries])


class ControlSlots:
    """The controls of every slot of one group's storage, and each call's `ControlCall`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: dict[int, ControlSlot] = {}

    @property
    def nbytes(self) -> int:
        return sum(value.nbytes for value in self.slots.values())

    def place(self, slot: int, value: ControlSlot) -> None:
        device = self.device
        self.slots[slot] = value.moved(lambda t: t.to(device))

    def holds(self, slot: int) -> bool:
        return slot in self.slots

    def after_update(self, latents, slots, steps) -> None:
        pass

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def park(self, slot: int) -> ControlSlot:
        from engine.core.storage import to_host

        return self.slots[slot].moved(to_host)

    def call(self, controlnets: dict, row_slot: np.ndarray, row_branch: np.ndarray, slot_step: np.ndarray,
             real: np.ndarray):
        """The `ControlCall` of one denoiser call: for each real row whose slot holds
        controls, the controls that apply at its slot's step (`slot_step[slot]`); None if
        no row has one. `row_branch` 1: the negative prompt's row."""
        if not self.slots:
            return None
        from engine.models.controlnet import ControlCall, ControlRun

        runs: dict[str, ControlRun] = {}
        real_rows = np.flatnonzero(real)
        negative_row = {int(row_slot[r]): int(r) for r in real_rows[row_branch[real_rows] == 1]}
        for row in real_rows.tolist():
            slot = int(row_slot[row])
            value = self.slots.get(slot)
            if value is None or (value.prompt_row_only and row_branch[row]):
                continue
            also = negative_row.get(slot, -1) if value.to_both_rows else -1
            step = int(slot_step[slot])
            for position, entry in enumerate(value.entries):
                if step >= len(entry.keep) or not entry.keep[step]:
                    continue
                run = runs.get(entry.name)
                if run is None:
                    run = runs[entry.name] = ControlRun(controlnets[entry.name], [], [], [], [])
                run.rows.append(row)
                run.images.append(entry.image_of(bool(row_branch[row])))
                run.factors.append(entry.factors)
                run.positions.append(position)
                run.also.append(also)
        return ControlCall(list(runs.values()), self.device) if runs else None
