"""Train the embedded `shapes` model as a text-to-image `StableDiffusionPipeline` folder:
`python -m engine.models.shapes.train [--out DIR] [--minutes M | --steps N]`.

The folder is what `StableDiffusionPipeline.from_pretrained(DIR)` loads with diffusers
alone: `tokenizer/` (a `CLIPTokenizer` over a small hand-written byte-level BPE
vocabulary from `engine.models.vocab`, one token per word, padded to 16), `text_encoder/` (a small `CLIPTextModel`),
`unet/` (a `UNet2DConditionModel` with cross-attention on the text), `vae/` (the trained
`AutoencoderKL`, 32×32×3 → 8×8×4, reused from `weights/vae` unless `--train-vae`) and
`scheduler/` (DDIM, epsilon prediction, scaled-linear betas). By default it writes the
embedded model itself (`engine/models/shapes/weights/`, what `resolve("shapes")` loads),
reading the VAE from there first.

Training, seeded and reproducible on a given machine and thread count:
1. (only with `--train-vae`) an `AutoencoderKL` from scratch, MSE reconstruction (an L1
   loss tends to wash the colours out) plus a small KL term;
2. the text encoder and the UNet jointly (or the text encoder frozen at its random
   init, `--freeze-text-encoder`) on latents times the VAE's `scaling_factor`; the prompt
   is dropped to "" with probability 0.1 so classifier-free guidance works. Batch 128,
   AdamW with a short warm-up and cosine decay; an EMA of the weights is what gets saved.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from tqdm import tqdm
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from engine.models.shapes.draw import COLORS, NULL_CONDITION, PROMPTS, SHAPES, draw
from engine.models.shapes.training import TrainingSteps
from engine.models.vocab import write_clip_tokenizer

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "weights"  # the embedded model itself: `--out` elsewhere to compare runs
DEFAULT_VAE = HERE / "weights" / "vae"
WORDS = ("a",) + COLORS + SHAPES
MAX_LENGTH = 16

SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "timestep_spacing": "trailing",  # a 1- or 2-step schedule still starts from pure noise
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 0,
}


# --- tokenizer -------------------------------------------------------------------------

def make_tokenizer(folder: pathlib.Path) -> CLIPTokenizer:
    tok = write_clip_tokenizer(folder, list(WORDS), model_max_length=MAX_LENGTH)
    check_tokenizer(tok)
    return tok


def check_tokenizer(tok: CLIPTokenizer) -> None:
    """Each word is exactly one token, and every prompt pads to `MAX_LENGTH`."""
    for word in WORDS:
        ids = tok(word, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, (word, ids)
    for prompt in (*PROMPTS, NULL_CONDITION):
        ids = tok(prompt, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
        assert len(ids) == MAX_LENGTH == tok.model_max_length, (prompt, ids)
        assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids, (prompt, ids)


# --- models ----------------------------------------------------------------------------

def make_text_encoder(tok: CLIPTokenizer) -> CLIPTextModel:
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_LENGTH, projection_dim=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    ))


def make_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(64, 128),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),  # attention at 4×4 and in the middle
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=4,  # diffusers' name for the number of heads
        norm_num_groups=32,
    )


def make_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64), layers_per_block=1, norm_num_groups=16,
        mid_block_add_attention=False,
    )


def to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_vae(images: torch.Tensor, steps: int, batch: int) -> AutoencoderKL:
    vae = make_vae()
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in (bar := tqdm(range(steps), desc="vae", mininterval=5)):
        x = images[torch.randint(0, len(images), (batch,), generator=gen)]
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.sample(gen)).sample
        loss = F.mse_loss(rec, x) + 1e-6 * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    return vae.eval()


@torch.no_grad()
def encode(vae: AutoencoderKL, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.cat([vae.encode(images[i:i + 512]).latent_dist.sample(gen) for i in range(0, len(images), 512)])


# --- text-conditioned diffusion --------------------------------------------------------

def train_t2i(latents: torch.Tensor, labels: torch.Tensor, tok: CLIPTokenizer, steps: int | None,
              minutes: float | None, batch: int = 128, lr: float = 1e-3, freeze_text: bool = False,
              p_uncond: float = 0.1, seed: int = 0, checkpoint=None, checkpoint_every: int = 0):
    """Train `make_unet()` and `make_text_encoder()`; returns their EMAs and the steps run.

    With `minutes` (and no `steps`) the cosine schedule is laid over a step count measured
    from the speed of the first steps, so a run fits its time on any machine (it is then
    not bit-reproducible across machines; `--steps` is). Every `checkpoint_every` steps
    `checkpoint(ema_unet, ema_text, step)` is called, so a stopped run leaves a model."""
    torch.manual_seed(seed)
    text_encoder, unet = make_text_encoder(tok), make_unet()
    text_encoder.requires_grad_(not freeze_text)
    ema_unet = copy.deepcopy(unet).requires_grad_(False)
    ema_text = copy.deepcopy(text_encoder).requires_grad_(False)
    trained = list(unet.parameters()) + ([] if freeze_text else list(text_encoder.parameters()))
    ema_pairs = list(zip(ema_unet.parameters(), unet.parameters()))
    if not freeze_text:
        ema_pairs += list(zip(ema_text.parameters(), text_encoder.parameters()))
    noise_sched = DDPMScheduler(**{k: v for k, v in SCHEDULER_CONFIG.items() if k != "set_alpha_to_one"})
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=1e-4)
    # The 12 prompts as users write them ("a red circle": the article shifts every position
    # a causal text encoder sees, so train on the served phrasing) and "" (last): the
    # encoder runs on these 13 once a step and the batch gathers its rows, which is the same
    # function as encoding every prompt in the batch.
    prompt_ids = tok(list(PROMPTS) + [NULL_CONDITION], padding="max_length", max_length=MAX_LENGTH,
                     truncation=True, return_tensors="pt").input_ids
    null = len(PROMPTS)
    gen = torch.Generator().manual_seed(seed + 2)
    loop = TrainingSteps(opt, lr, steps, minutes, warmup=100, ema_pairs=ema_pairs, averages=(ema_unet, ema_text),
                         desc="unet+text" if not freeze_text else "unet", timing=50, checkpoint=checkpoint,
                         checkpoint_every=checkpoint_every)
    for _ in loop:
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        x0, y = latents[idx], labels[idx].clone()
        y[torch.rand(batch, generator=gen) < p_uncond] = null  # prompt dropout for guidance
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), generator=gen)
        with torch.set_grad_enabled(not freeze_text):
            embeds = text_encoder(prompt_ids)[0]
        pred = unet(noise_sched.add_noise(x0, noise, t), t, encoder_hidden_states=embeds[y]).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loop.done(loss)
    return ema_unet.eval(), ema_text.eval(), loop.step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    ap.add_argument("--images", type=int, default=30000)
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="UNet/text-encoder steps (default 1500)")
    length.add_argument("--minutes", type=float, help="train for about this long instead of --steps")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--freeze-text-encoder", action="store_true",
                    help="keep the CLIP text encoder at its random init (default: train it jointly)")
    ap.add_argument("--checkpoint-every", type=int, default=250,
                    help="save the EMA pipeline to --out every this many steps (0: only at the end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vae-from", type=pathlib.Path, default=DEFAULT_VAE,
                    help="the trained VAE folder to reuse (default: %(default)s)")
    ap.add_argument("--train-vae", action="store_true", help="train the VAE from scratch instead")
    ap.add_argument("--vae-steps", type=int, default=1000)
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        args.steps = 1500
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    tok = make_tokenizer(args.out / "tokenizer")
    images, labels = draw(args.images, np.random.default_rng(args.seed))
    images = to_tensor(images)
    if args.train_vae:
        vae = train_vae(images, args.vae_steps, batch=32)
    else:
        vae = AutoencoderKL.from_pretrained(args.vae_from).eval()
    latents = encode(vae, images, torch.Generator().manual_seed(args.seed + 3))
    if args.train_vae:
        vae.register_to_config(scaling_factor=float(1.0 / latents.std()))
    latents = latents * vae.config.scaling_factor

    def save(unet, text_encoder, step=None):
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tok, unet=unet,
            scheduler=DDIMScheduler(**SCHEDULER_CONFIG), safety_checker=None, feature_extractor=None,
            requires_safety_checker=False)
        pipe.save_pretrained(args.out, safe_serialization=True)
        for config in args.out.glob("*/config.json"):  # the VAE's records the folder it came from
            text = config.read_text()
            if '"_name_or_path"' in text:
                data = json.loads(text)
                data.pop("_name_or_path")
                config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        if step is not None:
            tqdm.write(f"checkpoint: EMA after {step} steps -> {args.out}")

    unet, text_encoder, steps = train_t2i(latents, torch.from_numpy(labels).long(), tok, args.steps,
                                          args.minutes, batch=args.batch, lr=args.lr,
                                          freeze_text=args.freeze_text_encoder, seed=args.seed,
                                          checkpoint=save, checkpoint_every=args.checkpoint_every)
    save(unet, text_encoder)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"trained {steps} steps in {time.time() - start:.0f}s "
          f"({'frozen' if args.freeze_text_encoder else 'joint'} text encoder), "
          f"{size / 2**20:.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
