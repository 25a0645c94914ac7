"""Part `flux`: a FLUX.1-dev-architecture FluxTransformer2DModel (random weights, real
widths and all 19 + 38 blocks, 4 + 8 with --quick, said in its rows; 1024×1024 → 16×128×128 unpacked latents,
4096 image + 512 text tokens, bf16) in the engine's own FluxModel (packing, position ids,
shift; embedded guidance differing per row): engine vs peak, as `unet`."""
from __future__ import annotations

import functools
import pathlib
import time
import types

import torch
from diffusers import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from engine.models.flux import FluxModel
from engine.models.geometry import Geometry
from engine.models.model import Conditioning

from .engine_runs import engine_vs_peak, finite_output_check
from .report import row
from .text_stand_in import random_rows


FLUX_TRANSFORMER_CONFIG = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json, written out (no hub)
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # 11,901,408,320 parameters, as the released transformer


FLUX_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json
    _class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
    base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
)


FLUX_TEXT_TOKENS = 512  # the pipeline's max_sequence_length

#: --quick: a fifth of the depth at the real widths (a block's cost and the engine's
#: overhead per call are what the ratio compares; building and running 57 blocks is not)
QUICK_BLOCKS = dict(num_layers=4, num_single_layers=8)


def flux_model(config: dict = FLUX_TRANSFORMER_CONFIG, device="cuda", dtype=torch.bfloat16, native_size: int = 1024):
    """The engine's own `FluxModel` on a random-weight transformer (its packing, position
    ids, timestep scaling, per-row embedded guidance and schedule shift are the class's).
    The pipeline object is reduced to what the class reads; prompts map to fixed random
    rows (512 × 4096 T5 hidden, 768 CLIP pooled)."""
    class Flux(FluxModel):
        def __init__(self):
            self.path = pathlib.Path("flux-architecture-random")
            self.device, self.dtype = torch.device(device), dtype
            torch.manual_seed(0)
            with torch.device(device):
                transformer = FluxTransformer2DModel(**config)
            transformer = transformer.to(dtype).eval().requires_grad_(False)
            self.pipe = types.SimpleNamespace(
                transformer=transformer, vae=None, text_encoder=None,
                scheduler=types.SimpleNamespace(config=dict(FLUX_SCHEDULER_CONFIG)),
                _pack_latents=FluxPipeline._pack_latents, _unpack_latents=FluxPipeline._unpack_latents,
                _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids)
            self.vae = None
            self.scheduler_config = dict(FLUX_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:  # the released VAE's: 16 channels, 8 pixels per cell; 2×2 packing
            return Geometry(latent_channels=16, vae_scale=8, size_multiple=16, native_size=native_size)

        def _encode_texts(self, prompts):
            return [Conditioning(random_rows(p, (FLUX_TEXT_TOKENS, config["joint_attention_dim"]), self.device, dtype),
                                 random_rows(p + "\0pooled", (config["pooled_projection_dim"],), self.device, dtype))
                    for p in prompts]

    return Flux()


def flux_config(quick: bool) -> dict:
    """The transformer's config: all blocks (about 24 GB in bf16), or `QUICK_BLOCKS`."""
    return dict(FLUX_TRANSFORMER_CONFIG, **(QUICK_BLOCKS if quick else {}))


def run(args) -> None:
    config = flux_config(args.quick)
    depth = f"{config['num_layers']}/19 double + {config['num_single_layers']}/38 single blocks"
    t0 = time.perf_counter()
    model = flux_model(config)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.denoiser.parameters())
    row("flux", "FLUX FluxTransformer2DModel", "built (s)", time.perf_counter() - t0, "info",
        f"{params / 1e6:.0f} M parameters ({depth}; real widths), bf16, random weights, "
        "1024×1024 → 16×128×128 (4096 tokens + 512 text)")
    finite_output_check("flux", model, "FLUX transformer", guidance=torch.tensor([3.5, 1.0], device="cuda"))
    slots = 4 if args.quick else 8
    guidance = torch.tensor([2.0 + 0.5 * k for k in range(slots)], device="cuda")
    engine_vs_peak("flux", model, "FLUX", slots, 1, 6 if args.quick else 12, sampler="flow_euler",
                   params=lambda k: dict(guidance=2.0 + 0.5 * k, negative_prompt=None),
                   peak_inputs=dict(guidance=guidance))
