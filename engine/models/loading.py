"""Loading a model folder as diffusers saves it, and the few calls the core makes of it.

Five layouts (`model_index.json` names the pipeline):

- `StableDiffusionPipeline` (SD 1.x/2.x): CLIP tokenizer + text encoder,
  `UNet2DConditionModel`, `AutoencoderKL`, scheduler;
- `StableDiffusion3Pipeline`: two CLIP encoders, optional T5, `SD3Transformer2DModel`,
  flow matching, a VAE with a shift factor;
- `StableDiffusionXLPipeline` (`engine.models.sdxl`): two CLIP encoders, pooled
  embeddings, per-request micro-conditioning time ids;
- `FluxPipeline` (`engine.models.flux`): CLIP pooled + T5, `FluxTransformer2DModel` on
  2×2-packed latents, embedded guidance (dev), resolution-dependent timestep shift;
- the class-conditional layout (no `model_index.json`): `unet/` `UNet2DModel`, `vae/`,
  `scheduler/`, `conditions.json` (null condition last).

Components come from diffusers' and transformers' own classes via the pipeline's
`from_pretrained`; prompts are encoded by the pipeline's own `encode_prompt`, so the
embeddings are the pipeline's. The denoising loop is the core's, not the pipeline's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import pathlib
import re
import shutil
from typing import Sequence

import numpy as np
import torch

from engine.models import ModelLoadError, is_single_file, one_line, resolve
from engine.models.geometry import Geometry, geometry_from_configs, pipeline_class_of
from engine.models.inputs import ModelInputs
from engine.protocol import MICRO_CONDITIONING


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without the host waiting for the work queued there: a copy from
    pageable memory to CUDA waits for the stream, so a host tensor is page-locked first."""
    device = torch.device(device)
    if device.type == "cuda" and not tensor.is_cuda:
        return tensor.contiguous().pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def prediction_type_of(scheduler_config: dict) -> str:
    """The model's prediction type, in the contract's words: epsilon, v_prediction,
    sample or flow (a flow-matching scheduler config, or `flow_prediction`)."""
    if scheduler_config.get("_class_name", "").startswith("FlowMatch"):
        return "flow"
    pred = scheduler_config.get("prediction_type", "epsilon")
    return {"flow_prediction": "flow", "original_sample": "sample"}.get(pred, pred)


