"""The gateway under hostile connections: a flood of half-sent requests meets the
connection limits and the header timeout, not the open-files limit; one address cannot
take every connection before authentication; slow and abandoned uploads hold at most
their caller's share of body bytes and time out; a form of many parts is refused at once
and forms parse off the event loop; a burst of /v1/models leaves /health fast; a
non-ASCII API key authenticates; an edit whose image is too large for the output budget
is blamed on `image`. One fake engine and one gateway per test (seconds each); each
failed before its fix."""
from __future__ import annotations

import concurrent.futures
import io
import json
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

from http_helpers import gateway
from proc_helpers import REPO, env, fake_engine

pytestmark = pytest.mark.timeout(120)


def half_request(port: int, text: bytes = b"GET /heal") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(text)
    return sock


def answer_of(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What the server sends before it closes (b"" when it closes without a word)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_a_flood_of_half_sent_requests_meets_the_connection_limit_and_the_header_timeout():
    with fake_engine() as engine, gateway(engine.address, "--max-connections", "40", "--header-timeout", "2",
                                          "--max-connections-per-address", "0") as gw:
        held = [half_request(gw.port) for _ in range(40)]
        try:
            time.sleep(0.3)
            refused = half_request(gw.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = answer_of(refused)
            assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer
            start = time.monotonic()
            assert [answer_of(sock) for sock in held[:3]] == [b"", b"", b""]  # closed by the header timeout
            assert time.monotonic() - start < 8
            time.sleep(0.5)
            assert httpx.get(gw.url + "/health", timeout=5).status_code == 200
        finally:
            for sock in held:
                sock.close()


def test_one_address_cannot_take_every_connection_before_authentication():
    with fake_engine() as engine, gateway(engine.address, "--api-key", "k" * 20, "--max-connections-per-address",
                                          "5", "--header-timeout", "30") as gw:
        held = [half_request(gw.port) for _ in range(5)]
        try:
            time.sleep(0.3)
            answer = answer_of(half_request(gw.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"))
            assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections-per-address" in answer
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 200


def _edit_upload(port: int, key: str, nbytes: int, keep_back: int) -> socket.socket:
    """An edits upload of `nbytes` declared, all sent but its last `keep_back` bytes."""
    head = (f"POST /v1/images/edits HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: multipart/form-data; boundary=B\r\ncontent-length: {nbytes}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head + b"x" * (nbytes - keep_back))
    return sock


def test_slow_uploads_hold_at_most_their_callers_share_and_time_out():
    key = "k" * 20
    share = 3 << 20
    with fake_engine() as engine, gateway(engine.address, "--api-key", key, "--max-caller-body-bytes", str(share),
                                          "--body-timeout", "3") as gw:
        uploads = [_edit_upload(gw.port, key, 1 << 20, 10) for _ in range(6)]  # 6 MB declared, 3 MB allowed
        try:
            answers = [answer_of(sock, 20) for sock in uploads]
        finally:
            for sock in uploads:
                sock.close()
        too_many = [a for a in answers if a.startswith(b"HTTP/1.1 429") and b"too_many_body_bytes" in a]
        timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
        assert too_many and timed_out and len(too_many) + len(timed_out) == 6, answers
        assert len(timed_out) <= 3  # at most the share was held at once
        answer = httpx.get(gw.url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
        assert answer.status_code == 200  # the share came back


def test_a_form_of_many_parts_is_refused_at_once_without_holding_up_health():
    key = "k" * 20
    parts = b"".join(b"--B\r\ncontent-disposition: form-data; name=\"p%d\"\r\n\r\nx\r\n" % i for i in range(20000))
    body = parts + b"--B--\r\n"
    with fake_engine() as engine, gateway(engine.address, "--api-key", key) as gw:
        answer = httpx.post(gw.url + "/v1/images/edits", content=body, timeout=30,
                            headers={"authorization": f"Bearer {key}",
                                     "content-type": "multipart/form-data; boundary=B"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "too_many_parts"


def test_a_burst_of_model_listings_leaves_health_fast():
    """Each listing is a Stats round trip that the engine answers between two steps (half
    a second here); before, 60 of them filled the loop's default executor (6 threads on
    this machine) that the link's drain poll behind /health also waited in."""
    with fake_engine("--step-delay", "0.5") as engine, gateway(engine.address) as gw, \
            httpx.Client(timeout=60) as http:
        busy = concurrent.futures.ThreadPoolExecutor(64)
        try:
            busy.submit(http.post, gw.url + "/v1/images/generations",
                        json={"prompt": "a red circle", "steps": 30, "size": "32x32"})
            time.sleep(1.0)  # steps of half a second run now
            listings = [busy.submit(http.get, gw.url + "/v1/models") for _ in range(60)]
            time.sleep(0.5)
            slowest = 0.0
            for _ in range(3):
                start = time.monotonic()
                assert http.get(gw.url + "/health").status_code == 200
                slowest = max(slowest, time.monotonic() - start)
                time.sleep(1.1)  # past the drain poll's interval: each probe asks the engine
            assert all(f.result(60).status_code == 200 for f in listings)
        finally:
            busy.shutdown(wait=True)
        assert slowest < 2.0, slowest


def test_a_non_ascii_api_key_authenticates():
    key = "clé-ключ-鍵-0123456789"
    with fake_engine() as engine, gateway(engine.address, extra_env={"DIFFSLOT_API_KEYS": key}) as gw:
        good = httpx.get(gw.url + "/v1/models", headers={"authorization": b"Bearer " + key.encode()}, timeout=10)
        bad = httpx.get(gw.url + "/v1/models", headers={"authorization": b"Bearer " + key.encode()[:-1]}, timeout=10)
        assert good.status_code == 200 and bad.status_code == 401


def test_an_edit_image_too_large_for_the_output_budget_is_blamed_on_image():
    from frontend.http.errors import APIError
    from frontend.http.schemas import check_fits, parse_edit

    buffer = io.BytesIO()
    Image.new("RGB", (2048, 2048)).save(buffer, format="PNG")
    form = (b"--B\r\ncontent-disposition: form-data; name=\"prompt\"\r\n\r\na red circle\r\n"
            b"--B\r\ncontent-disposition: form-data; name=\"image\"; filename=\"i.png\"\r\n"
            b"content-type: image/png\r\n\r\n" + buffer.getvalue() + b"\r\n--B--\r\n")
    gen = parse_edit("multipart/form-data; boundary=B", form, ("diffslot",), 16 << 20)
    with pytest.raises(APIError) as info:
        check_fits(gen, 1 << 20, 512)
    assert info.value.param == "image"


def test_the_open_files_soft_limit_is_raised_to_the_hard_one():
    code = ("import resource\nfrom frontend.http.server import raise_open_files_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256)
    out = subprocess.run([sys.executable, "-c", f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, "
                          f"({lowered}, {hard}))\n" + code], cwd=REPO, env=env(), capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    got, now_soft, now_hard = (int(x) for x in out)
    assert now_soft == got and (now_hard == resource.RLIM_INFINITY or now_soft == now_hard) and now_soft > lowered


def test_health_reports_json():  # the guarded protocol still serves plain requests and keep-alive
    with fake_engine() as engine, gateway(engine.address) as gw, httpx.Client(timeout=10) as http:
        for _ in range(3):
            assert json.loads(http.get(gw.url + "/health").text)["status"] == "ok"


def test_a_caller_past_the_engines_client_limit_is_told_so():
    """The engine takes two clients: the gateway's main connection and one caller's; a
    second caller gets a 503 naming the limit, with Retry-After (before: "not reachable")."""
    with fake_engine("--max-clients", "2") as engine, \
            gateway(engine.address, extra_env={"DIFFSLOT_API_KEYS": "first-key-0123456789,second-key-0123456789"}) \
            as gw:
        body = {"prompt": "a red circle", "steps": 2, "size": "32x32"}
        first = httpx.post(gw.url + "/v1/images/generations", json=body, timeout=30,
                           headers={"authorization": "Bearer first-key-0123456789"})
        second = httpx.post(gw.url + "/v1/images/generations", json=body, timeout=30,
                            headers={"authorization": "Bearer second-key-0123456789"})
        assert first.status_code == 200, first.text
        assert second.status_code == 503 and second.json()["error"]["code"] == "engine_client_limit"
        assert second.headers["retry-after"] == "1"
