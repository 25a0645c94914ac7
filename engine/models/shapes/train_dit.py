"""Train the embedded `shapes-dit` model, a text-to-image `FluxPipeline` folder on the same
drawn shapes as `shapes`: `python -m engine.models.shapes.train_dit [--out DIR]
[--minutes M | --steps N]`.

The folder is what `FluxPipeline.from_pretrained(DIR)` loads with diffusers alone, in
FLUX.1-schnell's layout (no embedded guidance, no shift):

* `tokenizer/` + `text_encoder/`: the `shapes` model's CLIP tokenizer and its trained
  `CLIPTextModel` (hidden 64) as the starting point, trained further here. FLUX uses only
  its pooled output, which enters every block through the adaptive-norm modulation: that
  is how the prompt reaches the image.
* `tokenizer_2/` + `text_encoder_2/`: a T5 unigram tokenizer and a tiny `T5EncoderModel`
  (d_model 32, one layer) whose final norm is zero, so it says nothing: its output is
  zero at every position. The pipeline pads every prompt to 512 T5 tokens, so the
  transformer's text stream is 512 copies of one learned token (the context embedder's
  bias). Identical tokens stay identical through every block (per-token layers, and text
  positions all rotate by zero), so training runs *one* text token whose key carries an
  attention bias of log 512, which is exactly the attention over 512 copies, at 1/30 of
  the cost; `check_one_token_is_512` verifies this on the model before training.
* `transformer/`: a `FluxTransformer2DModel`, 16 input channels (the VAE's 4 latent
  channels packed 2×2, so a 32×32 image is 16 tokens), `DOUBLE_BLOCKS` dual-stream and
  `SINGLE_BLOCKS` single-stream blocks, 4 heads of 32 (width 128), rotary axes (8, 12, 12).
* `vae/`: the `shapes` model's trained `AutoencoderKL` (32×32×3 → 8×8×4, 4 pixels per
  latent side) with `shift_factor` 0, which FluxPipeline's decode needs set.
* `scheduler/`: `FlowMatchEulerDiscreteScheduler` as schnell's (shift 1, no dynamic
  shifting): the pipeline's `sigmas = linspace(1, 1/steps, steps)` as they are.

FluxPipeline's own default size is 128 latent cells (512×512 here): ask for
`height=32, width=32`, the size it is trained at. The model runs without guidance of any
kind (`guidance` is ignored, true CFG is off by default); the engine's default 20 steps
of flow-matching Euler is its default.

Training, seeded: rectified flow on the VAE's latents, `x_σ = (1 − σ) x0 + σ ε`, the
target the velocity `ε − x0`, σ half logit-normal (0, 1), half uniform; batch 64, AdamW with a
short warm-up and cosine decay; the transformer and CLIP encoder jointly; an EMA of the
weights is what gets saved (every `--checkpoint-every` steps too). `--init DIR` continues
from a folder's transformer and text encoder with a fresh schedule (the shipped weights
are a first run and two continuations: bench/RESULTS.md has the commands).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from tqdm import tqdm
from transformers import CLIPTextModel, T5Config, T5EncoderModel

from engine.models.geometry import NATIVE_SIZE_KEY
from engine.models.shapes.draw import NULL_CONDITION, PROMPTS, SIZE, draw
from engine.models.shapes.train import MAX_LENGTH, WORDS, encode, make_tokenizer, to_tensor
from engine.models.shapes.training import TrainingSteps
from engine.models.vocab import write_t5_tokenizer

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "dit_weights"  # the embedded model itself: `--out` elsewhere to compare runs
SHAPES = HERE / "weights"  # the `shapes` model: its VAE and text encoder are reused
T5_TOKENS = 512  # FluxPipeline's default `max_sequence_length`, what it and the engine pad to
T5_DIM = 32
DOUBLE_BLOCKS, SINGLE_BLOCKS = 2, 4
HEADS, HEAD_DIM = 4, 32
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_image_seq_len=256,
                        max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)


FOLDER_README = """\
# shapes-dit

A `FluxPipeline` folder (FLUX.1-schnell's layout) trained by
`python -m engine.models.shapes.train_dit` on the drawn shapes of the `shapes` model:
prompts "a red circle", ..., "a blue cross" (3 colours × circle, square, triangle, cross).

Defaults to use, in diffusers and in the engine (`--model shapes-dit`):

- size 32×32: the engine's default, as `model_index.json` declares it (`_native_size`);
  in diffusers ask for `height=32, width=32`, as FluxPipeline's own default size is 128
  latent cells, 512×512 with this VAE, which the model was never trained on;
- 20 steps of the folder's FlowMatchEulerDiscreteScheduler (the engine's default 20
  steps, sampler `default` or `flow_euler`);
- no guidance: `guidance` is ignored (no embedded guidance) and true CFG stays off (the
  model was trained without prompt dropout).

