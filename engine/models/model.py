"""The model contract the core calls: a `DiffusionModel` (encode prompts, one denoiser
call on `ModelInputs`, decode), a prompt's `Conditioning` rows, the `VaeDecoder` the
decode stage runs, and how one call's inputs are stacked from its rows' prompts.

Each layout's subclass lives with its family (`engine.models.stable_diffusion`,
`engine.models.sdxl`, `engine.models.flux`, `engine.models.qwen_image`);
`engine.models.loading` picks one for a folder.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import math
import pathlib
from typing import Sequence

import numpy as np
import torch

from engine.models.folders import folder_variant, quiet_loading
from engine.models.geometry import Geometry, declared_native_size, geometry_from_configs
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
        return geometry_from_configs(self.pipeline_class, vae, dict(self.denoiser.config), self.denoiser_is_unet,
                                     declared_native_size(self.path))

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
        `cache_call` (an `engine.models.cache_units.CacheCall`): the step caches of its rows."""
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
        if settings.lite:  # the transformer's output rows: as many numbers as the latents
            return (settings.max_order + 1) * math.prod(latent_shape) * factor
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
