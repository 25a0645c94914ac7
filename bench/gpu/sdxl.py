"""Part `sdxl`: an SDXL-architecture UNet2DConditionModel (random weights, SDXL base 1.0's
config written out: text_time added conditioning, 2048-wide cross-attention; 1024×1024 →
4×128×128, fp16) in the engine's own StableDiffusionXLModel (random 77×2048 prompt rows
and 1280 pooled; per-request time ids mixed in one batch, zero negative rows for half):
engine vs peak, as `unet`."""
from __future__ import annotations

import functools
import pathlib
import time
import types

import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

from engine.models.geometry import Geometry
from engine.models.model import Conditioning
from engine.models.sdxl import StableDiffusionXLModel

from .engine_runs import engine_vs_peak, finite_output_check
from .report import row
from .text_stand_in import TEXT_TOKENS, random_rows


SDXL_UNET_CONFIG = dict(  # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json, written out (no hub)
    sample_size=128, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    only_cross_attention=False, block_out_channels=(320, 640, 1280), layers_per_block=2, downsample_padding=1,
    mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=2048,
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    upcast_attention=False,
)  # 2,567,463,684 parameters, as the released UNet


SDXL_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json
    _class_name="EulerDiscreteScheduler", num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
    beta_schedule="scaled_linear", trained_betas=None, prediction_type="epsilon", interpolation_type="linear",
    use_karras_sigmas=False, timestep_spacing="leading", steps_offset=1, clip_sample=False, sample_max_value=1.0,
    set_alpha_to_one=False, skip_prk_steps=True,
)


def sdxl_model(config: dict = SDXL_UNET_CONFIG, device="cuda", dtype=torch.float16):
    """The engine's own `StableDiffusionXLModel` on a random-weight UNet. The pipeline
    object is reduced to what that class reads (the UNet, `force_zeros_for_empty_prompt`,
    the pipeline's `_get_add_time_ids`); prompts map to fixed random rows (77 × 2048
    hidden, 1280 pooled), as `sd15_model`'s."""
    hidden_width = int(config["cross_attention_dim"])
    pooled_width = int(config["projection_class_embeddings_input_dim"]) - 6 * int(config["addition_time_embed_dim"])

    class Sdxl(StableDiffusionXLModel):
        def __init__(self):
            self.path = pathlib.Path("sdxl-architecture-random")
            self.device, self.dtype = torch.device(device), dtype
            torch.manual_seed(0)
            with torch.device(device):
                unet = UNet2DConditionModel(**config)
            unet = unet.to(dtype).eval().requires_grad_(False)
            pipe = types.SimpleNamespace(unet=unet, vae=None, text_encoder_2=None,
                                         config={"force_zeros_for_empty_prompt": True})
            pipe._get_add_time_ids = functools.partial(StableDiffusionXLPipeline._get_add_time_ids, pipe)
            self.pipe, self.vae = pipe, None
            self.scheduler_config = dict(SDXL_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:  # the released VAE's: 8 pixels per cell, 2 halvings in the UNet
            return Geometry(latent_channels=4, vae_scale=8, size_multiple=32, native_size=8 * config["sample_size"])

        def _encode_texts(self, prompts):
            return [Conditioning(random_rows(p, (TEXT_TOKENS, hidden_width), self.device, dtype),
                                 random_rows(p + "\0pooled", (pooled_width,), self.device, dtype)) for p in prompts]

    return Sdxl()


def sdxl_request(k: int) -> dict:
    """Mixed micro-conditioning in one batch: original sizes, crops and targets per request;
    no negative prompt for every other one (zero rows: `force_zeros_for_empty_prompt`)."""
    sizes = ((1024, 1024), (768, 1344), (1344, 768), (2048, 2048))
    return dict(original_size=sizes[k % 4], crops_coords_top_left=((0, 0), (64, 32), (128, 0))[k % 3],
                target_size=sizes[(k + 1) % 4], negative_prompt=None if k % 2 else "", guidance=5.0 + k % 3)


def run(args) -> None:
    t0 = time.perf_counter()
    model = sdxl_model()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.denoiser.parameters())
    row("sdxl", "SDXL UNet2DConditionModel", "built (s)", time.perf_counter() - t0, "info",
        f"{params / 1e6:.0f} M parameters, fp16, random weights, 1024×1024 → 4×128×128")
    time_ids = torch.tensor([[1024, 1024, 0, 0, 1024, 1024], [768, 1344, 64, 32, 1024, 1024]],
                            dtype=torch.float32, device="cuda")
    finite_output_check("sdxl", model, "SDXL UNet", time_ids=time_ids)
    slots = 8 if args.quick else 16
    rows = 2 * slots  # guidance > 1: cond + uncond rows
    engine_vs_peak("sdxl", model, "SDXL UNet", slots, 2, 8 if args.quick else 16, params=sdxl_request,
                   guidance=5.0, peak_inputs=dict(time_ids=time_ids.repeat(slots, 1)[:rows]))
