"""A tiny random-weight `QwenImagePipeline` folder, built offline in seconds, for oracle
tests and the mixed-models benchmark's smoke run.

Written with diffusers' and transformers' own classes and `save_pretrained`, so that
diffusers' own Qwen-Image pipelines (text-to-image, img2img, inpainting) load it as they
load the real checkpoint:

* `tokenizer/`: a Qwen2 byte-level BPE (`engine.models.vocab.write_qwen2_tokenizer`)
  whose vocabulary holds the pipeline's prompt template word for word, so the template's
  system turn is 34 tokens, the pipeline's `prompt_template_encode_start_idx`, as with
  the real tokenizer;
* `text_encoder/`: `Qwen2_5_VLForConditionalGeneration` sized as diffusers' own tests
  size it (hidden 16, 2 layers, 2 heads, mrope sections (1, 1, 2)), its vocabulary the
  tokenizer's;
* `transformer/`: `QwenImageTransformer2DModel` as diffusers' tests (patch 2, 16 input
  channels = 4 latent channels packed 2×2, 2 layers of 3 heads of 16, rotary axes
  (8, 4, 4), joint attention width 16);
* `vae/`: `AutoencoderKLQwenImage` as diffusers' tests (z_dim 4, base 24, two spatial
  halvings so 4 pixels per latent side), with non-trivial `latents_mean`/`latents_std`
  so the engine's normalisation is exercised;
* `scheduler/`: `FlowMatchEulerDiscreteScheduler` with Qwen-Image's own config
  (`QWEN_IMAGE_SCHEDULER`: exponential dynamic shift from the image's token count,
  `shift_terminal` 0.02).
"""
from __future__ import annotations

import pathlib

import torch

from engine.models.vocab import write_qwen2_tokenizer

#: The pipeline's prompt template's words, each one token as in the real vocabulary.
TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", "the", "image", "by", "detailing", "color", "shape",
                  "size", "texture", "quantity", "text", "spatial", "relationships", "of", "objects", "and",
                  "background")

#: Prompt words of the tests.
WORDS = ("a", "an", "with", "on", "red", "green", "blue", "yellow", "circle", "square", "triangle", "cat", "dog",
         "big", "small", "photo", "cross", "bad", "quality", "blurry", "sky", "over", "hills")

#: Qwen-Image's scheduler config (scheduler/scheduler_config.json of the released folder).
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_image_seq_len=256,
                            max_image_seq_len=8192, base_shift=0.5, max_shift=0.9,
                            shift_terminal=0.02, time_shift_type="exponential", invert_sigmas=False,
                            stochastic_sampling=False)


def qwen2_5_vl_config(vocab_size: int, hidden: int = 16, special: dict | None = None, text_ids: dict | None = None):
    """The text encoder's config as diffusers' tests size it, on the tokenizer's vocabulary
    (`special`: its vision token ids; `text_ids`: its bos / eos / pad ids)."""
    from transformers import Qwen2_5_VLConfig

    special = special or {}
    return Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": hidden, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": vocab_size, **(text_ids or {}),
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        hidden_size=hidden, vocab_size=vocab_size, **special)


def build_qwen_image(folder, *, seed: int = 0, words=WORDS, guidance_embeds: bool = False,
                     layers: int = 2) -> pathlib.Path:
    """Write a tiny `QwenImagePipeline` folder (see the module docstring) and return its path."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_qwen2_tokenizer(folder / "tokenizer", TEMPLATE_WORDS + tuple(words))
    ids = tokenizer.convert_tokens_to_ids
    special = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                   vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))

    torch.manual_seed(seed)
    # Qwen2.5-VL's: <|endoftext|> begins and pads, <|im_end|> ends a turn
    text_ids = dict(bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                    pad_token_id=ids("<|endoftext|>"))
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        qwen2_5_vl_config(len(tokenizer), special=special, text_ids=text_ids)).eval()
    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=layers, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=guidance_embeds, axes_dims_rope=(8, 4, 4)).eval()
    torch.manual_seed(seed + 2)
    z_dim = 4
    vae = AutoencoderKLQwenImage(
        base_dim=z_dim * 6, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0]).eval()
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


__all__ = ["QWEN_IMAGE_SCHEDULER", "TEMPLATE_WORDS", "WORDS", "build_qwen_image", "qwen2_5_vl_config"]
