"""Sample the `shapes` model the plain diffusers way and save a grid:
`python -m engine.models.shapes.sample -o shapes_grid.png`.

One batched loop with diffusers' own DPMSolverMultistepScheduler and classifier-free
guidance, as a pipeline call does; used by the model's quality test and to look at it.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch
from PIL import Image

from engine.model import LoadedModel, load_model
from engine.solvers import make_scheduler


@torch.no_grad()
def sample(model: LoadedModel, labels: list[int], steps: int = 20, guidance: float = 3.0, seed: int = 0,
           sampler: str = "dpmpp_2m") -> np.ndarray:
    """uint8 images (len(labels) × H × W × 3) for condition indices `labels`."""
    sched = make_scheduler(sampler, model.scheduler_config)
    sched.set_timesteps(steps)
    gen = torch.Generator("cpu").manual_seed(seed)
    n = len(labels)
    size = model.native_size
    x = torch.randn((n, *model.latent_shape(size, size)), generator=gen) * sched.init_noise_sigma
    classes = torch.tensor(list(labels) + [model.null_index] * n)
    for t in sched.timesteps:
        x_in = sched.scale_model_input(torch.cat([x, x]), t)
        cond, uncond = model.denoise(x_in, t, classes).chunk(2)
        x = sched.step(uncond + guidance * (cond - uncond), t, x, generator=gen).prev_sample
    return model.decode(x)


def grid(images: np.ndarray, columns: int) -> np.ndarray:
    n, h, w, c = images.shape
    rows = -(-n // columns)
    out = np.full((rows * (h + 2) + 2, columns * (w + 2) + 2, c), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, k = divmod(i, columns)
        out[2 + r * (h + 2):2 + r * (h + 2) + h, 2 + k * (w + 2):2 + k * (w + 2) + w] = img
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=pathlib.Path, default=pathlib.Path("shapes_grid.png"))
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--per-condition", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = load_model(args.model)
    conditions = model.conditions[:-1]
    labels = [i for i in range(len(conditions)) for _ in range(args.per_condition)]
    images = sample(model, labels, args.steps, args.guidance, args.seed)
    big = grid(images, args.per_condition * 4)
    Image.fromarray(big).resize((big.shape[1] * 3, big.shape[0] * 3), Image.NEAREST).save(args.output)
    print(f"{len(images)} samples ({args.per_condition} per condition, rows of 4 conditions) -> {args.output}")


if __name__ == "__main__":
    main()
