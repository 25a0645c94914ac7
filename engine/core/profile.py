"""The default slot count from the denoiser's own throughput curve (as vLLM profiles
memory before it sizes its cache): a short profile at start of rows/s at a few rows per
call, and the slots that reach the knee of that curve.

On a CPU larger calls are cheaper per row for a long way (the shapes UNet: 192 rows/s at
1 row, 1,117 at 32), but each step of every request in the batch waits for the whole
call. The knee is the smallest call within `knee` of the best rows/s measured; with
classifier-free guidance a slot takes two rows, so slots = rows / 2. On CUDA the slot
count comes from memory (the ledger's budgets), not from this profile.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

log = logging.getLogger("diffslot.core")

PROFILE_ROWS = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class SlotProfile:
    rows_per_s: dict[int, float]  # rows per call → denoiser rows per second
    knee_rows: int
    slots: int
    complete: bool  # every row count was measured within the time budget

    def describe(self) -> str:
        curve = ", ".join(f"{r}: {v:.0f}" for r, v in self.rows_per_s.items())
        return f"{self.slots} slots (knee at {self.knee_rows} rows a call; rows/s by rows a call: {curve})"


@torch.no_grad()
def profile_slots(model, rows: tuple[int, ...] = PROFILE_ROWS, repeats: int = 3, knee: float = 0.9,
                  budget_s: float = 10.0) -> SlotProfile:
    """Time `model.run` at each row count on the model's native size (the best of
    `repeats` after a warm-up call), stopping early once `budget_s` is spent."""
    geometry = model.geometry
    native = geometry.native_size
    shape = geometry.latent_shape(native, native)
    prompt_rows = model.encode([""])
    extras = model.request_inputs(_ProfileParams(), native, native)
    started = time.perf_counter()
    curve: dict[int, float] = {}
    for n in rows:
        x = torch.randn(n, *shape, device=model.device).to(model.dtype)
        t = torch.full((n,), 500.0, device=model.device)
        request_inputs = {name: value[:1].expand(n, *value.shape[1:]) for name, value in extras.items()}
        model.denoise(x, t, prompt_rows * n, **request_inputs)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            model.denoise(x, t, prompt_rows * n, **request_inputs)
            best = min(best, time.perf_counter() - begin)
        curve[n] = n / best
        if time.perf_counter() - started > budget_s:
            break
    top = max(curve.values())
    knee_rows = min(n for n, rate in curve.items() if rate >= knee * top)
    complete = len(curve) == len(rows)
    # a curve cut short by the budget has not shown its knee: take its largest call
    knee_rows = knee_rows if complete else max(curve)
    profile = SlotProfile(curve, knee_rows, max(1, knee_rows // 2), complete)
    log.info("slots from the denoiser's curve: %s", profile.describe())
    return profile


@dataclasses.dataclass(frozen=True)
class _ProfileParams:
    """What `request_inputs` reads of a request: a plain text-to-image request."""

    guidance: float = 3.0
    true_cfg: float = 1.0
    negative_prompt: str | None = None
    original_size: tuple | None = None
    crops_coords_top_left: tuple | None = None
    target_size: tuple | None = None
    loras: tuple = ()
