"""What `EngineCore.step()` returns, and its rejection: plain types without torch, so the
engine process and the fake core of the tests use them without loading a model stack."""
from __future__ import annotations

import dataclasses
from typing import Any

from engine.protocol import GenerateParams, Timings


@dataclasses.dataclass
class StepProgress:
    request_id: str
    step: int
    total: int


@dataclasses.dataclass
class DenoiseFinished:
    request_id: str
    latents: Any  # C×H×W float32 (a CPU torch tensor from the real core), as the denoiser sees them
    params: GenerateParams
    timings: Timings
    finished_at: float


@dataclasses.dataclass
class PreviewReady:
    """A partial image: the clean-image estimate x0 after `step` of `total` steps."""

    request_id: str
    index: int  # 0-based among the request's previews
    step: int
    total: int
    latents: Any  # C×H×W float32, as DenoiseFinished's


@dataclasses.dataclass
class RequestCanceled:
    request_id: str
    timings: Timings


@dataclasses.dataclass
class RequestFailed:
    request_id: str
    error: str


class RequestRejected(Exception):
    """Bad input or no room: the request is not taken; nothing else is affected."""

    def __init__(self, reason: str, field: str | None = None, retry_after_s: float = 0.0):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.reason, self.field, self.retry_after_s = reason, field, retry_after_s
