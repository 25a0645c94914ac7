"""The oracle for pipeline folders (DESIGN.md, "Reference semantics"): diffusers' own
pipeline call, its scheduler swapped for the sampler.

    pipe(prompt, negative_prompt=neg, num_inference_steps=steps, guidance_scale=g,
         height=h, width=w, generator=torch.Generator("cpu").manual_seed(seed),
         output_type="latent")          # = the engine's "latent" output

with what each pipeline adds: SDXL's micro-conditioning (`original_size`,
`crops_coords_top_left`, `target_size`), FLUX's `true_cfg_scale`. A negative prompt of
None is "not given", which SDXL (`force_zeros_for_empty_prompt`) and FLUX (no true CFG)
tell apart from ""; SD and SD3 treat both as "". FLUX's `output_type="latent"` is packed
tokens: it comes back unpacked as the pipeline's own decode path unpacks it, C×h×w.

With an `image` (and a `mask`) the oracle is the folder's image pipeline on the same
components (`AutoPipelineForImage2Image` / `AutoPipelineForInpainting.from_pipe`: SD's
and SDXL's img2img and inpainting, SD3's and FLUX's img2img), called with the image,
mask and `strength` as PIL images. SD's and SDXL's img2img pipelines take no height or
width (the image's size is the output size): the oracle passes them only to pipelines
that take them.
"""
from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import torch


@functools.lru_cache(maxsize=8)
def load_pipeline(folder: str):
    import diffusers

    from engine.models.geometry import pipeline_class_of

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


def image_pipeline(pipe, masked: bool):
    """The folder's img2img (or inpainting) pipeline, sharing the text-to-image pipeline's components."""
    import diffusers

    auto = diffusers.AutoPipelineForInpainting if masked else diffusers.AutoPipelineForImage2Image
    image_pipe = auto.from_pipe(pipe)
    image_pipe.set_progress_bar_config(disable=True)
    return image_pipe


def _image_arguments(pipe, image, mask, strength, height, width) -> dict:
    """The image pipeline's own arguments; height and width only where it takes them."""
    import inspect

    accepted = inspect.signature(type(pipe).__call__).parameters
    extra = {"image": image}
    if mask is not None:
        extra["mask_image"] = mask
    if strength is not None:
        extra["strength"] = strength
    for name, value in (("height", height), ("width", width)):
        if name in accepted:
            extra[name] = value
        elif value is not None:
            raise ValueError(f"{type(pipe).__name__} takes no {name}: the image's size is the output size")
    return extra


def oracle_scheduler(sampler: str, original):
    """The scheduler the oracle runs for `sampler`, built here from diffusers' own classes
    the way diffusers' documentation swaps a pipeline's scheduler
    (`Class.from_config(pipe.scheduler.config, ...)`), sharing nothing with the engine's
    construction (engine.core.solvers.make_scheduler), so a break there shows. `default`:
    a fresh copy of the pipeline's own scheduler."""
    import diffusers

    config = original.config
    flow = "FlowMatch" in type(original).__name__
    if sampler == "default":
        return type(original).from_config(config)
    if sampler == "flow_euler":
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    if sampler == "euler":
        return diffusers.EulerDiscreteScheduler.from_config(config)
    if sampler == "euler_ancestral":
        return diffusers.EulerAncestralDiscreteScheduler.from_config(config)
    if sampler == "ddim":
        return diffusers.DDIMScheduler.from_config(config)
    if sampler == "dpmpp_2m":  # DPM-Solver++(2M), as diffusers' docs name it
        extra = dict(use_flow_sigmas=True, flow_shift=config.get("shift", 1.0),
                     prediction_type="flow_prediction") if flow else {}
        return diffusers.DPMSolverMultistepScheduler.from_config(config, algorithm_type="dpmsolver++",
                                                                 solver_order=2, **extra)
    raise ValueError(f"the oracle knows no sampler {sampler!r}")


@torch.no_grad()
def pipeline_output(folder, sampler: str, prompt: str, steps: int, guidance: float, seed: int, *,
                    negative_prompt: str | None = None, height: int | None = None, width: int | None = None,
                    output_type: str = "latent", true_cfg: float = 1.0, original_size=None,
                    crops_coords_top_left=None, target_size=None, image=None, mask=None,
                    strength: float | None = None) -> np.ndarray:
    """The pipeline's result: latents C×h×w (float32) for "latent", H×W×3 in [0, 1] for "np".
    `image`, `mask`: PIL images (img2img, inpainting), with `strength` (None: the
    pipeline's default)."""
    text_pipe = load_pipeline(str(folder))
    pipe = text_pipe if image is None else image_pipeline(text_pipe, mask is not None)
    extra = _extra_arguments(pipe, true_cfg, original_size, crops_coords_top_left, target_size)
    if image is not None:
        extra.update(_image_arguments(pipe, image, mask, strength, height, width))
        size = {}
    else:
        size = dict(height=height, width=width)
    original = pipe.scheduler
    pipe.scheduler = oracle_scheduler(sampler, original)
    try:
        out = pipe(prompt, negative_prompt=negative_prompt, num_inference_steps=steps, guidance_scale=guidance,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **size, **extra)
    finally:
        pipe.scheduler = original
    images = out.images
    if output_type == "latent":
        if type(pipe).__name__.startswith("Flux"):  # packed tokens → C×h×w, as its decode path unpacks
            native = pipe.default_sample_size * pipe.vae_scale_factor
            images = pipe._unpack_latents(images, height or native, width or native, pipe.vae_scale_factor)
        return images[0].float().cpu().numpy()
    return np.asarray(images[0], dtype=np.float32)


def pipeline_output_of(folder, params, output_type: str = "latent") -> np.ndarray:
    """`pipeline_output` for the request `params` (a `GenerateParams`), field by field;
    its `image` and `mask` bytes decoded as PIL images."""
    image, mask = (None if data is None else _pil(data) for data in (params.image, params.mask))
    return pipeline_output(folder, params.sampler, params.prompt, params.steps, params.guidance, params.seed,
                           negative_prompt=params.negative_prompt, height=params.height, width=params.width,
                           output_type=output_type, true_cfg=params.true_cfg, original_size=params.original_size,
                           crops_coords_top_left=params.crops_coords_top_left, target_size=params.target_size,
                           image=None if image is None else image.convert("RGB"), mask=mask, strength=params.strength)


def _pil(data: bytes):
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


_MODELS: dict = {}


def model_of(folder):
    """The engine's model of a test folder, loaded once per process (tests share it)."""
    from engine.models.loading import load_model

    if folder not in _MODELS:
        _MODELS[folder] = load_model(folder)
    return _MODELS[folder]


def rel_l2(a, b) -> float:
    """Relative L2 error of `a` against `b`, in float64."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
