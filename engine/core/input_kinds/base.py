"""What one kind of per-request input declares, once.

A kind owns one or more `GenerateParams` fields (its wire fields: a bytes field travels
as its own frame, and the client, the gateway's upload form and the CLI derive from the
struct itself). The engine asks the kind, at each stage of a request's life:

| stage | call | what the kind does |
|---|---|---|
| intake | `check(params)` | validates its fields against the model (RequestRejected naming the field); returns its decoded value, or None when the request does not use it |
| intake | `output_size(value)`, `start_step(value, steps, h, w)` | the output size it implies where none is given; the schedule step it starts at |
| intake | `nbytes(value, latent_shape)` | what admission reserves for it in the ledger |
| admission | `prepare(requests)` | the batched preparation of everything admitted at one boundary (a VAE encode, an image encoder, rows of an adapter table); it leaves data on each request: `request.start`, `request.request_inputs` rows, `request.slot_inputs[name]` |
| admission | `spent(value)` | the reserved bytes the request no longer holds once prepared (its encoded input) |
| slots | the `SlotInput.slot_state` it leaves | the device state a slot keeps: placed, acted on after each update, released after the fence, parked and brought back |

The header size (`header_size`) lets the engine process bound a request's output before
decoding anything.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class InputKind:
    """Defaults for a kind that only validates; subclasses override what they use."""

    name: str = ""
    fields: tuple[str, ...] = ()
    timing: str = ""  # the `Timings` field its preparation's time goes to, if any

    def check(self, params) -> Any | None:
        return None

    def header_size(self, params) -> tuple[int, int] | None:
        return None

    def output_size(self, value) -> tuple[int | None, int | None]:
        return None, None

    def start_step(self, value, steps: int, height: int, width: int) -> int | None:
        """The step of the full schedule the request starts at (None: it runs them all)."""
        return None

    def nbytes(self, value, latent_shape: tuple[int, ...]) -> int:
        return 0

    def largest_nbytes(self, latent_shape: tuple[int, ...]) -> int:
        """The most `nbytes` can be for one request of this latent shape under the documented
        limits (the default trajectory budget holds at least one such request)."""
        return 0

    def headroom(self, latent_shape: tuple[int, ...], slots: int) -> int:
        """What the default trajectory budget sets aside for this kind (0: none)."""
        return 0

    def prepare(self, requests: list) -> dict:
        """Returns {request: error} for the requests whose preparation failed."""
        return {}

    def spent(self, value) -> int:
        return 0


class SlotInput(Protocol):
    """A prepared value a slot keeps (`request.slot_inputs[kind]`)."""

    nbytes: int

    def slot_state(self, storage) -> "SlotState":
        """The state object that holds values of this kind for every slot of `storage`."""


class SlotState(Protocol):
    """One input kind's device state for every slot of one group's storage."""

    nbytes: int

    def place(self, slot: int, value: SlotInput) -> None: ...

    def holds(self, slot: int) -> bool: ...

    def after_update(self, latents: torch.Tensor, slots: np.ndarray, steps: np.ndarray) -> None:
        """After the fused update of `slots` (each at its step index `steps` before it)."""

    def release(self, slot: int) -> None: ...

    def park(self, slot: int) -> SlotInput:
        """The slot's value, in host memory, that `place` brings back bit for bit."""
