"""The engine process with real client processes: results, cancellation, lifecycle
(R10), slow clients (R8), metrics. Most tests run the engine around FakeCore
(tests/fake_core.py) to stay fast; the numerical test runs the real EngineCore."""
from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from proc_helpers import (
    REPO, RawPeer, start_engine, client_process, env, fake_engine, read_line, real_engine, shm_leftovers,
    socket_dir, wait_until,
)

from engine.protocol import Accepted, Canceled, Completed, Delivered, Failed, Rejected, Submit
from fake_core import FakeModel, fake_latents
from frontend import AsyncClient, Client, EngineDeadError, GenerateParams

MIXED_SAMPLERS = ("euler", "euler_ancestral", "ddim", "dpmpp_2m")

CLIENT_SCRIPT = """
import json, sys
import numpy as np
from frontend import Client, Completed, GenerateParams
address, specs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
with Client(address) as c:
    handles = [c.submit(GenerateParams(**spec)) for spec in specs]
    results = [h.result(timeout=300) for h in handles]
arrays = {}
for i, r in enumerate(results):
    assert isinstance(r, Completed), r
    arrays[str(i)] = np.frombuffer(r.output, np.uint8) if r.output_kind == "png" else r.output
np.savez(out, **arrays)
print("done", flush=True)
"""


def mixed_specs(client: int, count: int, max_steps: int, kinds=("latent", "latent", "uint8", "png")) -> list[dict]:
    rng = np.random.default_rng(client)
    prompts = ["a red circle", "a green square", "a blue triangle"]
    return [dict(prompt=prompts[(client + i) % 3], steps=int(rng.integers(2, max_steps + 1)),
                 sampler=MIXED_SAMPLERS[(client + i) % 4], guidance=[1.0, 2.5, 7.0][i % 3], seed=int(rng.integers(0, 1000)),
                 output=kinds[i % len(kinds)]) for i in range(count)]


def run_three_clients(address: str, directory: pathlib.Path, count: int, max_steps: int, kinds=None):
    specs = [mixed_specs(c, count, max_steps, *([kinds] if kinds else [])) for c in range(3)]
    outs = [directory / f"client{c}.npz" for c in range(3)]
    procs = [client_process(CLIENT_SCRIPT, address, json.dumps(s), str(o)) for s, o in zip(specs, outs)]
    popens = [p.__enter__() for p in procs]
    try:
        for popen in popens:
            assert read_line(popen, timeout=300) == "done"
    finally:
        for p in procs:
            p.__exit__(None, None, None)
    return specs, [dict(np.load(o)) for o in outs]


@pytest.mark.timeout(120)
def test_three_clients_get_what_each_request_gives_alone():
    model = FakeModel()
    with fake_engine("--step-delay", "0.002", "--slots", "4") as engine, socket_dir() as directory:
        specs, results = run_three_clients(engine.address, directory, count=8, max_steps=40)
        with Client(engine.address) as c:
            stats = c.stats()
    for client_specs, arrays in zip(specs, results):
        for i, spec in enumerate(client_specs):
            params = GenerateParams(**spec)
            alone = fake_latents(params, model.latent_shape(32, 32))
            got = arrays[str(i)]
            if spec["output"] == "latent":
                np.testing.assert_array_equal(got, alone)
            elif spec["output"] == "uint8":
                np.testing.assert_array_equal(got, model.decode(alone[None])[0])
            else:
                from PIL import Image

                image = np.asarray(Image.open(io.BytesIO(got.tobytes())))
                np.testing.assert_array_equal(image, model.decode(alone[None])[0])
    assert stats["requests_in_flight"] == 0 and stats["undelivered_output_bytes"] == 0


def _real_core_available() -> bool:
    try:
        import engine.core as core

        return hasattr(core, "EngineCore")
    except ImportError:
        return False


