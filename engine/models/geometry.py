"""A model's geometry, read once from its folder's configs (torch-free, no weights).

The one source for latent channels, pixels per latent cell, the size multiple, the
native size and the largest size the engine serves: the core, request validation and
the decode workers all take it from here.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

#: Largest served side, in native sizes: SD's 512 → 2048.
MAX_SIZE_FACTOR = 4

#: The key of `model_index.json` where a folder declares the size (pixels) it was trained
#: at, when its pipeline's own default is one it never saw (diffusers ignores keys that
#: start with "_"): the engine's default size for it then.
NATIVE_SIZE_KEY = "_native_size"


@dataclasses.dataclass(frozen=True)
class Geometry:
    latent_channels: int  # channels of the latents the engine keeps (the VAE's, unpacked)
    vae_scale: int  # pixels per latent cell along one side
    size_multiple: int  # height and width are multiples of this (VAE, denoiser downsampling, packing)
    native_size: int  # the default height and width in pixels

    @property
    def max_size(self) -> int:
        return MAX_SIZE_FACTOR * self.native_size

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)


def _config(path: pathlib.Path, name: str) -> dict:
    file = path / name / "config.json"
    return json.loads(file.read_text()) if file.exists() else {}


def pipeline_class_of(path: pathlib.Path) -> str:
    index = pathlib.Path(path) / "model_index.json"
    return json.loads(index.read_text()).get("_class_name", "") if index.exists() else "class-conditional"


#: Pipelines whose default size is not the denoiser's `sample_size`: the pipeline's own
#: `default_sample_size` (in latent cells) where the transformer has no such field.
_DEFAULT_SAMPLE_SIZE = {"FluxPipeline": 128, "QwenImagePipeline": 128, "QwenImageImg2ImgPipeline": 128,
                        "QwenImageInpaintPipeline": 128, "QwenImageEditPipeline": 128,
                        "QwenImageEditPlusPipeline": 128}


def declared_native_size(path: str | pathlib.Path) -> int | None:
    """The size the folder declares (`NATIVE_SIZE_KEY`), or None."""
    index = pathlib.Path(path) / "model_index.json"
    size = json.loads(index.read_text()).get(NATIVE_SIZE_KEY) if index.exists() else None
    return None if size is None else int(size)


def geometry_from_configs(kind: str, vae: dict | None, denoiser: dict, denoiser_is_unet: bool,
                          declared_size: int | None = None) -> Geometry:
    """The geometry as the pipeline computes it, from its VAE's and denoiser's configs (the
    native size: the folder's declared one, if any)."""
    vae = vae or {}
    vae_scale = 2 ** (len(vae["block_out_channels"]) - 1) if vae.get("block_out_channels") else 1
    channels = int(vae.get("latent_channels") or denoiser.get("in_channels", 4))
    if "temperal_downsample" in vae:  # Qwen-Image's video VAE: one halving per entry, z_dim channels
        vae_scale, channels = 2 ** len(vae["temperal_downsample"]), int(vae["z_dim"])
    if denoiser_is_unet:  # UNet2DModel / UNet2DConditionModel: one halving per down block after the first
        latent_multiple = 2 ** (len(denoiser.get("block_out_channels", (0,))) - 1)
    elif kind.startswith(("Flux", "QwenImage")):  # 2×2 packing of the latents into the transformer's tokens
        latent_multiple = 2
    else:  # SD3: the patch size
        latent_multiple = int(denoiser.get("patch_size", 1))
    sample = denoiser.get("sample_size")
    if not isinstance(sample, int):
        sample = _DEFAULT_SAMPLE_SIZE.get(kind) or int(vae.get("sample_size", 32)) // vae_scale
    multiple = vae_scale * latent_multiple
    if declared_size is not None and (declared_size <= 0 or declared_size % multiple):
        raise ValueError(f"{NATIVE_SIZE_KEY} {declared_size} is not a positive multiple of {multiple}")
    return Geometry(channels, vae_scale, multiple, declared_size or int(sample) * vae_scale)


def geometry_of(path: str | pathlib.Path) -> Geometry:
    """The geometry of a model folder, read from its configs (no weights loaded)."""
    path = pathlib.Path(path)
    unet = _config(path, "unet")
    return geometry_from_configs(pipeline_class_of(path), _config(path, "vae") or None,
                                 unet or _config(path, "transformer"), bool(unet), declared_native_size(path))
