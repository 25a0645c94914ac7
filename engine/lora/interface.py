"""The adapter pool as the core names it (torch-free): what intake, admission, the
preparation phase, the embedding cache and the graphs ask of it. `AdapterPool`
(`engine.lora.pool`) implements it; `tests/test_model_contract.py` checks that."""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class AdapterResidency(Protocol):
    #: bumped whenever what a captured graph of the denoiser reads of the adapters changes
    #: other than through the device tables updated in place (a k×k conv layer's adapters)
    layout_version: int

    def names(self) -> list[str]:
        """The adapters served now."""

    def check(self, loras: Mapping[str, float]) -> str | None:
        """Why these adapters and scales cannot be served, or None (intake)."""

    def acquire(self, names: Sequence[str]) -> list[int] | str | None:
        """Reference each once when all are resident: their pool slots. Never blocks:
        "loading" while a loader thread reads one of them (admission waits; nobody else
        is held back), None when there is no room for them now (admission waits, as for
        memory). Raises when they can never be resident (a set over the budget, a file
        that changed into one that cannot be served or read)."""

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block for at most `timeout_s` while an adapter is loading (an idle busy loop)."""

    def release(self, slots: Sequence[int]) -> None:
        """Drop one reference per slot (after the fence of the slot's last launch)."""

    def row_inputs(self, slots: Sequence[int], scales: Sequence[float], rows: int = 2) -> dict:
        """A request's `lora_index` / `lora_scale` rows (preparation), host tensors."""

    def text_encoder_key(self, loras: Mapping[str, float] | None) -> tuple:
        """What an embedding's cache key must add for these adapters."""

    def encode(self, prompts: Sequence[str], loras: Sequence[Mapping[str, float] | None]) -> list:
        """Prompt rows made with each prompt's text-encoder adapters."""

    def stats(self) -> dict: ...
