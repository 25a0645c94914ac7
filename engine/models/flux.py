"""`FluxPipeline` folders: FLUX.1-dev (guidance embedded in the transformer) and
FLUX.1-schnell (without).

The engine keeps FLUX's latents as the VAE's, C×h×w (16 channels), never packed: the
fused update is elementwise and packing is a permutation, so the solver step is the
same on either layout, and every other part of the engine (groups, decode workers,
the `latent` output) sees the one latent shape `engine.models.geometry` gives. Only
`forward` packs them, 2×2 cells into tokens as `FluxPipeline._pack_latents` does,
with the pipeline's position ids, and unpacks the transformer's output as
`FluxPipeline._unpack_latents` does.

Per request and per row:

- the embedded guidance (`guidance` request input, dev only): the pipeline's
  `guidance_scale`, one value per row, so dev requests with different guidance share
  a call;
- `true_cfg`: the pipeline's `true_cfg_scale`; with a negative prompt given and above 1,
  two rows a step (prompt, negative prompt) combined by the kernel's guidance
  coefficient, as `neg + true_cfg * (cond - neg)`;
- the schedule: `sigmas = linspace(1, 1/steps, steps)` and the shift `mu` from the
  image's token count (`calculate_shift` with the scheduler config's sequence lengths
  and shifts), as `FluxPipeline.__call__` computes them; dev's scheduler applies `mu`
  (dynamic shifting), schnell's its fixed shift.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from engine.models.inputs import ModelInputs
from engine.models.model import Conditioning

#: Samplers FLUX runs: its own scheduler, and the kernel's flow-matching Euler (the same
from engine.models.stable_diffusion import PipelineModel

#: Samplers FLUX runs: its own scheduler, and the kernel's flow-matching Euler (the same
#: update). The others do not take the pipeline's `sigmas` (DPM-Solver++) or predict noise.
FLUX_SAMPLERS = ("default", "flow_euler")


class FluxModel(PipelineModel):
    pipeline_class = "FluxPipeline"
    max_sequence_length = 512  # the pipeline's default T5 length
    denoiser_is_unet = False
    image_pipelines = {"image": "FluxImg2ImgPipeline"}

    def start_step(self, steps: int, strength: float) -> int:
        """FluxImg2ImgPipeline's `get_timesteps` rounds the other way: int(steps − steps · strength)."""
        return int(max(steps - min(steps * strength, steps), 0))

    @property
    def denoiser(self):
        return self.pipe.transformer

    @property
    def guidance_embedded(self) -> bool:
        """FLUX.1-dev: the guidance scale is an input of the transformer (distilled guidance)."""
        return bool(self.pipe.transformer.config.guidance_embeds)

    @property
    def encoder_settings(self) -> tuple:
        return ("max_sequence_length", self.max_sequence_length)

    takes_true_cfg = True
    cfg_rows_share_cache = False  # the pipeline's true CFG: two transformer calls, a cache context each

    @functools.cached_property
    def mag_ratios(self) -> tuple[float, ...] | None:
        """The folder's calibrated ratios, else (a FLUX.1 folder) diffusers' `FLUX_MAG_RATIOS`."""
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        own = super().mag_ratios
        if own is not None or self.pipeline_class != "FluxPipeline":
            return own
        return tuple(FLUX_MAG_RATIOS.tolist())

    def image_tokens(self, latent_shape) -> int:
        _, h, w = latent_shape
        return (h // 2) * (w // 2)  # 2×2 cells packed into one token

    def check_params(self, params) -> tuple[str, str] | None:
        if params.sampler not in FLUX_SAMPLERS:
            return "sampler", f"FluxPipeline runs {' or '.join(FLUX_SAMPLERS)}, not {params.sampler!r}"
        return super().check_params(params)

    def cfg_scale(self, params) -> float | None:
        """Two rows only for true CFG, as the pipeline's `do_true_cfg`: `true_cfg_scale`
        above 1 and a negative prompt given ("" counts). `guidance` never makes two rows:
        dev embeds it, schnell ignores it."""
        if params.true_cfg > 1.0 and params.negative_prompt is not None:
            return float(params.true_cfg)
        return None

    def negative_text(self, params) -> str | None:
        return params.negative_prompt

    def schedule_options(self, height: int, width: int, steps: int) -> tuple:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipe.scheduler.config
        _, h, w = self.latent_shape(height, width)
        image_seq_len = (h // 2) * (w // 2)  # packed tokens, the pipeline's latents.shape[1]
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        if config.get("use_flow_sigmas", False):  # the pipeline then lets the scheduler choose
            return (("mu", mu),)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        return (("sigmas", tuple(float(s) for s in sigmas)), ("mu", mu))

    def request_inputs(self, params, height: int, width: int) -> dict[str, torch.Tensor]:
        if not self.guidance_embedded:
            return {}
        # float32 as the pipeline's `torch.full([1], guidance_scale, dtype=torch.float32)`;
        # both branches of a true-CFG request take the same embedded guidance
        return {"guidance": torch.full((2,), float(params.guidance), dtype=torch.float32)}  # host: the slots stage it

    @torch.no_grad()
    def encode(self, prompts: Sequence[str | None]) -> list[Conditioning]:
        return self._encode_with_zero_rows(prompts)

    def _encode_texts(self, prompts: list[str]) -> list[Conditioning]:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=list(prompts), prompt_2=None, device=self.device,
                                                    num_images_per_prompt=1,
                                                    max_sequence_length=self.max_sequence_length)
        return [Conditioning(e, p) for e, p in zip(embeds, pooled)]

    def _position_ids(self, text_tokens: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(text ids, latent image ids) as the pipeline builds them: zeros for the text,
        (0, row, column) per packed cell. Cached per shape: they depend on nothing else."""
        cache = self.__dict__.setdefault("_ids", {})
        key = (text_tokens, h, w)
        if key not in cache:
            pipe = self.pipe
            text_dtype = pipe.text_encoder.dtype if pipe.text_encoder is not None else pipe.transformer.dtype
            text_ids = torch.zeros(text_tokens, 3).to(device=self.device, dtype=text_dtype)
            image_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)
            cache[key] = (text_ids, image_ids)
        return cache[key]

    # ---- ControlNets (engine.models.controlnet): FluxControlNetPipeline's ----

    controlnets: dict = {}
    controlnet_class = "FluxControlNetModel"
    controls_on_prompt_row = True  # one ControlNet pass with the prompt, its residuals for both true-CFG calls
    takes_guess_mode = False
    takes_controls_with_image = False

    def control_image_size(self, image) -> tuple[int | None, int | None]:
        return None, None  # the pipeline's default size, the control image resized to it

    def prepare_control_image(self, image, height: int, width: int, generator, controlnet,
                              rows: int = 1) -> torch.Tensor:
        """The pipeline's control latents: the image preprocessed, VAE-encoded, sampled from
        the request's generator, shifted, scaled and packed (one for all rows)."""
        from diffusers.pipelines.flux.pipeline_flux_controlnet import retrieve_latents

        pixels = self.image_pipeline("image").image_processor.preprocess(image, height=height, width=width)
        moments = self.encode_image_moments([pixels.to(self.device, self.vae.dtype)])[0]
        latents = retrieve_latents(moments, generator=generator)
        config = self.vae.config
        latents = (latents - config.shift_factor) * config.scaling_factor
        _, channels, h, w = latents.shape
        return self.pipe._pack_latents(latents, 1, channels, h, w).to(controlnet.dtype)

    def _control_residuals(self, inputs: ModelInputs, packed, timestep, guidance, text_ids, image_ids) -> dict:
        def run(net, rows, images):
            blocks, singles = net(
                hidden_states=packed.index_select(0, rows), controlnet_cond=images, conditioning_scale=1.0,
                timestep=timestep.index_select(0, rows),
                guidance=guidance.index_select(0, rows) if net.config.guidance_embeds else None,
                pooled_projections=inputs.pooled.index_select(0, rows),
                encoder_hidden_states=inputs.hidden.index_select(0, rows), txt_ids=text_ids, img_ids=image_ids,
                return_dict=False)
            return [*(blocks or ()), *(singles or ())]

        total = inputs.controls.summed(run, packed.shape[0])
        split = len(next(iter(self.controlnets.values())).controlnet_blocks)
        return {"controlnet_block_samples": total[:split] or None,
                "controlnet_single_block_samples": total[split:] or None}

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        pipe = self.pipe
        rows, channels, h, w = inputs.sample.shape
        packed = pipe._pack_latents(inputs.sample.to(self.dtype).contiguous(), rows, channels, h, w)
        text_ids, image_ids = self._position_ids(int(inputs.hidden.shape[1]), h, w)
        guidance = inputs.guidance if self.guidance_embedded else None
        residuals = {} if inputs.controls is None else self._control_residuals(
            inputs, packed, inputs.timestep.to(self.dtype) / 1000, inputs.guidance, text_ids, image_ids)
        out = pipe.transformer(
            hidden_states=packed,
            timestep=inputs.timestep.to(self.dtype) / 1000,  # the pipeline's `timestep / 1000`
            guidance=guidance,
            pooled_projections=inputs.pooled,
            encoder_hidden_states=inputs.hidden,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
            **residuals,
        )[0]
        # back to C×h×w, as the pipeline's own decode path unpacks (pixel sizes in, as there)
        scale = self.vae_scale
        return pipe._unpack_latents(out, h * scale, w * scale, scale)
