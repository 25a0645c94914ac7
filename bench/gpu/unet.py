"""Part `unet`: an SD-1.5-architecture UNet2DConditionModel (random weights, 512×512 →
4×64×64 latents, fp16) under the engine at full batch vs the same UNet's peak batched
rate: useful rows/s ratio, host time per step() less its fence waits (the run-ahead
window's and the idle reaper's)."""
from __future__ import annotations

from .engine_runs import engine_vs_peak, finite_output_check
from .sd15 import get_sd15


def run(args) -> None:
    model = get_sd15()
    finite_output_check("unet", model, "SD-1.5 UNet")
    engine_vs_peak("unet", model, "UNet", 16, 2, 10 if args.quick else 20)  # guidance 7.5: cond + uncond rows
