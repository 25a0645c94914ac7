"""The image input kind: img2img and inpainting requests, as the pipelines run them.

At intake (`ImageKind.check`, `start_step`): the `image` and `mask`
bytes are decoded (PNG, JPEG or WebP), bounded in bytes and pixels, the mask's size
checked against the image's, `strength` checked and defaulted to the model's image
pipeline's own default; a field the model cannot use is rejected naming it. The image's
size (rounded down as `VaeImageProcessor` rounds it) is the output size unless height
or width are given; then the image is resized to them, as the pipelines resize it.

At admission (`ImageKind.prepare`, beside the prompt encode):
every admitted image is preprocessed by the pipeline's own processors, the VAE's
encoder runs once per image size over all of them, and each request then, from its own
generator and in the pipeline's order, samples its image latents from `latent_dist`,
draws its initial noise (and, inpainting, the masked image's sample the pipeline
draws), and gets its first latents: the image latents noised to its first timestep
(`add_noise` coefficients from its schedule). An edit model's requests (Qwen-Image-Edit:
`conditions_on_image`) instead keep the image's latents as a request input of both rows
and start from their noise. Inpainting slots also keep the image's
latents, the noise and the mask (`KnownRegion`, held by `KnownRegionState`), and the
known region is blended back after every update (`engine.core.kernels.blend_known_region`).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import math
import warnings

import torch

import numpy as np

from engine.core.input_kinds.base import InputKind
from engine.core.kernels import blend_known_region
from engine.core.outputs import RequestRejected
from engine.core.storage import to_host, upload
from engine.models.model import to_device

log = logging.getLogger("diffslot.core")

#: The formats an `image` or `mask` may have (PIL's names).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


@dataclasses.dataclass(eq=False)
class ImageInputs:
    """A request's decoded image inputs, held from validation to its image-encode phase."""

    image: object  # PIL.Image.Image, RGB
    mask: object | None  # PIL.Image.Image (grey level, white = repaint), or None: img2img
    strength: float
    input_bytes: int  # the encoded image and mask bytes it arrived with
    height: int = 0  # the output size the image is resized to (set by `start_step`)
    width: int = 0

    @property
    def field(self) -> str:
        """The field that names this request's image path: "mask" for inpainting."""
        return "image" if self.mask is None else "mask"


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
    return _eight_bit(image)


#: PIL's modes of a 16-bit grey-level PNG; PIL's own convert() clips them to 8 bits instead of scaling
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def _eight_bit(image):
    """A 16-bit grey-level image scaled to 8 bits (65535 → 255), as every pipeline reads
    8-bit images; any other image as it is."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    from PIL import Image

    wide = np.asarray(image).astype(np.float64)
    return Image.fromarray(np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8))  # 2-D uint8: mode L


def image_header_size(data) -> tuple[int, int] | None:
    """(height, width) an encoded image's header states, without decoding its pixels; None
    if it is not readable."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            width, height = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS).size
    except Exception:
        return None
    return height, width


