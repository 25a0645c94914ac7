"""`StableDiffusionXLPipeline` folders: SDXL and its fine-tunes.

What SDXL adds to SD, and where each piece lives here:

- two CLIP encoders, through the pipeline's own `encode_prompt`: the penultimate hidden
  states of both concatenated (`hidden`), the projected pooled output of the second
  (`pooled`);
- micro-conditioning: `add_time_ids` = original size + crop top-left + target size,
  built per request by the pipeline's own `_get_add_time_ids` (defaults as the
  pipeline's: original = target = (height, width), crop (0, 0)). They are a per-row
  request input (`time_ids`), never an embedding-cache entry, so requests with different
  sizes' ids or crops share a denoiser call. The unconditional branch's ids are the
  conditional ones, as the pipeline's when no `negative_original_size` /
  `negative_target_size` is given (the API has neither);
- `force_zeros_for_empty_prompt`: with no negative prompt given (`negative_prompt` None)
  the unconditional branch's rows are zeros, not the encoded empty prompt; a given ""
  is encoded, as the pipeline distinguishes them.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.models.inputs import ModelInputs
from engine.models.model import Conditioning
from engine.models.stable_diffusion import StableDiffusionModel


class StableDiffusionXLModel(StableDiffusionModel):
    """SDXL: a `UNet2DConditionModel` with `text_time` added conditioning. Guidance and
    LCM's guidance embedding (`timestep_cond`) as SD's, which this class extends."""

    pipeline_class = "StableDiffusionXLPipeline"
    image_pipelines = {"image": "StableDiffusionXLImg2ImgPipeline", "mask": "StableDiffusionXLInpaintPipeline"}
    takes_micro_conditioning = True

    @property
    def force_zeros_for_empty_prompt(self) -> bool:
        return bool(self.pipe.config.get("force_zeros_for_empty_prompt", False))

    def negative_text(self, params) -> str | None:
        """None (zero rows) when no negative prompt is given and the folder says
        `force_zeros_for_empty_prompt`, as the pipeline's `encode_prompt` decides."""
        if params.negative_prompt is None and self.force_zeros_for_empty_prompt:
            return None
        return params.negative_prompt or ""

    def request_inputs(self, params, height: int, width: int) -> dict[str, torch.Tensor]:
        inputs = super().request_inputs(params, height, width)  # LCM-SDXL's timestep_cond
        # the pipeline's defaults: original and target size the output's, crop at (0, 0)
        original = tuple(params.original_size or (height, width))
        crops = tuple(params.crops_coords_top_left or (0, 0))
        target = tuple(params.target_size or (height, width))
        pipe = self.pipe
        projection = (int(pipe.text_encoder_2.config.projection_dim) if pipe.text_encoder_2 is not None
                      else int(self.conditioning_layout[1][0]))
        # float32 here (the slot's table); `forward` casts to the weights' dtype, as the
        # pipeline builds them in the prompt embeddings' dtype
        time_ids = pipe._get_add_time_ids(original, crops, target, dtype=torch.float32,
                                          text_encoder_projection_dim=projection)
        # (cond, uncond): the negative ids are the positive ones, as the pipeline's default; on
        # the host: the slot storage stages them to the device without waiting for the stream
        inputs["time_ids"] = time_ids.repeat(2, 1)
        return inputs

    @torch.no_grad()
    def encode(self, prompts: Sequence[str | None]) -> list[Conditioning]:
        return self._encode_with_zero_rows(prompts)

    def _encode_texts(self, prompts: list[str]) -> list[Conditioning]:
        # do_classifier_free_guidance=False: each text is encoded as a prompt; a negative
        # prompt tokenized and encoded as the pipeline's negative branch gives the same rows
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False)
        return [Conditioning(e, p) for e, p in zip(embeds, pooled)]

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        cond = None if inputs.timestep_cond is None else inputs.timestep_cond.to(self.dtype)
        added = {"text_embeds": inputs.pooled, "time_ids": inputs.time_ids.to(self.dtype)}
        residuals = {} if inputs.controls is None else inputs.controls.residuals(
            inputs.sample, inputs.timestep, inputs.hidden, added)
        return self.pipe.unet(inputs.sample, inputs.timestep, encoder_hidden_states=inputs.hidden,
                              timestep_cond=cond, added_cond_kwargs=self.ip_adapter_inputs(inputs, added),
                              return_dict=False, **residuals)[0]
