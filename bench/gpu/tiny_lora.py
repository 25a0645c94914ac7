"""A tiny Stable Diffusion folder (`engine.testing.tiny_pipelines.build_sd`) with LoRA
adapters in a folder of their own, and its model with an `AdapterPool` on a device: shared
by the lora_engine and nosync parts. Adapters: two plain ones on attention and
feed-forward Linears and the 1×1 `proj_in` (A: rank 4, B: rank 8), and a LoCon one on the
3×3 `conv1` convs (L), which moves the pool's layout (a graph key) when loaded or evicted.
Made with PEFT (`engine.testing.loras.make_lora`), as the tests make theirs."""
from __future__ import annotations

import functools
import io
import pathlib
import random
import tempfile

import torch

ADAPTER_SPECS = {
    "A": dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"]),
    "B": dict(r=8, lora_alpha=4, target_modules=["to_k", "to_v", "proj_out", "ff.net.0.proj"]),
    "L": dict(r=4, lora_alpha=4, target_modules=["conv1"]),
}


@functools.lru_cache(maxsize=1)
def tiny_folder() -> tuple[pathlib.Path, pathlib.Path]:
    """(the pipeline folder, the adapter folder), written once per process."""
    from diffusers import StableDiffusionPipeline

    from engine.testing.loras import make_lora
    from engine.testing.tiny_pipelines import build_sd

    root = pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-lora-"))
    folder = build_sd(root / "sd", scheduler="ddim", seed=3)
    lora_dir = root / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    for seed, (name, spec) in enumerate(ADAPTER_SPECS.items(), start=11):
        make_lora(pipe, name, seed, {"unet": spec}, lora_dir / name)
    return folder, lora_dir


def model_with_pool(device: str, budget_bytes: int | None = None, pairs: bool = True):
    """(model, pool) on `device`. `budget_bytes` None with `pairs`: room for the largest
    pair of adapters at once and no more (so a third evicts); None without: 1 GiB."""
    from engine.lora import AdapterPool
    from engine.models.loading import load_model

    folder, lora_dir = tiny_folder()
    model = load_model(folder, device=device)
    pool = AdapterPool(model, lora_dir, budget_bytes=1 << 30)
    if budget_bytes is None and pairs:
        names = sorted(ADAPTER_SPECS)
        budget_bytes = max(pool.nbytes([a, b]) for a in names for b in names if a < b) + pool.resident_bytes
    if budget_bytes is not None:
        pool.budget_bytes = budget_bytes
    return model, pool


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_and_mask(seed: int, size: int) -> tuple[bytes, bytes]:
    """A drawn RGB image and a mask (white: repaint) of `size`×`size` pixels."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), (rng.randrange(256),) * 3)
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.randrange(size - 8), rng.randrange(size - 8)
        draw.rectangle([x0, y0, x0 + 8 + rng.randrange(size // 2), y0 + 8 + rng.randrange(size // 2)],
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle([size // 4, size // 4, 3 * size // 4, 3 * size // 4], fill=255)
    return png_bytes(image), png_bytes(mask)


PROMPTS = ("a red circle", "a blue cat", "the small green dog")


def mixed_requests(tag: str, native: int, seed: int = 0, prompts: tuple = PROMPTS) -> list:
    """(id, GenerateParams) of every kind the engine serves on this model: plain text,
    img2img and inpainting at the native size, each adapter alone, two adapters, LoCon."""
    from engine.protocol import GenerateParams

    image, mask = image_and_mask(seed, native)
    kinds = [
        ("plain", dict()),
        ("a", dict(loras={"A": 1.0})),
        ("img2img", dict(image=image, strength=0.6)),
        ("ab", dict(loras={"A": 0.7, "B": -0.5})),
        ("inpaint", dict(image=image, mask=mask, strength=0.9)),
        ("inpaint-b", dict(image=image, mask=mask, strength=1.0, loras={"B": 1.0})),
        ("locon", dict(loras={"L": 0.8})),
        ("plain2", dict(guidance=1.0)),
        ("img2img-l", dict(image=image, strength=0.8, loras={"L": 1.0, "A": 0.3})),
    ]
    out = []
    for k, (name, fields) in enumerate(kinds):
        base = dict(prompt=prompts[k % len(prompts)], negative_prompt="",
                    steps=4 + k % 3, sampler=["ddim", "euler", "dpmpp_2m", "euler_ancestral"][k % 4],
                    guidance=3.0, seed=seed * 100 + k, output="latent")
        base.update(fields)
        out.append((f"{tag}-{name}", GenerateParams(**base)))
    return out


def no_tf32() -> None:
    """fp32 convs and matmuls without TF32: CUDA results comparable with the CPU's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
