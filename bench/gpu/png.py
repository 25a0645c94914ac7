"""Part `png`: the SD-1.5-architecture UNet with an SD-1.5-architecture AutoencoderKL
(random weights): goodput of the same requests with `png` outputs through the in-process
decode stage (`--decode-workers 0`) over `latent` outputs through it, in the steady state
(the middle half of the completions: the last decodes' tail after the last step is left
out, so the ratio judges the decode beside the denoiser, not the tail); target
`judge.PNG_TARGET`."""
from __future__ import annotations

from engine.decode.factory import make_decode_stage

from . import judge
from .engine_internals import CoreConfig
from .report import check
from .sd15 import get_sd15, sd15_vae
from .served import generate_requests, serve_in_process, served_row


def run(args) -> None:
    """Goodput with `png` outputs through the in-process decode stage (`--decode-workers 0`:
    the VAE on its own CUDA stream in a thread of the engine process, PNG encoding on the
    host) against `latent` outputs through the same stage, same requests; their steps
    staggered so that completions spread over the run."""
    model = get_sd15()
    if model.vae is None:
        model.vae = sd15_vae()  # random weights: the decode's cost, not its pictures
    slots, n, steps = 16, (48 if args.quick else 96), (8 if args.quick else 16)
    config = CoreConfig(slots=slots, max_steps=64, device="cuda")
    stage = make_decode_stage(model, 0)
    try:
        serve_in_process(model, stage, generate_requests("warm", 2, "png", 2), config)  # VAE kernels, PNG path
        results = {kind: serve_in_process(model, stage, generate_requests(kind, n, kind, steps, stagger=7), config)
                   for kind in ("latent", "png")}
    finally:
        stage.close()
    for kind, r in results.items():
        served_row("png", f"SD-1.5 {n} requests x {steps}-{steps + 7} steps, {kind}, in-process decode", r, n)
    ratio, verdict = judge.png_goodput(results["latent"]["completed_at"], results["png"]["completed_at"], n,
                                       len(results["latent"]["errors"]) + len(results["png"]["errors"]))
    whole = results["png"]["goodput"] / results["latent"]["goodput"]
    check("png", "png / latent goodput, in-process decode", "steady-state ratio", ratio, verdict.ok,
          f"{verdict.note}; whole runs {whole:.3f} (tail included); {slots} slots, guidance 7.5, 512×512, fp16")