@pytest.mark.timeout(600)
def test_three_clients_real_core_match_the_reference(tmp_path):
    if not _real_core_available():
        pytest.skip("engine.core (the real EngineCore) is not available")
    import torch

    from engine.testing.reference import reference_latents, rel_l2, tiny_model

    model = tiny_model("epsilon", seed=0, with_vae=True)
    folder = tmp_path / "tiny"
    model.unet.save_pretrained(folder / "unet")
    model.vae.save_pretrained(folder / "vae")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(model.scheduler_config))
    (folder / "conditions.json").write_text(json.dumps(model.conditions))
    with real_engine("--model", str(folder), "--slots", "4", "--decode-workers", "1") as engine, \
            socket_dir() as directory:
        specs, results = run_three_clients(engine.address, directory, count=3, max_steps=8, kinds=("latent",))
    for client_specs, arrays in zip(specs, results):
        for i, spec in enumerate(client_specs):
            alone = reference_latents(model, spec["sampler"], spec["prompt"], spec["steps"], spec["guidance"],
                                      spec["seed"])
            assert rel_l2(torch.from_numpy(np.array(arrays[str(i)])), alone) <= 1e-5, spec


@pytest.mark.timeout(60)
def test_cancel_while_queued_mid_denoise_and_after_the_last_step():
    with fake_engine("--slots", "1", "--step-delay", "0.01", "--decode-delay", "0.5") as engine, \
            Client(engine.address) as c:
        long = c.submit(GenerateParams("a red circle", steps=1000))
        queued = c.submit(GenerateParams("a red circle", steps=5))
        assert queued.accepted(5) is not None
        queued.cancel()
        r = queued.result(5)
        assert isinstance(r, Canceled) and r.timings.evals == 0

        for p in long.progress(timeout=5):  # mid-denoise
            if p.step >= 5:
                long.cancel()
                break
        r = long.result(5)
        assert isinstance(r, Canceled) and 10 <= r.timings.evals < 2000

        decoding = c.submit(GenerateParams("a red circle", steps=3, output="uint8"))  # decode takes 0.5 s
        for p in decoding.progress(timeout=5):
            if p.step == p.total:
                decoding.cancel()
        r = decoding.result(5)
        assert isinstance(r, Canceled), r  # the decode output is dropped, never delivered

        done = c.submit(GenerateParams("a red circle", steps=2, output="latent"))
        assert isinstance(done.result(5), Completed)
        done.cancel()  # after completion: nothing happens
        c.cancel("no-such-request")
        assert isinstance(done.result(0), Completed)

        # Cancels racing with completion: each request ends exactly once, nothing hangs.
        handles = [c.submit(GenerateParams("a blue cross", steps=1 + i % 3, output="latent")) for i in range(30)]
        for i, h in enumerate(handles):
            if i % 2:
                h.cancel()
        outcomes = {type(h.result(10)).__name__ for h in handles}
        assert outcomes <= {"Completed", "Canceled"}
        stats = wait_until(lambda: (s := c.stats())["requests_in_flight"] == 0 and s["decoding"] == 0 and s,
                           5, message="all requests finished")
        assert stats["slots_busy"] == 0 and stats["undelivered_output_bytes"] == 0


@pytest.mark.timeout(60)
def test_asyncio_task_cancel_cancels_the_request():
    async def scenario(address):
        async with AsyncClient(address) as c:
            steps = []
            r = await c.generate(GenerateParams("a green cross", steps=4, output="latent"), on_progress=steps.append)
            assert isinstance(r, Completed) and [p.step for p in steps] == [1, 2, 3, 4]
            task = asyncio.create_task(c.generate(GenerateParams("a green cross", steps=1000)))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 3
            while (stats := await c.stats())["requests_in_flight"]:
                assert time.monotonic() < deadline, "the canceled task's request is still running"
                await asyncio.sleep(0.05)
            assert stats["canceled_evals"] > 0

    with fake_engine("--step-delay", "0.01") as engine:
        asyncio.run(scenario(engine.address))


