"""Tiny random-weight model folders, built offline in seconds, for oracle tests.

Three layouts, each written with diffusers' and transformers' own classes and
`save_pretrained`, so that diffusers' own pipelines load them as they load
real checkpoints:

* `build_sd`: a `StableDiffusionPipeline` folder (CLIP tokenizer and
  `CLIPTextModel`, `UNet2DConditionModel`, `AutoencoderKL`, a DDIM/PNDM/...
  scheduler with SD's betas), as SD 1.x/2.x are laid out.
* `build_sd3`: a `StableDiffusion3Pipeline` folder (two CLIP encoders with
  projection, optionally a T5 encoder, `SD3Transformer2DModel`, a 16-channel
  `AutoencoderKL` with a shift factor, `FlowMatchEulerDiscreteScheduler`).
* `build_sdxl`: a `StableDiffusionXLPipeline` folder (two CLIP encoders, the
  second with projection, a `UNet2DConditionModel` with SDXL's `text_time`
  added conditioning, Euler with SDXL's betas and spacing).
* `build_flux`: a `FluxPipeline` folder (CLIP for the pooled embedding, T5 for
  the sequence, `FluxTransformer2DModel` with or without guidance embedding, a
  16-channel VAE with a shift factor, FLUX's flow-matching scheduler).
* `build_class_conditional`: the project's own class-conditional layout
  (`unet/` with class embeddings, `vae/`, `scheduler/`, `conditions.json`).

Every builder is deterministic given its seed: each component is created
right after `torch.manual_seed(seed + k)` with its own `k`. Tokenizers are
hand-written (`engine.models.vocab`), so nothing is fetched from a hub.
"""
from __future__ import annotations

import json
import pathlib

import torch

from engine.models.vocab import write_clip_tokenizer, write_t5_tokenizer

#: The tiny text models' vocabulary: each word is one token of every tokenizer.
VOCAB = ("a", "an", "the", "of", "and", "with", "on", "red", "green", "blue", "yellow", "circle", "square",
         "triangle", "cross", "big", "small", "cat", "dog", "photo", "blurry", "ugly")

#: SD 1.x's noise schedule (its scheduler/scheduler_config.json).
SD_BETAS = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")

#: `build_sd(scheduler=...)`: the scheduler class written to the SD folder.
SD_SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_ancestral": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
}

# --- the class-conditional layout (engine.testing.reference.tiny_model builds it) ---

#: The class-conditional tiny model's conditions, in class-index order, the null condition last.
TEST_CONDITIONS = ["a red circle", "a green square", "a blue triangle", ""]

#: Scheduler configs of the class-conditional tiny model, by prediction type.
SCHEDULER_CONFIGS = {
    "epsilon": dict(_class_name="DDPMScheduler", num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                    beta_schedule="scaled_linear", prediction_type="epsilon", timestep_spacing="trailing",
                    clip_sample=False, set_alpha_to_one=False),
    "v_prediction": dict(_class_name="DDPMScheduler", num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                         beta_schedule="linear", prediction_type="v_prediction", timestep_spacing="leading",
                         steps_offset=1, clip_sample=False),
    "sample": dict(_class_name="DDPMScheduler", num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2",
                   prediction_type="sample", timestep_spacing="linspace", clip_sample=True, clip_sample_range=1.0),
    "flow": dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0),
}


def tiny_unet(seed: int = 0, channels: int = 4, size: int = 8, num_class_embeds: int | None = None):
    """The class-conditional tiny `UNet2DModel` (random weights, output of order one)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    unet = UNet2DModel(sample_size=size, in_channels=channels, out_channels=channels, layers_per_block=1,
                       block_out_channels=(32, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=16,
                       norm_num_groups=8,
                       num_class_embeds=len(TEST_CONDITIONS) if num_class_embeds is None else num_class_embeds)
    with torch.no_grad():  # random weights with an output of order one, as a trained model's
        for p in unet.conv_out.parameters():
            p.mul_(20.0)
    return unet.eval().requires_grad_(False)


def tiny_class_vae(seed: int = 0):
    """The class-conditional tiny model's `AutoencoderKL` (4 latent channels, 4 pixels per latent)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, sample_size=32,
                         down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
                         mid_block_add_attention=False).eval().requires_grad_(False)


