"""Decode workers over the shared arena (R7, R8, R10): hand-off, cancel, faults, cleanup.

Worker processes import torch and diffusers (seconds each), so the tests that need
no fault share one module-scoped stage with two workers; the fault tests (a worker
killed, a worker hung) start their own single-worker stage, because the replacement
worker they cause must be reaped within the test. The VAE is the tiny one from
tests/reference.py, saved as a diffusers folder.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from engine.decode import arena as A
from engine.decode.factory import make_decode_stage
from engine.decode.in_process import InProcessDecodeStage
from engine.decode.inline import InlineDecodeStage
from engine.decode.stage import DecodeConfig
from engine.decode.stage import postprocess
from engine.decode.workers import MultiProcessDecodeStage
from engine.protocol import GenerateParams, Timings

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futexes and /dev/shm are Linux-only")]

SHM = pathlib.Path("/dev/shm")


@pytest.fixture(scope="module")
def tiny():
    from engine.testing.reference import tiny_model

    return tiny_model("epsilon", seed=0, with_vae=True)


@pytest.fixture(scope="module")
def vae_folder(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vae")
    tiny.vae.save_pretrained(folder / "vae")
    return folder


class _Wakes:
    def __init__(self):
        self.count = 0

    def __call__(self):
        self.count += 1


@pytest.fixture(scope="module")
def shared(vae_folder):
    """One stage, two workers, for the tests that kill nothing."""
    wakes = _Wakes()
    stage = MultiProcessDecodeStage(vae_folder, workers=2, buffers=4, on_ready=wakes, decode_timeout_s=60.0,
                                    threads_per_worker=1)
    stage.wakes = wakes
    yield stage
    name, pids = stage.arena.name, stage.worker_pids()
    stage.close()
    assert not (SHM / name).exists()
    assert not any(A.pid_alive(pid) for pid in pids)


@pytest.fixture
def stage(shared):
    yield shared
    shared.debug_delays.clear()
    shared.decode_delay_s = 0.0
    deadline = time.monotonic() + 30
    while shared._jobs and time.monotonic() < deadline:  # leave no decode behind for the next test
        shared.poll()
        time.sleep(0.01)
    shared.poll()
    assert shared.free_buffers() == shared.buffers


def params(kind: str = "png", **kw) -> GenerateParams:
    return GenerateParams("a red circle", output=kind, **kw)


def collect(stage, want: set[str], timeout: float = 60.0) -> dict:
    got = {}
    deadline = time.monotonic() + timeout
    while not want <= set(got):
        for out in stage.poll():
            assert out.request_id not in got, f"{out.request_id} came back twice"
            got[out.request_id] = out
        assert time.monotonic() < deadline, f"waiting for {want - set(got)}; in flight {stage.inflight()}"
        time.sleep(0.002)
    return got


def wait_for(predicate, timeout: float = 30.0, step=None):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        if step:
            step()
        time.sleep(0.005)


def same(kind: str, got, want) -> bool:
    return got == want if kind == "png" else np.array_equal(got, want)


# ---- round trip ----------------------------------------------------------------------------

def test_round_trip_equals_in_process_postprocess(stage, tiny):
    gen = torch.Generator().manual_seed(3)
    latents = {f"{kind}-{k}": (kind, torch.randn(4, 8, 8, generator=gen) * 2)
               for kind in ("png", "uint8", "latent") for k in range(3)}
    latents["png-wide"] = ("png", torch.randn(4, 8, 16, generator=gen))  # another size, same buffers
    wakes_before = stage.wakes.count
    for rid, (kind, lat) in latents.items():
        stage.submit(rid, lat, params(kind), Timings(queue_s=0.5), time.monotonic())
    got = collect(stage, set(latents))
    for rid, (kind, lat) in latents.items():
        out = got[rid]
        want, shape, dtype = postprocess(tiny, lat, kind)
        assert out.error is None, out.error
        assert (out.output_kind, out.shape, out.dtype) == (kind, tuple(shape), dtype)
        assert same(kind, out.payload, want), rid
        assert isinstance(out.payload, bytes if kind == "png" else np.ndarray)
        assert out.timings.queue_s == 0.5 and out.timings.decode_wait_s >= 0 and out.timings.decode_s >= 0
    assert stage.free_buffers() == stage.buffers
    assert stage.wakes.count > wakes_before  # the watcher woke the busy loop on results
    assert stage.stats()["decode_stale_handoffs"] == 0
    assert len(stage.handoff_ns) >= 7 and min(stage.handoff_ns) > 0


def test_more_submits_than_buffers_wait_in_the_engine(stage, tiny):
    lat = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(4))
    ids = [f"many-{k}" for k in range(3 * stage.buffers)]
    for rid in ids:
        stage.submit(rid, lat, params("uint8"), Timings(), time.monotonic())  # never blocks
    assert stage.stats()["decode_waiting_for_buffer"] == len(ids) - stage.buffers
    got = collect(stage, set(ids))
    want = postprocess(tiny, lat, "uint8")[0]
    assert all(np.array_equal(got[rid].payload, want) for rid in ids)


# ---- with the engine core: backpressure and cancel -------------------------------------------

class Loop:
    """The busy loop of engine.proc in miniature: core.step() → DenoiseFinished into the
    stage → stage.poll() → core.decode_done()."""

    def __init__(self, core, stage):
        self.core, self.stage = core, stage
        self.results: dict[str, tuple[str, object]] = {}
        self.decoded: dict[str, object] = {}
        self.samples: list[tuple[dict, int]] = []

    def turn(self) -> None:
        for out in self.core.step():
            name = type(out).__name__
            if name == "DenoiseFinished":
                self.stage.submit(out.request_id, out.latents, out.params, out.timings, out.finished_at)
            elif name == "RequestCanceled":
                self.results.setdefault(out.request_id, ("canceled", out))
                self.stage.cancel(out.request_id)  # what engine.proc does for a request in decode
            elif name == "RequestFailed":
                self.results[out.request_id] = ("failed", out)
        for d in self.stage.poll():
            self.decoded[d.request_id] = d
            deliver = self.core.decode_done(d.request_id)
            if not deliver:
                self.results.setdefault(d.request_id, ("canceled", d))
            else:
                self.results[d.request_id] = ("failed", d) if d.error else ("completed", d)
        self.samples.append((self.core.stats(), len(self.stage._jobs) + len(self.stage._waiting)))

    def run(self, until, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"stuck: {self.results.keys()}, {self.stage.inflight()}"
            self.turn()
            time.sleep(0.002)


def make_core(tiny, decode_buffers: int, slots: int = 4):
    from engine.core import CoreConfig, EngineCore

    return EngineCore(tiny, CoreConfig(slots=slots, decode_buffers=decode_buffers, max_queue=32))


def test_slow_decode_holds_admission_instead_of_piling_up_latents(stage, tiny):
    core = make_core(tiny, decode_buffers=3)
    stage.decode_delay_s = 0.4  # decode (2 workers × 0.4 s) is slower than denoise (2 tiny steps)
    ids = [f"slow-{k}" for k in range(8)]
    for k, rid in enumerate(ids):
        core.add_request(rid, params("uint8", steps=2, seed=k, sampler="euler", guidance=1.0))
    loop = Loop(core, stage)
    loop.run(lambda: len(loop.results) == len(ids))
    assert all(loop.results[rid][0] == "completed" for rid in ids), loop.results
    # requests wait in the queue beside free slots: what holds them is the decode reservation
    held = [s for s, _ in loop.samples
            if s["queue_depth"] > 0 and s["reserved_decode_buffers"] == 3 and s["slots_busy"] < 4]
    assert held, "admission never held a request back for a decode buffer"
    assert max(s["reserved_decode_buffers"] for s, _ in loop.samples) <= 3
    assert max(n for _, n in loop.samples) <= 3  # latents in the decode stage never exceed the reservation
    waits = [loop.results[rid][1].timings.decode_wait_s for rid in ids]
    assert min(waits) > 0 and max(waits) > 0.2  # with 3 decodes for 2 workers, one waits a whole decode
    assert all(loop.results[rid][1].timings.decode_s >= 0.4 for rid in ids)
    assert core.stats()["reserved_decode_buffers"] == 0 and not core.has_unfinished_requests()


def test_cancel_while_waiting_for_decode_and_while_being_decoded(stage, tiny):
    core = make_core(tiny, decode_buffers=4)
    stage.debug_delays.update({"dec-a": 1.5, "dec-b": 1.5})  # both workers busy; dec-c waits
    for rid in ("dec-a", "dec-b", "dec-c"):
        core.add_request(rid, params("png", steps=1, guidance=1.0))
    loop = Loop(core, stage)

    def states():
        return {row["request_id"]: row["state"] for row in stage.inflight()}

    loop.run(lambda: states() == {"dec-a": "CLAIMED", "dec-b": "CLAIMED", "dec-c": "READY"})
    core.abort_requests(["dec-c", "dec-a"])
    loop.turn()
    assert loop.results["dec-c"][0] == loop.results["dec-a"][0] == "canceled"  # at once
    loop.run(lambda: "dec-c" in loop.decoded)  # never claimed: its buffer came back at once
    assert "dec-a" not in loop.decoded and stage.free_buffers() == stage.buffers - 2
    loop.run(lambda: {"dec-a", "dec-b"} <= set(loop.decoded))
    assert loop.results["dec-b"][0] == "completed"
    for rid in ("dec-a", "dec-c"):
        assert loop.results[rid][0] == "canceled"
        assert loop.decoded[rid].payload is None and loop.decoded[rid].error == "canceled"  # never the image
    assert stage.free_buffers() == stage.buffers
    assert core.stats()["reserved_decode_buffers"] == 0 and not core.has_unfinished_requests()
    stage.cancel("dec-a")  # idempotent, and after the end: nothing
    assert stage.poll() == []


# ---- stale hand-offs ---------------------------------------------------------------------------

def test_stale_handoff_is_dropped_and_counted():
    engine_side = A.Arena.create(2, 4096, 4096)
    worker_side = A.Arena.attach(engine_side.name, os.getpid(), engine_side.fd)  # a second mapping, as a worker has
    try:
        # 1. the engine revokes a claimed hand-off (deadline): the worker's completion is stale
        e = engine_side.publish(0, kind=0, shape=(4, 8, 8), req_hash=1)
        assert worker_side.claim(0, 1) == e
        assert engine_side.revoke(0, e, 1)
        assert worker_side.cancel_requested(0, e)  # the worker sees the epoch moved on
        assert not worker_side.finish(0, e, 1, A.DONE)
        assert engine_side.load_global(A.G_STALE) == 1
        state, _, epoch = engine_side.state(0)
        assert state == A.REVOKED and epoch == e + 1  # the stale completion changed nothing

        # 2. a worker that read a READY word of an earlier epoch cannot claim a later hand-off
        e1 = engine_side.publish(1, kind=0, shape=(4, 8, 8), req_hash=2)
        old_word = worker_side.load(1, A.H_STATE)
        assert engine_side.unpublish(1, e1)  # canceled before any claim
        e2 = engine_side.publish(1, kind=0, shape=(4, 8, 8), req_hash=3)
        assert e2 == e1 + 1
        assert worker_side.claim(1, 2, old_word) is None
        assert worker_side.claim(1, 2) == e2
        assert worker_side.finish(1, e2, 2, A.DONE)  # the current hand-off completes
        assert engine_side.load_global(A.G_DONE_SEQ) == 1 and engine_side.load_global(A.G_STALE) == 1
    finally:
        worker_side.close()
        engine_side.close()
    assert not (SHM / engine_side.name).exists()


def test_stage_drops_a_completion_of_another_epoch(stage):
    """Engine side: a DONE buffer whose epoch is not the side table's is not delivered."""
    stage.debug_delays["stale"] = 1.0
    stage.submit("stale", torch.zeros(4, 8, 8), params("uint8"), Timings(), time.monotonic())
    wait_for(lambda: [r["state"] for r in stage.inflight()] == ["CLAIMED"])
    job = stage._by_request["stale"]
    job.epoch -= 1  # as if the side table still held an earlier hand-off of this buffer
    before = stage.stats()["decode_stale_handoffs"]
    out = collect(stage, {"stale"})["stale"]
    assert out.payload is None and "stale hand-off" in out.error
    assert stage.stats()["decode_stale_handoffs"] == before + 1


