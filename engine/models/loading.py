"""Loading a model folder as diffusers saves it, and the few calls the core makes of it.

Three layouts (`model_index.json` names the pipeline):

- `StableDiffusionPipeline` (SD 1.x/2.x): CLIP tokenizer + text encoder,
  `UNet2DConditionModel`, `AutoencoderKL`, scheduler;
- `StableDiffusion3Pipeline`: two CLIP encoders, optional T5, `SD3Transformer2DModel`,
  flow matching, a VAE with a shift factor;
- the class-conditional layout (no `model_index.json`): `unet/` `UNet2DModel`, `vae/`,
  `scheduler/`, `conditions.json` (null condition last).

Components come from diffusers' and transformers' own classes via the pipeline's
`from_pretrained`; prompts are encoded by the pipeline's own `encode_prompt`, so the
embeddings are the pipeline's. The denoising loop is the core's, not the pipeline's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Sequence

import numpy as np
import torch

from engine.models import resolve


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


class VaeDecoder:
    """Final latents (unscaled, as the denoiser sees them) → uint8 images, as the
    pipeline's `vae.decode` and image post-processing do."""

    def __init__(self, vae, device: torch.device, dtype: torch.dtype = torch.float32):
        self.vae, self.device, self.dtype = vae, device, dtype
        self.scale = 2 ** (len(vae.config.block_out_channels) - 1)

    @classmethod
    def from_folder(cls, path: pathlib.Path, device: str | torch.device = "cpu") -> "VaeDecoder":
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(pathlib.Path(path) / "vae", low_cpu_mem_usage=False)
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
    """What the core needs of a model: geometry, prompt encoding, one batched denoiser
    call, the scheduler config. Subclasses per layout."""

    pipeline_class = ""
    path: pathlib.Path
    device: torch.device
    dtype: torch.dtype = torch.float32
    scheduler_config: dict
    denoiser: torch.nn.Module
    vae = None
    prompts: tuple[str, ...] = ()  # known prompts (class-conditional models); () for free text

    @property
    def prediction_type(self) -> str:
        return prediction_type_of(self.scheduler_config)

    @property
    def revision(self) -> str:
        return str(self.path)

    @property
    def latent_channels(self) -> int:
        return int(self.denoiser.config.in_channels)

    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell along one side."""
        return 1 if self.vae is None else 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        return int(self.denoiser.config.sample_size) * self.vae_scale

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE and denoiser downsampling)."""
        return self.vae_scale * self._latent_multiple()

    def _latent_multiple(self) -> int:
        return 2 ** (len(self.denoiser.config.block_out_channels) - 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    @functools.cached_property
    def conditioning_layout(self) -> tuple:
        """Shapes and dtype of one prompt's rows (sequence × width, pooled width), as the
        encoder gives them: part of the group key (R14)."""
        c = self.encode([""])[0]
        return (tuple(c.hidden.shape), None if c.pooled is None else tuple(c.pooled.shape), str(c.hidden.dtype))

    @functools.cached_property
    def conditioning_nbytes(self) -> int:
        """Bytes of one prompt's rows, which admission counts (R14)."""
        return self.encode([""])[0].nbytes

    @property
    def encoder_settings(self) -> tuple:
        """What besides the prompt decides an embedding: part of the cache key."""
        return ()

    def check_prompt(self, prompt: str) -> str | None:
        """Why the model cannot take this prompt, or None."""
        return None

    def guided(self, guidance: float) -> bool:
        """Whether a request runs classifier-free guidance (two rows a step), as the
        pipeline decides: only for a guidance scale above 1."""
        return guidance > 1.0

    def encode(self, prompts: Sequence[str]) -> list[Conditioning]:
        """One batched pass of the model's own text encoder(s)."""
        raise NotImplementedError

    def denoise(self, x: torch.Tensor, t: torch.Tensor, rows: Sequence[Conditioning]) -> torch.Tensor:
        """One batched denoiser call: rows of latents, per-row timesteps and conditioning."""
        return self.denoise_stacked(x, t, *self.stack_conditioning(rows))

    def stack_conditioning(self, rows: Sequence[Conditioning]) -> tuple[torch.Tensor, ...]:
        """The rows' conditioning as the denoiser's batched tensors. Kept apart from
        `denoise_stacked` so a CUDA graph can capture the denoiser on fixed buffers."""
        raise NotImplementedError

    def denoise_stacked(self, x: torch.Tensor, t: torch.Tensor, *conditioning: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def decoder(self) -> VaeDecoder:
        decoder = self.__dict__.get("_decoder")
        if decoder is None:
            decoder = self.__dict__["_decoder"] = VaeDecoder(self.vae, self.device, self.dtype)
        return decoder

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        return self.decoder.decode(latents)


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

    def guided(self, guidance: float) -> bool:
        """DESIGN.md section 3's class-conditional loop: one row only at guidance 1."""
        return guidance != 1.0

    def condition_index(self, prompt: str) -> int:
        return self.null_index if prompt == "" else self.prompts.index(prompt)

    def encode(self, prompts: Sequence[str]) -> list[Conditioning]:
        return [Conditioning(torch.tensor(self.condition_index(p), device=self.device)) for p in prompts]

    def stack_conditioning(self, rows):
        return (torch.stack([c.hidden for c in rows]),)

    def denoise_stacked(self, x, t, labels):
        return self.denoiser(x, t, class_labels=labels).sample


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

    def make_default_scheduler(self):
        """A fresh copy of the folder's own scheduler, as the pipeline runs it."""
        return type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)


class StableDiffusionModel(_PipelineModel):
    pipeline_class = "StableDiffusionPipeline"

    @property
    def denoiser(self):
        return self.pipe.unet

    def guided(self, guidance: float) -> bool:
        """As the pipeline: only above 1, and never with a guidance embedding (LCM)."""
        return guidance > 1.0 and self.pipe.unet.config.time_cond_proj_dim is None

    @torch.no_grad()
    def encode(self, prompts):
        embeds, _ = self.pipe.encode_prompt(list(prompts), self.device, 1, False)
        return [Conditioning(e) for e in embeds]

    def stack_conditioning(self, rows):
        return (torch.stack([c.hidden for c in rows]),)

    def denoise_stacked(self, x, t, hidden):
        return self.pipe.unet(x, t, encoder_hidden_states=hidden, return_dict=False)[0]


class StableDiffusion3Model(_PipelineModel):
    pipeline_class = "StableDiffusion3Pipeline"
    max_sequence_length = 256  # the pipeline's default T5 length

    @property
    def denoiser(self):
        return self.pipe.transformer

    def _latent_multiple(self) -> int:
        return int(self.pipe.transformer.config.patch_size)

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

    def stack_conditioning(self, rows):
        return torch.stack([c.hidden for c in rows]), torch.stack([c.pooled for c in rows])

    def denoise_stacked(self, x, t, hidden, pooled):
        return self.pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=hidden,
                                     pooled_projections=pooled, return_dict=False)[0]


