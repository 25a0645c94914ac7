"""The OpenAI-compatible images API (R16), through the real `openai` package and httpx.

Every gateway is `python -m frontend http` as a subprocess on 127.0.0.1 and a free
port (tests/http_helpers.py), in front of an engine subprocess (the real engine on a
tiny SD folder where the model matters, the fake core elsewhere); all are stopped and
reaped here.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import sys
import threading
import time

import httpx
import pytest

from frontend import launcher
from frontend import Client
from tests.http_helpers import gateway, png_size, serving
from tests.output_contract import IMAGE_LEVELS, assert_images_close, image_difference
from tests.proc_helpers import REPO, env, socket_dir, start_engine, wait_until

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")


# ----------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> pathlib.Path:
    from engine.testing.tiny_pipelines import build_sd

    return build_sd(tmp_path_factory.mktemp("tiny-sd") / "tiny-sd")


@pytest.fixture(scope="module")
def real_stack(tiny_sd):
    """A real engine on the tiny SD folder (16×16 native) and a gateway in front of it."""
    with serving("--model", str(tiny_sd), "--slots", "4", "--decode-workers", "1") as stack:
        yield stack


@pytest.mark.timeout(300)
def test_images_generate_models_and_sizes(real_stack):
    engine, gw = real_stack
    client = gw.openai()
    models = [m.id for m in client.models.list()]
    assert models == ["tiny-sd"]

    r = client.images.generate(model="tiny-sd", prompt="a red circle", n=2, response_format="b64_json",
                               extra_body={"steps": 3, "sampler": "euler", "guidance": 2.5, "seed": 11})
    assert len(r.data) == 2 and all(png_size(d.b64_json) == (16, 16) for d in r.data)
    assert [d.model_extra["seed"] for d in r.data] == [11, 12]
    assert r.data[0].b64_json != r.data[1].b64_json  # seeds 11 and 12
    assert r.model_extra["timings"][0]["evals"] == 6  # 3 steps × 2 guidance rows
    # n>1 is n requests with seeds seed…seed+n−1: the second equals a request with seed 12,
    # within the contract's one level (alone, it ran in other batches than beside the first)
    alone = client.images.generate(prompt="a red circle",
                                   extra_body={"steps": 3, "sampler": "euler", "guidance": 2.5, "seed": 12})
    assert_images_close(alone.data[0].b64_json, r.data[1].b64_json)
    assert image_difference(alone.data[0].b64_json, r.data[0].b64_json) > IMAGE_LEVELS  # and not the first

    r = client.images.generate(prompt="a blue square", size="24x32", extra_body={"steps": 2, "seed": 1})
    assert png_size(r.data[0].b64_json) == (24, 32) and r.size == "24x32"


@pytest.mark.timeout(300)
def test_bad_requests_name_the_param(real_stack):
    engine, gw = real_stack
    client = gw.openai()
    cases = [
        ({"prompt": "a red circle", "extra_body": {"steps": 0}}, "steps"),
        ({"prompt": "a red circle", "extra_body": {"sampler": "nope"}}, "sampler"),
        ({"prompt": "a red circle", "extra_body": {"steps": "many"}}, "steps"),
        ({"prompt": "a red circle", "extra_body": {"stepz": 3}}, "stepz"),
        ({"prompt": "a red circle", "size": "13x16", "extra_body": {"steps": 1}}, "size"),
        ({"prompt": "a red circle", "size": "big"}, "size"),
        ({"prompt": "a red circle", "n": 0}, "n"),
        ({"prompt": "a red circle", "response_format": "jpeg"}, "response_format"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(**kwargs)
        error = info.value
        assert error.status_code == 400 and error.body["param"] == param, (kwargs, error.body)
        assert error.body["type"] == "invalid_request_error" and error.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red circle", response_format="jpeg")
    assert "b64_json" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(model="dall-e-3", prompt="a red circle")
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    # an error from the engine itself still names the field
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red circle", extra_body={"guidance": -1, "steps": 1})
    assert info.value.body["param"] == "guidance"


@pytest.mark.timeout(300)
def test_stream_partial_images_then_completed(real_stack):
    engine, gw = real_stack
    client = gw.openai()
    events = list(client.images.generate(prompt="a green triangle", stream=True, partial_images=2,
                                         extra_body={"steps": 6, "seed": 3}))
    kinds = [e.type for e in events]
    assert kinds[-1] == "image_generation.completed", kinds
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert [p.partial_image_index for p in partials] == list(range(len(partials)))
    assert len(partials) == 2, kinds
    for event in events:
        assert png_size(event.b64_json) == (16, 16)
        assert event.size == "auto" and event.output_format == "png"
    # the streamed image is the one a plain request returns
    plain = client.images.generate(prompt="a green triangle", extra_body={"steps": 6, "seed": 3})
    assert events[-1].b64_json == plain.data[0].b64_json  # both alone: the same calls, the same bytes
    # partial_images=0: one completed event only
    events = list(client.images.generate(prompt="a green triangle", stream=True, partial_images=0,
                                         extra_body={"steps": 2}))
    assert [e.type for e in events] == ["image_generation.completed"]


def raw_post(port: int, body: dict) -> socket.socket:
    """POST a JSON body on a raw socket, so that the test decides when the connection closes."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before {marker!r}: {seen[:300]!r}")
        seen += chunk
    return seen


