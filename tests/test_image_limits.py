"""Image inputs at the documented limits: every request valid under them is admitted, at
least one at a time, at any `slots` (the largest image and mask at the largest size
included), or refused at intake naming the budget it exceeds; 16-bit images and masks are
scaled to 8 bits, not clipped; a NUL in a prompt is named as such. A tiny SD model."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw, PngImagePlugin

from engine.core import CoreConfig, EngineCore, RequestRejected
from engine.protocol import GenerateParams
from engine.testing.pipeline_oracle import model_of
from engine.testing.tiny_pipelines import build_sd

from core_driver import run_to_end

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

MAX_INPUT = 256 << 10  # each input frame at most this (CoreConfig.max_input_bytes), kept small for speed


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_of(build_sd(tmp_path_factory.mktemp("image-limits") / "sd", scheduler="ddim", seed=31))


def padded_png(image: Image.Image, nbytes: int) -> bytes:
    """`image` as a PNG of exactly `nbytes` bytes: a text chunk holds the rest (a valid
    file, as large as the limit allows, whatever its pixels)."""
    def encode(pad: int) -> bytes:
        info = PngImagePlugin.PngInfo()
        info.add_text("padding", "x" * pad)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", pnginfo=info)
        return buffer.getvalue()
    data = encode(nbytes - len(encode(0)))
    assert len(data) == nbytes
    return data


def scene(side: int) -> tuple[Image.Image, Image.Image]:
    image = Image.new("RGB", (side, side), (90, 90, 90))
    ImageDraw.Draw(image).ellipse([2, 2, side - 3, side - 3], fill=(200, 40, 40))
    mask = Image.new("L", (side, side), 0)
    ImageDraw.Draw(mask).rectangle([0, 0, side // 2, side // 2], fill=255)
    return image, mask


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_the_largest_valid_requests_are_admitted_at_any_slots(model, slots):
    largest = model.geometry.max_size
    image, mask = scene(largest)
    base = dict(prompt="a red circle", steps=2, guidance=1.0, output="latent", height=largest, width=largest)
    requests = {
        "text": GenerateParams(**base),
        "img2img": GenerateParams(**base, image=padded_png(image, MAX_INPUT), strength=0.6),
        "inpaint": GenerateParams(**base, image=padded_png(image, MAX_INPUT), mask=padded_png(mask, MAX_INPUT),
                                  strength=0.6),
    }
    core = EngineCore(model, CoreConfig(slots=slots, max_input_bytes=MAX_INPUT, max_queue=8))
    for rid, p in requests.items():
        core.add_request(rid, p)  # raised "needs more memory than the engine holds at all" before
    d = run_to_end(core, limit=200)
    assert set(d.results) == set(requests) and not d.failed
    assert core.ledger.used.trajectory_bytes == 0


def test_a_request_over_an_explicit_budget_is_refused_naming_the_budget(model):
    core = EngineCore(model, CoreConfig(slots=2, trajectory_budget_bytes=64 << 10))
    largest = model.geometry.max_size
    with pytest.raises(RequestRejected) as info:
        core.add_request("big", GenerateParams(prompt="a red circle", steps=2, height=largest, width=largest,
                                               output="latent"))
    assert info.value.field == "height" and "trajectory budget of 65536 bytes" in info.value.reason


def sixteen_bit_png(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(values.astype(np.uint16)).save(buffer, format="PNG")
    assert Image.open(io.BytesIO(buffer.getvalue())).mode.startswith("I")
    return buffer.getvalue()


def test_sixteen_bit_masks_and_images_are_scaled_not_clipped(model):
    side = model.geometry.native_size
    ramp = np.tile(np.linspace(0, 65535, side), (side, 1))  # black to white, 16 bits
    core = EngineCore(model, CoreConfig(slots=1))
    rgb = Image.new("RGB", (side, side), (10, 20, 30))
    buffer = io.BytesIO()
    rgb.save(buffer, format="PNG")
    core.add_request("m", GenerateParams(prompt="a red circle", steps=4, image=buffer.getvalue(),
                                         mask=sixteen_bit_png(ramp), output="latent"))
    core.add_request("i", GenerateParams(prompt="a red circle", steps=4, image=sixteen_bit_png(ramp),
                                         output="latent"))
    want = np.rint(ramp / 257).astype(np.uint8)
    mask = np.asarray(core.requests["m"].inputs["image"].mask)
    image = np.asarray(core.requests["i"].inputs["image"].image)
    assert mask.dtype == np.uint8 and np.array_equal(mask, want)  # clipped to 255 almost everywhere before
    assert image.shape == (side, side, 3) and all(np.array_equal(image[..., c], want) for c in range(3))


def test_a_nul_in_a_prompt_is_named_as_such(model):
    core = EngineCore(model, CoreConfig(slots=1))
    for field in ("prompt", "negative_prompt"):
        fields = {"prompt": "a red circle", field: "a red\x00 circle"}
        with pytest.raises(RequestRejected) as info:
            core.add_request("x", GenerateParams(steps=2, **fields))
        assert info.value.field == field and "NUL" in info.value.reason and "at most" not in info.value.reason