@pytest.mark.timeout(60)
def test_killed_client_requests_are_canceled_and_slots_freed():
    script = """
    import sys, time
    from frontend import Client, GenerateParams
    c = Client(sys.argv[1]).__enter__()
    handles = [c.submit(GenerateParams("a red circle", steps=1000)) for _ in range(6)]
    for h in handles:
        h.accepted(10)
    print("ready", flush=True)
    time.sleep(60)
    """
    with fake_engine("--slots", "4", "--step-delay", "0.01") as engine, Client(engine.address) as observer:
        with client_process(script, engine.address) as child:
            assert read_line(child) == "ready"
            wait_until(lambda: observer.stats()["slots_busy"] == 4, 5, message="slots filled")
            assert observer.stats()["queue_depth"] == 2
            child.kill()
            started = time.monotonic()
            stats = wait_until(lambda: (s := observer.stats())["requests_in_flight"] == 0 and s, 5,
                               message="dead client's requests canceled")
            assert time.monotonic() - started < 2.0  # its connection closed: no timeout needed
        assert stats["slots_busy"] == 0 and stats["queue_depth"] == 0 and stats["clients"] == 1
        assert isinstance(observer.submit(GenerateParams("a red circle", steps=3)).result(5), Completed)


@pytest.mark.timeout(60)
def test_silent_client_is_written_off_after_the_peer_timeout():
    script = """
    import sys
    from frontend import Client, GenerateParams
    with Client(sys.argv[1]) as c:
        h = c.submit(GenerateParams("a red circle", steps=1000))
        h.accepted(10)
        print("ready", flush=True)
        try:
            print(type(h.result(30)).__name__, flush=True)
        except Exception as exc:
            print(type(exc).__name__, flush=True)
    """
    with fake_engine("--step-delay", "0.01", "--peer-timeout", "1.0") as engine, Client(engine.address) as observer:
        with client_process(script, engine.address) as child:
            assert read_line(child) == "ready"
            child.send_signal(signal.SIGSTOP)  # alive and connected, but silent
            try:
                wait_until(lambda: observer.stats()["requests_in_flight"] == 0, 5, message="silent client written off")
            finally:
                child.send_signal(signal.SIGCONT)
            assert read_line(child, timeout=10) == "EngineDeadError"


@pytest.mark.timeout(60)
def test_killed_engine_fails_every_request_promptly():
    with fake_engine("--step-delay", "0.01") as engine:
        busy, idle = Client(engine.address), Client(engine.address)
        busy.connect(), idle.connect()
        try:
            handles = [busy.submit(GenerateParams("a red circle", steps=1000)) for _ in range(3)]
            next(iter(handles[0].progress(timeout=5)))
            os.kill(engine.pid, signal.SIGKILL)
            started = time.monotonic()
            for h in handles:
                with pytest.raises(EngineDeadError):
                    h.result(timeout=5)
            assert time.monotonic() - started < 1.5
            with pytest.raises(EngineDeadError):
                list(handles[1].progress())
            with pytest.raises(EngineDeadError):
                busy.submit(GenerateParams("a red circle"))
            wait_until(lambda: not idle.alive, 2, message="idle client notices")
        finally:
            busy.close(), idle.close()


