"""The reference semantics for class-conditional models (DESIGN.md, "Reference
semantics"): the loop written out, and the tiny class-conditional model loaded in
memory. For pipeline folders the oracle is the diffusers pipeline itself
(`engine.testing.pipeline_oracle`)."""
from __future__ import annotations

import pathlib

import torch

from engine.core.solvers import init_noise_sigma, make_scheduler
from engine.models.stable_diffusion import ClassConditionalModel
from engine.testing.tiny_pipelines import SCHEDULER_CONFIGS, TEST_CONDITIONS, tiny_class_vae, tiny_unet



def tiny_model(prediction: str = "epsilon", seed: int = 0, with_vae: bool = False) -> ClassConditionalModel:
    vae = tiny_class_vae(seed + 1) if with_vae else None
    return ClassConditionalModel(path=pathlib.Path(f"tiny-{prediction}-{seed}"), unet=tiny_unet(seed), vae=vae,
                       scheduler_config=dict(SCHEDULER_CONFIGS[prediction]), conditions=list(TEST_CONDITIONS),
                       device=torch.device("cpu"))


@torch.no_grad()
def reference_latents(model: ClassConditionalModel, sampler: str, prompt: str, steps: int, guidance: float,
                      seed: int, height: int | None = None, width: int | None = None) -> torch.Tensor:
    """The reference loop, literally: one request, one diffusers scheduler. Returns C×H×W."""
    size = model.native_size
    shape = (1, *model.latent_shape(height or size, width or size))
    sched = make_scheduler(sampler, model.scheduler_config)
    sched.set_timesteps(steps)
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * init_noise_sigma(sched)
    rows = model.encode([prompt, ""])
    for t in sched.timesteps:
        if guidance == 1.0:
            xin = x if not hasattr(sched, "scale_model_input") else sched.scale_model_input(x, t)
            out = model.denoise(xin, t, rows[:1])
        else:
            xin = torch.cat([x, x])
            xin = xin if not hasattr(sched, "scale_model_input") else sched.scale_model_input(xin, t)
            out_cond, out_uncond = model.denoise(xin, t, rows).chunk(2)
            out = out_uncond + guidance * (out_cond - out_uncond)
        x = sched.step(out, t, x, generator=gen).prev_sample
    return x[0]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
