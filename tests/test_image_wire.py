"""Image inputs on the wire : `GenerateParams.image` / `.mask` travel as
their own frames after `Submit` (`Submit.inputs` names them), the engine's IO thread
reattaches them, checks their count, names and sizes (`Welcome.max_input_bytes`), and
answers anything wrong with a `Rejected` naming the field.

The engine is the real one (`python -m engine serve`) on a tiny random-weight SD folder;
the in-process reference runs the same core in a subprocess with the engine's thread
settings, so the two can be compared bit for bit.
"""
from __future__ import annotations

import io
import pathlib
import random
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from engine.protocol import MAX_INPUT_BYTES, Completed, GenerateParams, Heartbeat, Rejected, Submit
from frontend import Client
from tests.proc_helpers import REPO, RawPeer, env, real_engine

Image = pytest.importorskip("PIL.Image")
from PIL import ImageDraw  # noqa: E402


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def drawn(seed: int, width: int = 16, height: int = 16) -> bytes:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (rng.randrange(256),) * 3)
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.randrange(width - 4), rng.randrange(height - 4)
        draw.ellipse([x0, y0, x0 + 4, y0 + 4], fill=tuple(rng.randrange(256) for _ in range(3)))
    return png(image)


def mask(width: int = 16, height: int = 16) -> bytes:
    image = Image.new("L", (width, height), 0)
    ImageDraw.Draw(image).rectangle([2, 2, width // 2, height // 2], fill=255)
    return png(image)


REFERENCE = """
import sys
import msgspec, numpy as np
from engine.core import CoreConfig, EngineCore
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from tests.core_driver import CoreDriver

folder, params_path, out_path = sys.argv[1:]
requests = msgspec.msgpack.decode(open(params_path, "rb").read(), type=list[GenerateParams])
driver = CoreDriver(EngineCore(load_model(folder, "cpu", dtype="float32"), CoreConfig(slots=2, device="cpu")))
for i, p in enumerate(requests):  # one at a time, as the test submits them to the engine
    driver.run({str(i): p})
np.savez(out_path, **driver.results)
"""


def in_process(folder: pathlib.Path, requests: list[GenerateParams], tmp_path: pathlib.Path) -> list[np.ndarray]:
    params_path, out_path = tmp_path / "params.msgpack", tmp_path / "reference.npz"
    params_path.write_bytes(msgspec.msgpack.encode(requests))
    subprocess.run([sys.executable, "-c", REFERENCE, str(folder), str(params_path), str(out_path)], cwd=REPO,
                   env=env(), check=True, timeout=240)
    with np.load(out_path) as saved:
        return [saved[str(i)] for i in range(len(requests))]


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> pathlib.Path:
    from engine.testing.tiny_pipelines import build_sd

    return build_sd(tmp_path_factory.mktemp("wire-sd") / "tiny-sd", scheduler="ddim", seed=5)


@pytest.fixture(scope="module")
def engine(tiny_sd):
    with real_engine("--model", str(tiny_sd), "--slots", "2", "--decode-workers", "1") as engine:
        yield engine


@pytest.mark.timeout(400)
def test_image_requests_over_the_wire_equal_the_core_in_process(engine, tiny_sd, tmp_path):
    requests = [
        GenerateParams(prompt="a red circle", steps=5, seed=3, guidance=3.0, output="latent",
                       image=drawn(1), strength=0.6),
        GenerateParams(prompt="a blue square", negative_prompt="blurry", steps=4, seed=8, sampler="dpmpp_2m",
                       output="latent", image=drawn(2), mask=mask(), strength=0.8),
        GenerateParams(prompt="a green cross", steps=4, seed=2, output="latent", image=drawn(3, 24, 16)),
    ]
    got = []
    with Client(engine.address) as client:
        assert client.welcome.max_input_bytes == MAX_INPUT_BYTES
        for p in requests:
            result = client.submit(p, progress=False).result(timeout=60)
            assert isinstance(result, Completed), result
            assert result.timings.image_encode_s > 0
            got.append(np.array(result.output))
    want = in_process(tiny_sd, requests, tmp_path)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert np.array_equal(a, b), f"request {i}: max |diff| {np.abs(a - b).max():.3g}"
    assert got[2].shape[-1] > got[2].shape[-2]  # the 24×16 image's own size


@pytest.mark.timeout(120)
def test_bad_images_are_rejected_naming_the_field(engine):
    with Client(engine.address) as client:
        cases = [
            (GenerateParams(prompt="a red circle", steps=2, image=b"not an image at all"), "image"),
            (GenerateParams(prompt="a red circle", steps=2, image=drawn(4), mask=b"\x89PNG broken"), "mask"),
            (GenerateParams(prompt="a red circle", steps=2, image=drawn(4), mask=mask(24, 16)), "mask"),
            (GenerateParams(prompt="a red circle", steps=2, image=drawn(4), strength=1.5), "strength"),
            (GenerateParams(prompt="a red circle", steps=2, image="a path, not bytes"), "image"),  # client-side
        ]
        for params, field in cases:
            result = client.submit(params).result(timeout=30)
            assert isinstance(result, Rejected) and result.field == field, (field, result)
        # an input over Welcome.max_input_bytes is refused by the client, unsent
        big = drawn(5) + b"\0" * (client.welcome.max_input_bytes)
        result = client.submit(GenerateParams(prompt="a red circle", image=big)).result(timeout=5)
        assert isinstance(result, Rejected) and result.field == "image" and "max_input_bytes" in result.reason
        assert client.stats()["rejected_image_inputs"] == 0
        # and the engine goes on serving image requests
        ok = client.submit(GenerateParams(prompt="a red circle", steps=2, image=drawn(6))).result(timeout=60)
        assert isinstance(ok, Completed) and ok.output[:4] == b"\x89PNG"


def submit_frames(peer: RawPeer, request_id: str, inputs: tuple[str, ...], frames: list[bytes], **params) -> Rejected:
    body = peer.encoder.encode(Submit(request_id, GenerateParams(prompt="a red circle", steps=2, **params),
                                      inputs=inputs))
    peer.send_frames([body, *frames])
    while True:
        msg = peer.recv(30)
        if getattr(msg, "request_id", None) == request_id:
            return msg


@pytest.mark.timeout(120)
def test_frames_the_engine_refuses_name_the_field(engine):
    with Client(engine.address) as client:
        refused_before = client.stats()["rejected_image_inputs"]
    peer = RawPeer(engine.address)
    try:
        image = drawn(7)
        oversized = image + b"\0" * (MAX_INPUT_BYTES + 1 - len(image))
        cases = [
            ("big", ("image",), [oversized], {}, "image"),  # over Welcome.max_input_bytes
            ("no-frame", ("image",), [], {}, "image"),  # named, not sent
            ("no-mask", ("image", "mask"), [image], {}, "mask"),
            ("surplus", (), [image], {}, "inputs"),  # sent, not named
            ("twice", ("image", "image"), [image, image], {}, "inputs"),
            ("unknown", ("picture",), [image], {}, "inputs"),
            ("both", ("image",), [image], {"image": image}, "image"),  # in the body and as a frame
        ]
        for request_id, inputs, frames, params, field in cases:
            msg = submit_frames(peer, request_id, inputs, frames, **params)
            assert isinstance(msg, Rejected) and msg.field == field, (request_id, msg)
        # frames after a message that takes none are refused, the engine is unharmed
        peer.send_frames([peer.encoder.encode(Heartbeat()), image])
        assert isinstance(peer.recv(10), Rejected)
        # a well-formed one is accepted and completes (PNG output as its frame)
        msg = submit_frames(peer, "ok", ("image",), [image])
        assert type(msg).__name__ == "Accepted", msg
        while type(msg).__name__ != "Completed":
            peer.heartbeat()
            msg = peer.recv(60)
        assert msg.frames[0][:4] == b"\x89PNG"
    finally:
        peer.close()
    with Client(engine.address) as client:
        assert client.stats()["rejected_image_inputs"] - refused_before == len(cases)


@pytest.mark.timeout(10)
def test_the_new_fields_are_last_and_optional_on_the_wire():
    from engine.protocol import StatsReply, Welcome, client_decoder, engine_decoder

    old_submit = msgspec.msgpack.encode(["submit", "r1", {"prompt": "a red circle"}, True, 0])
    assert client_decoder().decode(old_submit).inputs == ()
    old_welcome = msgspec.msgpack.encode(["welcome", 1, 2, 0.5, 3.0, 1 << 20, "m", [], 16, "P", 65536])
    assert engine_decoder().decode(old_welcome).max_input_bytes == MAX_INPUT_BYTES
    assert engine_decoder().decode(old_welcome).controlnets == []
    assert engine_decoder().decode(msgspec.msgpack.encode(["stats_reply", 1, {}])).adapters == []
    assert Submit.__struct_fields__[-1] == "inputs" and Welcome.__struct_fields__[-2:] == ("max_input_bytes",
                                                                                         "controlnets")
    assert StatsReply.__struct_fields__[-1] == "adapters"