def build_class_conditional(folder, *, seed: int = 0, prediction_type: str = "epsilon",
                            conditions=None) -> pathlib.Path:
    """Write the project's class-conditional layout to `folder` and return it.

    `unet/` (`UNet2DModel`, `num_class_embeds = len(conditions)`, 8×8×4 latents,
    weights from `tiny_unet(seed)`), `vae/` (`tiny_class_vae(seed + 1)`: 4
    pixels per latent side, so 32×32 images), `scheduler/scheduler_config.json`
    (`SCHEDULER_CONFIGS[prediction_type]`: epsilon, v_prediction, sample or
    flow) and `conditions.json` (default `TEST_CONDITIONS`, null "" last).
    The weights equal those of the test helper it replaces
    (`tiny_model(prediction_type, seed, with_vae=True)`).
    """
    if prediction_type not in SCHEDULER_CONFIGS:
        raise ValueError(f"prediction_type must be one of {sorted(SCHEDULER_CONFIGS)}, not {prediction_type!r}")
    conditions = list(TEST_CONDITIONS if conditions is None else conditions)
    if not conditions or conditions[-1] != "":
        raise ValueError("conditions must end with the null condition \"\"")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tiny_unet(seed, num_class_embeds=len(conditions)).save_pretrained(folder / "unet")
    tiny_class_vae(seed + 1).save_pretrained(folder / "vae")
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(SCHEDULER_CONFIGS[prediction_type], indent=2) + "\n")
    (folder / "conditions.json").write_text(json.dumps(conditions, indent=1) + "\n")
    return folder


# --- diffusers pipeline layouts ---

@torch.no_grad()
def _identity_path_(unet, gain: float = 10.0) -> None:
    """Give a random `UNet2DConditionModel` a path from its input to its output.

    A random UNet's output is uncorrelated with its input, so an epsilon model's
    x0 = (x - sqrt(1-a) eps) / sqrt(a) grows by 1/sqrt(a_T) (~14 with SD's
    betas) over a DDIM run. A trained one predicts eps close to x at high noise.
    So: `conv_in` copies the latent channels into its first channels; the last
    up-resnet's 1×1 shortcut sends that skip to two GroupNorm groups as +gain·x
    and -gain·x; and `conv_out` adds silu(n) - silu(-n) = n, the normalized x.
    The prediction is then ~x/std(x) plus the random (text-conditioned) rest,
    and latents stay O(1) over 50 steps (measured: std ~1 for epsilon and
    sample, at guidance 1 and 7.5).
    """
    c = unet.config.in_channels
    groups = unet.conv_norm_out.num_groups
    width = unet.conv_norm_out.num_channels
    per_group = width // groups
    resnet = unet.up_blocks[-1].resnets[-1]
    skip0 = resnet.in_channels - unet.conv_in.out_channels  # concat(hidden, skip): skip is last
    if (c > per_group or groups < 2 or unet.config.out_channels != c or resnet.conv_shortcut is None
            or unet.conv_in.out_channels != width):
        raise ValueError("UNet layout does not allow the identity path")
    k = unet.conv_in.kernel_size[0] // 2
    unet.conv_in.weight[:c].zero_()
    unet.conv_in.bias[:c].zero_()
    sc = resnet.conv_shortcut
    sc.weight[: 2 * per_group].zero_()
    sc.bias[: 2 * per_group].zero_()
    ko = unet.conv_out.kernel_size[0] // 2
    for i in range(c):
        unet.conv_in.weight[i, i, k, k] = 1.0
        sc.weight[i, skip0 + i, 0, 0] = gain
        sc.weight[per_group + i, skip0 + i, 0, 0] = -gain
        unet.conv_out.weight[i, i, ko, ko] += 1.0
        unet.conv_out.weight[i, per_group + i, ko, ko] -= 1.0


