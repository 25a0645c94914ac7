"""Image inputs (R21): img2img and inpainting requests, as the pipelines run them.

At `add_request` (`checked_image_inputs`, `ImageInputs.fit`): the `image` and `mask`
bytes are decoded (PNG, JPEG or WebP), bounded in bytes and pixels, the mask's size
checked against the image's, `strength` checked and defaulted to the model's image
pipeline's own default; a field the model cannot use is rejected naming it. The image's
size (rounded down as `VaeImageProcessor` rounds it) is the output size unless height
or width are given; then the image is resized to them, as the pipelines resize it.

At admission (`start_from_images`, the image-encode phase beside the prompt encode):
every admitted image is preprocessed by the pipeline's own processors, the VAE's
encoder runs once per image size over all of them, and each request then, from its own
generator and in the pipeline's order, samples its image latents from `latent_dist`,
draws its initial noise (and, inpainting, the masked image's sample the pipeline
draws), and starts its slot at the image latents noised to its first timestep
(`add_noise` coefficients from its schedule). Inpainting slots also keep the image's
latents, the noise and the mask: the runner blends the known region back after every
step (`engine.core.kernels.blend_known_region`).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import math
import warnings

import torch

from engine.core.ledger import image_input_nbytes
from engine.core.outputs import RequestRejected

log = logging.getLogger("diffslot.core")

#: The formats an `image` or `mask` may have (PIL's names).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
#: `max_input_bytes`'s default: each of `image` and `mask` at most this many bytes.
MAX_INPUT_BYTES = 16 << 20


@dataclasses.dataclass(eq=False)
class ImageInputs:
    """A request's decoded image inputs, held from validation to its image-encode phase."""

    image: object  # PIL.Image.Image, RGB
    mask: object | None  # PIL.Image.Image (grey level, white = repaint), or None: img2img
    strength: float
    input_bytes: int  # the encoded image and mask bytes it arrived with
    height: int = 0  # the output size the image is resized to (set by `fit`)
    width: int = 0
    start: int = 0  # the pipeline's t_start: steps of the full schedule skipped

    @property
    def field(self) -> str:
        """The field that names this request's image path: "mask" for inpainting."""
        return "image" if self.mask is None else "mask"

    def fit(self, model, steps: int, height: int, width: int) -> None:
        """Fix the output size and the start step; rejects a strength that leaves no step."""
        start = model.start_step(steps, self.strength)
        if start >= steps:
            raise RequestRejected(f"{steps} steps at strength {self.strength:g} leave no step to run "
                                  "(steps × strength must reach 1)", "strength")
        self.height, self.width, self.start = height, width, start

    def nbytes(self, latent_shape: tuple[int, ...]) -> int:
        """What admission reserves for the inputs (`engine.core.ledger.image_input_nbytes`)."""
        return image_input_nbytes(latent_shape, self.input_bytes, self.mask is not None)


def _decode(data, field: str, max_bytes: int, max_size: int):
    """The image in `data`, fully decoded; RequestRejected naming `field` if it is not a
    PNG, JPEG or WebP image within the byte and pixel bounds."""
    from PIL import Image

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RequestRejected("must be the bytes of a PNG, JPEG or WebP image", field)
    size = memoryview(data).nbytes
    if size == 0:
        raise RequestRejected("is empty: must be the bytes of a PNG, JPEG or WebP image", field)
    if size > max_bytes:
        raise RequestRejected(f"{size} bytes, more than the engine takes ({max_bytes})", field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            # the header alone says the size: refuse a huge image before decoding its pixels
            width, height = image.size
            if not (0 < width <= max_size and 0 < height <= max_size):
                raise RequestRejected(f"{width}×{height} pixels, larger than the engine takes "
                                      f"({max_size}×{max_size})", field)
            image.load()
    except RequestRejected:
        raise
    except Exception as exc:  # PIL raises many kinds on a truncated or foreign stream
        raise RequestRejected(f"is not a decodable PNG, JPEG or WebP image ({type(exc).__name__})", field) from None
    return image


def checked_image_inputs(model, geometry, p, max_input_bytes: int) -> ImageInputs | None:
    """The request's image inputs, decoded and checked, or None for a text-to-image
    request; raises RequestRejected naming the field (R11)."""
    if p.image is None:
        for field in ("mask", "strength"):
            if getattr(p, field) is not None:
                raise RequestRejected("needs an image (`image`)", field)
        return None
    why = model.image_support("image")
    if why:
        raise RequestRejected(why, "image")
    if p.mask is not None:
        why = model.image_support("mask")
        if why:
            raise RequestRejected(why, "mask")
    strength = p.strength
    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float))
                                 or not math.isfinite(strength) or not 0.0 < strength <= 1.0):
        raise RequestRejected("must be a number in (0, 1]", "strength")
    image = _decode(p.image, "image", max_input_bytes, geometry.max_size)
    mask = None
    if p.mask is not None:
        mask = _decode(p.mask, "mask", max_input_bytes, geometry.max_size)
        if mask.size != image.size:
            raise RequestRejected(f"is {mask.width}×{mask.height} pixels, the image {image.width}×{image.height}: "
                                  "they must be the same size", "mask")
    if image.mode != "RGB":  # alpha or palette: the pipelines take RGB (four channels would read as latents)
        image = image.convert("RGB")
    field = "image" if mask is None else "mask"
    strength = model.default_strength(field) if strength is None else float(strength)
    input_bytes = memoryview(p.image).nbytes + (0 if p.mask is None else memoryview(p.mask).nbytes)
    return ImageInputs(image, mask, strength, input_bytes)


