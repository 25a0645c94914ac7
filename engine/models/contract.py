"""The model contract, by capability: what the core asks of a served model. Each layout
module (`loading.py`: SD, SD3, class-conditional; `sdxl.py`; `flux.py`) implements the
capabilities its pipeline has; `capabilities_of(model)` says which, and
`tests/test_model_contract.py` checks every layout against these Protocols."""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from engine.models.inputs import ModelInputs


@runtime_checkable
class TextEncoding(Protocol):
    """Prompts to prompt rows (the embedding cache's entries)."""

    conditioning_layout: tuple
    conditioning_nbytes: int
    encoder_settings: tuple

    def check_prompt(self, prompt: str) -> str | None: ...

    def negative_text(self, params) -> str | None: ...

    def encode(self, prompts: Sequence[str | None]) -> list: ...


@runtime_checkable
class Denoising(Protocol):
    """One batched denoiser call over `ModelInputs`, and what decides a request's rows."""

    geometry: Any
    prediction_type: str
    scheduler_config: dict
    revision: str
    dtype: torch.dtype

    def check_params(self, params) -> tuple[str, str] | None: ...

    def cfg_scale(self, params) -> float | None: ...

    def schedule_options(self, height: int, width: int, steps: int) -> tuple: ...

    def request_inputs(self, params, height: int, width: int) -> dict[str, torch.Tensor]: ...

    def run(self, inputs: ModelInputs) -> torch.Tensor: ...


@runtime_checkable
class ImageEncoding(Protocol):
    """Image inputs as the model's image pipelines take them (the image input kind)."""

    def image_support(self, field: str) -> str | None: ...

    def default_strength(self, field: str) -> float: ...

    def start_step(self, steps: int, strength: float) -> int: ...

    def image_size(self, image, height: int | None, width: int | None) -> tuple[int, int]: ...

    def preprocess_image(self, image, height: int, width: int) -> torch.Tensor: ...

    def preprocess_mask(self, mask, height: int, width: int) -> torch.Tensor: ...

    def encode_image_moments(self, pixels: Sequence[torch.Tensor]) -> list: ...

    def image_latents(self, moments, generator: torch.Generator) -> torch.Tensor: ...


@runtime_checkable
class AdapterHost(Protocol):
    """A model whose pipeline diffusers can load LoRA into: the adapter pool wraps its
    layers and the model binds each call's adapter rows."""

    pipe: Any

    def bind_adapter_rows(self, rows) -> None: ...


CAPABILITIES = {"text encoding": TextEncoding, "denoising": Denoising, "image encoding": ImageEncoding,
                "adapters": AdapterHost}


def capabilities_of(model) -> list[str]:
    """The capabilities `model` implements, by name."""
    found = [name for name, protocol in CAPABILITIES.items() if isinstance(model, protocol)]
    if "image encoding" in found and not getattr(model, "image_pipelines", None):
        found.remove("image encoding")
    if "adapters" in found and not hasattr(type(getattr(model, "pipe", None)), "lora_state_dict"):
        found.remove("adapters")
    return found
