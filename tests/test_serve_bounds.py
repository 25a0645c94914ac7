"""The engine process's bounds and probes (R8, R22): per-client input queues with
backpressure, health answered during a long step, the in-process decode's deadline,
partial images in the output budget, preview and request ids that cannot be confused,
what Welcome tells about the model, and CURVE on tcp. All on the fake core, so they
are fast; each failed before its fix."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from fake_core import FakeModel, HangingLatents, fake_latents
from proc_helpers import REPO, RawPeer, client_process, env, fake_engine, read_line, socket_dir, start_engine, \
    wait_until

from engine.protocol import Accepted, Completed, Delivered, GenerateParams, Rejected, Submit, Timings
from frontend.client import AuthenticationError, Client, Failed
from engine.serve.transport import load_curve_keys


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# =============================================================== inputs: bounded, fair

def test_the_busy_loop_takes_a_bounded_share_of_each_client_in_turn():
    from engine.serve.handoff import ClientConnected, FromClient, InputQueues
    from engine.protocol import Hello, Stats

    inputs = InputQueues()
    inputs.put(ClientConnected(b"flood", Hello(1)))
    for i in range(1000):
        inputs.put(FromClient(b"flood", Stats(i), 0.0))
    inputs.put(ClientConnected(b"quiet", Hello(1)))
    inputs.put(FromClient(b"quiet", Stats(-1), 0.0))
    first = inputs.take(64, 4)
    # one of each in turn; the flood's share ends at four, the quiet client's items are all taken
    assert [item.identity for item in first] == [b"flood", b"quiet", b"flood", b"quiet", b"flood", b"flood"]
    second = inputs.take(64, 4)
    assert len(second) == 4 and all(item.identity == b"flood" for item in second)
    order = [item.message.token for item in first + second if isinstance(item, FromClient)
             and item.identity == b"flood"]
    assert order == sorted(order)  # each client's messages keep their order


FLOOD_SCRIPT = """
import os, sys, time
import zmq
from engine.protocol import PROTOCOL_VERSION, GenerateParams, Hello, Stats, Submit, encoder
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
enc = encoder()
sock.send(enc.encode(Hello(PROTOCOL_VERSION, os.getpid(), "flood")))
sock.recv()
# one long request takes one slot; every later Submit reuses its id and is refused
submit = enc.encode(Submit("flood", GenerateParams("a red circle", steps=1000, output="latent"), progress=False))
stats = enc.encode(Stats(1))
print("go", flush=True)
sent = 0
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    sock.send(submit)
    sock.send(stats)
    sent += 2
    while True:  # read what comes back, so the engine never writes this client off
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
print("sent", sent, flush=True)
"""


def _latencies(client: Client, n: int) -> list[float]:
    """Round trips of a small request: three steps of 0.3 ms each (the fake core's --step-delay)."""
    samples = []
    for _ in range(n):
        start = time.monotonic()
        result = client.generate(GenerateParams("a blue square", steps=3, output="latent"), timeout=30)
        samples.append(time.monotonic() - start)
        assert isinstance(result, Completed), result
    return samples


def _settle(client: Client) -> None:
    """Wait until the engine has read what a stopped flooder left in its pipe."""
    last = -1
    deadline = time.monotonic() + 20
    while (received := client.stats()["io_messages_received"]) - last > 3 and time.monotonic() < deadline:
        last = received
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_a_flooding_client_leaves_another_clients_latency_within_twice_its_idle_value():
    """Idle and flood phases alternate (the flooder stopped and continued), so both
    medians see the same machine; the best of three attempts counts, since this
    machine is shared. Before the fix, one client's frames filled one unbounded queue
    the busy loop drained whole before every step: the other's p50 was 4x idle here
    (10x with steps of no time at all); after it, about 1.5x."""
    with fake_engine("--peer-timeout", "20", "--step-delay", "0.0003") as engine, Client(engine.address) as quiet:
        _latencies(quiet, 20)  # warm up
        with client_process(FLOOD_SCRIPT, engine.address, "240") as flooder:
            assert read_line(flooder) == "go"
            ratios = []
            for _attempt in range(3):
                idle, flooded = [], []
                for _round in range(4):
                    os.kill(flooder.pid, signal.SIGSTOP)
                    try:
                        _settle(quiet)
                        idle += _latencies(quiet, 25)
                    finally:
                        os.kill(flooder.pid, signal.SIGCONT)
                    time.sleep(0.3)  # the flood is back, its burst spent
                    flooded += _latencies(quiet, 25)
                ratios.append(statistics.median(flooded) / statistics.median(idle))
                if ratios[-1] <= 2.0:
                    break
            stats = quiet.stats()
        assert min(ratios) <= 2.0, f"p50 under flood / idle p50: {ratios}"
        # the flood met the bounds: it was read no faster than its frame rate, and the
        # engine never held more than a bounded inbox of it
        assert stats["io_paused_for_frame_rate_s"] > 0
        assert stats["inputs_waiting"] <= 64 * 2


@pytest.mark.timeout(60)
def test_a_client_over_its_pending_bound_gets_rejected_with_retry_after():
    """The IO thread refuses a Submit beyond --max-pending-per-client at once."""
    with fake_engine("--max-pending-per-client", "2", "--step-delay", "0.2", "--max-client-frames-per-s",
                     "100000") as engine, Client(engine.address) as observer:
        peer = RawPeer(engine.address)
        try:
            peer.send(Submit("slow", GenerateParams("a red circle", steps=3, output="latent")))
            wait_until(lambda: observer.stats()["slots_busy"] == 1, 10, message="a step running")
            for i in range(20):  # sent while the busy loop sleeps in a 0.2 s step
                peer.send(Submit(f"r{i}", GenerateParams("a red circle", steps=1, output="latent")))
            answers = {}
            while len(answers) < 21:
                msg = peer.recv(10)
                if isinstance(msg, (Accepted, Rejected)):
                    answers[msg.request_id] = msg
            refused = [m for m in answers.values() if isinstance(m, Rejected)]
            assert refused and all("--max-pending-per-client" in m.reason and m.retry_after_s > 0 for m in refused)
        finally:
            peer.close()


# =============================================================== health from the IO thread

def _health_cli(address: str, timeout: float = 3.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "health", "--address", address, "--timeout", str(timeout)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_health_says_alive_while_a_long_step_runs():
    faults = {"hang_prompt": "a red cross", "hang_s": 5.0}  # one step of 5 s, far under --step-timeout
    with fake_engine("--step-timeout", "30", faults=faults) as engine, Client(engine.address) as c:
        long = c.submit(GenerateParams("a red cross", steps=2, output="latent"))
        wait_until(lambda: c.health().step_running_s > 1.0, 10, message="the long step under way")
        probe = _health_cli(engine.address, timeout=2.0)
        assert probe.returncode == 0, probe.stderr
        summary = json.loads(probe.stdout)
        assert summary["alive"] and summary["step_running_s"] > 1.0 and summary["stall_limit_s"] == 30
        assert isinstance(long.result(timeout=30), Completed)  # the step ended: the engine serves on
        assert c.health().alive and c.health().step_running_s == 0


@pytest.mark.timeout(120)
def test_health_says_dead_when_the_busy_loop_is_stuck_past_the_step_timeout():
    """Stuck outside a step (which the step watchdog does not cover): after --step-timeout
    the probe fails; when the loop moves again, it recovers."""
    faults = {"hang_prompt": "a red cross", "hang_s": 6.0, "hang_where": "add_request"}
    with fake_engine("--step-timeout", "1.5", faults=faults) as engine, Client(engine.address) as c:
        c.submit(GenerateParams("a red cross", steps=2, output="latent"))
        verdict = wait_until(lambda: (h := c.health()).alive is False and h, 10, message="a dead verdict")
        assert "stuck outside a step" in verdict.reason
        probe = _health_cli(engine.address)
        assert probe.returncode == 2 and "stuck outside a step" in probe.stderr, probe.stderr
        wait_until(lambda: c.health().alive, 15, message="the loop moving again")
        assert _health_cli(engine.address).returncode == 0


# =============================================================== the in-process decode's deadline

class _BlockingModel(FakeModel):
    """A decode of HangingLatents blocks until released (a VAE stuck in a call)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def decode(self, latents):
        if isinstance(latents, HangingLatents):
            self.release.wait(30)
        return super().decode(np.asarray(latents))


@pytest.mark.timeout(60)
def test_in_process_decode_past_its_deadline_fails_and_later_decodes_flow():
    from engine.decode.in_process import InProcessDecodeStage

    model = _BlockingModel()
    stage = InProcessDecodeStage(model, decode_timeout_s=0.3)
    try:
        params = GenerateParams("a red circle", output="uint8")
        latents = fake_latents(params, model.latent_shape(32, 32))
        stage.submit("hung", latents.view(HangingLatents), params, Timings())
        stage.submit("next", latents, params, Timings())
        outputs = {}
        deadline = time.monotonic() + 10
        while len(outputs) < 2 and time.monotonic() < deadline:
            outputs.update({o.request_id: o for o in stage.poll()})
            time.sleep(0.02)
        assert "timed out" in outputs["hung"].error and outputs["hung"].payload is None
        assert outputs["next"].error is None
        np.testing.assert_array_equal(outputs["next"].payload, model.decode(latents[None])[0])
        assert stage.stats()["decode_timeouts"] == 1
        model.release.set()  # the abandoned decode returns: its late result is dropped
        time.sleep(0.1)
        assert stage.poll() == []
    finally:
        model.release.set()
        stage.close()


@pytest.mark.timeout(60)
def test_a_hung_in_process_decode_fails_its_request_and_the_engine_serves_on():
    with fake_engine("--hang-decode-prompt", "a red cross", "--decode-timeout", "0.5") as engine, \
            Client(engine.address) as c:
        hung = c.submit(GenerateParams("a red cross", steps=2, output="png"))
        after = c.submit(GenerateParams("a blue circle", steps=2, output="png"))
        failed = hung.result(timeout=20)
        assert isinstance(failed, Failed) and "timed out" in failed.error
        assert isinstance(after.result(timeout=20), Completed)
        assert isinstance(c.generate(GenerateParams("a green square", steps=2), timeout=20), Completed)


# =============================================================== partial images in the budget

PNG_32 = 32 * 32 * 3 + 32 + 3 + 1024  # protocol.output_nbytes("png", 32, 32, ...)


@pytest.mark.timeout(60)
def test_partial_images_count_against_the_output_budget():
    budget = 3 * PNG_32
    with fake_engine("--output-budget", str(budget), "--step-delay", "0.01") as engine, \
            Client(engine.address) as c:
        # a PNG with three partial images can never fit three PNGs' budget: no retry
        never = c.submit(GenerateParams("a red circle", steps=8), partial_images=3).result(timeout=10)
        assert isinstance(never, Rejected) and never.field == "partial_images" and never.retry_after_s == 0
        assert isinstance(c.submit(GenerateParams("a red circle", steps=8), partial_images=2).result(timeout=10),
                          Completed)
        peer = RawPeer(engine.address)  # reads, never acknowledges
        try:
            peer.send(Submit("p", GenerateParams("a red circle", steps=8, output="latent"), partial_images=2))
            sent = []  # the bytes of every frame that came with a message: partial images, the latents
            while not isinstance(msg := peer.recv(10), Completed):
                sent += [len(frame) for frame in getattr(msg, "frames", [])]
            sent.append(len(msg.frames[0]))
            assert len(sent) == 3 and c.stats()["undelivered_output_bytes"] == sum(sent)  # held until Delivered
            peer.send(Submit("q", GenerateParams("a red circle", steps=8), partial_images=2))
            while not isinstance(msg := peer.recv(10), (Accepted, Rejected)):
                pass
            assert isinstance(msg, Rejected) and "budget" in msg.reason and msg.retry_after_s > 0
            peer.send(Delivered("p"))
            wait_until(lambda: c.stats()["undelivered_output_bytes"] == 0, 5, message="bytes back")
        finally:
            peer.close()
        # a request canceled after its partial images: the client library acknowledges them
        handle = c.submit(GenerateParams("a red circle", steps=300, output="latent"), partial_images=2)
        next(iter(handle.partial_images(timeout=20)))
        handle.cancel()
        assert type(handle.result(timeout=10)).__name__ == "Canceled"
        wait_until(lambda: c.stats()["undelivered_output_bytes"] == 0, 5, message="preview bytes back")


@pytest.mark.timeout(60)
def test_partial_images_count_against_the_backlog_cap():
    latent_bytes = 4 * 4 * 8 * 8
    with_previews = latent_bytes + 3 * PNG_32  # a latent and three partial images, reserved at submit
    with fake_engine("--max-backlog-bytes", str(int(1.5 * with_previews)), "--step-delay", "0.01") as engine, \
            Client(engine.address) as reader:
        hoarder = RawPeer(engine.address)
        try:
            params = GenerateParams("a red circle", steps=500, output="latent")
            answers = []
            for rid in ("h1", "h2"):
                hoarder.send(Submit(rid, params, partial_images=3))
                while not isinstance(msg := hoarder.recv(10), (Accepted, Rejected)):
                    pass
                answers.append(msg)
            assert isinstance(answers[0], Accepted)
            assert isinstance(answers[1], Rejected) and "--max-backlog-bytes" in answers[1].reason
            # the client that holds nothing is under its share: served
            assert isinstance(reader.generate(GenerateParams("a red circle", steps=2, output="latent"), timeout=10),
                              Completed)
        finally:
            hoarder.close()


# =============================================================== ids

@pytest.mark.timeout(60)
def test_a_partial_image_is_never_taken_for_a_request_named_like_one():
    """`x`'s partial image and the request `x#preview0` are in the decode stage together
    (each decode takes 0.3 s); each gets its own output."""
    model = FakeModel()
    with fake_engine("--decode-delay", "0.3", "--step-delay", "0.01") as engine, Client(engine.address) as c:
        named = GenerateParams("a green cross", steps=1, output="uint8", seed=5)
        lookalike = c.submit(named, request_id="x#preview0")
        x = c.submit(GenerateParams("a red circle", steps=4, output="uint8"), request_id="x", partial_images=1)
        result = lookalike.result(timeout=20)
        assert isinstance(result, Completed), result
        np.testing.assert_array_equal(result.output, model.decode(fake_latents(named, (4, 8, 8))[None])[0])
        assert list(lookalike.partial_images(timeout=1)) == []
        partials = list(x.partial_images(timeout=20))
        assert [(p.index, p.step) for p in partials] == [(0, 2)]
        assert np.asarray(Image.open(io.BytesIO(partials[0].image))).shape == (32, 32, 3)
        assert isinstance(x.result(timeout=20), Completed)


@pytest.mark.timeout(60)
def test_reusing_a_request_id_before_its_delivered_is_rejected():
    with fake_engine() as engine, Client(engine.address) as observer:
        peer = RawPeer(engine.address)
        try:
            params = GenerateParams("a red circle", steps=1, output="latent")
            peer.send(Submit("r", params))
            while not isinstance(peer.recv(10), Completed):
                pass
            peer.send(Submit("r", params))  # its output is not acknowledged yet
            while not isinstance(msg := peer.recv(10), (Accepted, Rejected)):
                pass
            assert isinstance(msg, Rejected) and msg.field == "request_id" and "Delivered" in msg.reason
            peer.send(Delivered("r"))
            peer.send(Submit("r", params))
            while not isinstance(msg := peer.recv(10), (Accepted, Rejected)):
                pass
            assert isinstance(msg, Accepted)
            while not isinstance(peer.recv(10), Completed):
                pass
            peer.send(Delivered("r"))
            wait_until(lambda: observer.stats()["undelivered_output_bytes"] == 0, 5, message="no bytes lost")
        finally:
            peer.close()


@pytest.mark.timeout(60)
def test_welcome_names_the_model_by_its_folder_not_its_path():
    with fake_engine("--model-path", "/srv/models/private/tiny-sd") as engine, Client(engine.address) as c:
        assert c.welcome.model == "tiny-sd"


# =============================================================== CURVE over tcp

@pytest.mark.timeout(120)
def test_curve_over_tcp_admits_the_right_keys_only(tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    keys.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    known_public, known_secret = zmq.auth.create_certificates(str(keys), "known")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    _, impostor_secret = zmq.auth.create_certificates(str(keys), "impostor")  # not the engine
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "known.key").write_bytes(open(known_public, "rb").read())
    os.chmod(server_secret, 0o600)
    request = GenerateParams("a red circle", steps=2, output="latent")

    with socket_dir() as directory:  # any client that knows the engine's public key
        address = f"tcp://127.0.0.1:{free_port()}"
        engine = start_engine(address, directory / "engine.log", ["--curve-secret-key", server_secret])
        try:
            wait_until(lambda: engine.popen.poll() is not None or "ready on" in engine.log(), 60,
                       message="engine started")
            with Client(address, curve=load_curve_keys(server_public), connect_timeout=20) as c:
                assert isinstance(c.generate(request, timeout=10), Completed)
            with pytest.raises(AuthenticationError, match="handshake"):  # no CURVE at all
                Client(address, connect_timeout=5).connect()
            with pytest.raises(ConnectionError):  # keys for another engine
                Client(address, curve=load_curve_keys(impostor_secret), connect_timeout=3).connect()
        finally:
            assert engine.stop() == 0

    with socket_dir() as directory:  # only the authorized client keys
        address = f"tcp://127.0.0.1:{free_port()}"
        engine = start_engine(address, directory / "engine.log", ["--curve-secret-key", server_secret,
                                                                  "--curve-authorized-keys", str(authorized)])
        try:
            wait_until(lambda: engine.popen.poll() is not None or "ready on" in engine.log(), 60,
                       message="engine started")
            with Client(address, curve=load_curve_keys(server_public, known_secret), connect_timeout=20) as c:
                assert isinstance(c.generate(request, timeout=10), Completed)
            with pytest.raises(ConnectionError):
                Client(address, curve=load_curve_keys(server_public, stranger_secret), connect_timeout=3).connect()
            probe = subprocess.run([sys.executable, "-m", "engine", "health", "--address", address, "--timeout", "10",
                                    "--curve-server-key", server_public, "--curve-client-key", known_secret],
                                   cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
            assert probe.returncode == 0, probe.stderr
        finally:
            assert engine.stop() == 0


# =============================================================== image inputs: bounded in bytes

def _padded_png(nbytes: int, side: int = 32) -> bytes:
    """A valid side×side PNG of exactly `nbytes` bytes (a text chunk holds the rest)."""
    from PIL import PngImagePlugin

    def encode(pad: int) -> bytes:
        info = PngImagePlugin.PngInfo()
        info.add_text("padding", "x" * pad)
        buffer = io.BytesIO()
        Image.new("RGB", (side, side), (10, 200, 30)).save(buffer, format="PNG", pnginfo=info)
        return buffer.getvalue()
    return encode(nbytes - len(encode(0)))


@pytest.mark.timeout(120)
def test_image_inputs_are_bounded_in_bytes_per_client_and_released_when_requests_end():
    """One client sends 24 img2img requests of 1 MB each at once; it may hold 3 MB of
    image inputs (--max-input-bytes-per-client): the rest are Rejected naming the limit with
    retry_after_s, nothing more is held, another client's image request still gets in, and
    once the requests end nothing is held. Before, every one was queued with its frames."""
    png = _padded_png(1 << 20)
    with fake_engine("--max-input-bytes-per-client", str(3 << 20), "--step-delay", "0.02",
                     "--max-client-frames-per-s", "100000") as engine, \
            Client(engine.address) as heavy, Client(engine.address) as other:
        handles = [heavy.submit(GenerateParams("a red circle", steps=20, output="latent", image=png, seed=k),
                                progress=False) for k in range(24)]
        peak = 0
        while not all(h.done() for h in handles):
            peak = max(peak, other.stats()["input_bytes_held"])
            time.sleep(0.01)
        results = [h.result(0) for h in handles]
        refused = [r for r in results if isinstance(r, Rejected)]
        done = [r for r in results if isinstance(r, Completed)]
        assert done and refused, results
        assert all("--max-input-bytes-per-client" in r.reason and r.retry_after_s > 0 for r in refused)
        one = (1 << 20) + 4 * 32 * 32  # encoded bytes and decoded pixels
        assert peak <= 3 * one + 4 * one // 10
        mine = other.generate(GenerateParams("a blue square", steps=2, output="latent", image=png), timeout=30)
        assert isinstance(mine, Completed), mine
        stats = other.stats()
        assert stats["input_bytes_held"] == 0 and stats["rejected_input_bytes"] == len(refused)


@pytest.mark.timeout(60)
def test_a_gone_clients_image_inputs_are_released():
    png = _padded_png(1 << 20)
    with fake_engine("--step-delay", "0.02") as engine, Client(engine.address) as observer:
        heavy = Client(engine.address)
        heavy.connect()
        for k in range(4):
            heavy.submit(GenerateParams("a red circle", steps=500, output="latent", image=png, seed=k), progress=False)
        wait_until(lambda: observer.stats()["input_bytes_held"] >= 4 << 20, 10, message="the inputs held")
        heavy.close()  # Goodbye: its requests are canceled, their inputs let go
        wait_until(lambda: observer.stats()["input_bytes_held"] == 0, 10, message="the inputs released")


@pytest.mark.timeout(60)
def test_a_request_larger_than_the_per_client_bound_still_gets_in_alone():
    png = _padded_png(2 << 20)
    with fake_engine("--max-input-bytes-per-client", str(1 << 20), "--max-input-bytes-total", str(1 << 20)) \
            as engine, Client(engine.address) as client:
        result = client.generate(GenerateParams("a red circle", steps=2, output="latent", image=png, mask=png),
                                 timeout=30)
        assert isinstance(result, Completed), result
        assert client.stats()["input_bytes_held"] == 0


@pytest.mark.timeout(60)
def test_a_client_over_the_engines_client_limit_is_told_the_limit_at_once():
    """Before, the refusal was only logged and connect() waited out its timeout: "no diffslot
    engine answered"."""
    with fake_engine("--max-clients", "1") as engine, Client(engine.address):
        start = time.monotonic()
        with pytest.raises(ConnectionError) as info:
            Client(engine.address, connect_timeout=20).connect()
        assert "--max-clients" in str(info.value) and time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_an_image_whose_size_passes_the_output_budget_is_blamed_on_image():
    png = _padded_png(4096)
    with fake_engine("--output-budget-bytes", "1000") as engine, Client(engine.address) as client:
        result = client.generate(GenerateParams("a red circle", steps=2, output="uint8", image=png), timeout=30)
        assert isinstance(result, Rejected) and result.field == "image", result
        sized = client.generate(GenerateParams("a red circle", steps=2, output="uint8", image=png, height=64,
                                               width=64), timeout=30)
        assert isinstance(sized, Rejected) and sized.field == "height", sized