def default_size(model, images: ImageInputs | None) -> tuple[int | None, int | None]:
    """(height, width) an image request takes where height or width is not given: the
    image's, rounded down as the pipeline's image processor rounds them."""
    if images is None:
        return None, None
    return model.image_size(images.image, None, None)


def header_size(data) -> tuple[int, int] | None:
    """(height, width) an image's header states, without decoding its pixels; None if
    it is not a readable image (its request is rejected later, naming the field)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            width, height = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS).size
    except Exception:
        return None
    return height, width


# ---- the image-encode phase ---------------------------------------------------------------

def start_from_images(model, requests: list) -> dict:
    """Start the slots of newly admitted image requests (see the module docstring).
    Returns {request: exception} for those whose inputs failed; every other one's slot
    holds its first latents. A request's generator is drawn from only after its encoder
    pass succeeded, so a failure and a retry never shift its random stream."""
    failed: dict = {}
    pixels = {}
    for request in requests:
        images = request.image_inputs
        try:
            pixels[request] = model.preprocess_image(images.image, images.height, images.width)
        except Exception as exc:
            failed[request] = exc
    moments = _encode(model, [r for r in requests if r in pixels], pixels, failed)
    for request, encoded in moments.items():
        try:
            _start(model, request, encoded)
        except Exception as exc:
            failed[request] = exc
    return failed


def _encode(model, requests: list, pixels: dict, failed: dict) -> dict:
    """The VAE encoder's output per request: one batched pass per image size; a pass
    that raises runs again one image at a time, so only the images that raise fail."""
    by_size: dict[tuple, list] = {}
    for request in requests:
        by_size.setdefault(tuple(pixels[request].shape), []).append(request)
    moments = {}
    for same in by_size.values():
        try:
            moments.update(zip(same, model.encode_image_moments([pixels[r] for r in same])))
            continue
        except Exception as exc:
            if len(same) == 1:
                failed[same[0]] = exc
                continue
            log.warning("encoding %d images raised %s: one at a time", len(same), exc)
        for request in same:
            try:
                moments[request] = model.encode_image_moments([pixels[request]])[0]
            except Exception as exc:
                failed[request] = exc
    return moments


def _start(model, request, moments) -> None:
    """One request's draws, in the pipeline's order, and its slot's first latents."""
    images, trajectory = request.image_inputs, request.trajectory
    schedule, generator = trajectory.schedule, trajectory.generator
    group, slot = request.group, request.slot
    device = group.latents.device
    image_latents = model.image_latents(moments, generator).to(device)
    noise = torch.randn((1, *request.latent_shape), generator=generator, dtype=torch.float32).to(device)
    masked = images.mask is not None
    if masked:
        model.masked_image_draw(request.latent_shape, generator)
    if masked and model.inpaint_starts_from_noise(images.strength):
        start = noise * schedule.init_noise_sigma  # pure noise, as the pipeline's strength-1 start
    else:
        a, b = (torch.tensor(float(c), dtype=torch.float32, device=device) for c in schedule.start_noising)
        start = a * image_latents + b * noise  # the scheduler's add_noise at the first timestep
    known = None
    if masked:
        mask = model.preprocess_mask(images.mask, images.height, images.width).to(device)
        known = (image_latents, noise, mask, schedule.step_noising)
    group.attach_image(slot, start, known, model.channels_last(images.field))
