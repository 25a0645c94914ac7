"""`QwenImagePipeline` folders (and the same folder saved as `QwenImageImg2ImgPipeline` or
`QwenImageInpaintPipeline`): Qwen-Image.

What it differs in from FLUX, whose per-request pieces it shares (`FluxModel`: the
samplers, `true_cfg` as two rows, the embedded guidance of a distilled transformer, the
schedule's `sigmas` and resolution-dependent `mu`, img2img's start step):

- the text encoder is a Qwen2.5-VL language model, through the pipeline's own
  `encode_prompt` (its chat template, the template's 34 system tokens dropped, the last
  hidden state): each prompt's embedding has its own length, and the embedding cache
  holds it at that length (`Conditioning.hidden` is tokens × width, bytes as long as the
  prompt). A call whose rows have prompts of different lengths pads them with zeros to
  its longest and passes the mask of real tokens (`ModelInputs.hidden_mask`), as the
  pipeline pads a batch of prompts; a call whose rows are all one length has no mask, as
  the pipeline passes none for a single prompt. The length is never part of a group key;
- `true_cfg` combines the two rows as the pipeline does, norm-preserving:
  `comb = neg + s · (cond − neg)`, then `comb · (‖cond‖ / ‖comb‖)` per packed token
  (`combine_guidance`, which the runner calls for every guided pair before the fused
  update; it writes the result into both rows, whose kernel combine is then exactly it);
- latents are the VAE's C×h×w (16 channels for the real model), packed 2×2 into tokens
  only inside `forward`, with `img_shapes` per row as the pipeline passes them;
- the VAE is `AutoencoderKLQwenImage`, a video VAE taking one frame (B×C×1×H×W) and
  normalising latents with `latents_mean` / `latents_std`: the image encode, the image
  latents and the decoder here do as the pipelines do;
- img2img and inpainting follow `QwenImageImg2ImgPipeline` / `QwenImageInpaintPipeline`
  (default strength 0.6; inpainting always starts from the image noised to its first
  timestep, and blends the known region back after every step).

`QwenImageEditPipeline` folders (`QwenImageEditModel`, its own checkpoint) edit an image:
every request has one. At admission the image kind resizes it to the pipeline's
`calculate_dimensions` size (1024² area at the image's aspect ratio) and encodes it with
the VAE (the distribution's mode, no random draw) into the request's `image_latents`,
appended to its rows' image tokens in `forward`; the preparation phase hands the same
image to the prompt encode, where the Qwen2.5-VL processor puts its vision tokens in the
prompt (the embedding cache keys such rows by text and image content). The output is that
size: rows of one latent shape then have image latents of one shape, so they share calls.
`QwenImageEditPlusPipeline` folders (Qwen-Image-Edit-2509) take the same road with one
image a request (`QwenImageEditPlusModel`).
"""
from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np
import torch