The T5 encoder says nothing (zero output); the prompt reaches the transformer through
CLIP's pooled embedding.
"""


# --- components ------------------------------------------------------------------------

def make_t5(tokenizer) -> T5EncoderModel:
    """A one-layer T5 encoder with a zero final norm: zero at every position, whatever the prompt."""
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=T5_DIM, d_kv=T5_DIM // 4, d_ff=2 * T5_DIM, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, layer_norm_epsilon=1e-6, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, is_encoder_decoder=False, use_cache=False,
    ))
    with torch.no_grad():
        t5.encoder.final_layer_norm.weight.zero_()
    return t5.eval().requires_grad_(False)


def make_transformer(pooled_dim: int) -> FluxTransformer2DModel:
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=DOUBLE_BLOCKS, num_single_layers=SINGLE_BLOCKS,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=T5_DIM,
        pooled_projection_dim=pooled_dim, guidance_embeds=False,
        axes_dims_rope=(HEAD_DIM // 4, 3 * HEAD_DIM // 8, 3 * HEAD_DIM // 8),  # as FLUX's (16, 56, 56) of 128
    )


def load_vae() -> AutoencoderKL:
    vae = AutoencoderKL.from_pretrained(SHAPES / "vae").eval()
    vae.register_to_config(shift_factor=0.0)  # FluxPipeline decodes latents / scaling + shift
    return vae


def image_ids(cells: int) -> torch.Tensor:
    """FluxPipeline's latent image ids for a cells×cells packed grid: (0, row, column)."""
    return FluxPipeline._prepare_latent_image_ids(1, cells, cells, "cpu", torch.float32)


def pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def one_token_bias(image_tokens: int) -> torch.Tensor:
    """The attention bias that makes one text token weigh as `T5_TOKENS` identical ones."""
    bias = torch.zeros(1, 1, 1, 1 + image_tokens)
    bias[..., 0] = math.log(T5_TOKENS)
    return bias


@torch.no_grad()
def check_one_token_is_512(transformer: FluxTransformer2DModel, text_token: torch.Tensor, pooled: torch.Tensor,
                           cells: int = 4) -> float:
    """The transformer on one text token with the log-512 bias equals it on 512 copies
    (relative L2 returned; asserts ≤ 1e-4)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, cells * cells, transformer.config.in_channels, generator=gen)
    t = torch.tensor([0.3, 0.9])
    ids = image_ids(cells)
    common = dict(hidden_states=x, timestep=t, pooled_projections=pooled[:2], img_ids=ids, return_dict=False)
    short = transformer(encoder_hidden_states=text_token[:2, :1], txt_ids=torch.zeros(1, 3),
                        joint_attention_kwargs={"attention_mask": one_token_bias(cells * cells)}, **common)[0]
    full = transformer(encoder_hidden_states=text_token[:2, :1].expand(-1, T5_TOKENS, -1),
                       txt_ids=torch.zeros(T5_TOKENS, 3), **common)[0]
    err = float((short - full).norm() / full.norm())
    assert err <= 1e-4, f"one token with the log-{T5_TOKENS} bias is not {T5_TOKENS} copies: {err:.2e}"
    return err


def text_tokens(t5: T5EncoderModel, tokenizer_2, prompts: list[str]) -> torch.Tensor:
    """T5's output as the pipeline computes it (padded to 512), checked constant: one token per prompt."""
    ids = tokenizer_2(prompts, padding="max_length", max_length=T5_TOKENS, truncation=True,
                      return_tensors="pt").input_ids
    with torch.no_grad():
        out = t5(ids)[0]
    assert torch.count_nonzero(out) == 0, "the T5 encoder must say nothing"
    return out[:, :1]


# --- training --------------------------------------------------------------------------

