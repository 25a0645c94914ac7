"""IP-Adapter per row (SD 1.x/2.x and SDXL): an image as a prompt, as diffusers'
`load_ip_adapter` + `set_ip_adapter_scale` run it, decided per request inside a shared call.

Loaded once at start (`--ip-adapter PATH`: a folder holding the weights file
`load_ip_adapter` takes and its `image_encoder/`) by the pipeline's own `load_ip_adapter`,
which swaps the UNet's cross-attention processors for diffusers' IP-Adapter processors and
adds the image projection. Every row of every call then carries `ip_embeds` (its image
embedding: the image encoder's for the prompt's row, zeros for the negative prompt's, as
the pipeline's `prepare_ip_adapter_image_embeds`; zeros for a request without an image)
and `ip_scale` (the request's scale on both of its rows; 0 for a request without an image,
whose rows so get exactly their plain output: `hidden + 0 · ip`).

The processors multiply the IP branch by their `scale`; `RowScale` makes that one factor
per row, with the pipeline's arithmetic (a float32 factor, the product in the hidden
states' dtype).
"""
from __future__ import annotations

import pathlib

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def ip_adapter_weights(path) -> pathlib.Path:
    """The one weights file in an IP-Adapter folder; ValueError saying what is wrong."""
    path = pathlib.Path(path)
    if not (path / "image_encoder").is_dir():
        raise ValueError(f"{path}: an IP-Adapter folder holds its image encoder in image_encoder/")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if len(files) != 1:
        raise ValueError(f"{path}: one IP-Adapter weights file (.safetensors or .bin) expected, found "
                         f"{', '.join(p.name for p in files) or 'none'}")
    return files[0]


def attach_ip_adapter(model, path) -> None:
    """Load the IP-Adapter in `path` into the model's pipeline (`load_ip_adapter`)."""
    unet = getattr(getattr(model, "pipe", None), "unet", None)
    if unet is None or not hasattr(model.pipe, "load_ip_adapter"):
        raise ValueError(f"{model.pipeline_class or 'this model'} has no IP-Adapter path here (SD 1.x/2.x, SDXL)")
    weights = ip_adapter_weights(path)
    pipe = model.pipe
    try:
        pipe.load_ip_adapter(str(weights.parent), subfolder="", weight_name=weights.name,
                             image_encoder_folder="image_encoder", low_cpu_mem_usage=False)
    except (KeyError, RuntimeError) as exc:  # the weights' shapes or names do not fit this UNet
        raise ValueError(f"{path}: does not fit the served UNet ({type(exc).__name__}: {exc})") from None
    for module in (pipe.unet, pipe.image_encoder):
        module.to(model.device, model.dtype).eval().requires_grad_(False)
    model.ip_adapter = str(path)


def ip_processors(unet) -> list:
    from diffusers.models.attention_processor import IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0

    return [p for p in unet.attn_processors.values() if isinstance(p, (IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0))]


class RowScale:
    """One IP-Adapter scale per row where the processor takes one number: `scale * x` is
    each row's float32 factor times its rows of `x`, rounded to `x`'s dtype as a Python
    float's product is. Never "== 0" (a call's rows are not all skipped)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows  # rows, float32

    def __eq__(self, other) -> bool:
        return False

    __hash__ = None

    def __mul__(self, x: torch.Tensor) -> torch.Tensor:
        factor = self.rows.view(-1, *([1] * (x.dim() - 1)))
        return (factor * x.float()).to(x.dtype) if x.dtype != torch.float32 else factor * x

    __rmul__ = __mul__


def bind_ip_scale(unet, scale: torch.Tensor) -> None:
    """Each IP-Adapter processor's scale: `scale` (rows × 1, float32), per row."""
    row_scale = RowScale(scale.reshape(-1))
    for processor in ip_processors(unet):
        processor.scale = [row_scale]


@torch.no_grad()
def encode_ip_images(model, images: list) -> torch.Tensor:
    """The image encoder's embeddings of PIL images, one batched pass, as the pipeline's
    `encode_image` (its feature extractor, `image_embeds`): n × width, float32 on the host."""
    pipe = model.pipe
    pixels = pipe.feature_extractor(images, return_tensors="pt").pixel_values
    pixels = pixels.to(model.device, next(pipe.image_encoder.parameters()).dtype)
    return pipe.image_encoder(pixels).image_embeds.float().cpu()


def ip_embed_width(model) -> int:
    return int(model.pipe.image_encoder.config.projection_dim)
