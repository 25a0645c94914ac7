"""What a model folder or single file holds, before anything loads: saved variants, the
components it names and whether their weights are there, which pipeline a single file
is, and a failed load traced to the component that failed (in one line)."""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import re
import shutil

import torch

from engine.models import ModelLoadError, one_line
from engine.models.geometry import pipeline_class_of


#: the weights' dtype keyword of `from_pretrained`: `dtype` where diffusers has it (it warns at `torch_dtype`)
DTYPE_KEYWORD = "dtype" if hasattr(importlib.import_module("diffusers.utils.deprecation_utils"),
                                    "_resolve_dtype") else "torch_dtype"


@contextlib.contextmanager
def quiet_loading():
    """Load without diffusers' and transformers' progress bars and notices (optional
    backends not installed, casts): what the engine says about a load is its own log line,
    and real errors still raise."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    levels = diffusers_logging.get_verbosity(), transformers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(levels[0])
        transformers_logging.set_verbosity(levels[1])
        diffusers_logging.enable_progress_bar()
        transformers_logging.enable_progress_bar()


def _weights_variant(name: str) -> tuple[str, str | None] | None:
    """(weights kind, variant or None) of a weights file as diffusers and transformers save
    them (`diffusion_pytorch_model.fp16.safetensors`, `model-00001-of-00002.safetensors`,
    `model.safetensors.index.fp16.json`), or None for any other file."""
    index = re.fullmatch(r"(diffusion_pytorch_model|model|pytorch_model)\.(safetensors|bin)\.index(?:\.(\w+))?\.json",
                         name)
    if index:
        return index.group(1), index.group(3)
    unsharded = re.sub(r"-\d+-of-\d+", "", name)  # model-00001-of-00002.fp16.safetensors, or .fp16-00001-of-...
    plain = re.fullmatch(r"(diffusion_pytorch_model|model|pytorch_model)(?:\.(\w+))?\.(safetensors|bin)", unsharded)
    return (plain.group(1), plain.group(2)) if plain else None


def saved_variants(folder: pathlib.Path) -> set[str | None]:
    """The weight variants a component folder holds (None: the default weights)."""
    found = (_weights_variant(f.name) for f in pathlib.Path(folder).iterdir() if f.is_file()) \
        if pathlib.Path(folder).is_dir() else ()
    return {kind_variant[1] for kind_variant in found if kind_variant is not None}


def folder_variant(folder: pathlib.Path) -> str | None:
    """The variant a component folder loads with when none is asked for: None where it has
    the default weights, else the one variant it holds (a folder saved with `variant="fp16"`
    alone, a very common download)."""
    variants = saved_variants(folder)
    if None in variants or len(variants) != 1:
        return None
    return next(iter(variants))


def _components(path: pathlib.Path) -> dict[str, tuple[str, str]]:
    """{component: (library, class)} of a pipeline folder's model_index.json, the saved ones only."""
    index = json.loads((path / "model_index.json").read_text())
    return {name: (value[0], value[1]) for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] and value[1]}


def _has_weights(class_name: str) -> bool:
    """Whether a component of this class is a model that loads weights (not a tokenizer,
    a scheduler or a processor)."""
    return not any(word in class_name for word in ("Tokenizer", "Scheduler", "Processor", "FeatureExtractor"))