@pytest.mark.timeout(300)
def test_disconnect_cancels_on_the_engine_within_a_second(real_stack):
    engine, gw = real_stack
    with Client(engine.address) as direct:
        stats = direct.stats
        cases = [  # (body, what to wait for before hanging up)
            ({"prompt": "a red circle", "steps": 500}, None),  # waiting for the whole image
            ({"prompt": "a red circle", "steps": 500, "stream": True, "partial_images": 2}, None),  # for the first event
            ({"prompt": "a red circle", "steps": 80, "stream": True, "partial_images": 3},  # mid-stream
             b"image_generation.partial_image"),
        ]
        for body, marker in cases:
            before = stats()["canceled_requests"]
            sock = raw_post(gw.port, body)
            try:
                if marker is None:
                    wait_until(lambda: stats()["slots_busy"] >= 1, 60, message="request running")
                else:
                    read_until(sock, marker, 60)
            finally:
                sock.close()
            closed_at = time.monotonic()
            wait_until(lambda: stats()["canceled_requests"] > before, 5, interval=0.01, message="engine cancel")
            elapsed = time.monotonic() - closed_at
            assert elapsed < 1.0, f"{body}: the cancel reached the engine {elapsed:.2f}s after the disconnect"
            wait_until(lambda: stats()["slots_busy"] == 0, 10, message="slot released")
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'diffslot_http_images_total{outcome="client_gone"} 3.0' in metrics, metrics


# ----------------------------------------------------------------------------- fake engine


@contextlib.contextmanager
def fake_core_engine(*args: str):
    """tests/fake_core.py run directly (tests.proc_helpers.fake_engine's wrapper parser would
    take `--max-queue` as an abbreviation of its own `--max-queue-per-client`)."""
    with socket_dir() as directory:
        address = f"ipc://{directory / 'engine.sock'}"
        engine = launcher.EngineProcess([sys.executable, str(REPO / "tests" / "fake_core.py"), "--address", address,
                                         *args], address, directory / "engine.log", env=env(), cwd=REPO)
        try:
            engine.wait_ready(60)
            yield engine
        finally:
            engine.stop()


@pytest.mark.timeout(120)
def test_queue_full_is_429_with_retry_after():
    with fake_core_engine("--max-queue", "0") as engine, gateway(engine.address) as gw:
        with pytest.raises(openai.RateLimitError) as info:
            gw.openai().images.generate(prompt="a red circle", extra_body={"steps": 2})
        error = info.value
        assert error.status_code == 429 and int(error.response.headers["retry-after"]) >= 1
        assert error.body["code"] == "engine_busy"
        # the openai client honours Retry-After and retries (here until it gives up)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError):
            gw.openai().with_options(max_retries=1).images.generate(prompt="a red circle")
        assert time.monotonic() - started >= 0.4  # it waited the engine's retry_after_s (0.5 s)
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'diffslot_http_requests_total{route="/v1/images/generations",status="429"} 3.0' in metrics
        assert "diffslot_http_request_duration_seconds_bucket" in metrics


@pytest.mark.timeout(120)
def test_engine_death_is_503_and_a_restarted_engine_is_picked_up():
    with socket_dir() as directory:
        address = f"ipc://{directory / 'engine.sock'}"
        engine = start_engine(address, directory / "engine.log", ["--step-delay", "0.01"])
        try:
            engine.wait_ready(60)
            with gateway(address) as gw:
                client = gw.openai()
                assert len(client.images.generate(prompt="a red circle", extra_body={"steps": 2}).data) == 1
                outcome = {}

                def long_request():
                    try:
                        client.images.generate(prompt="a red circle", extra_body={"steps": 1000})
                    except Exception as exc:  # noqa: BLE001 - the test inspects it
                        outcome["error"] = exc

                thread = threading.Thread(target=long_request)
                thread.start()
                time.sleep(0.5)
                engine.popen.kill()  # SIGKILL: no goodbye
                engine.stop()
                thread.join(30)
                error = outcome.get("error")
                assert isinstance(error, openai.InternalServerError) and error.status_code == 503, error
                assert error.body["code"] == "engine_unavailable"
                with pytest.raises(openai.InternalServerError) as info:
                    client.images.generate(prompt="a red circle", extra_body={"steps": 2})
                assert info.value.status_code == 503
                assert httpx.get(gw.url + "/health").status_code == 503

                engine = start_engine(address, directory / "engine2.log", [])  # a supervisor restarts it
                engine.wait_ready(60)
                wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, 20, interval=0.2,
                           message="gateway reconnected")
                assert len(client.images.generate(prompt="a red circle", extra_body={"steps": 2}).data) == 1
        finally:
            engine.stop()


@pytest.mark.timeout(120)
def test_gateway_starts_before_its_engine():
    with socket_dir() as directory:
        address = f"ipc://{directory / 'engine.sock'}"
        with gateway(address, ready=False) as gw:
            response = httpx.get(gw.url + "/health")
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
            engine = start_engine(address, directory / "engine.log", [])
            try:
                engine.wait_ready(60)
                wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, 30, interval=0.2,
                           message="gateway connected")
                r = gw.openai().images.generate(prompt="a blue cross", extra_body={"steps": 1})
                assert png_size(r.data[0].b64_json) == (32, 32)
            finally:
                engine.stop()


@pytest.mark.timeout(120)
def test_stream_errors_and_unknown_routes_in_openai_shape():
    with serving("--fail-prompt", "a red cross", fake=True) as (engine, gw):
        client = gw.openai()
        with pytest.raises(openai.InternalServerError) as info:  # fails before any event: a plain 500
            list(client.images.generate(prompt="a red cross", stream=True, extra_body={"steps": 2}))
        assert info.value.status_code == 500 and info.value.body["code"] == "generation_failed"
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a red circle", stream=True, n=2)
        assert info.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as info:
            client.images.generate(prompt="a red circle", stream=True, partial_images=4)
        assert info.value.body["param"] == "partial_images"
        response = httpx.get(gw.url + "/v1/nothing")
        assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
        response = httpx.post(gw.url + "/v1/images/generations", content=b"{not json")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
        response = httpx.post(gw.url + "/v1/images/generations", json={"n": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
