"""Train the embedded `shapes` model: `python -m engine.models.shapes.train [--out DIR]`.

Two stages, seeded and reproducible on a given machine and thread count:
1. an `AutoencoderKL` (32×32×3 → 8×8×4), MSE reconstruction (an L1 loss tends to wash
   the colours out) plus a small KL term;
2. a class-conditional `UNet2DModel` (epsilon prediction) on latents times the VAE's
   `scaling_factor`, as diffusers pipelines do, with label dropout to the null class so
   classifier-free guidance works; an EMA of its weights is what gets saved.
Writes a diffusers folder: `vae/`, `unet/`, `scheduler/`, `conditions.json`.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DModel
from tqdm import tqdm

from engine.models import SHAPES_DIR
from engine.models.shapes.draw import CONDITIONS, NULL_CONDITION, draw

SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
    timestep_spacing="trailing",  # a 1- or 2-step schedule still starts from pure noise
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=0,
)


def make_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64), layers_per_block=1, norm_num_groups=16,
        mid_block_add_attention=False,
    )


def make_unet() -> UNet2DModel:
    return UNet2DModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(64, 128), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=32,
        norm_num_groups=32, num_class_embeds=len(CONDITIONS) + 1,
    )


def to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_vae(images: torch.Tensor, steps: int, batch: int) -> AutoencoderKL:
    vae = make_vae()
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in (bar := tqdm(range(steps), desc="vae", mininterval=5)):
        x = images[torch.randint(0, len(images), (batch,), generator=gen)]
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.sample(gen)).sample
        loss = F.mse_loss(rec, x) + 1e-6 * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    return vae.eval()


@torch.no_grad()
def encode(vae: AutoencoderKL, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.cat([vae.encode(images[i:i + 512]).latent_dist.sample(gen) for i in range(0, len(images), 512)])


def train_unet(latents: torch.Tensor, labels: torch.Tensor, steps: int, batch: int,
               start: UNet2DModel | None = None, lr: float = 1e-3) -> UNet2DModel:
    unet = start.train().requires_grad_(True) if start is not None else make_unet()
    ema = copy.deepcopy(unet).requires_grad_(False)
    noise_sched = DDPMScheduler(**{k: v for k, v in SCHEDULER_CONFIG.items() if k != "set_alpha_to_one"})
    opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(2 if start is None else 4)
    null = len(CONDITIONS)
    for i in (bar := tqdm(range(steps), desc="unet", mininterval=5)):
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        x0, y = latents[idx], labels[idx].clone()
        y[torch.rand(batch, generator=gen) < 0.15] = null  # label dropout for guidance
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), generator=gen)
        pred = unet(noise_sched.add_noise(x0, noise, t), t, class_labels=y).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        decay = min(0.999, (1 + i) / (10 + i))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), unet.parameters()):
                pe.lerp_(p, 1 - decay)
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    return ema.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=SHAPES_DIR)
    ap.add_argument("--images", type=int, default=30000)
    ap.add_argument("--vae-steps", type=int, default=1000)
    ap.add_argument("--unet-steps", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-from", type=pathlib.Path, help="skip stage 1: load this trained VAE folder")
    ap.add_argument("--unet-from", type=pathlib.Path, help="continue stage 2 from this UNet folder")
    ap.add_argument("--unet-lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    images, labels = draw(args.images, np.random.default_rng(args.seed))
    images = to_tensor(images)
    if args.vae_from:
        vae = AutoencoderKL.from_pretrained(args.vae_from).eval()
    else:
        vae = train_vae(images, args.vae_steps, batch=32)
        vae.save_pretrained(args.out / "vae")  # kept even if the second stage is stopped
    latents = encode(vae, images, torch.Generator().manual_seed(3))
    vae.register_to_config(scaling_factor=float(1.0 / latents.std()))
    latents = latents * vae.config.scaling_factor
    start_unet = UNet2DModel.from_pretrained(args.unet_from) if args.unet_from else None
    unet = train_unet(latents, torch.from_numpy(labels).long(), args.unet_steps, batch=64,
                      start=start_unet, lr=args.unet_lr)
    vae.save_pretrained(args.out / "vae")
    unet.save_pretrained(args.out / "unet")
    DDIMScheduler(**SCHEDULER_CONFIG).save_pretrained(args.out / "scheduler")
    (args.out / "conditions.json").write_text(json.dumps(list(CONDITIONS) + [NULL_CONDITION], indent=1) + "\n")
    print(f"trained in {time.time() - start:.0f}s, scaling_factor={vae.config.scaling_factor:.4f} -> {args.out}")


if __name__ == "__main__":
    main()
