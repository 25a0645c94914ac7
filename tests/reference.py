"""The reference semantics of DESIGN.md section 3, and small random-weight models for tests."""
from __future__ import annotations

import json
import pathlib

import torch
from diffusers import AutoencoderKL, UNet2DModel

from engine.model import LoadedModel
from engine.solvers import init_noise_sigma, make_scheduler

TEST_CONDITIONS = ["red circle", "green square", "blue triangle", ""]

SCHEDULER_CONFIGS = {
    "epsilon": dict(_class_name="DDPMScheduler", num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                    beta_schedule="scaled_linear", prediction_type="epsilon", timestep_spacing="trailing",
                    clip_sample=False, set_alpha_to_one=False),
    "v_prediction": dict(_class_name="DDPMScheduler", num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                         beta_schedule="linear", prediction_type="v_prediction", timestep_spacing="leading",
                         steps_offset=1, clip_sample=False),
    "sample": dict(_class_name="DDPMScheduler", num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2",
                   prediction_type="sample", timestep_spacing="linspace", clip_sample=True, clip_sample_range=1.0),
    "flow": dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0),
}


def tiny_unet(seed: int = 0, channels: int = 4, size: int = 8) -> UNet2DModel:
    torch.manual_seed(seed)
    unet = UNet2DModel(sample_size=size, in_channels=channels, out_channels=channels, layers_per_block=1,
                       block_out_channels=(32, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=16,
                       norm_num_groups=8, num_class_embeds=len(TEST_CONDITIONS))
    with torch.no_grad():  # random weights with an output of order one, as a trained model's
        for p in unet.conv_out.parameters():
            p.mul_(20.0)
    return unet.eval().requires_grad_(False)


def tiny_model(prediction: str = "epsilon", seed: int = 0, with_vae: bool = False) -> LoadedModel:
    vae = None
    if with_vae:
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, sample_size=32,
                            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
                            mid_block_add_attention=False).eval().requires_grad_(False)
    return LoadedModel(path=pathlib.Path(f"tiny-{prediction}-{seed}"), unet=tiny_unet(seed), vae=vae,
                       scheduler_config=dict(SCHEDULER_CONFIGS[prediction]), conditions=list(TEST_CONDITIONS),
                       device=torch.device("cpu"))


@torch.no_grad()
def reference_latents(model: LoadedModel, sampler: str, condition: str, steps: int, guidance: float,
                      seed: int, height: int | None = None, width: int | None = None) -> torch.Tensor:
    """DESIGN.md section 3, literally: one request, one diffusers scheduler. Returns C×H×W."""
    size = model.native_size
    shape = (1, *model.latent_shape(height or size, width or size))
    sched = make_scheduler(sampler, model.scheduler_config)
    sched.set_timesteps(steps)
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * init_noise_sigma(sched)
    cond = torch.tensor([model.condition_index(condition), model.null_index])
    for t in sched.timesteps:
        if guidance == 1.0:
            xin = x if not hasattr(sched, "scale_model_input") else sched.scale_model_input(x, t)
            out = model.denoise(xin, t, cond[:1])
        else:
            xin = torch.cat([x, x])
            xin = xin if not hasattr(sched, "scale_model_input") else sched.scale_model_input(xin, t)
            out_cond, out_uncond = model.denoise(xin, t, cond).chunk(2)
            out = out_uncond + guidance * (out_cond - out_uncond)
        x = sched.step(out, t, x, generator=gen).prev_sample
    return x[0]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