def check_pipeline_folder(path: pathlib.Path, variant: str | None) -> str | None:
    """The variant every weighted component of a pipeline folder loads with (`variant`, or
    the one the folder holds when none is asked for); raises ModelLoadError naming the
    first component that cannot load, before any weights are read."""
    chosen = variant
    for name, (_, class_name) in _components(path).items():
        folder = path / name
        if not folder.is_dir():
            raise ModelLoadError(f"{path}: component {name} ({class_name}) has no folder {name}/")
        if not _has_weights(class_name):
            continue
        if not (folder / "config.json").exists():
            raise ModelLoadError(f"{path}: component {name} ({class_name}) has no {name}/config.json")
        variants = saved_variants(folder)
        if not variants:
            raise ModelLoadError(f"{path}: component {name} ({class_name}) has no weights file in {name}/")
        wanted = chosen if chosen is not None else folder_variant(folder)
        if wanted not in variants and None not in variants:  # diffusers falls back to the default weights
            held = ", ".join(sorted("default" if v is None else v for v in variants))
            raise ModelLoadError(f"{path}: component {name} ({class_name}) has no "
                                 f"{'default' if wanted is None else wanted} weights (it holds: {held})"
                                 + ("" if variant else "; pass --variant"))
        if wanted in variants:
            chosen = wanted
    return chosen


def locate_failure(path: pathlib.Path, variant: str | None, dtype: torch.dtype, exc: BaseException) -> ModelLoadError:
    """Which component of a pipeline folder fails to load, and why, in one line: each is
    loaded alone (only on the error path) until one raises."""
    for name, (library, class_name) in _components(path).items():
        try:
            cls = getattr(importlib.import_module(library), class_name)
            kwargs = {"variant": variant, DTYPE_KEYWORD: dtype} if _has_weights(class_name) else {}
            with quiet_loading():
                cls.from_pretrained(path / name, **kwargs)
        except Exception as component_exc:  # noqa: BLE001 - reported, with its component
            return ModelLoadError(f"{path}: cannot load component {name} ({class_name}): {one_line(component_exc)}")
    return ModelLoadError(f"{path}: the pipeline does not load: {one_line(exc)}")


#: single-file checkpoints by the model type diffusers infers from their keys -> the pipeline serving them
_SINGLE_FILE_PIPELINES = {"v1": "StableDiffusionPipeline", "v2": "StableDiffusionPipeline",
                          "xl_base": "StableDiffusionXLPipeline", "playground-v2-5": "StableDiffusionXLPipeline",
                          "sd3": "StableDiffusion3Pipeline", "sd35_large": "StableDiffusion3Pipeline",
                          "sd35_medium": "StableDiffusion3Pipeline", "flux-dev": "FluxPipeline",
                          "flux-schnell": "FluxPipeline"}


def single_file_pipeline(file: pathlib.Path, config: pathlib.Path | None) -> str:
    """The pipeline class of a single-file checkpoint: its `config` folder's, else the one
    diffusers infers from the checkpoint's keys."""
    if config is not None:
        return pipeline_class_of(config)
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type, load_single_file_checkpoint

    try:
        model_type = infer_diffusers_model_type(load_single_file_checkpoint(str(file), local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - not a checkpoint diffusers reads
        raise ModelLoadError(f"{file}: not a checkpoint diffusers can read: {one_line(exc)}") from None
    if model_type not in _SINGLE_FILE_PIPELINES:
        raise ModelLoadError(f"{file}: a {model_type!r} checkpoint; single files served: SD 1.x/2.x, SDXL base, "
                             "SD3, FLUX.1 (or pass --config FOLDER, a pipeline folder of the same architecture)")
    return _SINGLE_FILE_PIPELINES[model_type]


def decode_folder_of(file: pathlib.Path, pipe) -> pathlib.Path:
    """A folder holding the configs and the VAE of a pipeline loaded from one file, which
    decode worker processes load their VAE from (as from a pipeline folder); written once
    per checkpoint under the user's cache directory."""
    import hashlib

    stat = file.stat()
    key = hashlib.sha256(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    folder = cache / "diffslot" / "single-file" / f"{file.stem}-{key}"
    if not (folder / "vae" / "config.json").exists():
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        pipe.save_config(partial)
        for name, component in pipe.components.items():
            if name == "vae":
                component.save_pretrained(partial / name, safe_serialization=True)
            elif hasattr(component, "save_config") and hasattr(component, "config"):
                component.save_config(partial / name)
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return folder