from engine.models.flux import FLUX_SAMPLERS, FluxModel
from engine.models.inputs import ModelInputs
from engine.models.model import Conditioning, DiffusionModel, VaeDecoder, to_device


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """rows × C × h × w → rows × (h/2 · w/2) × 4C: the pipeline's `_pack_latents`."""
    rows, channels, h, w = latents.shape
    latents = latents.view(rows, channels, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(rows, (h // 2) * (w // 2), channels * 4)


def _unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `_pack`, as the pipeline's `_unpack_latents` (without its frame axis)."""
    rows, _, width = tokens.shape
    tokens = tokens.view(rows, h // 2, w // 2, width // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(rows, width // 4, h, w)


class QwenImageVaeDecoder(VaeDecoder):
    """Final latents → uint8 images as `QwenImagePipeline` decodes them: un-normalised with
    the VAE's `latents_mean` / `latents_std`, decoded as one frame."""

    def __init__(self, vae, device: torch.device, dtype: torch.dtype = torch.float32):
        self.vae, self.device, self.dtype = vae, device, dtype
        self.scale = 2 ** len(vae.config.temperal_downsample)

    @classmethod
    def from_folder(cls, path: pathlib.Path, device: str | torch.device = "cpu") -> "QwenImageVaeDecoder":
        from diffusers import AutoencoderKLQwenImage

        vae = AutoencoderKLQwenImage.from_pretrained(pathlib.Path(path) / "vae", low_cpu_mem_usage=False)
        device = torch.device(device)
        return cls(vae.to(device).eval().requires_grad_(False), device)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        config = self.vae.config
        latents = latents.to(self.device, self.vae.dtype).unsqueeze(2)  # one frame
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        images = self.vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        images = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return images.permute(0, 2, 3, 1).cpu().numpy()


def combine_norm_preserving(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG that keeps the conditional prediction's norm, as Qwen-Image's pipelines
    combine their two branches: `comb = uncond + scale · (cond − uncond)`, rescaled per
    token (the last axis: one packed token's channels) by ‖cond‖ / ‖comb‖. The operations
    and their order are the pipeline's, so a row combined here equals the pipeline's own.

    Models whose pipeline combines so (`combines_guidance`) run this before the fused
    update and write the result into both branch rows: the kernel's `u + g · (c − u)` of
    two equal rows is that row exactly."""
    comb = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / noise_norm)


class QwenImageModel(FluxModel):
    pipeline_class = "QwenImagePipeline"
    image_pipelines = {"image": "QwenImageImg2ImgPipeline", "mask": "QwenImageInpaintPipeline"}
    max_sequence_length = 512  # the pipeline's `__call__` default: prompt embeddings cut there
    #: the runner hands every guided pair to `combine_guidance` before the fused update
    combines_guidance = True
    #: under CUDA graphs a call's prompt rows are padded to a multiple of this many tokens:
    #: one graph per (rows, text bucket), not per prompt length
    text_length_multiple = 64

    def check_params(self, params) -> tuple[str, str] | None:
        if params.sampler not in FLUX_SAMPLERS:
            return "sampler", f"{self.pipeline_class} runs {' or '.join(FLUX_SAMPLERS)}, not {params.sampler!r}"
        return DiffusionModel.check_params(self, params)

    # ---- prompts: each at its own length -----------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: Sequence[str | None]) -> list[Conditioning]:
        return self._encode_texts(list(prompts))

    def _encode_texts(self, prompts: list[str]) -> list[Conditioning]:
        """One batched pass of the pipeline's own `encode_prompt`; each prompt's rows cut to
        its own tokens (the mask the pipeline returns) and copied out of the batch, so an
        entry holds only its own bytes."""
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        return [Conditioning(e[:n].clone()) for e, n in zip(embeds, lengths)]

    @property
    def text_width(self) -> int:
        return int(self.pipe.transformer.config.joint_attention_dim)

    @property
    def conditioning_layout(self) -> tuple:
        """Prompt rows of any length up to `max_sequence_length` (None: variable), the
        transformer's text width, the text encoder's dtype: one group for every prompt."""
        return ((None, self.text_width), None, str(self.pipe.text_encoder.dtype))

    @property
    def conditioning_nbytes(self) -> int:
        """What admission reserves per prompt: the longest embedding the pipeline keeps."""
        return self.max_sequence_length * self.text_width * self.pipe.text_encoder.dtype.itemsize

    # ---- the denoiser ------------------------------------------------------------------

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        rows, _, h, w = inputs.sample.shape
        packed = _pack(inputs.sample.to(self.dtype).contiguous())
        tokens = packed.shape[1]
        shapes = [(1, h // 2, w // 2)]
        if inputs.image_latents is not None:  # Edit: the image's tokens after the noisy latents'
            image = inputs.image_latents.to(self.dtype)
            packed = torch.cat([packed, _pack(image.contiguous())], dim=1)
            shapes.append((1, image.shape[2] // 2, image.shape[3] // 2))
        guidance = inputs.guidance if self.guidance_embedded else None
        out = self.pipe.transformer(
            hidden_states=packed,
            timestep=inputs.timestep.to(self.dtype) / 1000,  # the pipeline's `timestep / 1000`
            guidance=guidance,
            encoder_hidden_states_mask=inputs.hidden_mask,
            encoder_hidden_states=inputs.hidden,
            img_shapes=[shapes] * rows,
            return_dict=False,
        )[0]
        return _unpack(out[:, :tokens], h, w)

    def combine_guidance(self, out: torch.Tensor, latent_shape: tuple[int, int, int], cond_rows: Sequence[int],
                         uncond_rows: Sequence[int], scales: Sequence[float]) -> None:
        """The pipeline's norm-preserving true-CFG combine of each (cond, uncond) pair of
        `out` (rows × numel), written into both rows. Pairs with the same scale in one
        pass; the scale a Python float, as the pipeline multiplies by it."""
        by_scale: dict[float, list[tuple[int, int]]] = {}
        for c, u, s in zip(cond_rows, uncond_rows, scales):
            by_scale.setdefault(float(s), []).append((c, u))
        for scale, pairs in by_scale.items():
            cond_index = to_device(torch.tensor([c for c, _ in pairs]), out.device)
            uncond_index = to_device(torch.tensor([u for _, u in pairs]), out.device)
            cond = _pack(out.index_select(0, cond_index).view(len(pairs), *latent_shape))
            uncond = _pack(out.index_select(0, uncond_index).view(len(pairs), *latent_shape))
            guided = _unpack(combine_norm_preserving(cond, uncond, scale), *latent_shape[1:]).reshape(len(pairs), -1)
            out.index_copy_(0, cond_index, guided)
            out.index_copy_(0, uncond_index, guided)

    # ---- image inputs: the VAE takes one frame, latents normalised per channel ------------

    def inpaint_starts_from_noise(self, strength: float) -> bool:
        """QwenImageInpaintPipeline noises the image to its first timestep at any strength."""
        return False

    @torch.no_grad()
    def encode_image_moments(self, pixels: Sequence[torch.Tensor]) -> list:
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        vae = self.vae
        # the pipeline encodes in the prompt embeddings' dtype, the text encoder's
        batch = torch.cat(list(pixels)).to(self.device, self.pipe.text_encoder.dtype).unsqueeze(2)
        parameters = vae.encode(batch).latent_dist.parameters
        return [AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(parameters[i:i + 1]))
                for i in range(len(pixels))]

    def image_latents(self, moments, generator: torch.Generator) -> torch.Tensor:
        """`_encode_vae_image`: a sample of latent_dist from the request's generator,
        `(latents − mean) · (1 / std)`; one frame, float32 as the engine keeps latents."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents

        latents = retrieve_latents(moments, generator=generator)
        config = self.vae.config
        mean = to_device(torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1), latents.device)
        std = to_device(1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1), latents.device)
        latents = (latents - mean.to(latents.dtype)) * std.to(latents.dtype)
        return latents[:, :, 0].to(torch.float32)

    @property
    def decoder(self) -> QwenImageVaeDecoder:
        decoder = self.__dict__.get("_decoder")
        if decoder is None:
            decoder = self.__dict__["_decoder"] = QwenImageVaeDecoder(self.vae, self.device, self.dtype)
        return decoder


class QwenImageEditModel(QwenImageModel):
    """`QwenImageEditPipeline` folders: every request edits its `image` (see the module
    docstring). What differs from text-to-image, as the pipeline does it: the prompt
    template with the image's vision tokens (the pipeline's own `encode_prompt` with the
    resized image), no truncation of the prompt rows, the image latents as a per-row input
    (the VAE's mode, normalised as `(x − mean) / std`), the output size the image's."""

    pipeline_class = "QwenImageEditPipeline"
    image_pipelines = {"image": "QwenImageEditPipeline"}

    def image_tokens(self, latent_shape) -> int:
        """The output's tokens and, appended to them, the image's (of the output's size)."""
        return 2 * super().image_tokens(latent_shape)
    #: the image kind conditions every step on the image (no strength, from noise)
    conditions_on_image = True
    #: the preparation phase encodes each prompt with its request's image
    prompt_takes_image = True
    #: the pipeline's target area for the image, at its aspect ratio
    image_area = 1024 * 1024
    #: the pipeline's module, whose `calculate_dimensions` (and areas) it calls
    pipeline_module = "pipeline_qwenimage_edit"

    @property
    def module(self):
        import importlib

        return importlib.import_module(f"diffusers.pipelines.qwenimage.{self.pipeline_module}")

    def check_params(self, params) -> tuple[str, str] | None:
        if params.image is None:
            return "image", f"{self.pipeline_class} edits an image: `image` is required"
        return super().check_params(params)

    def image_pipeline(self, field: str):
        return self.pipe

    def calculated_size(self, image, area: int | None = None) -> tuple[int, int]:
        """(height, width) the pipeline resizes the image to: `calculate_dimensions` of its
        target area (`area`, default `image_area`) at the image's aspect ratio, looked up on
        the pipeline's module at each call, as the pipeline does."""
        dims = self.module.calculate_dimensions(area or self.image_area, image.width / image.height)
        return int(dims[1]), int(dims[0])

    def image_size(self, image, height: int | None, width: int | None) -> tuple[int, int]:
        """The pipeline's default output size: the calculated size, rounded down to its multiple."""
        calculated_height, calculated_width = self.calculated_size(image)
        multiple = self.pipe.vae_scale_factor * 2
        height, width = height or calculated_height, width or calculated_width
        return height // multiple * multiple, width // multiple * multiple

    def prompt_image(self, image):
        """The image as the pipeline hands it to the processor: resized to the calculated size."""
        height, width = self.calculated_size(image)
        return self.pipe.image_processor.resize(image, height, width)

    def preprocess_image(self, image, height: int, width: int) -> torch.Tensor:
        """The VAE's input as the pipeline makes it: resized to the calculated size (whatever
        the output size), then preprocessed at that size."""
        calculated_height, calculated_width = self.calculated_size(image)
        pixels = self.pipe.image_processor.preprocess(self.prompt_image(image), calculated_height, calculated_width)
        return pixels.to(dtype=torch.float32)

    def edit_image_latents(self, moments) -> torch.Tensor:
        """`_encode_vae_image` with `sample_mode="argmax"`: the mode, `(x − mean) / std`, one
        frame; in the weights' dtype, as the pipeline concatenates it with the latents."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents

        latents = retrieve_latents(moments, sample_mode="argmax")
        config = self.vae.config
        mean = to_device(torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1), latents.device)
        std = to_device(torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1), latents.device)
        latents = (latents - mean.to(latents.dtype)) / std.to(latents.dtype)
        return latents[:, :, 0].to(self.dtype)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str | None], images: Sequence | None = None) -> list[Conditioning]:
        if images is None:
            raise ValueError(f"{self.pipeline_class} encodes each prompt with its image")
        return self._encode_texts(list(prompts), [self.prompt_image(image) for image in images])

    def _encode_texts(self, prompts: list[str], images: list | None = None) -> list[Conditioning]:
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), image=images, device=self.device,
                                               num_images_per_prompt=1)
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        return [Conditioning(e[:n].clone()) for e, n in zip(embeds, lengths)]

    @property
    def conditioning_nbytes(self) -> int:
        """What admission reserves per prompt: the pipeline's longest text (1024 tokens) and
        the vision tokens of an image of the target area (one per 28×28 pixels)."""
        tokens = self.pipe.tokenizer_max_length + self.image_area // (28 * 28)
        return tokens * self.text_width * self.pipe.text_encoder.dtype.itemsize


class QwenImageEditPlusModel(QwenImageEditModel):
    """`QwenImageEditPlusPipeline` folders (Qwen-Image-Edit-2509), one image a request (the
    API's `image`). As Edit, but as its pipeline does it: the text encoder sees the image
    resized to its `CONDITION_IMAGE_SIZE` area under a "Picture 1:" prefix, the VAE the image
    preprocessed straight at its `VAE_IMAGE_SIZE` area; the output size is the 1024² area's.
    Its template numbers every image of an encoder call into every prompt of it, so each
    prompt is encoded in a call of its own."""

    pipeline_class = "QwenImageEditPlusPipeline"
    image_pipelines = {"image": "QwenImageEditPlusPipeline"}
    pipeline_module = "pipeline_qwenimage_edit_plus"

    def prompt_image(self, image):
        height, width = self.calculated_size(image, self.module.CONDITION_IMAGE_SIZE)
        return self.pipe.image_processor.resize(image, height, width)

    def preprocess_image(self, image, height: int, width: int) -> torch.Tensor:
        vae_height, vae_width = self.calculated_size(image, self.module.VAE_IMAGE_SIZE)
        return self.pipe.image_processor.preprocess(image, vae_height, vae_width).to(dtype=torch.float32)

    def _encode_texts(self, prompts: list[str], images: list | None = None) -> list[Conditioning]:
        rows = []
        for prompt, image in zip(prompts, images):
            rows += super()._encode_texts([prompt], [image])
        return rows
