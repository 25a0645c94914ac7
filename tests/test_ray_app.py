"""The images API over Ray Serve (R17): a local Ray cluster (2 CPUs), two replicas,
each owning a real engine on a tiny SD folder; requests through the `openai`
package; an HTTP disconnect cancels the engine request; an engine that dies fails
its replica's requests with 503 and Ray replaces the replica; one batch job's lines
run on both replicas (R26).

Sized for CI: one module-wide cluster, tiny model, a handful of requests.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import signal
import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'ray[serve]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'ray[serve]')")
openai = pytest.importorskip("openai")

from frontend import Client  # noqa: E402
from tests.proc_helpers import socket_dir, wait_until  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> pathlib.Path:
    from engine.testing.tiny_pipelines import build_sd

    return build_sd(tmp_path_factory.mktemp("tiny-sd") / "tiny-sd")


def _child_pids(zombies: bool = False) -> set[int]:
    """Live (non-zombie) direct children of this process. Ray makes the driver a child
    subreaper, so an engine whose replica died is adopted by this process."""
    me, found = os.getpid(), set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) == me and (fields[0] != "Z") != zombies:
            found.add(int(stat.parent.name))
    return found


def _engine_pids(sockets: pathlib.Path) -> set[int]:
    found = set()
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(sockets).encode() in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return found


def _reap() -> None:
    """Collect adopted children that have exited."""
    for pid in _child_pids(zombies=True):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


@pytest.fixture(scope="module")
def ray_serve(tiny_sd, tmp_path_factory):
    """A local Ray cluster with Serve on a free port and the diffslot app (2 replicas).
    Torn down so that nothing outlives it: the app is deleted first (each replica stops
    its engine: SIGTERM, drained), then Serve and Ray; engines and their decode workers
    adopted by this process are waited for and reaped."""
    from frontend.http.options import BatchOptions, StoreOptions
    from frontend.ray_app import build_app

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = _child_pids()
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        with socket_dir() as sockets:
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                serve.run(build_app(model=str(tiny_sd), replicas=2, slots=4, decode_workers=1, cpus_per_replica=0.5,
                                    socket_dir=str(sockets), health_check_period_s=1.0,
                                    health_check_timeout_s=10.0,
                                    store=StoreOptions(state_dir=str(tmp_path_factory.mktemp("state"))),
                                    batch=BatchOptions(batch_concurrency=1)),
                          name="diffslot", route_prefix="/")
                yield f"http://127.0.0.1:{port}", sockets
            finally:
                try:
                    if "diffslot" in serve.status().applications:
                        serve.delete("diffslot")
                finally:
                    serve.shutdown()
                wait_until(lambda: not _engine_pids(sockets), 60, interval=0.2, message="engines stopped")
    finally:
        ray.shutdown()
        adopted = lambda: _child_pids() - before  # noqa: E731
        try:
            wait_until(lambda: (_reap(), not adopted())[1], 30, interval=0.2,
                       message="Ray's processes and adopted engine children gone")
        finally:
            _reap()


def engines(sockets: pathlib.Path) -> dict[int, Client]:
    """A direct client of every live replica engine: {engine pid: Client}."""
    found = {}
    for path in sorted(sockets.glob("engine-*.sock")):
        client = Client(f"ipc://{path}", connect_timeout=2)
        try:
            client.connect()
        except ConnectionError:
            continue
        found[client.welcome.engine_pid] = client
    return found


def close_all(clients) -> None:
    for client in clients.values():
        client.close()


def png_size(b64: str) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).size


@pytest.mark.timeout(600)
def test_two_replicas_serve_the_openai_api(ray_serve):
    url, sockets = ray_serve
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["tiny-sd"]
    r = client.images.generate(prompt="a red circle", n=2, extra_body={"steps": 3, "seed": 5})
    assert [png_size(d.b64_json) for d in r.data] == [(16, 16), (16, 16)]
    events = list(client.images.generate(prompt="a blue cross", stream=True, partial_images=1,
                                         extra_body={"steps": 4}))
    assert [e.type for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red circle", extra_body={"sampler": "nope"})
    assert info.value.body["param"] == "sampler"
    # both replicas answer (Serve routes among them); each owns its own engine
    pids = {httpx.get(url + "/health", timeout=30).json()["engine_pid"] for _ in range(24)}
    assert len(pids) == 2
    direct = engines(sockets)
    try:
        assert set(direct) == pids
    finally:
        close_all(direct)


@pytest.mark.timeout(600)
def test_disconnect_cancels_the_replica_call_and_the_engine_request(ray_serve):
    url, sockets = ray_serve
    direct = engines(sockets)
    try:
        canceled = lambda: sum(c.stats()["canceled_requests"] for c in direct.values())  # noqa: E731
        busy = lambda: sum(c.stats()["slots_busy"] for c in direct.values())  # noqa: E731
        before = canceled()
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps({"prompt": "a red circle", "steps": 500}).encode()
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(lambda: busy() >= 1, 60, message="request running on a replica engine")
        sock.close()
        closed_at = time.monotonic()
        wait_until(lambda: canceled() > before, 10, interval=0.02, message="engine cancel")
        elapsed = time.monotonic() - closed_at
        assert elapsed < 2.0, f"the cancel reached the engine {elapsed:.2f}s after the disconnect"
        wait_until(lambda: busy() == 0, 10, message="slot released")
    finally:
        close_all(direct)


@pytest.mark.timeout(600)
def test_one_batch_runs_on_every_replica(ray_serve):
    url, sockets = ray_serve
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/images/generations",
                                "body": {"prompt": "a red circle", "steps": 12, "seed": i}}) + "\n" for i in range(6))
    direct = engines(sockets)
    try:
        before = {pid: c.stats()["completed"] for pid, c in direct.items()}
        uploaded = client.files.create(file=("job.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        # every replica opens the shared state once its database exists (polled each second)
        # and then asks it for lines every 0.25 s: give both that time, so that the lines
        # spread is the runners' claiming and not which replica saw the upload first
        time.sleep(2.5)
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/images/generations",
                                      completion_window="24h")
        done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 120,
                          interval=0.2, message="batch completed")
        outputs = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(line["custom_id"] for line in outputs) == [f"line-{i}" for i in range(6)]
        assert all(png_size(line["response"]["body"]["data"][0]["b64_json"]) == (16, 16) for line in outputs)
        served = {pid: c.stats()["completed"] - before[pid] for pid, c in direct.items()}
        assert sum(served.values()) == 6 and all(served.values()), served  # each replica ran some of the lines
    finally:
        close_all(direct)


@pytest.mark.timeout(600)
def test_dead_engine_fails_with_503_and_ray_replaces_the_replica(ray_serve):
    url, sockets = ray_serve
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    direct = engines(sockets)
    assert len(direct) == 2
    outcomes, finished_at = [], []

    def request():
        try:
            client.images.generate(prompt="a red circle", extra_body={"steps": 80})
            outcomes.append(200)
        except openai.APIStatusError as exc:
            outcomes.append(exc.status_code)
            assert exc.status_code != 503 or exc.body["code"] == "engine_unavailable", exc.body
        finished_at.append(time.monotonic())

    threads = [threading.Thread(target=request) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:  # the victim: an engine that is running some of them
        victim = wait_until(lambda: next((pid for pid, c in direct.items() if c.stats()["slots_busy"] >= 1), None),
                            60, interval=0.05, message="requests running")
    finally:
        close_all(direct)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(120)
    # the dead engine's requests failed with 503 at once; the other replica's completed
    assert 503 in outcomes and set(outcomes) <= {200, 503}, outcomes
    assert min(finished_at) - killed_at < 5.0

    def replaced():
        live = engines(sockets)
        close_all(live)
        return len(live) == 2 and victim not in live

    wait_until(replaced, 300, interval=1.0, message="replica replaced with a fresh engine")
    wait_until(lambda: serve.status().applications["diffslot"].status == "RUNNING", 120, interval=0.5,
               message="application RUNNING again")
    # the service is whole again: both replicas answer
    wait_until(lambda: len({httpx.get(url + "/health", timeout=30).json().get("engine_pid")
                            for _ in range(16)} - {None}) == 2, 60, interval=1.0, message="two healthy replicas")
    r = client.images.generate(prompt="a green square", extra_body={"steps": 2})
    assert png_size(r.data[0].b64_json) == (16, 16)
    # the replacement engine was started by this test: stop the application here (each replica
    # stops its engine), so that nothing this test started outlives it. Runs last in the file.
    serve.delete("diffslot")
    wait_until(lambda: not _engine_pids(sockets), 60, interval=0.2, message="engines stopped")
