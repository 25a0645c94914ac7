"""What the engine process drives: the core's declared interface (torch-free).

`EngineCore` implements it; so do the benchmark's baseline cores and the tests' fake
core, and a test checks all three against this Protocol. The engine process
(`engine.serve.proc`) uses nothing else of a core and nothing of the model.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol, runtime_checkable

from engine.protocol import GenerateParams


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What clients learn of the served model in `Welcome`."""

    name: str
    native_size: int  # default height and width in pixels
    prompts: tuple[str, ...] = ()  # the prompts a class-conditional model knows; () for free text
    pipeline: str = ""  # e.g. "StableDiffusionPipeline"
    controlnets: tuple[str, ...] = ()  # the ControlNets served beside it (`--controlnet`), by name


@runtime_checkable
class CoreInterface(Protocol):
    """The calls of vLLM's EngineCore, for diffusion: pure, single-threaded, in-process."""

    def add_request(self, request_id: str, params: GenerateParams, arrival_time: float | None = None,
                    partial_images: int = 0) -> None:
        """Validate and queue. Raises `RequestRejected(reason, field, retry_after_s)`.
        `partial_images`: previews (`PreviewReady`) of the clean-image estimate to publish."""

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Cancel: idempotent, safe to race with completion."""

    def step(self) -> list:
        """Do one unit of work; return StepProgress / DenoiseFinished / RequestCanceled /
        RequestFailed outputs."""

    def has_work(self) -> bool:
        """Something for `step()` to do right now."""

    def has_unfinished_requests(self) -> bool:
        """Any request not yet ended."""

    def decode_done(self, request_id: str) -> bool:
        """The decode stage finished or dropped the request: return its reservation.
        True: deliver the output; False: it was canceled meanwhile."""

    def output_bytes(self, params: GenerateParams) -> int:
        """Worst-case size of the request's output frame (0 if the core will reject it)."""

    def model_info(self) -> ModelInfo:
        """The served model, as clients see it."""

    def adapter_names(self) -> list[str]:
        """The LoRA adapters served now (a folder rescanned on each call); [] without any."""

    def stats(self) -> dict:
        """Counters and gauges for the metrics."""
