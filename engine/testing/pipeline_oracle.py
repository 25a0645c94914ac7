"""The oracle for pipeline folders (DESIGN.md section 3): diffusers' own pipeline call,
its scheduler swapped for the sampler.

    pipe(prompt, negative_prompt=neg, num_inference_steps=steps, guidance_scale=g,
         height=h, width=w, generator=torch.Generator("cpu").manual_seed(seed),
         output_type="latent")          # = the engine's "latent" output
"""
from __future__ import annotations

import functools
import pathlib

import numpy as np
import torch

from engine.core.solvers import make_scheduler


@functools.lru_cache(maxsize=8)
def load_pipeline(folder: str):
    import diffusers

    from engine.models.loading import pipeline_class_of

    path = pathlib.Path(folder)
    kind = pipeline_class_of(path)
    index = __import__("json").loads((path / "model_index.json").read_text())
    absent = {k: None for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is None}
    pipe = getattr(diffusers, kind).from_pretrained(path, low_cpu_mem_usage=False, **absent)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def pipeline_output(folder, sampler: str, prompt: str, steps: int, guidance: float, seed: int, *,
                    negative_prompt: str = "", height: int | None = None, width: int | None = None,
                    output_type: str = "latent") -> np.ndarray:
    """The pipeline's result: latents C×h×w (float32) for "latent", H×W×3 in [0, 1] for "np"."""
    pipe = load_pipeline(str(folder))
    original = pipe.scheduler
    if sampler != "default":  # as the contract writes it: Cls.from_config(pipe.scheduler.config, ...)
        config = dict(original.config, _class_name=type(original).__name__)
        pipe.scheduler = make_scheduler(sampler, config)
    else:
        pipe.scheduler = type(original).from_config(original.config)  # fresh state
    try:
        out = pipe(prompt, negative_prompt=negative_prompt, num_inference_steps=steps, guidance_scale=guidance,
                   height=height, width=width, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type=output_type)
    finally:
        pipe.scheduler = original
    images = out.images
    if output_type == "latent":
        return images[0].float().cpu().numpy()
    return np.asarray(images[0], dtype=np.float32)
