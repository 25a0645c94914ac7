"""The HTTP gateway's bounds (R22): API keys, the body limit, each caller's own
share of the engine, the rate limit, requests that can never fit, /health while the
engine drains, 500s without internals, the seed range, and a Ray replica's engine
that must not outlive its replica.

Gateways are `python -m frontend http` subprocesses in front of fake-core engines
(tests/fake_core.py behind the real engine process), except where the app is driven
in-process through httpx's ASGI transport; every process is stopped and reaped here.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from frontend import Client, EngineDeadError, GenerateParams
from frontend.http import callers
from frontend.http.callers import KeyRing, RateLimiter
from tests.http_helpers import gateway as http_gateway, serving
from tests.proc_helpers import client_process, fake_engine, read_line, socket_dir, wait_until

openai = pytest.importorskip("openai")

# 256×256 PNGs reserve 198,084 bytes each: with a 5,000,000-byte budget per engine client,
# two n=10 requests fit at once (3.96 MB) and three do not (5.94 MB)
BUDGET = 5_000_000
N10_256 = {"prompt": "a red circle", "n": 10, "size": "256x256", "steps": 50}  # 1 s of 20 ms steps


# ----------------------------------------------------------------------------- helpers

# the gateway (tests/http_helpers.py) logs at info here: a test reads the request ids it logs
gateway = functools.partial(http_gateway, log_level="info")


@pytest.fixture(scope="module")
def engine():
    """One fake engine for the module: a 5 MB output budget per client, 20 ms steps."""
    with fake_engine("--output-budget", str(BUDGET), "--step-delay", "0.02") as engine:
        yield engine


def engine_submissions(engine) -> int:
    """Requests the engine has accepted or rejected so far (its log's lines for each)."""
    text = engine.log_path.read_text(errors="replace")
    return text.count(" accepted: ") + text.count(" rejected: ")


def concurrently(*calls):
    """Run the calls at once on threads; their results (or exceptions), in order."""
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


# ----------------------------------------------------------------------------- API keys


@pytest.mark.timeout(120)
def test_api_keys_guard_every_v1_route_and_leave_probes_open(engine):
    with gateway(engine.address, "--api-key", "key-one", "--api-key", "key-two",
                 extra_env={callers.API_KEYS_ENV: " key-three , "}) as gw:
        for key in ("key-one", "key-two", "key-three"):
            assert [m.id for m in gw.openai(key).models.list()] == ["fake"]
        r = gw.openai("key-two").images.generate(prompt="a red circle", extra_body={"steps": 2})
        assert len(r.data) == 1
        for wrong in ("key-four", "KEY-ONE", "key-on", "key-one-and-more"):
            with pytest.raises(openai.AuthenticationError) as info:
                gw.openai(wrong).images.generate(prompt="a red circle", extra_body={"steps": 2})
            error = info.value
            assert error.status_code == 401 and error.body["code"] == "invalid_api_key", error.body
            assert set(error.body) == {"message", "type", "param", "code"}
            assert wrong not in error.body["message"]
        # no header, another scheme, an unknown /v1 route: 401 all the same
        for headers, path in (({}, "/v1/models"), ({"Authorization": "Basic a2V5LW9uZQ=="}, "/v1/models"),
                              ({}, "/v1/nothing")):
            response = httpx.get(gw.url + path, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        # probes and scrapers need no key
        assert httpx.get(gw.url + "/health").status_code == 200
        assert httpx.get(gw.url + "/metrics").status_code == 200
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'diffslot_http_requests_total{route="/v1/models",status="401"} 2.0' in metrics


def test_key_comparison_checks_every_key_in_constant_time(monkeypatch):
    compared = []
    real = hmac.compare_digest

    def counting(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(callers.hmac, "compare_digest", counting)
    ring = KeyRing(["first", "a-much-longer-second-key", "third"])
    assert ring.caller("Bearer first") == "key#0"
    assert ring.caller("bearer third") == "key#2"
    assert ring.caller("Bearer fourth") is None and ring.caller("first") is None and ring.caller(None) is None
    # every key compared on every attempt, a match included, as digests of one length
    assert len(compared) == 9 and set(compared) == {(32, 32)}


def test_api_keys_from_flags_and_environment():
    assert callers.api_keys(["a", "b", "a"], {callers.API_KEYS_ENV: "c, ,b,"}) == ("a", "b", "c")
    assert callers.api_keys([], {}) == ()


# ----------------------------------------------------------------------------- body size


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _status_line(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes]:
    seen, deadline = b"", time.monotonic() + timeout
    while b"\r\n\r\n" not in seen:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        seen += chunk
    with contextlib.suppress(OSError):  # the rest of the body, if the server sent it before closing
        sock.settimeout(1)
        while chunk := sock.recv(65536):
            seen += chunk
    return int(seen.split(b" ", 2)[1]), seen


@pytest.mark.timeout(120)
def test_bodies_over_the_limit_are_413_before_they_are_read(engine):
    with gateway(engine.address) as gw:  # the default limit: 1 MiB
        # a declared 60 MiB body: 413 with none of it sent
        with _raw(gw.port) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (60 << 20))
            status, response = _status_line(sock)
        assert status == 413, response[:300]
        assert b'"code": "request_too_large"' in response
        # a chunked body of unknown length: refused once it passes 1 MiB, before it ends (this
        # body never ends: a gateway that read it whole would never answer)
        with _raw(gw.port) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 65536
            with contextlib.suppress(OSError):  # the gateway may close while we still send
                for _ in range(17):  # 1 MiB + 64 KiB
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            status, response = _status_line(sock)
        assert status == 413, response[:300]
        # through the openai package: a 2 MB prompt
        with pytest.raises(openai.APIStatusError) as info:
            gw.openai().images.generate(prompt="a red circle" * 200_000)
        assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
        # a body under the limit still works, and the gateway is fine
        assert len(gw.openai().images.generate(prompt="a red circle", extra_body={"steps": 1}).data) == 1


@pytest.mark.timeout(120)
def test_max_body_bytes_sets_the_limit(engine):
    body = json.dumps({"prompt": "a red circle", "steps": 1, "negative_prompt": "z" * 3000}).encode()
    with gateway(engine.address, "--max-body-bytes", "2048") as gw:
        response = httpx.post(gw.url + "/v1/images/generations", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 413 and "2048" in response.json()["error"]["message"]
        ok = httpx.post(gw.url + "/v1/images/generations", json={"prompt": "a red circle", "steps": 1}, timeout=30)
        assert ok.status_code == 200


# ----------------------------------------------------------------------------- each caller's share


@pytest.mark.timeout(180)
def test_each_caller_has_its_own_share_of_the_engine(engine):
    """Three n=10 requests that together exceed one engine client's budget: from three
    callers all complete (each caller is its own engine client); from one caller, the one
    that does not fit in its share is told to retry."""
    with gateway(engine.address, "--api-key", "k1", "--api-key", "k2", "--api-key", "k3") as gw:
        body = dict(N10_256)
        prompt, n, size = body.pop("prompt"), body.pop("n"), body.pop("size")
        generate = lambda key: lambda: gw.openai(key).images.generate(prompt=prompt, n=n, size=size,  # noqa: E731
                                                                      extra_body=body)
        results = concurrently(generate("k1"), generate("k2"), generate("k3"))
        assert all(not isinstance(r, Exception) and len(r.data) == 10 for r in results), results
        results = concurrently(generate("k1"), generate("k1"), generate("k1"))
        refused = [r for r in results if isinstance(r, Exception)]
        assert refused and all(isinstance(r, openai.RateLimitError) for r in refused), results
        assert all(r.body["code"] == "engine_busy" for r in refused)


@pytest.mark.timeout(180)
def test_without_keys_each_client_address_is_a_caller(engine):
    with gateway(engine.address) as gw, contextlib.ExitStack() as stack:
        posts = []
        for address in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):  # all of 127/8 is loopback
            http = stack.enter_context(httpx.Client(transport=httpx.HTTPTransport(local_address=address),
                                                    timeout=60))
            posts.append(lambda http=http: http.post(gw.url + "/v1/images/generations", json=N10_256).status_code)
        assert concurrently(*posts) == [200, 200, 200]


@pytest.mark.timeout(120)
def test_caller_connections_are_bounded(engine):
    """With room for one caller connection, a second caller is told to retry while the
    first has a request in flight, and is served once the first is idle."""
    with gateway(engine.address, "--api-key", "k1", "--api-key", "k2", "--max-callers", "1") as gw:
        first = threading.Thread(target=lambda: gw.openai("k1").images.generate(
            prompt="a red circle", extra_body={"steps": 100}))  # 2 s of 20 ms steps
        first.start()
        try:
            with Client(engine.address) as direct:
                wait_until(lambda: direct.stats()["slots_busy"] >= 1, 30, message="first caller's request running")
            with pytest.raises(openai.RateLimitError) as info:
                gw.openai("k2").images.generate(prompt="a red circle", extra_body={"steps": 1})
            assert info.value.body["code"] == "too_many_callers"
            assert int(info.value.response.headers["retry-after"]) >= 1
        finally:
            first.join(60)
        assert len(gw.openai("k2").images.generate(prompt="a red circle", extra_body={"steps": 1}).data) == 1


@pytest.mark.timeout(120)
def test_idle_caller_connections_make_room_and_are_closed_on_the_engine(engine):
    """Many callers one after another: never more than `max_callers` connections, the
    idle ones closed (the engine sees them go), and no caller refused."""
    from frontend.http.app import create_app
    from frontend.http.link import EngineLink
    from frontend.http.options import GatewayLimits

    keys = [f"key-{i}" for i in range(6)]

    async def run():
        link = EngineLink(engine.address, max_callers=2)
        app = create_app(link, GatewayLimits(api_keys=keys), own_link=False)
        transport = httpx.ASGITransport(app)
        try:
            assert await link.wait_connected(30)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as http:
                for key in keys:
                    response = await http.post("/v1/images/generations", headers={"authorization": f"Bearer {key}"},
                                               json={"prompt": "a red circle", "steps": 1})
                    assert response.status_code == 200, response.text
                    assert link.callers <= 2
            await asyncio.sleep(0)  # let the closing tasks start
            while link._closing:
                await asyncio.gather(*link._closing)
            with Client(engine.address) as direct:  # the link's main connection, two callers', this one
                wait_until(lambda: direct.stats()["clients"] <= 1 + 2 + 1, 5, message="idle callers gone")
        finally:
            await link.close()

    asyncio.run(run())


# ----------------------------------------------------------------------------- never fits


@pytest.mark.timeout(120)
def test_a_request_that_can_never_fit_is_400_naming_the_field(engine):
    with gateway(engine.address) as gw:
        client = gw.openai()
        before = engine_submissions(engine)
        cases = [  # (kwargs, the parameter to blame)
            ({"n": 10, "size": "512x512"}, "n"),  # 10 × 788,754 bytes > 5,000,000
            ({"size": "2048x2048"}, "size"),  # one image alone: 12.6 MB
            ({"size": "1024x1024", "stream": True, "partial_images": 3}, "partial_images"),  # 4 × 3.15 MB
        ]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                result = client.images.generate(prompt="a red circle", extra_body={"steps": 2}, **kwargs)
                list(result) if kwargs.get("stream") else None
            body = info.value.body
            assert body["param"] == param and str(BUDGET) in body["message"], (kwargs, body)
        assert engine_submissions(engine) == before  # refused before anything reached the engine
        # at the edge: six 512² images fit (4.7 MB), and are served
        assert len(client.images.generate(prompt="a red circle", n=6, size="512x512",
                                          extra_body={"steps": 1}).data) == 6


# ----------------------------------------------------------------------------- seeds


@pytest.mark.timeout(120)
def test_seeds_past_the_range_are_400_before_any_image_is_submitted(engine):
    with gateway(engine.address) as gw:
        client = gw.openai()
        before = engine_submissions(engine)
        for n, seed in ((2, 2**63 - 1), (10, 2**63 - 9), (1, 2**63), (1, -1), (3, 2**70)):
            with pytest.raises(openai.BadRequestError) as info:
                client.images.generate(prompt="a red circle", n=n, extra_body={"steps": 1, "seed": seed})
            assert info.value.body["param"] == "seed", (n, seed, info.value.body)
        assert engine_submissions(engine) == before
        r = client.images.generate(prompt="a red circle", n=2, extra_body={"steps": 1, "seed": 2**63 - 2})
        assert [d.model_extra["seed"] for d in r.data] == [2**63 - 2, 2**63 - 1]


# ----------------------------------------------------------------------------- rate limit


def test_token_bucket_refills_at_its_rate_and_forgets_full_buckets():
    now = [0.0]
    limiter = RateLimiter(2.0, burst=3, max_buckets=4, clock=lambda: now[0])
    assert [limiter.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a") == pytest.approx(0.5)
    assert limiter.acquire("b") == 0.0  # another caller has its own bucket
    now[0] += 0.5
    assert limiter.acquire("a") == 0.0 and limiter.acquire("a") == pytest.approx(0.5)
    for i in range(10):
        limiter.acquire(f"c{i}")
    assert len(limiter._buckets) <= 4
    assert RateLimiter(0).acquire("a") == 0.0  # off


@pytest.mark.timeout(120)
def test_rate_limit_is_per_caller_with_retry_after(engine):
    with gateway(engine.address, "--api-key", "k1", "--api-key", "k2", "--rate-limit", "0.5",
                 "--rate-burst", "2") as gw:
        fast = gw.openai("k1")
        fast.models.list()
        fast.models.list()
        with pytest.raises(openai.RateLimitError) as info:
            fast.models.list()
        assert info.value.body["code"] == "rate_limit_exceeded"
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert [m.id for m in gw.openai("k2").models.list()] == ["fake"]  # the other caller is not slowed
        assert httpx.get(gw.url + "/health").status_code == 200  # probes are not limited


# ----------------------------------------------------------------------------- health while draining


@pytest.mark.timeout(120)
def test_health_is_503_while_the_engine_drains():
    with serving("--step-delay", "0.02", "--drain-timeout", "3", fake=True, log_level="info") as (engine, gw):
        assert httpx.get(gw.url + "/health").status_code == 200
        outcome = {}

        def long_request():
            try:
                gw.openai().images.generate(prompt="a red circle", extra_body={"steps": 1000})
            except openai.APIStatusError as exc:
                outcome["status"] = exc.status_code

        thread = threading.Thread(target=long_request)
        thread.start()
        try:
            with Client(engine.address) as direct:
                wait_until(lambda: direct.stats()["slots_busy"] >= 1, 30, message="request running")
            engine.popen.send_signal(signal.SIGTERM)  # drain: the request in flight may finish
            health = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(
                httpx.get(gw.url + "/health", timeout=5)), 5, interval=0.1, message="/health 503")
            assert health.json()["error"]["code"] == "engine_draining"
            with pytest.raises(openai.RateLimitError):  # new work: go elsewhere, retry later
                gw.openai().images.generate(prompt="a red circle", extra_body={"steps": 1})
        finally:
            thread.join(30)
        assert outcome.get("status") == 503  # canceled at the drain timeout
        wait_until(lambda: engine.popen.poll() is not None, 15, message="engine exited")
        response = httpx.get(gw.url + "/health")
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"


# ----------------------------------------------------------------------------- 500s


@pytest.mark.timeout(120)
def test_a_failed_generation_is_500_without_the_engine_reason():
    with serving("--fail-prompt", "a red cross", fake=True, log_level="info") as (engine, gw):
        with pytest.raises(openai.InternalServerError) as info:
            gw.openai().images.generate(prompt="a red cross", extra_body={"steps": 2})
        error = info.value
        assert error.status_code == 500 and error.body["code"] == "generation_failed"
        assert "injected" not in error.body["message"]
        request_id = error.response.headers["x-request-id"]
        assert request_id in error.body["message"]
        wait_until(lambda: request_id in gw.log(), 5, message="the request id in the gateway's log")
        line = next(line for line in gw.log().splitlines() if request_id in line)
        assert "injected failure" in line


class _BrokenLink:
    """An EngineLink whose engine connection raises something unexpected."""

    models = ("diffslot",)

    def start(self):
        pass

    async def close(self):
        pass

    async def client(self):
        raise RuntimeError("secret detail: /srv/models/private-path token=abc123")

    async def adapters(self):
        return (await self.client()).adapters()


def test_an_unhandled_error_is_500_with_a_request_id_and_nothing_else(caplog):
    from frontend.http.app import create_app

    async def call():
        transport = httpx.ASGITransport(create_app(_BrokenLink(), own_link=False), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.get("/v1/models")

    with caplog.at_level("ERROR", logger="diffslot.http"):
        response = asyncio.run(call())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "secret" not in response.text and "RuntimeError" not in response.text
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"]
    assert any(request_id in r.getMessage() and "secret detail" in (r.exc_text or "") for r in caplog.records)


# ----------------------------------------------------------------------------- Ray: orphaned engines


@pytest.mark.timeout(120)
def test_an_engine_whose_starter_dies_stops_at_once_not_after_a_drain():
    """frontend.ray_app starts each replica's engine through frontend/parent_death.py: when
    the replica process dies, its engine gets SIGINT and stops at once, though a request
    is in flight (SIGTERM would drain it for the drain timeout, 30 s here)."""
    code = """
        import subprocess, sys, time
        from frontend import parent_death
        address = sys.argv[1]
        engine = subprocess.Popen(parent_death.command(
            [sys.executable, "tests/proc_helpers.py", "fake", "--address", address, "--step-delay", "0.05",
             "--drain-timeout", "30"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(engine.pid, flush=True)
        time.sleep(600)
    """
    with socket_dir() as directory:
        address = f"ipc://{directory / 'engine.sock'}"
        with client_process(code, address) as replica:
            engine_pid = int(read_line(replica))
            try:
                client = wait_until(lambda: _connected(address), 60, interval=0.1, message="engine ready")
                try:
                    handle = client.submit(GenerateParams(prompt="a red circle", steps=1000))
                    wait_until(lambda: client.stats()["slots_busy"] == 1, 30, message="request running")
                    replica.kill()  # SIGKILL: no chance to stop the engine itself
                    replica.wait(10)
                    killed_at = time.monotonic()
                    wait_until(lambda: not _alive(engine_pid), 10, interval=0.05, message="engine stopped")
                    assert time.monotonic() - killed_at < 5.0
                    with pytest.raises(EngineDeadError):  # the request ended with the engine
                        handle.result(timeout=10)
                finally:
                    client.close()
            finally:
                if _alive(engine_pid):
                    os.kill(engine_pid, signal.SIGKILL)


def _connected(address: str) -> Client | None:
    client = Client(address, connect_timeout=1)
    try:
        client.connect()
    except ConnectionError:
        return None
    return client


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan may be reparented to this process: reap it)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_parent_death_does_not_start_an_orphan():
    """Armed after the parent already died (its pid is not our parent's): nothing runs."""
    from frontend import parent_death

    argv = parent_death.command([sys.executable, "-c", "print('ran')"])
    argv[argv.index(str(os.getpid()))] = "1"  # claim a parent that is not ours
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "ran" not in result.stdout
    result = subprocess.run(parent_death.command([sys.executable, "-c", "print('ran')"]), capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "ran"
