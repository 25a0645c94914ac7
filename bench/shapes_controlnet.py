"""The shipped silhouette ControlNet of `shapes`, measured through the engine core:

    python bench/shapes_controlnet.py [--controlnet DIR] [--seeds 24] [--steps 20] [--scale 1.0]

`--seeds` requests (a random shape, colour, place and size each, drawn as the model's
training images are; its silhouette as the control at `--scale`, 0 for the model alone;
DDIM `--steps`, guidance 3) through `EngineCore`; per the `shapes` classifier's reading,
the share drawn in the prompt's colour, and the IoU of the drawn shape's mask with the
silhouette (mean and lowest).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch

from engine.core import CoreConfig, EngineCore
from engine.core.outputs import DenoiseFinished
from engine.models.controlnet import attach_controlnets
from engine.models.loading import load_model
from engine.models.shapes.classify import SATURATION, explain
from engine.models.shapes.draw import CONDITIONS
from engine.models.shapes.train_controlnet import DEFAULT_OUT, draw_with_silhouettes, silhouette_png
from engine.protocol import Control, GenerateParams


@torch.no_grad()
def evaluate(folder: pathlib.Path = DEFAULT_OUT, seeds: int = 24, steps: int = 20, scale: float = 1.0) -> dict:
    model = load_model("shapes")
    attach_controlnets(model, {"silhouette": folder})
    _, labels, masks = draw_with_silhouettes(seeds, np.random.default_rng(12345))
    core = EngineCore(model, CoreConfig(slots=8, max_queue=seeds + 1))
    for k, (label, mask) in enumerate(zip(labels, masks)):
        core.add_request(f"r{k}", GenerateParams(
            prompt=f"a {CONDITIONS[int(label)]}", steps=steps, guidance=3.0, seed=k, output="uint8",
            negative_prompt="", controls=(Control("silhouette", silhouette_png(mask), scale=scale),)))
    latents = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if isinstance(out, DenoiseFinished):
                latents[out.request_id] = out.latents.clone()
                core.decode_done(out.request_id)
    colours, ious = [], []
    for k, (label, mask) in enumerate(zip(labels, masks)):
        image = np.asarray(model.decode(latents[f"r{k}"][None]))[0]
        colour, _, _ = explain(image)
        drawn = (image.astype(np.float32) / 255).max(-1) - (image.astype(np.float32) / 255).min(-1) > SATURATION
        colours.append(colour == CONDITIONS[int(label)].split()[0])
        ious.append(float((drawn & mask).sum() / max(1, (drawn | mask).sum())))
    return {"colour_right": float(np.mean(colours)), "iou_mean": float(np.mean(ious)),
            "iou_min": float(np.min(ious)), "seeds": seeds}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--controlnet", type=pathlib.Path, default=DEFAULT_OUT)
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(evaluate(args.controlnet, args.seeds, args.steps, args.scale)))


if __name__ == "__main__":
    main()