class ImageKind(InputKind):
    """`image`, `mask` and `strength`: img2img and inpainting."""

    name = "image"
    fields = ("image", "mask", "strength")
    timing = "image_encode_s"

    def __init__(self, model, geometry, max_input_bytes: int):
        self.model, self.geometry, self.max_input_bytes = model, geometry, max_input_bytes

    def check(self, p) -> ImageInputs | None:
        """The request's image inputs, decoded and checked, or None for a text-to-image
        request; raises RequestRejected naming the field."""
        model = self.model
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
        image = _decode(p.image, "image", self.max_input_bytes, self.geometry.max_size)
        mask = None
        if p.mask is not None:
            mask = _decode(p.mask, "mask", self.max_input_bytes, self.geometry.max_size)
            if mask.size != image.size:
                raise RequestRejected(f"is {mask.width}×{mask.height} pixels, the image {image.width}×"
                                      f"{image.height}: they must be the same size", "mask")
        if image.mode != "RGB":  # alpha or palette: the pipelines take RGB (four channels would read as latents)
            image = image.convert("RGB")
        field = "image" if mask is None else "mask"
        if getattr(model, "conditions_on_image", False):  # an edit model: the image conditions every step
            if strength is not None:
                raise RequestRejected(f"{model.pipeline_class} takes no strength: it edits the image from noise",
                                      "strength")
            strength = 1.0
        strength = model.default_strength(field) if strength is None else float(strength)
        input_bytes = memoryview(p.image).nbytes + (0 if p.mask is None else memoryview(p.mask).nbytes)
        return ImageInputs(image, mask, strength, input_bytes)

    def header_size(self, params) -> tuple[int, int] | None:
        """(height, width) the image's header states, without decoding its pixels; None if
        there is no image or it is not readable (its request is rejected later, naming it)."""
        return None if params.image is None else image_header_size(params.image)

    def output_size(self, images: ImageInputs) -> tuple[int | None, int | None]:
        """(height, width) an image request takes where height or width is not given: the
        image's, rounded down as the pipeline's image processor rounds them."""
        return self.model.image_size(images.image, None, None)

    def start_step(self, images: ImageInputs, steps: int, height: int, width: int) -> int:
        """Fix the output size; the pipeline's `t_start` (steps of the full schedule
        skipped). Rejects a strength that leaves no step. An edit model's requests run the
        whole schedule at the image's own size (their image latents are then of one shape
        per output size, so requests of one size share calls)."""
        model = self.model
        if getattr(model, "conditions_on_image", False):
            expected = model.image_size(images.image, None, None)
            if (height, width) != tuple(expected):
                raise RequestRejected(f"{model.pipeline_class} serves the image's own size at its target area: "
                                      f"{expected[1]}×{expected[0]} for this image", "height" if height != expected[0]
                                      else "width")
            images.height, images.width = height, width
            return None
        start = self.model.start_step(steps, images.strength)
        if start >= steps:
            raise RequestRejected(f"{steps} steps at strength {images.strength:g} leave no step to run "
                                  "(steps × strength must reach 1)", "strength")
        images.height, images.width = height, width
        return start

    def nbytes(self, images: ImageInputs, latent_shape: tuple[int, ...]) -> int:
        """The encoded image (and mask) bytes it arrived with, until its preparation
        (`spent`), and its image latents; with a mask also the slot's kept noise and the
        mask at latent resolution (one float32 row of the latents each), until its slot is
        released. The decoded pixels live only from intake through preparation, bounded by
        the queue."""
        return images.input_bytes + _latent_rows(latent_shape, images.mask is not None)

    def largest_nbytes(self, latent_shape: tuple[int, ...]) -> int:
        """An image and a mask of `max_input_bytes` each, and the inpainting rows."""
        if self.model.image_support("image") is not None:
            return 0
        masked = self.model.image_support("mask") is None
        return (2 if masked else 1) * self.max_input_bytes + _latent_rows(latent_shape, masked)

    def headroom(self, latent_shape: tuple[int, ...], slots: int) -> int:
        """Room for every slot's image rows (latents, and with inpainting noise and mask)
        and for one native image and mask's encoded bytes at admission, raw-sized."""
        if self.model.image_support("image") is not None:
            return 0
        native = self.geometry.native_size
        masked = self.model.image_support("mask") is None
        return slots * _latent_rows(latent_shape, masked) + 4 * native * native

    def spent(self, images: ImageInputs) -> int:
        return images.input_bytes

    def prepare(self, requests: list) -> dict:
        return start_from_images(self.model, [r for r in requests if r.inputs.get(self.name) is not None])


def _latent_rows(latent_shape: tuple[int, ...], masked: bool) -> int:
    return 4 * math.prod(latent_shape) * (3 if masked else 1)


@dataclasses.dataclass(eq=False)
class StartLatents:
    """A request's first latents where they are not its initial noise (an image request's
    image latents noised to its first timestep), and the memory format its pipeline keeps."""

    latents: torch.Tensor
    channels_last: bool = False


@dataclasses.dataclass(eq=False)
class KnownRegion:
    """An inpainting slot's known region: the image's latents, its initial noise, the mask at
    latent resolution (1 × h × w, 1 = repaint) and per step the add_noise coefficients of
    the timestep it reaches next (steps × 2)."""

    image_latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor
    noising: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.image_latents, self.noise, self.mask))

    def slot_state(self, storage) -> "KnownRegionState":
        return KnownRegionState(storage)