_PIPELINES = {"StableDiffusionPipeline": StableDiffusionModel, "StableDiffusion3Pipeline": StableDiffusion3Model}


def pipeline_class_of(path: pathlib.Path) -> str:
    index = path / "model_index.json"
    return json.loads(index.read_text()).get("_class_name", "") if index.exists() else "class-conditional"


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(name_or_path: str | pathlib.Path = "shapes", device: str | torch.device = "cpu",
               load_vae: bool = True, dtype: torch.dtype | str = torch.float32) -> DiffusionModel:
    """The model of a folder (or the embedded `shapes`), ready for the core. `dtype` is the
    weights' (and so the denoiser's and encoders') dtype, as `torch_dtype` in
    `from_pretrained`; the engine's latents and solver state stay float32 either way."""
    path = resolve(name_or_path)
    device = torch.device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    kind = pipeline_class_of(path)
    if kind == "class-conditional":
        from diffusers import AutoencoderKL, UNet2DModel

        unet = UNet2DModel.from_pretrained(path / "unet", low_cpu_mem_usage=False, torch_dtype=dtype)
        vae = None
        if load_vae:
            vae = AutoencoderKL.from_pretrained(path / "vae", low_cpu_mem_usage=False, torch_dtype=dtype)
            vae = vae.to(device).eval().requires_grad_(False)
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        conditions = json.loads((path / "conditions.json").read_text())
        return ClassConditionalModel(path, unet.to(device).eval().requires_grad_(False), vae, scheduler_config,
                                     conditions, device, dtype)
    model_class = _PIPELINES.get(kind)
    if model_class is None:
        raise ValueError(f"{path}: pipeline {kind!r} is not served; one of {', '.join(_PIPELINES)} "
                         "or the class-conditional layout")
    import diffusers

    index = json.loads((path / "model_index.json").read_text())
    # optional components saved as None (SD3 without T5) must be passed as None to load
    absent = {name: None for name, value in index.items()
              if not name.startswith("_") and isinstance(value, list) and value[0] is None}
    pipe = getattr(diffusers, kind).from_pretrained(path, low_cpu_mem_usage=False, torch_dtype=dtype, **absent)
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        # diffusers loads some models (SD3's transformer, with low_cpu_mem_usage=False) in
        # float32 whatever torch_dtype says; modules that keep parts in float32 on purpose
        # (T5's `wo`) say so and are left as loaded
        if isinstance(component, torch.nn.Module) and not getattr(component, "_keep_in_fp32_modules", None):
            component.to(dtype)
    pipe = pipe.to(device)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    return model_class(path, pipe, device, dtype)