@pytest.mark.timeout(60)
def test_hung_engine_is_detected_by_heartbeat():
    """A silent engine whose process is still there is a stall (tests/test_stall.py) until
    the client's stall timeout; past it, dead."""
    with fake_engine("--step-delay", "0.01", "--peer-timeout", "1.0") as engine, \
            Client(engine.address, stall_timeout=2.0) as c:
        h = c.submit(GenerateParams("a red circle", steps=1000))
        h.accepted(5)
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match="no word.*stall timeout"):
                h.result(timeout=6)
            assert time.monotonic() - started < 3.5
        finally:
            os.kill(engine.pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_sigterm_shuts_down_cleanly():
    """SIGTERM drains (tests/test_faults.py has the rest): past --drain-timeout what is
    still in flight is canceled, then the engine exits 0 and leaves nothing behind."""
    with fake_engine("--step-delay", "0.01", "--drain-timeout", "0.5") as engine, Client(engine.address) as c:
        h = c.submit(GenerateParams("a red circle", steps=1000))
        h.accepted(5)
        engine.popen.send_signal(signal.SIGTERM)
        assert isinstance(h.result(timeout=5), Canceled)
        assert engine.popen.wait(10) == 0
        assert not os.path.exists(engine.address[len("ipc://"):])
        assert not shm_leftovers(engine.pid)
        assert "engine stopped" in engine.log()


@pytest.mark.timeout(60)
def test_sigint_shuts_down_cleanly_while_idle():
    with fake_engine() as engine:
        engine.popen.send_signal(signal.SIGINT)
        assert engine.popen.wait(10) == 0


@pytest.mark.timeout(120)
def test_slow_client_holds_only_its_own_budget():
    size, budget = 256, 2_000_000
    image_bytes = size * size * 3
    with fake_engine("--size", str(size), "--output-budget", str(budget), "--sndhwm", "4",
                     "--step-delay", "0.002") as engine:
        slow = RawPeer(engine.address, rcvhwm=1)
        try:
            ids = [f"slow{i}" for i in range(30)]
            for rid in ids:
                slow.send(Submit(rid, GenerateParams("a red circle", steps=5, output="uint8")))
            with Client(engine.address) as fast:
                started = time.monotonic()
                for _ in range(2):
                    handles = [fast.submit(GenerateParams("a blue square", steps=5, output="uint8")) for _ in range(10)]
                    results = [h.result(timeout=20) for h in handles]
                    assert all(isinstance(r, Completed) and r.output.shape == (size, size, 3) for r in results)
                    slow.heartbeat()
                assert time.monotonic() - started < 15
                stats = wait_until(lambda: (s := fast.stats())["outbound_backlog_messages"] > 0 and s, 10,
                                   message="slow client's messages held back")
                assert stats["undelivered_output_bytes"] <= budget
            # The slow client finally reads: every request answered exactly once, in budget.
            final = {}
            while len(final) < len(ids):
                msg = slow.recv(10)
                if isinstance(msg, (Completed, Rejected, Canceled, Failed)):
                    assert msg.request_id not in final
                    final[msg.request_id] = msg
            completed = [m for m in final.values() if isinstance(m, Completed)]
            rejected = [m for m in final.values() if isinstance(m, Rejected)]
            assert len(completed) + len(rejected) == len(ids)
            assert 1 <= len(completed) <= budget // image_bytes
            assert rejected and all("budget" in m.reason and m.retry_after_s > 0 for m in rejected)
            assert all(len(m.frames[0]) == image_bytes for m in completed)
            for m in completed:
                slow.send(Delivered(m.request_id))
            slow.send(Submit("again", GenerateParams("a red circle", steps=2, output="uint8")))
            while not isinstance(msg := slow.recv(10), (Accepted, Rejected)):
                pass
            assert isinstance(msg, Accepted), msg
        finally:
            slow.close()


@pytest.mark.timeout(60)
def test_closing_a_client_cancels_its_requests_and_queue_limits_reject():
    with fake_engine("--slots", "1", "--max-queue", "2", "--step-delay", "0.01") as engine, \
            Client(engine.address) as observer:
        with Client(engine.address) as c:
            assert c.submit(GenerateParams("a red circle", steps=1000)).accepted(5)
            wait_until(lambda: observer.stats()["slots_busy"] == 1, 5)
            for _ in range(2):  # fill the queue
                assert c.submit(GenerateParams("a red circle", steps=1000)).accepted(5)
            full = c.submit(GenerateParams("a red circle", steps=10)).result(5)
            assert isinstance(full, Rejected) and full.retry_after_s > 0 and "queue" in full.reason
        wait_until(lambda: observer.stats()["requests_in_flight"] == 0, 2, message="closed client's requests canceled")
        assert isinstance(observer.generate(GenerateParams("a red circle", steps=2), timeout=5), Completed)


@pytest.mark.timeout(60)
def test_failed_requests_and_metrics():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with fake_engine("--fail-prompt", "a red cross", "--metrics-port", str(port)) as engine, \
            Client(engine.address) as c:
        assert isinstance(c.generate(GenerateParams("a red cross"), timeout=5), Failed)
        assert isinstance(c.generate(GenerateParams("a red circle", steps=3), timeout=5), Completed)
        time.sleep(0.6)  # gauges refresh twice a second
        c.stats()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'diffslot_requests_total{outcome="completed"} 1.0' in text
    assert 'diffslot_requests_total{outcome="failed"} 1.0' in text
    assert "diffslot_request_total_s_bucket" in text
    assert "diffslot_core_slot_occupancy" in text


@pytest.mark.timeout(60)
def test_tcp_loopback_and_remote_bind_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket_dir() as directory:
        engine = start_engine(f"tcp://127.0.0.1:{port}", directory / "engine.log", [])
        try:
            engine.wait_ready(60)
            with Client(engine.address) as c:
                assert isinstance(c.generate(GenerateParams("a red circle", steps=2), timeout=5), Completed)
        finally:
            assert engine.stop() == 0
    refused = subprocess.run([sys.executable, "-m", "engine", "serve", "--address", "tcp://0.0.0.0:1"], cwd=REPO,
                             env=env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "allow-remote-bind" in refused.stderr


@pytest.mark.timeout(60)
def test_cli_generate_writes_png_and_ctrl_c_cancels(tmp_path):
    with fake_engine("--step-delay", "0.01") as engine, Client(engine.address) as observer:
        out = tmp_path / "out.png"
        cli = [sys.executable, "-m", "frontend", "generate", "--prompt", "a red circle", "--steps", "20",
               "--sampler", "dpmpp_2m", "--guidance", "3", "--seed", "7", "-o", str(out), "--address", engine.address]
        done = subprocess.run(cli, cwd=REPO, env=env(), capture_output=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        cli[cli.index("20")] = "1000"
        interrupted = subprocess.Popen(cli, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: observer.stats()["requests_in_flight"] == 1, 10, message="CLI request running")
            interrupted.send_signal(signal.SIGINT)
            _, stderr = interrupted.communicate(timeout=10)
        finally:
            if interrupted.poll() is None:
                interrupted.kill()
                interrupted.communicate()
        assert interrupted.returncode == 130, stderr
        assert b"canceled" in stderr
        assert observer.stats()["requests_in_flight"] == 0


@pytest.mark.timeout(900)
def test_demo_runs_clean(tmp_path):
    if not _real_core_available():
        pytest.skip("engine.core (the real EngineCore) is not available")
    from engine.models import resolve

    try:
        resolve("shapes")
    except FileNotFoundError:
        pytest.skip("the embedded shapes model has no weights yet")
    out = tmp_path / "grid.png"
    demo = subprocess.run([sys.executable, "-m", "engine", "demo", "--device", "cpu", "--decode-workers", "1",
                           "--out", str(out)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=840)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = demo.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "looks like" in line)
    rows = lines[header + 2:lines.index("", header)]  # one per request, between the rule and a blank line
    assert len(rows) >= 19 and sum("Completed" in r for r in rows) == len(rows) - 1
    assert sum("Canceled" in r for r in rows) == 1
    _check_controlnet_tiles(lines[header], rows, out)
    engine_pid = int(demo.stdout.split("engine pid ", 1)[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)  # reaped, not a zombie or still running
    assert not shm_leftovers(engine_pid)


def _check_controlnet_tiles(header: str, rows: list[str], grid_path: pathlib.Path) -> None:
    """The demo's silhouette ControlNet requests completed, each read in its prompt's colour, and the grid
    shows each control image with the output beside it, the figure drawn over the silhouette."""
    from PIL import Image

    from engine.demo import COLUMNS, SILHOUETTES, silhouette, silhouette_iou

    looks = [row[header.index("looks like"):] for row in rows if "ControlNet 'silhouette'" in row]
    assert len(looks) == len(SILHOUETTES), rows
    grid = np.asarray(Image.open(grid_path).convert("RGB"))
    tile, cell_w = 4 * 32, max(4 * 32, 150) + 6  # demo.grid's: 32×32 images drawn 4× with 6 px gaps, 150 px wide
    for look, (prompt, shape, cy, cx, size) in zip(looks, SILHOUETTES):
        assert look.startswith(prompt.removeprefix("a ").split()[0]), (prompt, look)
        control = silhouette(shape, cy, cx, size)
        shown = np.repeat(np.repeat(control, 4, axis=0), 4, axis=1)
        # the control tile, in any column but the last (demo.tiles keeps an input on its output's row)
        found = [(y, x) for x in (6 + c * cell_w for c in range(COLUMNS - 1)) for y in range(grid.shape[0] - tile)
                 if np.array_equal(grid[y, x:x + tile], shown[0]) and np.array_equal(grid[y:y + tile, x:x + tile], shown)]
        assert len(found) == 1, f"{prompt}: its control image is {len(found)} times in the grid"
        y, x = found[0]
        output = grid[y:y + tile, x + cell_w:x + cell_w + tile][::4, ::4]
        assert silhouette_iou(output, control) > 0.5, f"{prompt}: the output beside its control"


@pytest.mark.timeout(30)
def test_backlog_coalesces_progress_and_writes_off_a_client_too_far_behind():
    import queue

    import zmq

    from engine.protocol import Progress, ProgressBatch, Welcome, engine_decoder
    from engine.serve.handoff import ClientGone, InputQueues
    from engine.serve.heartbeat import LoopHeartbeat
    from engine.serve.io_thread import IOThread, _Peer
    from engine.serve.options import ProcConfig
    from engine.serve.transport import Waker

    ctx = zmq.Context()
    router, waker = ctx.socket(zmq.ROUTER), Waker()
    try:
        inputs = InputQueues()
        io = IOThread(router, ProcConfig("inproc://x", max_backlog_messages=3), Welcome(1, 1, 0.5, 3.0, 1),
                      inputs, queue.SimpleQueue(), waker, LoopHeartbeat(120.0))
        peer = io.peers[b"c"] = _Peer(time.monotonic(), io._frame_rate())
        for step in range(1, 6):  # a reader that is behind sees only the latest step
            io._enqueue(b"c", peer, Progress("r1", step, 5), [b"c", f"p{step}".encode()])
        io._enqueue(b"c", peer, Canceled("r1"), [b"c", b"final"])
        assert len(peer.backlog) == 2 and io.backlog_messages == 2 and io.backlog_bytes == len(b"final")
        # one pending progress entry per client: later steps of any request merge into it
        io._enqueue(b"c", peer, ProgressBatch([("r2", 1, 5), ("r3", 2, 5)]), [b"c", b"batch"])
        assert len(peer.backlog) == 2
        merged = engine_decoder().decode(io._progress_frames(b"c", peer)[1])
        assert merged == ProgressBatch([("r1", 5, 5), ("r2", 1, 5), ("r3", 2, 5)])
        io._enqueue(b"c", peer, Canceled("r2"), [b"c", b"final2"])
        assert b"c" in io.peers
        io._enqueue(b"c", peer, Canceled("r3"), [b"c", b"final3"])  # the fourth message: too far behind
        assert b"c" not in io.peers and io.backlog_messages == 0 and io.backlog_bytes == 0 and b"c" in io.gone
        assert inputs.take(10, 10) == [ClientGone(b"c", "more than 3 messages behind")]
    finally:
        router.close(linger=0)
        waker.close()
        ctx.term()