def train(latents: torch.Tensor, labels: torch.Tensor, tok, text_encoder: CLIPTextModel, t5_token: torch.Tensor,
          steps: int | None, minutes: float | None, batch: int = 64, lr: float = 6e-4, seed: int = 0,
          checkpoint=None, checkpoint_every: int = 0, transformer: FluxTransformer2DModel | None = None):
    """Train `transformer` (default: a fresh `make_transformer()`) and `text_encoder`
    jointly; returns their EMAs and the steps run. With `minutes` (and no `steps`) the cosine schedule is laid over a step
    count measured from the speed of the first steps, as in `train.py`."""
    torch.manual_seed(seed)
    if transformer is None:
        transformer = make_transformer(text_encoder.config.hidden_size)
    transformer.requires_grad_(True).train()
    text_encoder.requires_grad_(True).train()
    ema_transformer = copy.deepcopy(transformer).requires_grad_(False)
    ema_text = copy.deepcopy(text_encoder).requires_grad_(False)
    ema_pairs = list(zip(ema_transformer.parameters(), transformer.parameters()))
    ema_pairs += list(zip(ema_text.parameters(), text_encoder.parameters()))
    opt = torch.optim.AdamW([{"params": transformer.parameters()},
                             {"params": text_encoder.parameters(), "lr_scale": 0.2}], lr=lr, weight_decay=1e-4)
    prompt_ids = tok(list(PROMPTS) + [NULL_CONDITION], padding="max_length", max_length=MAX_LENGTH,
                     truncation=True, return_tensors="pt").input_ids
    cells = latents.shape[-1] // 2
    ids, txt_ids = image_ids(cells), torch.zeros(1, 3)
    bias = one_token_bias(cells * cells)
    gen = torch.Generator().manual_seed(seed + 2)
    loop = TrainingSteps(opt, lr, steps, minutes, warmup=200, ema_pairs=ema_pairs,
                         averages=(ema_transformer, ema_text), desc="transformer+text", timing=30,
                         checkpoint=checkpoint, checkpoint_every=checkpoint_every)
    for _ in loop:
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        x0, y = latents[idx], labels[idx]
        noise = torch.randn(x0.shape, generator=gen)
        # σ: half logit-normal(0, 1), which weighs the middle of the path, half uniform,
        # so the ends (where the layout is decided, and the last details) are not starved
        sigma = torch.where(torch.rand(batch, generator=gen) < 0.5, torch.sigmoid(torch.randn(batch, generator=gen)),
                            torch.rand(batch, generator=gen))
        s = sigma.view(-1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        pooled = text_encoder(prompt_ids).pooler_output
        pred = transformer(hidden_states=pack(x_t), timestep=sigma, pooled_projections=pooled[y],
                           encoder_hidden_states=t5_token.expand(batch, -1, -1), txt_ids=txt_ids, img_ids=ids,
                           joint_attention_kwargs={"attention_mask": bias}, return_dict=False)[0]
        loss = F.mse_loss(pred, pack(noise - x0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        loop.done(loss)
    return ema_transformer.eval(), ema_text.eval(), loop.step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    ap.add_argument("--images", type=int, default=30000)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="training steps (default 4672)")
    length.add_argument("--minutes", type=float, help="train for about this long instead of --steps")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--checkpoint-every", type=int, default=250,
                    help="save the EMA pipeline to --out every this many steps (0: only at the end)")
    ap.add_argument("--init", type=pathlib.Path,
                    help="continue from this folder's transformer and text encoder (a new schedule over them)")
    ap.add_argument("--seed", type=int, default=0)
    # one thread: on a shared 2-core machine two threads ran a step 7× slower (they wait on each other)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        args.steps = 4672
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    tok = make_tokenizer(args.out / "tokenizer")
    tokenizer_2 = write_t5_tokenizer(args.out / "tokenizer_2", list(WORDS))
    text_encoder = CLIPTextModel.from_pretrained((args.init or SHAPES) / "text_encoder")
    assert text_encoder.config.vocab_size == len(tok), "the shapes text encoder's vocabulary is this tokenizer's"
    t5 = make_t5(tokenizer_2)
    t5_token = text_tokens(t5, tokenizer_2, list(PROMPTS) + [NULL_CONDITION])[:1]
    torch.manual_seed(args.seed + 5)
    probe = make_transformer(text_encoder.config.hidden_size)
    with torch.no_grad():
        probe.context_embedder.bias.normal_()  # a text token that is not zero, as after training
        pooled = text_encoder(tok(list(PROMPTS[:2]), padding="max_length", max_length=MAX_LENGTH,
                                  return_tensors="pt").input_ids).pooler_output
    check_one_token_is_512(probe, t5_token.expand(2, -1, -1), pooled)
    del probe

    images, labels = draw(args.images, np.random.default_rng(args.seed))
    vae = load_vae()
    latents = encode(vae, to_tensor(images), torch.Generator().manual_seed(args.seed + 3))
    latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def save(transformer, text_encoder, step=None):
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                            text_encoder=text_encoder, tokenizer=tok, text_encoder_2=t5, tokenizer_2=tokenizer_2,
                            transformer=transformer)
        pipe.save_pretrained(args.out, safe_serialization=True)
        index = args.out / "model_index.json"  # the size it is trained at: the engine's default for it
        index.write_text(json.dumps({**json.loads(index.read_text()), NATIVE_SIZE_KEY: SIZE}, indent=2) + "\n")
        for config in args.out.glob("*/config.json"):  # drop the folder each part was loaded from
            data = json.loads(config.read_text())
            if data.pop("_name_or_path", None) is not None:
                config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        (args.out / "README.md").write_text(FOLDER_README)
        if step is not None:
            tqdm.write(f"checkpoint: EMA after {step} steps -> {args.out}")

    start_from = None if args.init is None else FluxTransformer2DModel.from_pretrained(args.init / "transformer")
    transformer, text_encoder, steps = train(latents, torch.from_numpy(labels).long(), tok, text_encoder, t5_token,
                                             args.steps, args.minutes, batch=args.batch, lr=args.lr, seed=args.seed,
                                             checkpoint=save, checkpoint_every=args.checkpoint_every,
                                             transformer=start_from)
    save(transformer, text_encoder)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"trained {steps} steps in {time.time() - start:.0f}s, {size / 2**20:.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