# ---- faults ----------------------------------------------------------------------------------

def _closed_cleanly(stage, pids):
    name = stage.arena.name
    stage.close()
    assert not (SHM / name).exists(), "close() left the arena"
    assert not any(A.pid_alive(pid) for pid in pids)
    stage.close()  # idempotent


def test_worker_killed_mid_decode_is_replaced_and_its_request_fails(vae_folder, tiny):
    stage = MultiProcessDecodeStage(vae_folder, workers=1, buffers=3, decode_timeout_s=60.0,
                                    debug_delays={"victim": 60.0})
    pids = list(stage.worker_pids())
    try:
        lat = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(5))
        for rid in ("victim", "other-1", "other-2"):
            stage.submit(rid, lat, params("png"), Timings(), time.monotonic())
        # the worker claims (CAS) first and writes its pid into the header just after
        wait_for(lambda: any(r["state"] == "CLAIMED" and r["worker_pid"] for r in stage.inflight()))
        (row,) = [r for r in stage.inflight() if r["state"] == "CLAIMED"]
        assert row["request_id"] == "victim" and row["worker_pid"] == pids[0]
        os.kill(pids[0], signal.SIGKILL)
        got = collect(stage, {"victim", "other-1", "other-2"}, timeout=90)
        pids += stage.worker_pids()
        victim = got["victim"]
        assert victim.payload is None
        assert victim.error.startswith("decode worker died") and "signal 9" in victim.error, victim.error
        want = postprocess(tiny, lat, "png")[0]
        assert got["other-1"].payload == want and got["other-2"].payload == want  # by the replacement
        assert len(stage.worker_pids()) == 1 and stage.worker_pids()[0] != pids[0]
        assert stage.free_buffers() == 3  # the dead worker's buffer was reclaimed
        stats = stage.stats()
        assert stats["decode_worker_deaths"] == 1 and stats["decode_worker_restarts"] == 1
    finally:
        pids += stage.worker_pids()
        _closed_cleanly(stage, pids)


