"""`POST /v1/images/edits`, the generation extras (`loras`, `true_cfg`, SDXL
micro-conditioning) and the adapters in `GET /v1/models`, through the real `openai`
package (R16, R20, R21).

One real engine (`python -m engine serve`, CPU) on a tiny random-weight SD folder with
two random LoRA adapters, served through the test core factory `lora_core` below (the
real EngineCore with an `engine.lora.AdapterPool` on $DIFFSLOT_TEST_LORA_DIR), and one
gateway (`python -m frontend http`) in front of it; both are stopped and reaped here.
"""
from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys

import httpx
import pytest

LORA_DIR_ENV = "DIFFSLOT_TEST_LORA_DIR"


def lora_core(model, config):
    """`python -m engine serve --core tests.test_edits_http:lora_core`: the real core with
    the adapters of $DIFFSLOT_TEST_LORA_DIR."""
    from engine.core import EngineCore
    from engine.lora import AdapterPool

    return EngineCore(model, config, adapters=AdapterPool(model, os.environ[LORA_DIR_ENV], budget_bytes=64 << 20))


openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")
from PIL import ImageDraw  # noqa: E402

from engine.protocol import MAX_INPUT_BYTES, Completed, GenerateParams  # noqa: E402
from frontend import Client  # noqa: E402
from frontend.http.options import MAX_UPLOAD_BYTES  # noqa: E402
from tests.http_helpers import png_size, serving  # noqa: E402
from tests.output_contract import IMAGE_LEVELS, assert_images_close, image_difference  # noqa: E402
from tests.proc_helpers import REPO, env  # noqa: E402

ADAPTER = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def circle(width: int = 24, height: int = 16) -> bytes:
    image = Image.new("RGB", (width, height), (200, 200, 200))
    ImageDraw.Draw(image).ellipse([4, 3, 14, 13], fill=(220, 30, 30))
    return png(image)


def square_mask(width: int = 24, height: int = 16) -> bytes:
    image = Image.new("L", (width, height), 0)
    ImageDraw.Draw(image).rectangle([2, 2, 12, 10], fill=255)
    return png(image)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from diffusers import StableDiffusionPipeline

    from engine.testing.loras import make_lora
    from engine.testing.tiny_pipelines import build_sd

    root = tmp_path_factory.mktemp("edits-http")
    folder = build_sd(root / "tiny-sd", scheduler="ddim", seed=9)
    lora_dir = root / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    make_lora(pipe, "A", 31, {"unet": ADAPTER}, lora_dir / "A")
    make_lora(pipe, "B", 32, {"unet": ADAPTER}, lora_dir, "B.safetensors")
    del pipe
    with serving("--core", "tests.test_edits_http:lora_core", "--model", str(folder), "--slots", "4",
                 "--decode-workers", "1", engine_env={LORA_DIR_ENV: str(lora_dir)}) as (engine, gw):
        yield engine, gw, lora_dir


def direct(engine, **fields) -> bytes:
    """The same request straight to the engine through the Python client: its PNG."""
    with Client(engine.address) as client:
        result = client.submit(GenerateParams(**fields), progress=False).result(timeout=60)
    assert isinstance(result, Completed), result
    return result.output


@pytest.mark.timeout(300)
def test_edit_plain_equals_the_engine_request_and_takes_the_image_size(stack):
    engine, gw, _ = stack
    client = gw.openai()
    image = circle()
    r = client.images.edit(image=("in.png", image, "image/png"), prompt="a blue circle", n=2,
                           response_format="b64_json",
                           extra_body={"steps": 4, "strength": 0.6, "seed": 5, "guidance": 2.0, "sampler": "ddim"})
    assert len(r.data) == 2 and all(png_size(d.b64_json) == (24, 16) for d in r.data)  # the image's size
    assert [d.model_extra["seed"] for d in r.data] == [5, 6]
    timings = r.model_extra["timings"][0]
    assert timings["image_encode_s"] > 0
    assert timings["evals"] < 4 * 2  # strength 0.6 skips the start of the schedule
    want = direct(engine, prompt="a blue circle", steps=4, strength=0.6, seed=5, guidance=2.0, sampler="ddim",
                  image=image)
    # the first of n=2 shared its calls with the second, the engine request ran alone: the
    # contract's one level, not the same bytes (the denoiser is not batch-invariant)
    assert_images_close(r.data[0].b64_json, want)
    assert image_difference(r.data[1].b64_json, want) > IMAGE_LEVELS  # and not the second (seed 6)

    # inpainting, resized by `size`, with a negative prompt
    r = client.images.edit(image=("in.png", image, "image/png"), mask=("m.png", square_mask(), "image/png"),
                           prompt="a green square", size="16x16",
                           extra_body={"steps": 3, "seed": 2, "negative_prompt": "blurry"})
    assert png_size(r.data[0].b64_json) == (16, 16) and r.size == "16x16"
    want = direct(engine, prompt="a green square", steps=3, seed=2, negative_prompt="blurry", height=16, width=16,
                  image=image, mask=square_mask())
    assert base64.b64decode(r.data[0].b64_json) == want  # both alone: the same calls, the same bytes


@pytest.mark.timeout(300)
def test_edit_streamed_with_partial_images(stack):
    _, gw, _ = stack
    stream = gw.openai().images.edit(image=("in.png", circle(), "image/png"), prompt="a blue circle", stream=True,
                                     partial_images=2, extra_body={"steps": 6, "strength": 0.9, "seed": 1})
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["image_edit.partial_image"] * 2 + ["image_edit.completed"], kinds
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert png_size(events[-1].b64_json) == (24, 16)
    assert events[-1].model_extra["timings"]["image_encode_s"] > 0


