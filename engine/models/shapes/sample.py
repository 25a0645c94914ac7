"""Sample an embedded model with diffusers alone and save a labelled grid:
`python -m engine.models.shapes.sample -o shapes_grid.png [--model shapes | shapes-dit | DIR]`.

`shapes` (a `StableDiffusionPipeline` folder): `StableDiffusionPipeline.from_pretrained`
with diffusers' DPMSolverMultistepScheduler swapped in (the folder's own DDIM with
`--scheduler ddim`), classifier-free guidance. `shapes-dit` (a `FluxPipeline` folder):
`FluxPipeline.from_pretrained` with its own flow-matching Euler scheduler, at 32×32 (the
pipeline's own default size is 512×512 for this VAE), no guidance of any kind. Every
prompt in one batched pipeline call. Used by the models' quality tests and to look at
them: each image is captioned with its prompt and, where the classifier reads it
otherwise, with what it reads.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    FluxPipeline,
    StableDiffusionPipeline,
)
from PIL import Image, ImageDraw, ImageFont

from engine.models.shapes.classify import classify
from engine.models import SHAPES_DIR, resolve
from engine.models.geometry import pipeline_class_of
from engine.models.shapes.draw import PROMPTS, SIZE


def prompt_condition(prompt: str) -> str:
    """"a red circle" -> "red circle", the classifier's reading of a right sample."""
    return prompt.removeprefix("a ")


def load_pipeline(folder: str | pathlib.Path = SHAPES_DIR, scheduler: str = "dpm"):
    """The folder's pipeline (a model name or a path). `scheduler` applies to
    StableDiffusionPipeline folders; a FluxPipeline keeps its own."""
    folder = resolve(folder)
    if pipeline_class_of(folder) == "FluxPipeline":
        pipe = FluxPipeline.from_pretrained(str(folder))
        pipe.set_progress_bar_config(disable=True)
        return pipe
    pipe = StableDiffusionPipeline.from_pretrained(str(folder))
    if scheduler == "dpm":
        pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    elif scheduler == "ddim":
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    else:
        raise ValueError(f"unknown scheduler {scheduler!r}")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def sample(pipe, prompts: list[str], steps: int = 20, guidance: float = 3.0, seed: int = 0) -> np.ndarray:
    """uint8 images (len(prompts) × H × W × 3), all prompts in one pipeline call. A
    FluxPipeline is asked for the trained size, 32×32 (`guidance` is then the schnell-like
    transformer's ignored `guidance_scale`)."""
    size = dict(height=SIZE, width=SIZE) if isinstance(pipe, FluxPipeline) else {}
    out = pipe(prompt=list(prompts), num_inference_steps=steps, guidance_scale=guidance,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **size)
    return (np.clip(out.images, 0, 1) * 255 + 0.5).astype(np.uint8)


def labelled_grid(images: np.ndarray, captions: list[list[str]], columns: int, scale: int = 4) -> Image.Image:
    """Images `scale`× enlarged in rows of `columns`, each with its caption lines under it."""
    font = ImageFont.load_default()
    h, w = images.shape[1] * scale, images.shape[2] * scale
    line = 11
    cell_w, cell_h = max(w, 112) + 6, h + 2 * line + 8
    rows = -(-len(images) // columns)
    canvas = Image.new("RGB", (columns * cell_w + 4, rows * cell_h + 4), "white")
    ink = ImageDraw.Draw(canvas)
    for i, (img, lines) in enumerate(zip(images, captions)):
        r, k = divmod(i, columns)
        x, y = 4 + k * cell_w, 4 + r * cell_h
        canvas.paste(Image.fromarray(img).resize((w, h), Image.NEAREST), (x + (cell_w - 6 - w) // 2, y))
        for j, text in enumerate(lines):
            ink.text((x, y + h + 2 + j * line), text, fill="black" if j == 0 else "red", font=font)
    return canvas


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=pathlib.Path, default=pathlib.Path("shapes_grid.png"))
    ap.add_argument("--model", default="shapes", help="shapes, shapes-dit or a pipeline folder")
    ap.add_argument("--per-prompt", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheduler", choices=("dpm", "ddim"), default="dpm",
                    help="for a StableDiffusionPipeline (FLUX keeps its own flow-matching Euler)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, args.scheduler)
    prompts = [p for p in PROMPTS for _ in range(args.per_prompt)]
    images = sample(pipe, prompts, args.steps, args.guidance, args.seed)
    readings = classify(images)
    captions = [[p] + ([f"read: {r}"] if r != prompt_condition(p) else [])
                for p, r in zip(prompts, readings)]
    labelled_grid(images, captions, args.per_prompt * 4).save(args.output)
    right = sum(r == prompt_condition(p) for p, r in zip(prompts, readings))
    print(f"{len(images)} samples ({args.per_prompt} per prompt, rows of 4 prompts), "
          f"{right}/{len(images)} read as their prompt -> {args.output}")


if __name__ == "__main__":
    main()
