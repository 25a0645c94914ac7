"""How close two outputs of the same request must be when they were made in different
batch compositions (a request alone and the same request sharing calls, n=2 in one call
and n=1): the denoiser is not batch-invariant, so bytes may differ; the contract is
uint8 images within one level and latents within a relative L2 of 1e-4.

Outputs of the same batch composition (the same request alone, twice) may be compared
exactly; this helper is for images of different ones (latents: `rel_l2` of
engine.testing.pipeline_oracle against LATENT_REL_L2).
"""
from __future__ import annotations

import base64
import io

import numpy as np

IMAGE_LEVELS = 1  # uint8 images: max |difference| in levels
LATENT_REL_L2 = 1e-4  # latents: ‖got − want‖ / ‖want‖


def pixels(image) -> np.ndarray:
    """A uint8 image as an array: PNG bytes, a base64 string of them (an API's
    `b64_json`), or an array already."""
    from PIL import Image

    if isinstance(image, str):
        image = base64.b64decode(image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(image)))
        assert image.format == "PNG", image.format
    array = np.asarray(image)
    assert array.dtype == np.uint8, array.dtype
    return array


def image_difference(a, b) -> int:
    """The largest difference, in levels, between two uint8 images of one shape (any
    form `pixels` takes)."""
    a, b = pixels(a), pixels(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max(initial=0))


def assert_images_close(got, want, levels: int = IMAGE_LEVELS) -> None:
    """Same shape, every channel of every pixel within `levels`."""
    diff = image_difference(got, want)
    assert diff <= levels, f"images differ by {diff} levels (at most {levels})"
