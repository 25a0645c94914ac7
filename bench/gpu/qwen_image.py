"""Part `qwen_image` (for `bench/gpu_check.py` to import): a Qwen-Image-architecture
QwenImageTransformer2DModel (random weights, the released widths, 60 blocks unless cut,
bf16) in the engine's own QwenImageModel (packing, `img_shapes`, per-row prompt lengths
padded per call with the mask, schedule shift), at 512² and 1024²: one request at a time
(batch 1, a request-level server's rate) against the engine's mixed batch of requests whose
prompts differ in length, in useful rows per second. The anchors published their ratios on
an H200: SGLang's continuous batching 3.2× at 512² batch 16, 1.02× at 1024² batch 2.

    from bench.gpu import qwen_image
    qwen_image.run(args)          # args.quick: fewer blocks, steps and requests

Prompt rows are random stand-ins (`text_stand_in.random_rows`) of a length drawn per
prompt, the text encoder being off the denoiser's path.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
import time
import types

import torch
from diffusers import QwenImageTransformer2DModel

from engine.models.geometry import Geometry
from engine.models.model import Conditioning
from engine.models.qwen_image import QwenImageModel

from .engine_runs import finite_output_check, run_engine_steps
from .report import check, row
from .text_stand_in import random_rows

QWEN_IMAGE_TRANSFORMER_CONFIG = dict(  # Qwen/Qwen-Image transformer/config.json, written out (no hub)
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)  # about 20.4 B parameters, as the released transformer

QWEN_IMAGE_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json
    _class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
    base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    time_shift_type="exponential", invert_sigmas=False, stochastic_sampling=False,
)

#: The anchors' published speedups of a batch over one request at a time (H200).
ANCHORS = {512: (16, 3.2), 1024: (2, 1.02)}


def prompt_tokens(text: str, low: int = 12, high: int = 160) -> int:
    """A stand-in prompt's token count, fixed per text: prompts differ in length as real ones do."""
    return low + int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") % (high - low)


def qwen_image_model(config: dict = QWEN_IMAGE_TRANSFORMER_CONFIG, device="cuda", dtype=torch.bfloat16,
                     native_size: int = 1024):
    """The engine's own `QwenImageModel` on a random-weight transformer; the pipeline object
    reduced to what the class reads, prompts mapped to random rows of their own length."""
    class QwenImage(QwenImageModel):
        def __init__(self):
            self.path = pathlib.Path("qwen-image-architecture-random")
            self.device, self.dtype = torch.device(device), dtype
            torch.manual_seed(0)
            with torch.device(device):
                transformer = QwenImageTransformer2DModel(**config)
            transformer = transformer.to(dtype).eval().requires_grad_(False)
            self.pipe = types.SimpleNamespace(transformer=transformer, vae=None,
                                              text_encoder=types.SimpleNamespace(dtype=dtype),
                                              scheduler=types.SimpleNamespace(config=dict(QWEN_IMAGE_SCHEDULER_CONFIG)))
            self.vae = None
            self.scheduler_config = dict(QWEN_IMAGE_SCHEDULER_CONFIG)
            self.size = native_size

        @functools.cached_property
        def geometry(self) -> Geometry:  # the released VAE's: 16 channels, 8 pixels per cell; 2×2 packing
            return Geometry(latent_channels=16, vae_scale=8, size_multiple=16, native_size=self.size)

        def _encode_texts(self, prompts):
            return [Conditioning(random_rows(p, (prompt_tokens(p), config["joint_attention_dim"]), self.device,
                                             dtype)) for p in prompts]

    return QwenImage()


def batch_vs_alone(model, size: int, batch: int, steps: int, device: str = "cuda") -> float:
    """Useful rows per second of `batch` requests at size² sharing the engine's calls (prompts
    of different lengths, compact layout), over the same requests served one at a time (one
    slot: a request-level server's batch 1); reports both."""
    model.size = size
    model.__dict__.pop("geometry", None)
    prompts = [f"prompt {k}" for k in range(batch)]
    fields = lambda k: dict(height=size, width=size, negative_prompt=None)  # noqa: E731 - one row each
    wall, calls, useful, _, _, finished, failed = run_engine_steps(
        model, 1, batch, "compact", steps, None, sampler="flow_euler", device=device, prompts=prompts, params=fields)
    alone = useful / wall
    row("qwen_image", f"Qwen-Image {size}², {batch} requests one at a time (1 slot)", "useful rows/s", alone, "info",
        f"{calls} calls of {useful / max(1, calls):.1f} rows, {finished} finished, {failed} failed")
    wall, calls, useful, _, _, finished, failed = run_engine_steps(
        model, batch, batch, "compact", steps, None, sampler="flow_euler", device=device, prompts=prompts,
        params=fields)
    mixed = useful / wall
    lengths = sorted({prompt_tokens(p) for p in prompts})
    anchor = ANCHORS.get(size)
    note = f" (SGLang: {anchor[1]}× at batch {anchor[0]})" if anchor and anchor[0] == batch else ""
    check("qwen_image", f"Qwen-Image {size}², engine batch {batch}, prompts of {len(lengths)} lengths "
          f"({lengths[0]}–{lengths[-1]} tokens)", "useful rows/s / one at a time", mixed / alone,
          finished == batch and failed == 0 and useful > 0,
          f"{mixed:.2f} vs {alone:.2f} rows/s, {useful / max(1, calls):.1f} useful rows per call{note}")
    return mixed / alone


def run(args) -> None:
    config = dict(QWEN_IMAGE_TRANSFORMER_CONFIG)
    if getattr(args, "quick", False):
        config["num_layers"] = 8  # real widths, fewer blocks: the ratio, not the absolute rate
    t0 = time.perf_counter()
    model = qwen_image_model(config)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.denoiser.parameters())
    row("qwen_image", "Qwen-Image QwenImageTransformer2DModel", "built (s)", time.perf_counter() - t0, "info",
        f"{params / 1e6:.0f} M parameters ({config['num_layers']}/60 blocks; real widths), bf16, random weights")
    finite_output_check("qwen_image", model, "Qwen-Image transformer")
    steps = 4 if getattr(args, "quick", False) else 10
    for size, batches in ((512, (4, 16)), (1024, (2, 4))):
        for batch in batches:
            batch_vs_alone(model, size, batch, steps)
