"""The SD-1.5-architecture UNet (and VAE) with random weights, shared by the unet, graphs,
layouts and png parts: built once, on first use, in fp16 on the current CUDA device."""
from __future__ import annotations

import functools
import hashlib
import pathlib
import time

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

from engine.models.geometry import Geometry
from engine.models.model import Conditioning, DiffusionModel

from .report import row
from .text_stand_in import TEXT_TOKENS, TEXT_WIDTH


SD15_UNET_CONFIG = dict(  # runwayml/stable-diffusion-v1-5 unet/config.json, written out (no hub)
    sample_size=64, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    only_cross_attention=False, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, downsample_padding=1,
    mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=768,
    attention_head_dim=8, use_linear_projection=False,
)


SD15_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json (PNDM; the engine's samplers build from it)
    _class_name="PNDMScheduler", num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
    beta_schedule="scaled_linear", trained_betas=None, skip_prk_steps=True, set_alpha_to_one=False,
    prediction_type="epsilon", steps_offset=1, clip_sample=False,
)


SD15_VAE_CONFIG = dict(  # runwayml/stable-diffusion-v1-5 vae/config.json, written out (no hub)
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=4, norm_num_groups=32, sample_size=512, scaling_factor=0.18215,
)


def sd15_model():
    """The UNet in a DiffusionModel: prompts map to fixed random 77×768 fp16 rows (a
    stand-in for the CLIP text encoder, which is off the denoiser's path)."""
    class Sd15(DiffusionModel):
        pipeline_class = "StableDiffusionPipeline"

        def __init__(self):
            self.path = pathlib.Path("sd15-architecture-random")
            self.device, self.dtype = torch.device("cuda"), torch.float16
            torch.manual_seed(0)
            with torch.device("cuda"):
                self.denoiser = UNet2DConditionModel(**SD15_UNET_CONFIG)
            self.denoiser = self.denoiser.to(torch.float16).eval().requires_grad_(False)
            self.scheduler_config = dict(SD15_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:
            return Geometry(latent_channels=4, vae_scale=8, size_multiple=64, native_size=512)

        def encode(self, prompts):
            out = []
            for p in prompts:
                seed = int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "little")
                g = torch.Generator("cuda").manual_seed(seed)
                out.append(Conditioning(torch.randn(TEXT_TOKENS, TEXT_WIDTH, device="cuda", generator=g,
                                                    dtype=torch.float16)))
            return out

        def forward(self, inputs):
            return self.denoiser(inputs.sample, inputs.timestep, encoder_hidden_states=inputs.hidden).sample

    return Sd15()


_SD15 = {}


def get_sd15():
    if "model" not in _SD15:
        t0 = time.perf_counter()
        _SD15["model"] = sd15_model()
        torch.cuda.synchronize()
        params = sum(p.numel() for p in _SD15["model"].denoiser.parameters())
        row("unet", "SD-1.5 UNet2DConditionModel", "built (s)", time.perf_counter() - t0, "info",
            f"{params / 1e6:.0f} M parameters, fp16, random weights")
    return _SD15["model"]


def sd15_vae(device="cuda", dtype=torch.float16, config=SD15_VAE_CONFIG):
    torch.manual_seed(1)
    with torch.device(device):
        vae = AutoencoderKL(**config)
    return vae.to(dtype).eval().requires_grad_(False)
