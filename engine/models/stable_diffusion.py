"""The class-conditional layout (no `model_index.json`: `unet/` `UNet2DModel`, `vae/`,
`scheduler/`, `conditions.json`, null condition last), and the pipeline-folder models of
SD 1.x/2.x (`StableDiffusionPipeline`: CLIP tokenizer + text encoder,
`UNet2DConditionModel`, `AutoencoderKL`) and SD3 (`StableDiffusion3Pipeline`: two CLIP
encoders, optional T5, `SD3Transformer2DModel`, flow matching, a VAE with a shift
factor). Prompts are encoded by the pipeline's own `encode_prompt`, so the embeddings are
the pipeline's; the denoising loop is the core's."""
from __future__ import annotations

import functools
import pathlib
from typing import Sequence

import torch

from engine.models.inputs import ModelInputs
from engine.models.model import Conditioning, DiffusionModel


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


class PipelineModel(DiffusionModel):
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


class StableDiffusionModel(PipelineModel):
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


class StableDiffusion3Model(PipelineModel):
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
