"""Per-request input kinds, each declared once (`base.InputKind`): the image kind
(`image`, `mask`, `strength`: img2img and inpainting), the controls kind (`controls`,
`guess_mode`: ControlNets), the IP-Adapter kind (`ip_image`, `ip_scale`), the adapter kind (`loras`) and the step-cache kind (`cache`).
`input_kinds_for` builds the served model's set; intake, admission's preparation phase,
the ledger's default budget and the slot storage ask every kind the same questions."""
from __future__ import annotations

from engine.core.input_kinds.adapters import AdapterKind
from engine.core.input_kinds.base import InputKind, SlotInput, SlotState
from engine.core.input_kinds.controls import ControlsKind
from engine.core.input_kinds.image import ImageKind
from engine.core.input_kinds.ip_adapter import IPAdapterKind
from engine.core.input_kinds.step_cache import StepCacheKind


def input_kinds_for(model, geometry, config, adapters=None) -> tuple[InputKind, ...]:
    """The kinds in preparation order (an image's draws before anything else's)."""
    return (ImageKind(model, geometry, config.max_input_bytes),
            ControlsKind(model, geometry, config.max_input_bytes, config.cache),
            IPAdapterKind(model, geometry, config.max_input_bytes), AdapterKind(adapters),
            StepCacheKind(model, config.cache))


__all__ = ["AdapterKind", "ControlsKind", "IPAdapterKind", "ImageKind", "InputKind", "SlotInput", "SlotState", "StepCacheKind", "input_kinds_for"]