def test_worker_hung_past_its_deadline_is_killed_and_replaced(vae_folder, tiny):
    stage = MultiProcessDecodeStage(vae_folder, workers=1, buffers=2, decode_timeout_s=3.0,
                                    debug_delays={"hangs": 120.0})
    pids = list(stage.worker_pids())
    try:
        lat = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(6))
        stage.submit("hangs", lat, params("uint8"), Timings(), time.monotonic())
        stage.submit("fine", lat, params("uint8"), Timings(), time.monotonic())
        got = collect(stage, {"hangs", "fine"}, timeout=100)
        pids += stage.worker_pids()
        assert got["hangs"].payload is None and "hung" in got["hangs"].error, got["hangs"].error
        assert got["hangs"].timings.decode_s >= 3.0
        assert np.array_equal(got["fine"].payload, postprocess(tiny, lat, "uint8")[0])
        assert not A.pid_alive(pids[0]) and stage.worker_pids()[0] != pids[0]
        stats = stage.stats()
        assert stats["decode_worker_hangs"] == 1 and stats["decode_worker_restarts"] == 1
        assert stage.free_buffers() == 2
    finally:
        pids += stage.worker_pids()
        _closed_cleanly(stage, pids)


def test_a_worker_that_cannot_load_its_model_fails_the_start(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text("{}")  # no weights
    before = set(SHM.glob(f"diffslot-{os.getpid()}-*"))
    with pytest.raises(RuntimeError, match="failed to start"):
        MultiProcessDecodeStage(tmp_path, workers=1, buffers=1)
    assert set(SHM.glob(f"diffslot-{os.getpid()}-*")) == before  # its arena is gone again


# ---- arena lifecycle (R10) ----------------------------------------------------------------------

def test_sweep_stale_removes_dead_engines_segments_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    paths = [SHM / f"diffslot-{dead.pid}-arena", SHM / f"diffslot-{live.pid}-arena", SHM / "diffslot-test-x"]
    try:
        for path in paths:
            path.write_bytes(b"\0" * 64)
        removed = A.sweep_stale()
        assert f"diffslot-{dead.pid}-arena" in removed
        assert not paths[0].exists() and paths[1].exists() and paths[2].exists()
    finally:
        live.kill()
        live.wait()
        for path in paths:
            path.unlink(missing_ok=True)


def test_arena_names_and_make_decode_stage(tiny):
    arena = A.Arena.create(1, 64, 64)
    second = A.Arena.create(1, 64, 64)  # a second arena in the same process gets its own name
    try:
        for a in (arena, second):
            assert a.name == f"diffslot-{os.getpid()}-arena" or a.name.startswith(f"diffslot-{os.getpid()}-arena-")
        assert second.name != arena.name
        assert arena.pin() is False  # no CUDA here: nothing to page-lock
    finally:
        arena.close()
        second.close()
    assert not (SHM / arena.name).exists() and not (SHM / second.name).exists()
    inproc = make_decode_stage(tiny, DecodeConfig(workers=0, in_process="thread"))
    assert isinstance(inproc, InProcessDecodeStage)
    inproc.close()
    inline = make_decode_stage(tiny, 0)  # on a CPU: on the busy loop's thread, nothing beside the denoiser
    assert isinstance(inline, InlineDecodeStage)
    inline.close()
