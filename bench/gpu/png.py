"""Part `png`: the SD-1.5-architecture UNet with an SD-1.5-architecture AutoencoderKL
(random weights): goodput of the same requests with `png` outputs through the in-process
decode stage (`--decode-workers 0`) over `latent` outputs through it; target ≥ 0.9."""
from __future__ import annotations

from engine.decode.factory import make_decode_stage

from .engine_internals import CoreConfig
from .report import check
from .sd15 import get_sd15, sd15_vae
from .served import generate_requests, serve_in_process, served_row


def run(args) -> None:
    """Goodput with `png` outputs through the in-process decode stage (`--decode-workers 0`:
    the VAE on its own CUDA stream in a thread of the engine process, PNG encoding on the
    host) against `latent` outputs through the same stage, same requests."""
    model = get_sd15()
    if model.vae is None:
        model.vae = sd15_vae()  # random weights: the decode's cost, not its pictures
    slots, n, steps = 16, (32 if args.quick else 64), (10 if args.quick else 20)
    config = CoreConfig(slots=slots, max_steps=64, device="cuda")
    stage = make_decode_stage(model, 0)
    try:
        serve_in_process(model, stage, generate_requests("warm", 2, "png", 2), config)  # VAE kernels, PNG path
        results = {kind: serve_in_process(model, stage, generate_requests(kind, n, kind, steps), config)
                   for kind in ("latent", "png")}
    finally:
        stage.close()
    ok = all([served_row("png", f"SD-1.5 {n} requests x {steps} steps, {kind}, in-process decode", r, n)
              for kind, r in results.items()])
    ratio = results["png"]["goodput"] / results["latent"]["goodput"]
    check("png", "png / latent goodput, in-process decode", "ratio", ratio, ok and ratio >= 0.9,
          f"target ≥ 0.9; {slots} slots, guidance 7.5, 512×512, fp16 UNet and VAE")
