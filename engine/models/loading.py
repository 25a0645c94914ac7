"""Loading a model folder as diffusers saves it (or a single checkpoint file, or a hub id
found in the local cache) as the `DiffusionModel` of its layout.

Layouts (`model_index.json` names the pipeline):

- `StableDiffusionPipeline` (SD 1.x/2.x) and `StableDiffusion3Pipeline`
  (`engine.models.stable_diffusion`);
- `StableDiffusionXLPipeline` (`engine.models.sdxl`): two CLIP encoders, pooled
  embeddings, per-request micro-conditioning time ids;
- `FluxPipeline` (`engine.models.flux`): CLIP pooled + T5, `FluxTransformer2DModel` on
  2×2-packed latents, embedded guidance (dev), resolution-dependent timestep shift;
- the Qwen-Image pipelines (`engine.models.qwen_image`);
- the class-conditional layout (no `model_index.json`; `engine.models.stable_diffusion`).

Components come from diffusers' and transformers' own classes via the pipeline's
`from_pretrained`; what a folder holds is read first (`engine.models.folders`), so a
failed load names the component that failed.
"""
from __future__ import annotations

import importlib
import json
import pathlib

import torch

from engine.models import ModelLoadError, is_single_file, one_line, resolve
from engine.models.folders import (DTYPE_KEYWORD, check_pipeline_folder, decode_folder_of, folder_variant,
                                   locate_failure, quiet_loading, single_file_pipeline)
from engine.models.geometry import pipeline_class_of
from engine.models.model import DiffusionModel
from engine.models.stable_diffusion import ClassConditionalModel, StableDiffusion3Model, StableDiffusionModel

_PIPELINES = {
    "StableDiffusionPipeline": StableDiffusionModel,
    "StableDiffusion3Pipeline": StableDiffusion3Model,
    # in their own modules, which subclass the classes above: imported on first use
    "StableDiffusionXLPipeline": "engine.models.sdxl:StableDiffusionXLModel",
    "FluxPipeline": "engine.models.flux:FluxModel",
    "QwenImagePipeline": "engine.models.qwen_image:QwenImageModel",
    "QwenImageImg2ImgPipeline": "engine.models.qwen_image:QwenImageModel",
    "QwenImageInpaintPipeline": "engine.models.qwen_image:QwenImageModel",
    "QwenImageEditPipeline": "engine.models.qwen_image:QwenImageEditModel",
    "QwenImageEditPlusPipeline": "engine.models.qwen_image:QwenImageEditPlusModel",
}


def model_class_of(kind: str) -> type[DiffusionModel] | None:
    """The model class serving a pipeline class name, or None."""
    entry = _PIPELINES.get(kind)
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(importlib.import_module(module), name)
    return entry


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(name_or_path: str | pathlib.Path = "shapes", device: str | torch.device = "cpu",
               load_vae: bool = True, dtype: torch.dtype | str = torch.float32, *, revision: str | None = None,
               variant: str | None = None, config: str | pathlib.Path | None = None) -> DiffusionModel:
    """The model of a folder, a hub id, a single-file checkpoint (or the embedded `shapes`),
    ready for the core (see `engine.models.resolve`). `dtype` is the weights' (and so the
    denoiser's and encoders') dtype, as `torch_dtype` in `from_pretrained`; the engine's
    latents and solver state stay float32 either way. `variant`: the weights variant to
    load (e.g. fp16; default: the default weights, or the one variant a folder holds).
    `config`: for a single file, the pipeline folder (or hub id) whose configs, tokenizers
    and scheduler it is loaded with, where diffusers cannot fetch them itself."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    path = resolve(name_or_path, revision=revision, variant=variant)
    device = torch.device(device)
    if is_single_file(path):
        return _load_single_file(path, config, device, dtype)
    if config is not None:
        raise ValueError(f"--config applies to a single-file checkpoint; {path} is a folder")
    kind = pipeline_class_of(path)
    if kind == "class-conditional":
        from diffusers import AutoencoderKL, UNet2DModel

        def component(cls, name):
            try:
                with quiet_loading():
                    return cls.from_pretrained(path / name, low_cpu_mem_usage=False, **{DTYPE_KEYWORD: dtype},
                                               variant=variant or folder_variant(path / name))
            except Exception as exc:  # noqa: BLE001 - one line, naming the component
                raise ModelLoadError(f"{path}: cannot load component {name} ({cls.__name__}): {one_line(exc)}") \
                    from None

        unet = component(UNet2DModel, "unet")
        vae = None
        if load_vae:
            vae = component(AutoencoderKL, "vae").to(device).eval().requires_grad_(False)
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        conditions = json.loads((path / "conditions.json").read_text())
        return ClassConditionalModel(path, unet.to(device).eval().requires_grad_(False), vae, scheduler_config,
                                     conditions, device, dtype)
    model_class = _served_class(kind, path)
    import diffusers

    variant = check_pipeline_folder(path, variant)
    index = json.loads((path / "model_index.json").read_text())
    # optional components saved as None (SD3 without T5) must be passed as None to load
    absent = {name: None for name, value in index.items()
              if not name.startswith("_") and isinstance(value, list) and value[0] is None}
    try:
        with quiet_loading():
            pipe = getattr(diffusers, kind).from_pretrained(path, low_cpu_mem_usage=False, variant=variant,
                                                            **{DTYPE_KEYWORD: dtype}, **absent)
    except Exception as exc:  # noqa: BLE001 - said in one line, naming the component that fails
        raise locate_failure(path, variant, dtype, exc) from None
    return model_class(path, _prepared(pipe, device, dtype), device, dtype)


def _served_class(kind: str, where) -> type[DiffusionModel]:
    model_class = model_class_of(kind)
    if model_class is None:
        raise ModelLoadError(f"{where}: pipeline {kind!r} is not served; one of {', '.join(_PIPELINES)} "
                             "or the class-conditional layout")
    return model_class


def _prepared(pipe, device: torch.device, dtype: torch.dtype):
    """A loaded pipeline in `dtype` on `device`, in eval mode without gradients."""
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        # diffusers loads some models (SD3's transformer, with low_cpu_mem_usage=False) in
        # float32 whatever torch_dtype says; modules that keep parts in float32 on purpose
        # (T5's `wo`) say so and are left as loaded
        if isinstance(component, torch.nn.Module) and not getattr(component, "_keep_in_fp32_modules", None) \
                and any(p.dtype != dtype for p in component.parameters()):
            component.to(dtype)
    pipe = pipe.to(device)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    return pipe


def _load_single_file(file: pathlib.Path, config, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
    """A single-file checkpoint through the pipeline's own `from_single_file`: its
    components' configs from `config` (a folder or hub id), else from the hub repo
    diffusers names for the checkpoint's architecture (its cache, or a download)."""
    import diffusers

    config_folder = None if config is None else resolve(config)
    kind = single_file_pipeline(file, config_folder)
    model_class = _served_class(kind, file)
    kwargs = {} if config_folder is None else {"config": str(config_folder)}
    try:
        with quiet_loading():
            pipe = getattr(diffusers, kind).from_single_file(str(file), **{DTYPE_KEYWORD: dtype}, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one line: which part and why
        hint = "" if config is not None else " (pass --config FOLDER: a pipeline folder of its architecture)"
        raise ModelLoadError(f"{file}: {kind}.from_single_file failed: {one_line(exc)}{hint}") from None
    model = model_class(file, _prepared(pipe, device, dtype), device, dtype)
    model.decode_folder = decode_folder_of(file, pipe)
    return model
