"""The oracle for pipeline folders (DESIGN.md section 3): diffusers' own pipeline call,
its scheduler swapped for the sampler.

    pipe(prompt, negative_prompt=neg, num_inference_steps=steps, guidance_scale=g,
         height=h, width=w, generator=torch.Generator("cpu").manual_seed(seed),
         output_type="latent")          # = the engine's "latent" output

with what each pipeline adds: SDXL's micro-conditioning (`original_size`,
`crops_coords_top_left`, `target_size`), FLUX's `true_cfg_scale`. A negative prompt of
None is "not given", which SDXL (`force_zeros_for_empty_prompt`) and FLUX (no true CFG)
tell apart from ""; SD and SD3 treat both as "". FLUX's `output_type="latent"` is packed
tokens: it comes back unpacked as the pipeline's own decode path unpacks it, C×h×w.
"""
from __future__ import annotations

import functools
import json
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
    index = json.loads((path / "model_index.json").read_text())
    absent = {k: None for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is None}
    pipe = getattr(diffusers, kind).from_pretrained(path, low_cpu_mem_usage=False, **absent)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _extra_arguments(pipe, true_cfg: float, original_size, crops_coords_top_left, target_size) -> dict:
    """The call's pipeline-specific arguments, passed only where the pipeline takes them
    (a default value elsewhere; anything else is an error, not silently dropped)."""
    kind = type(pipe).__name__
    extra = {}
    if kind.startswith("Flux"):
        extra["true_cfg_scale"] = true_cfg
    elif true_cfg != 1.0:
        raise ValueError(f"{kind} has no true_cfg_scale")
    micro = dict(original_size=original_size, crops_coords_top_left=crops_coords_top_left, target_size=target_size)
    given = {name: tuple(value) for name, value in micro.items() if value is not None}
    if kind.startswith("StableDiffusionXL"):
        extra.update(given)
    elif given:
        raise ValueError(f"{kind} takes no micro-conditioning ({', '.join(given)})")
    return extra


@torch.no_grad()
def pipeline_output(folder, sampler: str, prompt: str, steps: int, guidance: float, seed: int, *,
                    negative_prompt: str | None = None, height: int | None = None, width: int | None = None,
                    output_type: str = "latent", true_cfg: float = 1.0, original_size=None,
                    crops_coords_top_left=None, target_size=None) -> np.ndarray:
    """The pipeline's result: latents C×h×w (float32) for "latent", H×W×3 in [0, 1] for "np"."""
    pipe = load_pipeline(str(folder))
    extra = _extra_arguments(pipe, true_cfg, original_size, crops_coords_top_left, target_size)
    original = pipe.scheduler
    if sampler != "default":  # as the contract writes it: Cls.from_config(pipe.scheduler.config, ...)
        config = dict(original.config, _class_name=type(original).__name__)
        pipe.scheduler = make_scheduler(sampler, config)
    else:
        pipe.scheduler = type(original).from_config(original.config)  # fresh state
    try:
        out = pipe(prompt, negative_prompt=negative_prompt, num_inference_steps=steps, guidance_scale=guidance,
                   height=height, width=width, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type=output_type, **extra)
    finally:
        pipe.scheduler = original
    images = out.images
    if output_type == "latent":
        if type(pipe).__name__.startswith("Flux"):  # packed tokens → C×h×w, as its decode path unpacks
            size = pipe.default_sample_size * pipe.vae_scale_factor
            images = pipe._unpack_latents(images, height or size, width or size, pipe.vae_scale_factor)
        return images[0].float().cpu().numpy()
    return np.asarray(images[0], dtype=np.float32)


def pipeline_output_of(folder, params, output_type: str = "latent") -> np.ndarray:
    """`pipeline_output` for the request `params` (a `GenerateParams`), field by field."""
    return pipeline_output(folder, params.sampler, params.prompt, params.steps, params.guidance, params.seed,
                           negative_prompt=params.negative_prompt, height=params.height, width=params.width,
                           output_type=output_type, true_cfg=params.true_cfg, original_size=params.original_size,
                           crops_coords_top_left=params.crops_coords_top_left, target_size=params.target_size)