def _clip_text_config(tokenizer, hidden: int, *, layers: int = 2, heads: int = 4, projection_dim: int | None = None,
                      hidden_act: str = "quick_gelu"):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        projection_dim=projection_dim or hidden,
        # the ids of the hand-written vocabulary; pooling reads the first eos_token_id
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _sd_scheduler(name: str, prediction_type: str):
    import diffusers

    if name not in SD_SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SD_SCHEDULERS)}, not {name!r}")
    if prediction_type not in ("epsilon", "v_prediction", "sample"):
        raise ValueError(f"prediction_type must be epsilon, v_prediction or sample, not {prediction_type!r}")
    if name == "pndm" and prediction_type == "sample":
        raise ValueError("diffusers' PNDMScheduler has no sample prediction")
    cls = getattr(diffusers, SD_SCHEDULERS[name])
    # as SD 1.5's scheduler config: leading spacing with steps_offset 1, no clipping
    config = dict(SD_BETAS, prediction_type=prediction_type, steps_offset=1, timestep_spacing="leading",
                  clip_sample=False, set_alpha_to_one=False, skip_prk_steps=True)
    return cls.from_config(config)


def build_sd(folder, *, prediction_type: str = "epsilon", seed: int = 0, sample_size: int = 8,
             scheduler: str = "ddim", words=VOCAB, model_max_length: int = 16,
             cross_attention_dim: int = 32) -> pathlib.Path:
    """Write a tiny `StableDiffusionPipeline` folder and return its path.

    * `tokenizer/`: CLIP BPE (`write_clip_tokenizer`, `words` one token each,
      `model_max_length` 16, padded with `<|endoftext|>`).
    * `text_encoder/`: `CLIPTextModel`, hidden `cross_attention_dim` (32), 2
      layers, 4 heads, 16 positions; the pipeline's prompt embeddings are its
      last hidden state, B×16×32.
    * `unet/`: `UNet2DConditionModel`, 4 latent channels, `sample_size` (8),
      blocks (32, 64): CrossAttnDownBlock2D + DownBlock2D, UpBlock2D +
      CrossAttnUpBlock2D, as SD's (cross-attention at the high resolution).
    * `vae/`: `AutoencoderKL`, blocks (32, 64) so 2 pixels per latent side
      (native image 16×16), 4 latent channels, SD's scaling factor 0.18215.
    * `scheduler/`: `SD_SCHEDULERS[scheduler]` (DDIM by default) with SD 1.5's
      betas and spacing and `prediction_type` (epsilon, v_prediction, sample).
    * no safety checker or feature extractor.
    """
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_clip_tokenizer(folder / "tokenizer", words, model_max_length)

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, cross_attention_dim)).eval()

    torch.manual_seed(seed + 1)
    unet = UNet2DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=4, norm_num_groups=8,
    ).eval()
    if prediction_type in ("epsilon", "sample"):
        # eps (or x0) ~ the normalized input, as a trained model's at high noise; a
        # v_prediction model's random output already keeps latents O(1)
        _identity_path_(unet)

    torch.manual_seed(seed + 2)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=2 * sample_size,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, scaling_factor=0.18215,
    ).eval()

    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=_sd_scheduler(scheduler, prediction_type),
        safety_checker=None, feature_extractor=None, image_encoder=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def build_sd3(folder, *, with_t5: bool = True, seed: int = 0, sample_size: int = 8, words=VOCAB,
              model_max_length: int = 16, clip_hidden: tuple[int, int] = (32, 48), t5_dim: int = 128,
              shift: float = 3.0, layers: int = 2) -> pathlib.Path:
    """Write a tiny `StableDiffusion3Pipeline` folder and return its path.

    * `tokenizer/`, `tokenizer_2/`: CLIP BPE, 16 tokens; the first padded with
      `<|endoftext|>` (CLIP-L), the second with `!` (id 0, OpenCLIP bigG), as SD3's.
    * `text_encoder/`, `text_encoder_2/`: `CLIPTextModelWithProjection`, hidden
      `clip_hidden` (32 and 48) and projection of the same width, so the
      pooled embedding is 32 + 48 = 80 wide (`pooled_projection_dim`); the
      per-token CLIP embeddings (penultimate layer) concatenate to 80 and are
      zero-padded to `t5_dim` (128), as SD3 pads 768 + 1280 = 2048 to 4096.
    * `text_encoder_3/`, `tokenizer_3/` (when `with_t5`): `T5EncoderModel`
      (d_model `t5_dim`, 2 layers, gated-gelu as T5 v1.1) and a unigram T5
      tokenizer; without T5 both are saved as None and the pipeline feeds
      zeros of width `joint_attention_dim` instead.
    * `transformer/`: `SD3Transformer2DModel`, `sample_size` (8), patch 2, 16
      channels, `layers` (2) layers, 4 heads of 8 (inner and caption projection width
      32), `joint_attention_dim = t5_dim`, `pos_embed_max_size` 16 (latents up
      to 32×32).
    * `vae/`: `AutoencoderKL`, 16 latent channels, blocks (32, 64) so 2 pixels
      per latent side (native image 16×16), no quant convs, SD3's scaling
      factor 1.5305 and shift factor 0.0609.
    * `scheduler/`: `FlowMatchEulerDiscreteScheduler`, 1000 steps, `shift` (3.0).

    The prompt embeddings are B×(16 + max_sequence_length)×128, with or
    without T5 (the pipeline's `max_sequence_length` defaults to 256).
    """
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if t5_dim < sum(clip_hidden):
        raise ValueError(f"t5_dim ({t5_dim}) must be at least the concatenated CLIP width ({sum(clip_hidden)})")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_clip_tokenizer(folder / "tokenizer", words, model_max_length)
    tokenizer_2 = write_clip_tokenizer(folder / "tokenizer_2", words, model_max_length, pad_token="!")

    torch.manual_seed(seed)
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(tokenizer, clip_hidden[0])).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = CLIPTextModelWithProjection(
        _clip_text_config(tokenizer_2, clip_hidden[1], hidden_act="gelu")).eval()

    text_encoder_3 = tokenizer_3 = None
    if with_t5:
        tokenizer_3 = write_t5_tokenizer(folder / "tokenizer_3", words)
        torch.manual_seed(seed + 2)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=t5_dim, d_kv=t5_dim // 4, d_ff=2 * t5_dim, num_layers=2,
            num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
            pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id,
            decoder_start_token_id=tokenizer_3.pad_token_id, tie_word_embeddings=False,
            is_encoder_decoder=False, use_cache=False,
        )).eval()

    torch.manual_seed(seed + 3)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
        joint_attention_dim=t5_dim, pooled_projection_dim=sum(clip_hidden), pos_embed_max_size=16,
    ).eval()

    torch.manual_seed(seed + 4)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, sample_size=2 * sample_size,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def _t5_encoder(tokenizer, width: int):
    """A tiny `T5EncoderModel` (gated-gelu as T5 v1.1, 2 layers, 4 heads)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        is_encoder_decoder=False, use_cache=False,
    )).eval()


#: SDXL base's scheduler config (scheduler/scheduler_config.json): Euler, leading spacing.
SDXL_SCHEDULER = dict(SD_BETAS, prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
                      interpolation_type="linear", use_karras_sigmas=False, sample_max_value=1.0,
                      clip_sample=False, set_alpha_to_one=False, skip_prk_steps=True)


def build_sdxl(folder, *, seed: int = 0, sample_size: int = 8, words=VOCAB, model_max_length: int = 16,
               clip_hidden: tuple[int, int] = (32, 48), projection_dim: int = 40, time_embed_dim: int = 8,
               force_zeros_for_empty_prompt: bool = True) -> pathlib.Path:
    """Write a tiny `StableDiffusionXLPipeline` folder and return its path.

    * `tokenizer/`, `tokenizer_2/`: CLIP BPE, 16 tokens; the first padded with
      `<|endoftext|>` (CLIP-L), the second with `!` (OpenCLIP bigG), as SDXL's.
    * `text_encoder/`: `CLIPTextModel`, hidden 32; `text_encoder_2/`:
      `CLIPTextModelWithProjection`, hidden 48, projection `projection_dim`
      (40, the pooled width). The prompt embeddings are the penultimate hidden
      states of both, concatenated: B×16×80 (SDXL: 768 + 1280 = 2048).
    * `unet/`: `UNet2DConditionModel` with SDXL's layout in small: blocks
      (32, 64), DownBlock2D + CrossAttnDownBlock2D (attention only at the low
      resolution), linear projections, `addition_embed_type="text_time"` with
      `addition_time_embed_dim` 8, so the added embedding takes 6 × 8 time ids
      + 40 pooled = 88; `sample_size` 8; an identity path as `build_sd`'s so
      that latents stay O(1) under Euler.
    * `vae/`: `AutoencoderKL`, blocks (32, 64) so 2 pixels per latent side
      (native image 16×16), SDXL's scaling factor 0.13025.
    * `scheduler/`: `EulerDiscreteScheduler` as SDXL base's (`SDXL_SCHEDULER`).
    * `force_zeros_for_empty_prompt` (True, as SDXL base) in `model_index.json`.
    """
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_clip_tokenizer(folder / "tokenizer", words, model_max_length)
    tokenizer_2 = write_clip_tokenizer(folder / "tokenizer_2", words, model_max_length, pad_token="!")

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, clip_hidden[0])).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = CLIPTextModelWithProjection(
        _clip_text_config(tokenizer_2, clip_hidden[1], projection_dim=projection_dim, hidden_act="gelu")).eval()

    torch.manual_seed(seed + 2)
    unet = UNet2DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=sum(clip_hidden), attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + projection_dim, norm_num_groups=8,
    ).eval()
    _identity_path_(unet)

    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=2 * sample_size,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, scaling_factor=0.13025,
    ).eval()

    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt, add_watermarker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


#: FLUX.1's scheduler configs (scheduler/scheduler_config.json): dev shifts by the image's
#: sequence length (`mu`), schnell by a fixed 1.0 (no shift).
FLUX_SCHEDULERS = {
    True: dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
               max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
    False: dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_image_seq_len=256,
                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15),
}


def build_flux(folder, *, guidance_embeds: bool = True, seed: int = 0, words=VOCAB, model_max_length: int = 16,
               clip_hidden: int = 32, t5_dim: int = 32, head_dim: int = 16, heads: int = 2, layers: int = 1,
               single_layers: int = 1) -> pathlib.Path:
    """Write a tiny `FluxPipeline` folder and return its path: FLUX.1-dev's layout with
    `guidance_embeds` (True), FLUX.1-schnell's without.

    * `tokenizer/`: CLIP BPE, 16 tokens; `text_encoder/`: `CLIPTextModel`,
      hidden 32: only its pooled output is used (`pooled_projection_dim` 32).
    * `tokenizer_2/`: a unigram T5 tokenizer; `text_encoder_2/`:
      `T5EncoderModel`, d_model `t5_dim` (32), 2 layers. The pipeline pads the
      prompt to `max_sequence_length` (its default 512) T5 tokens, so the prompt
      embeddings are B×512×32 (`joint_attention_dim`).
    * `transformer/`: `FluxTransformer2DModel`, 64 input channels (16 latent
      channels packed 2×2), `layers` double and `single_layers` single blocks (1 and 1), 2 heads of 16,
      rotary axes (4, 6, 6), `guidance_embeds` as given. No `sample_size`: the
      pipeline's default size is its own `default_sample_size` (128 latent
      cells, so 256×256 pixels here); tests pass small sizes.
    * `vae/`: `AutoencoderKL`, 16 latent channels, blocks (32, 64) so 2 pixels
      per latent side (4 per packed token), no quant convs, FLUX's scaling
      factor 0.3611 and shift factor 0.1159.
    * `scheduler/`: `FlowMatchEulerDiscreteScheduler` as FLUX.1's (`FLUX_SCHEDULERS`):
      dev with dynamic shifting (`mu` from the image sequence length), schnell
      without.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_clip_tokenizer(folder / "tokenizer", words, model_max_length)
    tokenizer_2 = write_t5_tokenizer(folder / "tokenizer_2", words)

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, clip_hidden)).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = _t5_encoder(tokenizer_2, t5_dim)

    torch.manual_seed(seed + 2)
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)  # as FLUX's (16, 56, 56) of 128
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=t5_dim, pooled_projection_dim=clip_hidden,
        guidance_embeds=guidance_embeds, axes_dims_rope=rope,
    ).eval()

    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()

    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULERS[guidance_embeds]), vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


__all__ = ["VOCAB", "SD_SCHEDULERS", "TEST_CONDITIONS", "SCHEDULER_CONFIGS", "SDXL_SCHEDULER", "FLUX_SCHEDULERS",
           "tiny_unet", "tiny_class_vae", "build_class_conditional", "build_sd", "build_sd3", "build_sdxl",
           "build_flux"]
