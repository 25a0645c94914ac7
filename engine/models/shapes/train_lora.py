"""Train a LoRA adapter for the embedded `shapes` model that draws its shapes in another
style: `python -m engine.models.shapes.train_lora --style big [--out DIR] [--minutes M]`.

The recipe is diffusers' own LoRA fine-tuning, made small: the base pipeline is frozen,
PEFT adds low-rank factors (`LoraConfig`, `unet.add_adapter`) to the UNet's attention
projections and its resnets' convolutions, and only those are trained, on the usual noise
prediction loss, with images of the style drawn by `engine.models.shapes.draw`. The
adapter is written by `StableDiffusionPipeline.save_lora_weights` into `DIR/NAME/`
(`pytorch_lora_weights.safetensors`), the layout `--lora-dir` serves, and which
`pipe.load_lora_weights(DIR/NAME)` loads in diffusers alone.

Styles (the model's 8-word vocabulary has no trigger word: the adapter restyles every
prompt; the colour and the kind of shape stay the prompt's):

- `big`: the shape fills the frame (size 26-29 pixels of 32, centred);
- `small`: a small shape (size 8-10) anywhere in the frame.

`shape_area` is the pixel statistic that tells the styles apart: the fraction of the
image the shape covers (saturated pixels, as the classifier reads them); `--measure`
prints it for samples of every prompt without and with the adapter.
"""
from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.shapes.draw import _RGB, CONDITIONS, NULL_CONDITION, PROMPTS, SHAPES, SIZE, shape_mask

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "loras"
#: style name -> (size range, centred)
STYLES = {"big": ((26.0, 29.0), True), "small": ((8.0, 10.0), False)}
#: the UNet modules the adapter trains: attention projections and the resnets' 3×3 convolutions
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv2"]
SATURATION = 0.4  # as engine.models.shapes.classify: channel spread above which a pixel is shape


def draw_style(style: str, n: int, rng: np.random.Generator, labels: np.ndarray | None = None):
    """`n` images of `style` as `draw.draw` draws the base model's (uint8 n×32×32×3, condition indices)."""
    (low, high), centred = STYLES[style]
    if labels is None:
        labels = rng.integers(0, len(CONDITIONS), size=n)
    images = np.empty((n, SIZE, SIZE, 3), dtype=np.float32)
    for i, label in enumerate(labels):
        color, shape = divmod(int(label), len(SHAPES))
        s = rng.uniform(low, high)
        cy, cx = (SIZE / 2, SIZE / 2) if centred else rng.uniform(s / 2 + 1, SIZE - s / 2 - 1, size=2)
        img = np.full((SIZE, SIZE, 3), rng.uniform(0.3, 0.7), dtype=np.float32)
        img[shape_mask(SHAPES[shape], cy, cx, s)] = _RGB[color]
        images[i] = img
    return (images * 255 + 0.5).astype(np.uint8), np.asarray(labels)


def shape_area(images: np.ndarray) -> np.ndarray:
    """The fraction of each uint8 H×W×3 image its shape covers (saturated pixels)."""
    img = np.asarray(images, dtype=np.float32) / 255.0
    return ((img.max(axis=-1) - img.min(axis=-1)) > SATURATION).mean(axis=(-1, -2))


def train(style: str, out: pathlib.Path, minutes: float, rank: int = 8, batch: int = 64, lr: float = 1e-3,
          images: int = 8192, seed: int = 0) -> dict:
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from engine.models import resolve

    torch.manual_seed(seed)
    pipe = StableDiffusionPipeline.from_pretrained(resolve("shapes"), safety_checker=None)
    unet, vae = pipe.unet, pipe.vae
    for module in (unet, vae, pipe.text_encoder):
        module.requires_grad_(False).eval()
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=TARGETS))
    unet.train()
    trained = [p for p in unet.parameters() if p.requires_grad]
    rng = np.random.default_rng(seed)
    pixels, labels = draw_style(style, images, rng)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        latents = torch.cat([vae.encode(x[i:i + 512]).latent_dist.sample(gen) for i in range(0, len(x), 512)])
        latents = latents * vae.config.scaling_factor
        prompt_ids = pipe.tokenizer(list(PROMPTS) + [NULL_CONDITION], padding="max_length",
                                    max_length=pipe.tokenizer.model_max_length, truncation=True,
                                    return_tensors="pt").input_ids
        embeds = pipe.text_encoder(prompt_ids)[0]
    labels = torch.from_numpy(labels).long()
    noise_sched = pipe.scheduler  # DDIM shares DDPM's `add_noise` and training schedule
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    deadline, start, step, losses = time.time() + 60 * minutes, time.time(), 0, []
    while time.time() < deadline:
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        x0, y = latents[idx], labels[idx].clone()
        y[torch.rand(batch, generator=gen) < 0.1] = len(PROMPTS)  # prompt dropout: guidance still works
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), generator=gen)
        pred = unet(noise_sched.add_noise(x0, noise, t), t, encoder_hidden_states=embeds[y]).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"{style}: step {step}, loss {np.mean(losses[-50:]):.4f}, {time.time() - start:.0f}s", flush=True)
    StableDiffusionPipeline.save_lora_weights(out / style, unet_lora_layers=get_peft_model_state_dict(unet),
                                              safe_serialization=True)
    return {"style": style, "steps": step, "seconds": time.time() - start, "loss": float(np.mean(losses[-50:]))}


@torch.no_grad()
def measure(style: str, folder: pathlib.Path = DEFAULT_OUT, per_prompt: int = 2, seed: int = 100,
            scale: float = 1.0, prompts: tuple[str, ...] = PROMPTS) -> dict:
    """The adapter's effect in diffusers alone: the mean `shape_area` of `per_prompt` samples
    of every prompt (of `prompts`) (DPM-Solver++ 20 steps, guidance 3) without and with the adapter at
    `scale`, and how many the shapes classifier reads as their prompt in each case."""
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    from engine.models import resolve
    from engine.models.shapes.classify import classify

    pipe = StableDiffusionPipeline.from_pretrained(resolve("shapes"), safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    prompts = [p for p in prompts for _ in range(per_prompt)]
    seeds = [seed + i for i in range(len(prompts))]

    def sample() -> np.ndarray:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        images = pipe(prompts, num_inference_steps=20, guidance_scale=3.0, generator=generators,
                      output_type="np").images
        return (images * 255 + 0.5).astype(np.uint8)

    base = sample()
    pipe.load_lora_weights(folder / style, adapter_name=style)
    pipe.set_adapters([style], [scale])
    styled = sample()
    wanted = [p.removeprefix("a ") for p in prompts]
    return {"style": style, "samples": len(prompts), "area_base": float(shape_area(base).mean()),
            "area_lora": float(shape_area(styled).mean()),
            "read_base": sum(a == b for a, b in zip(classify(base), wanted)),
            "read_lora": sum(a == b for a, b in zip(classify(styled), wanted))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--style", choices=sorted(STYLES), required=True)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="the adapter goes to OUT/STYLE/")
    ap.add_argument("--minutes", type=float, default=5.0, help="train for this long")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measure", action="store_true",
                    help="measure the adapter in OUT/STYLE (shape area and classifier reads) instead of training")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure:
        print(measure(args.style, args.out))
    else:
        print(train(args.style, args.out, args.minutes, rank=args.rank, seed=args.seed))


if __name__ == "__main__":
    main()