@pytest.mark.timeout(300)
def test_bad_uploads_are_400_naming_the_field(stack):
    _, gw, _ = stack
    client = gw.openai()
    image = circle()
    cases = [
        (dict(image=("x.png", b"not an image", "image/png")), "image"),
        (dict(image=("x.png", image, "image/png"), mask=("m.png", square_mask(16, 16), "image/png")), "mask"),
        (dict(image=("x.png", image, "image/png"), mask=("m.png", b"garbage", "image/png")), "mask"),
        (dict(image=("x.png", image, "image/png"), extra_body={"strength": 1.5}), "strength"),
        (dict(image=("x.png", image, "image/png"), extra_body={"steps": "many"}), "steps"),
        (dict(image=("x.png", image, "image/png"), extra_body={"colour": "red"}), "colour"),
        (dict(image=("x.png", image, "image/png"), response_format="jpeg"), "response_format"),
        (dict(image=("x.png", image, "image/png"), n=2, stream=True), "n"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.images.edit(prompt="a red circle", **{"extra_body": {"steps": 2}, **kwargs})
        assert info.value.body["param"] == param, (param, info.value.body)
    url = gw.url + "/v1/images/edits"
    answers = [
        (httpx.post(url, data={"prompt": "a red circle"}, files={"mask": ("m.png", square_mask())}), "image"),
        (httpx.post(url, json={"prompt": "a red circle"}), None),  # not a form
        (httpx.post(url, data={"prompt": "a red circle"},
                    files={"image": ("big.png", image + b"\0" * MAX_INPUT_BYTES)}, timeout=60), "image"),  # too big
    ]
    for response, param in answers:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    # a form over the gateway's upload limit is 413 before it is read
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as raw:
        raw.sendall(f"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_UPLOAD_BYTES + 1}\r\n"
                    f"Content-Type: multipart/form-data; boundary=b\r\n\r\n".encode())
        assert raw.recv(64).startswith(b"HTTP/1.1 413")


@pytest.mark.timeout(300)
def test_models_list_the_adapters_and_generations_take_loras(stack):
    engine, gw, lora_dir = stack
    client = gw.openai()
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-sd", "A", "B"]
    assert [m.model_extra.get("parent") for m in models[1:]] == ["tiny-sd", "tiny-sd"]
    knobs = {"steps": 3, "seed": 3, "sampler": "ddim"}
    plain = client.images.generate(prompt="a red circle", extra_body=knobs).data[0].b64_json
    mixed = client.images.generate(prompt="a red circle", extra_body={**knobs, "loras": {"A": 1.0, "B": 0.5}})
    assert mixed.data[0].b64_json != plain
    want = direct(engine, prompt="a red circle", loras={"A": 1.0, "B": 0.5}, **knobs)
    assert base64.b64decode(mixed.data[0].b64_json) == want
    # an edit takes adapters too (the openai package sends them as loras[A] form fields)
    edited = client.images.edit(image=("in.png", circle(), "image/png"), prompt="a blue circle",
                                extra_body={**knobs, "strength": 0.7, "loras": {"A": 0.8}})
    want = direct(engine, prompt="a blue circle", image=circle(), strength=0.7, loras={"A": 0.8}, **knobs)
    assert base64.b64decode(edited.data[0].b64_json) == want
    # the engine's verdicts name the extra: an unknown adapter, and extras this SD folder has no use for
    for extra, param in [({"loras": {"nope": 1.0}}, "loras"), ({"true_cfg": 2.0}, "true_cfg"),
                         ({"original_size": [32, 32]}, "original_size"),
                         ({"crops_coords_top_left": [0, 0]}, "crops_coords_top_left"),
                         ({"target_size": [16, 16]}, "target_size")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a red circle", extra_body={"steps": 2, **extra})
        assert info.value.body["param"] == param, (extra, info.value.body)
    # a new adapter in the folder is listed without a restart
    (lora_dir / "B.safetensors").rename(lora_dir / "C.safetensors")
    try:
        assert [m.id for m in client.models.list().data] == ["tiny-sd", "A", "C"]
    finally:
        (lora_dir / "C.safetensors").rename(lora_dir / "B.safetensors")


@pytest.mark.timeout(300)
def test_cli_generate_takes_an_image_a_mask_adapters_and_true_cfg(stack, tmp_path):
    engine, _, _ = stack
    (tmp_path / "in.png").write_bytes(circle())
    (tmp_path / "m.png").write_bytes(square_mask())

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "frontend", "generate", "--address", engine.address,
                               "--prompt", "a blue circle", "--steps", "3", "--seed", "4", *args],
                              cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)

    done = cli("--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "m.png"), "--strength", "0.6",
               "--lora", "A=0.8", "--lora", "B=0.3", "-o", str(tmp_path / "out.png"))
    assert done.returncode == 0, done.stderr
    want = direct(engine, prompt="a blue circle", negative_prompt="", steps=3, seed=4, image=circle(),
                  mask=square_mask(), strength=0.6, loras={"A": 0.8, "B": 0.3})
    assert (tmp_path / "out.png").read_bytes() == want
    refused = cli("--true-cfg", "2.5", "-o", str(tmp_path / "no.png"))
    assert refused.returncode == 2 and "true_cfg" in refused.stderr, refused.stderr
    refused = cli("--image", str(tmp_path / "in.png"), "--lora", "A", "-o", str(tmp_path / "no.png"))
    assert refused.returncode == 2 and "NAME=SCALE" in refused.stderr, refused.stderr