#: the weights' dtype keyword of `from_pretrained`: `dtype` where diffusers has it (it warns at `torch_dtype`)
_DTYPE_KEYWORD = "dtype" if hasattr(importlib.import_module("diffusers.utils.deprecation_utils"),
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
            kwargs = {"variant": variant, _DTYPE_KEYWORD: dtype} if _has_weights(class_name) else {}
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


@dataclasses.dataclass(eq=False)
class Conditioning:
    """One prompt's embedding rows, as the denoiser takes them: `hidden` (sequence ×
    width, or a 0-d class index) and `pooled` (width) where the model has it. Shared by
    every slot whose request has that prompt; a slot holds a reference until released."""

    hidden: torch.Tensor
    pooled: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        size = self.hidden.numel() * self.hidden.element_size()
        return size + (0 if self.pooled is None else self.pooled.numel() * self.pooled.element_size())


#: decoders of the VAEs `AutoencoderKL` does not load, by their config's class name (imported on first use)
_VAE_DECODERS = {"AutoencoderKLQwenImage": "engine.models.qwen_image:QwenImageVaeDecoder"}


class VaeDecoder:
    """Final latents (unscaled, as the denoiser sees them) → uint8 images, as the
    pipeline's `vae.decode` and image post-processing do."""

    def __init__(self, vae, device: torch.device, dtype: torch.dtype = torch.float32):
        self.vae, self.device, self.dtype = vae, device, dtype
        self.scale = 2 ** (len(vae.config.block_out_channels) - 1)

    @classmethod
    def from_folder(cls, path: pathlib.Path, device: str | torch.device = "cpu") -> "VaeDecoder":
        from diffusers import AutoencoderKL

        config = pathlib.Path(path) / "vae" / "config.json"
        entry = _VAE_DECODERS.get(json.loads(config.read_text()).get("_class_name")) if config.exists() else None
        if entry is not None and cls is VaeDecoder:  # a VAE AutoencoderKL does not load, decoded as its pipeline does
            module, name = entry.split(":")
            return getattr(importlib.import_module(module), name).from_folder(path, device)
        with quiet_loading():
            vae = AutoencoderKL.from_pretrained(pathlib.Path(path) / "vae", low_cpu_mem_usage=False,
                                                variant=folder_variant(pathlib.Path(path) / "vae"))
        device = torch.device(device)
        return cls(vae.to(device).eval().requires_grad_(False), device)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """B×C×h×w latents → B×H×W×3 uint8."""
        config = self.vae.config
        latents = latents.to(self.device, self.dtype) / config.scaling_factor
        if getattr(config, "shift_factor", None) is not None:
            latents = latents + config.shift_factor
        images = self.vae.decode(latents).sample
        images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return images.permute(0, 2, 3, 1).cpu().numpy()


class DiffusionModel:
    """What the core needs of a model: geometry, prompt encoding, per-request inputs, one
    batched denoiser call (`run`), the scheduler config. Subclasses per layout.

    Per-row inputs follow `engine.models.inputs.ModelInputs`: the core gathers them
    from slot-owned state and calls `run(inputs)`; nothing else reaches the denoiser."""

    pipeline_class = ""
    path: pathlib.Path
    device: torch.device
    dtype: torch.dtype = torch.float32
    scheduler_config: dict
    denoiser: torch.nn.Module
    vae = None
    prompts: tuple[str, ...] = ()  # known prompts (class-conditional models); () for free text
    denoiser_is_unet = True
    decode_folder: pathlib.Path | None = None  # where decode workers load the VAE from, if not `path` (a single file)

    @property
    def prediction_type(self) -> str:
        return prediction_type_of(self.scheduler_config)

    @property
    def revision(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        """What clients are told the model is: an embedded one's name (`shapes`), a hub id, else
        its folder's name."""
        from engine.models import display_name

        return display_name(self.path)

    @functools.cached_property
    def geometry(self) -> Geometry:
        """The one source for channels, scale, size multiple and native size."""
        vae = None if self.vae is None else dict(self.vae.config)
        return geometry_from_configs(self.pipeline_class, vae, dict(self.denoiser.config), self.denoiser_is_unet)

    @property
    def latent_channels(self) -> int:
        return self.geometry.latent_channels

    @property
    def vae_scale(self) -> int:
        return self.geometry.vae_scale

    @property
    def native_size(self) -> int:
        return self.geometry.native_size

    @property
    def size_multiple(self) -> int:
        return self.geometry.size_multiple

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return self.geometry.latent_shape(height, width)

    @functools.cached_property
    def conditioning_layout(self) -> tuple:
        """Shapes and dtype of one prompt's rows (sequence × width, pooled width), as the
        encoder gives them: part of the group key."""
        c = self.encode([""])[0]
        return (tuple(c.hidden.shape), None if c.pooled is None else tuple(c.pooled.shape), str(c.hidden.dtype))

    @functools.cached_property
    def conditioning_nbytes(self) -> int:
        """Bytes of one prompt's rows, which admission counts."""
        return self.encode([""])[0].nbytes

    @property
    def encoder_settings(self) -> tuple:
        """What besides the prompt decides an embedding: part of the cache key."""
        return ()

    def check_prompt(self, prompt: str) -> str | None:
        """Why the model cannot take this prompt, or None."""
        return None

    #: what the pipeline takes besides every model's fields (their values are checked once,
    #: in `engine.core.validation`, for every model)
    takes_true_cfg = False
    takes_micro_conditioning = False

    def check_params(self, params) -> tuple[str, str] | None:
        """(field, why) for a field this model cannot use, or None."""
        if params.true_cfg != 1.0 and not self.takes_true_cfg:
            return "true_cfg", f"{self.pipeline_class or 'this model'} has no true_cfg_scale (FLUX only)"
        if not self.takes_micro_conditioning:
            for field in MICRO_CONDITIONING:
                if getattr(params, field) is not None:
                    return field, f"{self.pipeline_class or 'this model'} takes no micro-conditioning (SDXL only)"
        return None

    def cfg_scale(self, params) -> float | None:
        """The classifier-free guidance scale the kernel combines two rows with, or None
        for one row a step: as the pipeline decides, only above 1."""
        return float(params.guidance) if params.guidance > 1.0 else None

    def negative_text(self, params) -> str | None:
        """What the unconditional branch encodes: "" when no negative prompt is given."""
        return params.negative_prompt or ""

    def schedule_options(self, height: int, width: int, steps: int) -> tuple:
        """What besides (sampler, steps) a schedule depends on for this size, as
        (name, value) pairs passed to `set_timesteps` (FLUX's `sigmas`, which depend on the
        step count, and its resolution-dependent `mu`); part of the schedule key."""
        return ()

    def request_inputs(self, params, height: int, width: int) -> dict[str, torch.Tensor]:
        """Per-request inputs (`ModelInputs`' request-input fields), each 2 × field shape:
        the conditional branch's row, then the unconditional one's, as host tensors (made at
        intake, where a copy to the device would wait for every step queued on it; the slot
        storage stages them). Held by the slot."""
        return {}

    def encode(self, prompts: Sequence[str | None]) -> list[Conditioning]:
        """One batched pass of the model's own text encoder(s). A None prompt is a row of
        zeros of the layout (SDXL's `force_zeros_for_empty_prompt`), where the model has them."""
        raise NotImplementedError

    #: per-row LoRA: the layers an adapter pool wrapped read each call's rows from here
    #: (`engine.lora`); None while no pool is attached
    adapter_rows = None

    def bind_adapter_rows(self, rows) -> None:
        """Where `run` binds each call's `lora_index` / `lora_scale` (an adapter pool's
        `AdapterRows`), or None to stop."""
        self.adapter_rows = rows

    def run(self, inputs: ModelInputs, cache_call=None) -> torch.Tensor:
        """One batched denoiser call over `inputs.rows` rows (eager, or captured in a graph).
        `cache_call` (an `engine.models.step_cache.CacheCall`): the step caches of its rows."""
        adapters = self.adapter_rows
        if adapters is not None:
            adapters.bind(inputs.lora_index, inputs.lora_scale)
        if cache_call is None:
            return self.forward(inputs)
        index, scale = inputs.lora_index, inputs.lora_scale

        def rebind(rows):  # the rows a gathered block runs on keep their own adapters
            if rows is None:
                adapters.bind(index, scale)
            else:
                adapters.bind(index.index_select(0, rows), scale.index_select(0, rows))
        with self.row_cache.bound(cache_call, rebind if adapters is not None and index is not None else None):
            return self.forward(inputs)

    # ---- step caches, decided per request (engine.models.step_cache) ----

    #: the pipeline runs a request's guidance rows in one call, so one cache state decides
    #: for both (FLUX's true CFG is two calls: a state each)
    cfg_rows_share_cache = True

    def step_cache_support(self) -> str | None:
        """Why this model cannot cache steps per request, or None."""
        if self.denoiser_is_unet:
            return (f"{self.pipeline_class or 'this model'}'s UNet has no transformer blocks for diffusers' "
                    "cache hooks (first_block, mag, taylorseer serve transformer models: SD3, FLUX)")
        from engine.models.step_cache import RowCache

        return RowCache.supports(self.denoiser)

    @functools.cached_property
    def row_cache(self):
        from engine.models.step_cache import RowCache

        return RowCache(self.denoiser)

    @functools.cached_property
    def mag_ratios(self) -> tuple[float, ...] | None:
        """MagCache's calibrated ratios for this model: the folder's `mag_ratios.json`, if any."""
        path = pathlib.Path(self.path) / "mag_ratios.json"
        return tuple(json.loads(path.read_text())) if path.exists() else None

    def image_tokens(self, latent_shape) -> int:
        """The transformer's image sequence length for these latents."""
        _, h, w = latent_shape
        patch = int(self.denoiser.config.get("patch_size", 1) or 1)
        return (h // patch) * (w // patch)

    def step_cache_row_bytes(self, settings, latent_shape) -> int:
        """The most bytes one row's cache state of `settings` holds (what admission reserves)."""
        config = self.denoiser.config
        width = int(config.num_attention_heads) * int(config.attention_head_dim)
        text = self.conditioning_layout[0][0]
        if text is None:  # prompt rows of a variable length: the longest admission reserves
            text_width, dtype = self.conditioning_layout[0][1], getattr(torch, self.conditioning_layout[2].split(".")[-1])
            text = self.conditioning_nbytes // (text_width * torch.empty((), dtype=dtype).element_size())
        image = self.image_tokens(latent_shape)
        item = torch.empty((), dtype=self.dtype).element_size()
        if settings.kind == "first_block":
            return (2 * image + text) * width * item
        if settings.kind == "mag":
            return image * width * item
        factor = torch.empty((), dtype=settings.taylor_factors_dtype).element_size()
        return len(self.row_cache.attention) * (settings.max_order + 1) * (image + text) * width * factor

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The denoiser itself, its inputs passed by name: per layout."""
        raise NotImplementedError

    def denoise(self, x: torch.Tensor, t: torch.Tensor, rows: Sequence[Conditioning],
                **request_inputs: torch.Tensor) -> torch.Tensor:
        """`run` over latents, per-row timesteps, prompt rows and request inputs."""
        return self.run(model_inputs(x, t, rows, **request_inputs))

    # ---- image inputs: img2img and inpainting, as the model's image pipelines do them ----

    #: field → the diffusers pipeline whose image path this model follows: "image"
    #: (img2img) and "mask" (inpainting); a model without an entry rejects the field
    image_pipelines: dict[str, str] = {}

    def image_support(self, field: str) -> str | None:
        """Why this model cannot take `field` ("image" or "mask"), or None."""
        if field not in self.image_pipelines:
            kind = "image-to-image" if field == "image" else "inpainting"
            return f"{self.pipeline_class or 'this model'} has no {kind} path"
        return None

    def image_pipeline(self, field: str):
        """The diffusers image pipeline for `field`, on this model's own components (`from_pipe`
        shares them): its image and mask processors are the ones the engine uses."""
        import diffusers

        pipes = self.__dict__.setdefault("_image_pipelines", {})
        if field not in pipes:
            pipes[field] = getattr(diffusers, self.image_pipelines[field]).from_pipe(self.pipe)
        return pipes[field]

    def default_strength(self, field: str) -> float:
        """The pipeline's own default `strength` (SD img2img 0.8, SDXL img2img 0.3, SD
        inpainting 1.0, SDXL inpainting 0.9999, FLUX and SD3 img2img 0.6)."""
        import diffusers

        call = getattr(diffusers, self.image_pipelines[field]).__call__
        return float(inspect.signature(call).parameters["strength"].default)

    def start_step(self, steps: int, strength: float) -> int:
        """`t_start` of the pipeline's `get_timesteps(steps, strength)`: the steps skipped."""
        return max(steps - min(int(steps * strength), steps), 0)

    def inpaint_starts_from_noise(self, strength: float) -> bool:
        """The inpainting pipelines start at strength 1 from pure noise (`is_strength_max`),
        not from the image's latents noised to the first timestep."""
        return strength == 1.0

    def image_size(self, image, height: int | None, width: int | None) -> tuple[int, int]:
        """The output size of an image request: the given sides, the others the image's,
        rounded down to the VAE's multiple (`VaeImageProcessor.get_default_height_width`)."""
        return self.image_pipeline("image").image_processor.get_default_height_width(image, height, width)

    def preprocess_image(self, image, height: int, width: int) -> torch.Tensor:
        """1 × 3 × height × width in [-1, 1], float32: the pipeline's `image_processor.preprocess`."""
        pixels = self.image_pipeline("image").image_processor.preprocess(image, height=height, width=width)
        return pixels.to(dtype=torch.float32)

    def preprocess_mask(self, mask, height: int, width: int) -> torch.Tensor:
        """1 × 1 × h × w at latent resolution, 1 = repaint: the inpainting pipeline's
        `mask_processor.preprocess` (grey level, binarized at 0.5) resized as its
        `prepare_mask_latents` resizes it."""
        pipe = self.image_pipeline("mask")
        mask = pipe.mask_processor.preprocess(mask, height=height, width=width)
        scale = pipe.vae_scale_factor
        return torch.nn.functional.interpolate(mask, size=(height // scale, width // scale)).to(torch.float32)

    #: field → whether the image pipeline's latents are channels-last: SD's and SDXL's
    #: img2img keep the layout of the image processor's HWC → CHW permute through the VAE,
    #: add_noise and every step (the inpainting pipelines' `repeat` makes theirs
    #: contiguous). A UNet's rounding depends on it, so a call whose rows all have it runs so.
    image_channels_last: dict[str, bool] = {}

    @torch.no_grad()
    def encode_image_moments(self, pixels: Sequence[torch.Tensor]) -> list:
        """One batched pass of the VAE's encoder over same-sized images: each image's
        encoder output (`latent_dist`), not yet sampled. Deterministic: no random draw."""
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        vae = self.vae
        batch = torch.cat(list(pixels)).to(self.device, vae.dtype)
        encoded = vae.encode(batch)
        dist = getattr(encoded, "latent_dist", None)
        if dist is None:  # an encoder that gives latents directly
            return [_Latents(encoded.latents[i:i + 1]) for i in range(len(pixels))]
        return [AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(dist.parameters[i:i + 1]))
                for i in range(len(pixels))]

    def image_latents(self, moments, generator: torch.Generator) -> torch.Tensor:
        """The image's latents as the pipeline takes them: `retrieve_latents` (a sample
        of latent_dist from the request's own generator), scaled (and shifted) as the
        pipeline's `_encode_vae_image` / `prepare_latents`; float32, as the engine keeps latents."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents

        latents = retrieve_latents(moments, generator=generator)
        config = self.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is not None and std is not None:  # SDXL-style normalized latents
            channels = latents.shape[1]
            mean = to_device(torch.tensor(mean, dtype=latents.dtype).view(1, channels, 1, 1), latents.device)
            std = to_device(torch.tensor(std, dtype=latents.dtype).view(1, channels, 1, 1), latents.device)
            latents = (latents - mean) * config.scaling_factor / std
        elif getattr(config, "shift_factor", None) is not None:  # SD3, FLUX
            latents = (latents - config.shift_factor) * config.scaling_factor
        else:
            latents = config.scaling_factor * latents
        return latents.to(torch.float32)

    def masked_image_draw(self, latent_shape: tuple[int, ...], generator: torch.Generator) -> None:
        """Advance the generator as the inpainting pipeline's masked-image encode does (one
        latent-shaped sample from latent_dist), without running the encoder for it."""
        from diffusers.utils.torch_utils import randn_tensor

        randn_tensor((1, *latent_shape), generator=generator, device=self.device, dtype=self.vae.dtype)

    def channels_last(self, field: str) -> bool:
        return self.image_channels_last.get(field, False)

    @property
    def decoder(self) -> VaeDecoder:
        decoder = self.__dict__.get("_decoder")
        if decoder is None:
            decoder = self.__dict__["_decoder"] = VaeDecoder(self.vae, self.device, self.dtype)
        return decoder

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        return self.decoder.decode(latents)


@dataclasses.dataclass
class _Latents:
    """An encoder output that carries latents directly (`retrieve_latents`' other case)."""

    latents: torch.Tensor


def prompt_rows(rows: Sequence[Conditioning], multiple: int = 1) -> dict[str, torch.Tensor | None]:
    """One call's `hidden`, `pooled` and `hidden_mask` from its rows' prompt rows, stacked.
    Prompts of different lengths (Qwen-Image's) are padded with zeros to the call's
    longest, rounded up to `multiple` (a few text lengths, so a few CUDA graphs), with a
    mask of each row's real tokens, as a pipeline pads a batch of prompts; rows all of one
    length that needs no rounding stack as they are, without a mask. The lengths are the
    rows' shapes, known on the host: no device read."""
    lengths = [int(c.hidden.shape[0]) if c.hidden.dim() >= 2 else 0 for c in rows]
    pooled = None if rows[0].pooled is None else torch.stack([c.pooled for c in rows])
    longest = -(-max(lengths) // multiple) * multiple
    if all(n == longest for n in lengths):
        return {"hidden": torch.stack([c.hidden for c in rows]), "pooled": pooled, "hidden_mask": None}
    hidden = torch.stack([torch.nn.functional.pad(c.hidden, (0, 0, 0, longest - n)) for c, n in zip(rows, lengths)])
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    return {"hidden": hidden, "pooled": pooled, "hidden_mask": to_device(mask, hidden.device)}


def model_inputs(x: torch.Tensor, t: torch.Tensor, rows: Sequence[Conditioning],
                 **request_inputs: torch.Tensor) -> ModelInputs:
    """A `ModelInputs` from per-row prompt rows: their hidden (and pooled) rows stacked."""
    t = t.reshape(1).expand(x.shape[0]) if t.dim() == 0 else t
    return ModelInputs(x, t, **prompt_rows(rows), **request_inputs)


class ClassConditionalModel(DiffusionModel):
    """The class-label layout: a `UNet2DModel` with class embeddings; the prompt is the
    class name, the empty prompt (or the last condition) the null class."""

    pipeline_class = "class-conditional"

    def __init__(self, path, unet, vae, scheduler_config: dict, conditions: Sequence[str],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.path, self.denoiser, self.vae = pathlib.Path(path), unet, vae
        self.scheduler_config, self.prompts = dict(scheduler_config), tuple(conditions)
        self.device, self.dtype = torch.device(device), dtype

    @property
    def unet(self):
        return self.denoiser

    @property
    def conditions(self) -> tuple[str, ...]:
        return self.prompts

    @property
    def null_index(self) -> int:
        return len(self.prompts) - 1

    def check_prompt(self, prompt: str) -> str | None:
        if prompt not in self.prompts and prompt != "":
            return f"unknown prompt {prompt!r}: this class-conditional model knows {', '.join(map(repr, self.prompts))}"
        return None

    def cfg_scale(self, params) -> float | None:
        """The class-conditional reference loop's rule: one row only at guidance 1."""
        return None if params.guidance == 1.0 else float(params.guidance)

    def condition_index(self, prompt: str) -> int:
        return self.null_index if prompt == "" else self.prompts.index(prompt)

    def encode(self, prompts: Sequence[str]) -> list[Conditioning]:
        return [Conditioning(torch.tensor(self.condition_index(p), device=self.device)) for p in prompts]

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        return self.denoiser(inputs.sample, inputs.timestep, class_labels=inputs.hidden).sample


class _PipelineModel(DiffusionModel):
    """A text-to-image pipeline folder: the pipeline object owns the components."""

    def __init__(self, path: pathlib.Path, pipe, device: torch.device, dtype: torch.dtype | None = None):
        self.path, self.pipe, self.device = path, pipe, device
        # the requested dtype: `denoiser.dtype` is its first parameter's, and diffusers keeps
        # some modules in float32 (`_keep_in_fp32_modules`)
        self.dtype = dtype or self.denoiser.dtype
        self.vae = pipe.vae
        self.scheduler_config = dict(pipe.scheduler.config)
        self.scheduler_config["_class_name"] = type(pipe.scheduler).__name__

    def control_generator(self, generator: torch.Generator) -> torch.Generator:
        """The generator a request's control images are sampled from where the pipeline
        VAE-encodes them (FLUX): the request's own, drawn before its initial noise."""
        return generator

    def _encode_texts(self, prompts: list[str]) -> list[Conditioning]:
        """Models that take a None prompt (zero rows): the encoder pass over the texts."""
        raise NotImplementedError

    def _encode_with_zero_rows(self, prompts: Sequence[str | None]) -> list[Conditioning]:
        """`encode` for models whose pipeline feeds zeros for an absent negative prompt: the
        texts in one encoder pass, each None as `zero_rows`, in the given order."""
        texts = [p for p in prompts if p is not None]
        encoded = iter(self._encode_texts(texts) if texts else ())
        return [self.zero_rows if p is None else next(encoded) for p in prompts]

    @functools.cached_property
    def zero_rows(self) -> Conditioning:
        """Zeros shaped as one prompt's rows, as the pipeline's `torch.zeros_like(prompt_embeds)`."""
        c = self._encode_texts([""])[0]
        return Conditioning(torch.zeros_like(c.hidden), None if c.pooled is None else torch.zeros_like(c.pooled))


class StableDiffusionModel(_PipelineModel):
    pipeline_class = "StableDiffusionPipeline"
    image_pipelines = {"image": "StableDiffusionImg2ImgPipeline", "mask": "StableDiffusionInpaintPipeline"}
    image_channels_last = {"image": True}

    def image_support(self, field: str) -> str | None:
        channels = self.pipe.unet.config.in_channels
        if channels != self.latent_channels:
            return f"this model's inpainting UNet ({channels} input channels) is not served yet"
        return super().image_support(field)

    @property
    def denoiser(self):
        return self.pipe.unet

    def cfg_scale(self, params) -> float | None:
        """As the pipeline: only above 1, and never with a guidance embedding (LCM)."""
        return None if self.pipe.unet.config.time_cond_proj_dim is not None else super().cfg_scale(params)

    def request_inputs(self, params, height: int, width: int) -> dict[str, torch.Tensor]:
        dim = self.pipe.unet.config.time_cond_proj_dim
        if dim is None:
            return {}
        # LCM: the guidance scale enters as an embedding of w = guidance − 1, as the pipeline builds it
        w = torch.tensor(float(params.guidance) - 1).repeat(2)
        embedding = self.pipe.get_guidance_scale_embedding(w, embedding_dim=dim)
        return {"timestep_cond": embedding.to(torch.float32)}  # on the host: the slot storage stages it

    @torch.no_grad()
    def encode(self, prompts):
        embeds, _ = self.pipe.encode_prompt(list(prompts), self.device, 1, False)
        return [Conditioning(e) for e in embeds]

    #: name → ControlNetModel served beside the UNet (`engine.models.controlnet.attach_controlnets`)
    controlnets: dict = {}
    controlnet_class = "ControlNetModel"
    #: the ControlNets run on the prompt's row only, their residuals given to both rows (FLUX)
    controls_on_prompt_row = False
    takes_guess_mode = True
    takes_controls_with_image = True  # the ControlNet img2img and inpainting pipelines

    @functools.cached_property
    def control_image_processor(self):
        """The ControlNet pipelines' control image processor (RGB, resized, not normalised)."""
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=self.pipe.vae_scale_factor, do_convert_rgb=True,
                                 do_normalize=False)

    def control_image_size(self, image) -> tuple[int | None, int | None]:
        """The output size a control image implies where none is given: its own, rounded."""
        return self.control_image_processor.get_default_height_width(image, None, None)

    def prepare_control_image(self, image, height: int, width: int, generator, controlnet,
                              rows: int = 1) -> torch.Tensor:
        """The control image as the pipeline's `prepare_image` gives it to the ControlNet
        (one for every row of the request's call)."""
        pixels = self.control_image_processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)
        return pixels.to(self.device, controlnet.dtype)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        cond = None if inputs.timestep_cond is None else inputs.timestep_cond.to(self.dtype)
        residuals = {} if inputs.controls is None else inputs.controls.residuals(
            inputs.sample, inputs.timestep, inputs.hidden)
        added = self.ip_adapter_inputs(inputs, None)
        return self.pipe.unet(inputs.sample, inputs.timestep, encoder_hidden_states=inputs.hidden,
                              timestep_cond=cond, added_cond_kwargs=added, return_dict=False, **residuals)[0]

    #: the IP-Adapter folder served (`engine.models.ip_adapter.attach_ip_adapter`), or None
    ip_adapter = None

    def ip_adapter_inputs(self, inputs: ModelInputs, added: dict | None) -> dict | None:
        """`added_cond_kwargs` with the rows' IP-Adapter image embeddings, their scales bound
        to the attention processors (unchanged without an IP-Adapter)."""
        if inputs.ip_embeds is None:
            return added
        from engine.models.ip_adapter import bind_ip_scale

        bind_ip_scale(self.pipe.unet, inputs.ip_scale)
        return {**(added or {}), "image_embeds": [inputs.ip_embeds.to(self.dtype)]}


class StableDiffusion3Model(_PipelineModel):
    pipeline_class = "StableDiffusion3Pipeline"
    max_sequence_length = 256  # the pipeline's default T5 length
    denoiser_is_unet = False
    image_pipelines = {"image": "StableDiffusion3Img2ImgPipeline"}

    def start_step(self, steps: int, strength: float) -> int:
        """SD3's `get_timesteps` rounds the other way: int(steps − steps · strength)."""
        return int(max(steps - min(steps * strength, steps), 0))

    def check_params(self, params) -> tuple[str, str] | None:
        if params.image is not None and params.sampler not in ("default", "flow_euler"):
            # the img2img pipeline noises the image with `scheduler.scale_noise`, which only
            # flow-matching Euler has: with DPM-Solver++ the pipeline itself cannot run
            return "sampler", "StableDiffusion3Img2ImgPipeline runs default or flow_euler with an image"
        return super().check_params(params)

    @property
    def denoiser(self):
        return self.pipe.transformer

    @property
    def encoder_settings(self) -> tuple:
        return ("max_sequence_length", self.max_sequence_length)

    @torch.no_grad()
    def encode(self, prompts):
        prompts = list(prompts)
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return [Conditioning(e, p) for e, p in zip(embeds, pooled)]

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        residuals = {} if inputs.controls is None else self._control_residuals(inputs)
        return self.pipe.transformer(hidden_states=inputs.sample, timestep=inputs.timestep,
                                     encoder_hidden_states=inputs.hidden, pooled_projections=inputs.pooled,
                                     return_dict=False, **residuals)[0]

    # ---- ControlNets (engine.models.controlnet): StableDiffusion3ControlNetPipeline's ----

    controlnets: dict = {}
    controlnet_class = "SD3ControlNetModel"
    controls_on_prompt_row = False  # the pipeline runs its ControlNet on both rows of a guided call
    takes_guess_mode = False
    # the SD3 ControlNet inpainting pipeline takes another kind of ControlNet input; there is no img2img one
    takes_controls_with_image = False

    def control_image_size(self, image) -> tuple[int | None, int | None]:
        return None, None  # the pipeline's default size, the control image resized to it

    def control_generator(self, generator: torch.Generator) -> torch.Generator:
        """The pipeline samples its control latents from torch's global generator (it passes
        none to `latent_dist.sample`): the engine draws them from a fresh generator seeded
        with the request's seed, what the pipeline draws on the CPU after
        `torch.manual_seed(seed)` (on the CPU on every device, as all the engine's draws);
        the request's own noise stream is left as the pipeline leaves its generator."""
        return torch.Generator("cpu").manual_seed(generator.initial_seed())

    def prepare_control_image(self, image, height: int, width: int, generator, controlnet,
                              rows: int = 1) -> torch.Tensor:
        """The pipeline's control latents, one per row of the request's call (`rows`: 2 with
        classifier-free guidance, the negative prompt's first): the image preprocessed in
        the transformer's dtype, repeated per row, VAE-encoded and sampled in one draw,
        shifted (not for an InstantX-style ControlNet, `force_zeros_for_pooled_projection`)
        and scaled."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        pixels = self.pipe.image_processor.preprocess(image, height=height, width=width)
        moments = self.encode_image_moments([pixels.to(self.device, self.denoiser.dtype)])[0]
        latents = DiagonalGaussianDistribution(moments.latent_dist.parameters.repeat(rows, 1, 1, 1)).sample(generator)
        config = self.vae.config
        shift = 0 if controlnet.config.force_zeros_for_pooled_projection else config.shift_factor
        return ((latents - shift) * config.scaling_factor).to(controlnet.dtype)

    def _control_residuals(self, inputs: ModelInputs) -> dict:
        """`block_controlnet_hidden_states` for every row of the call, each ControlNet run
        as the pipeline runs it: on the rows' latents, timesteps and prompts (none for a
        ControlNet without text input), and zeros for the pooled projection where its
        config says so."""
        def run(net, rows, images):
            config = net.config
            pooled = inputs.pooled.index_select(0, rows)
            samples = net(hidden_states=inputs.sample.index_select(0, rows), controlnet_cond=images,
                          conditioning_scale=1.0, timestep=inputs.timestep.index_select(0, rows),
                          encoder_hidden_states=(inputs.hidden.index_select(0, rows)
                                                 if config.joint_attention_dim is not None else None),
                          pooled_projections=torch.zeros_like(pooled) if config.force_zeros_for_pooled_projection
                          else pooled, return_dict=False)[0]
            return list(samples)

        return {"block_controlnet_hidden_states": inputs.controls.summed(run, inputs.sample.shape[0])}


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
                    return cls.from_pretrained(path / name, low_cpu_mem_usage=False, **{_DTYPE_KEYWORD: dtype},
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
                                                            **{_DTYPE_KEYWORD: dtype}, **absent)
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
            pipe = getattr(diffusers, kind).from_single_file(str(file), **{_DTYPE_KEYWORD: dtype}, **kwargs)
    except Exception as exc:  # noqa: BLE001 - one line: which part and why
        hint = "" if config is not None else " (pass --config FOLDER: a pipeline folder of its architecture)"
        raise ModelLoadError(f"{file}: {kind}.from_single_file failed: {one_line(exc)}{hint}") from None
    model = model_class(file, _prepared(pipe, device, dtype), device, dtype)
    model.decode_folder = decode_folder_of(file, pipe)
    return model