class KnownRegionState:
    """Every inpainting slot's known region in one group's storage; after each update the
    known region is blended back into those slots' latents (one fused pass)."""

    def __init__(self, storage):
        self.storage = storage
        self.image_latents = torch.zeros_like(storage.latents)
        self.noise = torch.zeros_like(storage.latents)
        self.mask = torch.zeros_like(storage.latents)
        self.noising_table = np.zeros((storage.slots, storage.max_steps, 2), dtype=np.float32)
        self.masked = np.zeros(storage.slots, dtype=bool)

    @property
    def nbytes(self) -> int:
        return 3 * self.storage.latents.numel() * 4 + self.noising_table.nbytes

    def place(self, slot: int, value: KnownRegion) -> None:
        shape = self.storage.latent_shape
        upload(self.image_latents[slot], value.image_latents.reshape(-1))
        upload(self.noise[slot], value.noise.reshape(-1))
        upload(self.mask[slot].view(shape), value.mask.reshape(1, *shape[1:]).expand(shape))
        self.noising_table[slot] = 0
        self.noising_table[slot, :len(value.noising)] = value.noising
        self.masked[slot] = True

    def holds(self, slot: int) -> bool:
        return bool(self.masked[slot])

    def after_update(self, latents: torch.Tensor, slots: np.ndarray, steps: np.ndarray) -> None:
        keep = self.masked[slots]
        if not keep.any():
            return
        masked_slots, masked_steps = slots[keep], steps[keep]
        device = latents.device
        index = to_device(torch.from_numpy(masked_slots.astype(np.int32)), device)
        coefs = to_device(torch.from_numpy(np.ascontiguousarray(self.noising_table[masked_slots, masked_steps])),
                          device)
        blend_known_region(latents, self.image_latents, self.noise, self.mask, index, coefs)

    def release(self, slot: int) -> None:
        self.masked[slot] = False

    def park(self, slot: int) -> KnownRegion:
        shape = self.storage.latent_shape
        return KnownRegion(to_host(self.image_latents[slot]), to_host(self.noise[slot]),
                           to_host(self.mask[slot].view(shape)[:1]), self.noising_table[slot].copy())


# ---- the image-encode phase ---------------------------------------------------------------

def start_from_images(model, requests: list) -> dict:
    """The first latents (and, inpainting, the known region) of newly admitted image
    requests (see the module docstring). Returns {request: exception} for those whose
    inputs failed. A request's generator is drawn from only after its encoder pass
    succeeded, so a failure and a retry never shift its random stream."""
    failed: dict = {}
    pixels = {}
    for request in requests:
        images = request.inputs["image"]
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
    """One request's draws, in the pipeline's order, and its first latents."""
    images, trajectory = request.inputs["image"], request.trajectory
    if getattr(model, "conditions_on_image", False):  # an edit: the image's latents ride both rows; no draw
        latents = model.edit_image_latents(moments)
        request.request_inputs["image_latents"] = latents.expand(2, *latents.shape[1:])
        return
    schedule, generator = trajectory.schedule, trajectory.generator
    # this runs on the busy loop: no copy here may wait for the steps queued on the device
    # (the noise and mask stay host tensors that the slot storage stages; the image latents
    # come from the VAE on the device)
    image_latents = model.image_latents(moments, generator)
    noise = torch.randn((1, *request.latent_shape), generator=generator, dtype=torch.float32)
    masked = images.mask is not None
    if masked:
        model.masked_image_draw(request.latent_shape, generator)
    if masked and model.inpaint_starts_from_noise(images.strength):
        start = noise * schedule.init_noise_sigma  # pure noise, as the pipeline's strength-1 start
    else:
        # the scheduler's add_noise at the first timestep, its coefficients float32 as its own
        a, b = (torch.tensor(float(c), dtype=torch.float32) for c in schedule.start_noising)
        start = to_device(a, image_latents.device) * image_latents + to_device(b * noise, image_latents.device)
    if masked:
        mask = model.preprocess_mask(images.mask, images.height, images.width)
        request.slot_inputs["image"] = KnownRegion(image_latents, noise, mask, schedule.step_noising)
    request.start = StartLatents(start, model.channels_last(images.field))
