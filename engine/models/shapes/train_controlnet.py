"""Train a silhouette ControlNet for the embedded `shapes` model:
`python -m engine.models.shapes.train_controlnet [--out DIR] [--minutes M | --steps N]`.

The control image is a shape's filled silhouette (white on black, 32×32); the model then
draws that shape there, in the prompt's colour. Training data are drawn as the `shapes`
model's own (`engine.models.shapes.draw`: one shape of random size and position on a grey
background), each with its silhouette. The ControlNet starts as diffusers'
`ControlNetModel.from_unet(unet)` (its conditioning embedding downsampling 32 → 8 as the
VAE does); the UNet, text encoder and VAE stay frozen; loss: the UNet's epsilon MSE with
the ControlNet's residuals added, the prompt dropped to "" with probability 0.1. AdamW,
warm-up and cosine decay; the EMA of the weights is saved (`save_pretrained`) as
`engine/models/shapes/controlnet/` by default: serve it with
`python -m engine serve --controlnet silhouette=engine/models/shapes/controlnet`.

`python bench/shapes_controlnet.py` measures it through the engine core.
"""
from __future__ import annotations

import argparse
import copy
import io
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "controlnet"


def draw_with_silhouettes(n: int, rng: np.random.Generator):
    """(uint8 images n×32×32×3, condition indices n, bool silhouettes n×32×32), as `draw` draws."""
    from engine.models.shapes.draw import _RGB, CONDITIONS, SHAPES, SIZE, shape_mask

    labels = rng.integers(0, len(CONDITIONS), size=n)
    images = np.empty((n, SIZE, SIZE, 3), dtype=np.float32)
    masks = np.empty((n, SIZE, SIZE), dtype=bool)
    for i, label in enumerate(labels):
        color, shape = divmod(int(label), len(SHAPES))
        s = rng.uniform(12, 22)
        cy, cx = rng.uniform(s / 2 + 1, SIZE - s / 2 - 1, size=2)
        img = np.full((SIZE, SIZE, 3), rng.uniform(0.3, 0.7), dtype=np.float32)
        masks[i] = shape_mask(SHAPES[shape], cy, cx, s)
        img[masks[i]] = _RGB[color]
        images[i] = img
    return (images * 255 + 0.5).astype(np.uint8), labels, masks


def silhouette_png(mask: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1)).save(buffer, format="PNG")
    return buffer.getvalue()


def train(out: pathlib.Path, steps: int | None, minutes: float | None, images: int, batch: int, lr: float,
          seed: int) -> int:
    from diffusers import ControlNetModel, DDPMScheduler, StableDiffusionPipeline

    from engine.models import SHAPES_DIR
    from engine.models.shapes.draw import NULL_CONDITION, PROMPTS
    from engine.models.shapes.train import MAX_LENGTH, SCHEDULER_CONFIG, encode, to_tensor

    torch.manual_seed(seed)
    pipe = StableDiffusionPipeline.from_pretrained(SHAPES_DIR)
    for module in (pipe.unet, pipe.text_encoder, pipe.vae):
        module.eval().requires_grad_(False)
    drawn, labels, masks = draw_with_silhouettes(images, np.random.default_rng(seed))
    latents = encode(pipe.vae, to_tensor(drawn), torch.Generator().manual_seed(seed + 1)) * pipe.vae.config.scaling_factor
    controls = torch.from_numpy(masks).float()[:, None].expand(-1, 3, -1, -1).contiguous()  # [0, 1], RGB
    labels = torch.from_numpy(labels).long()
    with torch.no_grad():
        ids = pipe.tokenizer(list(PROMPTS) + [NULL_CONDITION], padding="max_length", max_length=MAX_LENGTH,
                             truncation=True, return_tensors="pt").input_ids
        embeds = pipe.text_encoder(ids)[0]
    null = len(PROMPTS)
    halvings = len(pipe.vae.config.block_out_channels) - 1
    controlnet = ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=tuple(
        16 * 2 ** k for k in range(halvings + 1))).train()
    ema = copy.deepcopy(controlnet).eval().requires_grad_(False)
    noise_sched = DDPMScheduler(**{k: v for k, v in SCHEDULER_CONFIG.items() if k != "set_alpha_to_one"})
    opt = torch.optim.AdamW(controlnet.parameters(), lr=lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed + 2)
    total = steps or 10**9
    deadline = None if minutes is None else time.time() + 60 * minutes
    i, t0 = 0, time.time()
    while i < total:
        if steps is None and i == 20:
            per_step = (time.time() - t0) / 20
            total = max(i + 1, int(i + (deadline - time.time()) / per_step))
            print(f"{per_step:.2f} s/step: {total} steps", flush=True)
        scale = min(1.0, (i + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(1.0, i / total)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        x0, y, cond = latents[idx], labels[idx].clone(), controls[idx]
        y[torch.rand(batch, generator=gen) < 0.1] = null
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), generator=gen)
        noisy = noise_sched.add_noise(x0, noise, t)
        down, mid = controlnet(noisy, t, encoder_hidden_states=embeds[y], controlnet_cond=cond, return_dict=False)
        pred = pipe.unet(noisy, t, encoder_hidden_states=embeds[y], down_block_additional_residuals=down,
                         mid_block_additional_residual=mid).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        decay = min(0.999, (1 + i) / (10 + i))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), controlnet.parameters()):
                pe.lerp_(p, 1 - decay)
        i += 1
        if i % 100 == 0:
            print(f"step {i}/{total} loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
        if i % 500 == 0 or i == total:
            ema.save_pretrained(out, safe_serialization=True)
    ema.save_pretrained(out, safe_serialization=True)
    return i


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int)
    length.add_argument("--minutes", type=float)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.steps is None and args.minutes is None:
        args.steps = 3000
    started = time.time()
    done = train(args.out, args.steps, args.minutes, args.images, args.batch, args.lr, args.seed)
    print(f"trained {done} steps in {time.time() - started:.0f} s -> {args.out}; measure it with "
          f"`python bench/shapes_controlnet.py --controlnet {args.out}`")


if __name__ == "__main__":
    main()
