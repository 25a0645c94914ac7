"""The GPU path's helpers, on CPU: staging buffers, the run-ahead
window, the device step timer, noise drawn ahead (bit-identical streams), fences on the
tensors' device, the arena's close ordering, and `bench/gpu_check.py`'s CPU run.

Nothing here needs CUDA: CUDA calls are replaced by recording fakes where the order or
the device of a call is what is checked."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from engine.core import fences as F
from engine.core.device import PinnedBuffers, RunAhead, StepTimer

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIELDS = {
    "index": (np.int32, (64, 4)),
    "coefs": (np.float32, (64, 13)),
    "row_slot": (np.int64, (128,)),
    "row_timestep": (np.float32, (128,)),
    "row_divisor": (np.float32, (128,)),
}


# ---- PinnedBuffers ----------------------------------------------------------------------------

def test_pinned_buffers_layout_and_views():
    bufs = PinnedBuffers(FIELDS, "cpu", depth=2)
    assert not bufs.pinned  # CPU device: no page-locking asked for
    offsets = [bufs.layout[n][0] for n in FIELDS]
    assert offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)
    stage = bufs.acquire()
    assert {n: (a.dtype, a.shape) for n, a in stage.host.items()} == \
        {n: (np.dtype(d), s) for n, (d, s) in FIELDS.items()}
    stage.host["index"][:3] = np.arange(12).reshape(3, 4)
    stage.host["coefs"][:3] = 0.5
    stage.host["row_slot"][:5] = [4, 4, 1, 2, 2]
    stage.host["row_timestep"][:5] = 999.0
    stage.host["row_divisor"][:5] = 2.0
    dev = stage.upload({"index": 3, "coefs": 3, "row_slot": 5, "row_timestep": 5, "row_divisor": 5})
    assert dev["index"].dtype == torch.int32 and dev["index"].shape == (3, 4)
    assert torch.equal(dev["index"], torch.arange(12, dtype=torch.int32).reshape(3, 4))
    assert dev["coefs"].shape == (3, 13) and bool((dev["coefs"] == 0.5).all())
    assert dev["row_slot"].tolist() == [4, 4, 1, 2, 2] and dev["row_slot"].dtype == torch.int64
    assert dev["row_timestep"].tolist() == [999.0] * 5 and dev["row_divisor"].tolist() == [2.0] * 5
    assert bufs.uploads == 1
    with pytest.raises(ValueError):
        bufs.acquire().upload({"index": 65})
    with pytest.raises(KeyError):
        bufs.acquire().upload({"nope": 1})


class _Event:
    def __init__(self, log):
        self.done, self.log = False, log

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append("sync")
        self.done = True


def test_pinned_buffers_ring_waits_for_the_copy_that_read_the_slot():
    """A staging buffer is refilled only after the copy that read it is done: with depth 2
    the third acquire waits on the first upload's event, the second does not."""
    log = []
    events = []

    def factory():
        events.append(_Event(log))
        return events[-1]

    bufs = PinnedBuffers(FIELDS, "cpu", depth=2, event_factory=factory)
    a = bufs.acquire()
    a.upload({"index": 1})
    b = bufs.acquire()
    assert b._k != a._k and bufs.waits == 0 and log == []
    b.upload({"index": 1})
    events[1].done = True  # the second copy finished, the first not yet
    c = bufs.acquire()
    assert c._k == a._k and bufs.waits == 1 and log == ["sync"] and events[0].done
    c.upload({"index": 1})
    d = bufs.acquire()  # slot of b: its copy is done, no wait
    assert d._k == b._k and bufs.waits == 1


# ---- RunAhead ----------------------------------------------------------------------------------

def test_run_ahead_caps_launches_in_flight():
    fences = F.DeferredFences()
    window = RunAhead(limit=2)
    assert window.in_flight < window.limit
    first, second = fences.record(), fences.record()
    window.admit(first)
    assert window.in_flight < window.limit
    window.admit(second)
    assert not window.in_flight < window.limit and window.in_flight == 2
    t0 = time.monotonic()
    assert window.wait_for_room(timeout=0.05) is False  # held by the test: no room, no hang
    assert window.wait_for_room() is False
    assert time.monotonic() - t0 < 1.0
    fences.release(first)
    assert window.wait_for_room(timeout=0.05) and window.in_flight == 1
    fences.release(second)
    assert window.in_flight == 0 and window.wait_for_room(timeout=0)


def test_run_ahead_out_of_order_completion_and_immediate_fences():
    fences = F.DeferredFences()
    window = RunAhead(limit=2)
    a, b = fences.record(), fences.record()
    window.admit(a)
    window.admit(b)
    fences.release(b)  # the newer one first (only a test can do that)
    assert window.in_flight == 1 and window.in_flight < window.limit
    immediate = RunAhead(limit=1)
    for fence in (F.ImmediateFences().record() for _ in range(5)):
        assert immediate.wait_for_room(timeout=0)
        immediate.admit(fence)
    with pytest.raises(ValueError):
        RunAhead(limit=0)


# ---- StepTimer ---------------------------------------------------------------------------------

def test_step_timer_on_cpu_is_host_time():
    timer = StepTimer("cpu", alpha=0.5)
    token = timer.start()
    time.sleep(0.02)
    timer.stop(token)
    assert 0.015 < timer.poll() < 0.5 and timer.samples == 1
    first = timer.ema
    token = timer.start()
    timer.stop(token)
    assert timer.ema < first and timer.samples == 2


# ---- fences on the tensors' device (fakes for torch.cuda) -----------------------------------------

class _FakeStream:
    def __init__(self, device):
        self.device = torch.device(device)


class _FakeCudaEvent:
    recorded: list = []

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.blocking = blocking

    def record(self, stream=None):
        _FakeCudaEvent.recorded.append((self, stream))

    def query(self):
        return True

    def synchronize(self):
        pass


def test_cuda_fences_record_on_the_stream_of_their_device(monkeypatch):
    """An engine on cuda:1 records its fences on cuda:1's current stream even while the
    process's current device is cuda:0 (the launch's device, not the current one)."""
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return _FakeStream(device if device is not None else "cuda:0")

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    _FakeCudaEvent.recorded = []
    fences = F.fences_for(torch.device("cuda:1"))
    assert isinstance(fences, F.CudaFences) and fences.device == torch.device("cuda:1")
    fence = fences.record()
    (event, stream), = _FakeCudaEvent.recorded
    assert fence.event is event and event.blocking  # the host sleeps, not spins, in wait()
    assert stream.device == torch.device("cuda:1") and fence.device == torch.device("cuda:1")
    assert asked == [torch.device("cuda:1")]
    assert fence.wait() and fence.wait(timeout=0.01) and fence.done()
    assert F.CudaFences("cuda").device == torch.device("cuda:0")  # no index: the current device
    with pytest.raises(ValueError):
        F.CudaFences("cpu")


def test_cpu_fences_wait():
    assert F.ImmediateFences().record().wait(timeout=0.0)
    deferred = F.DeferredFences()
    fence = deferred.record()
    assert fence.wait(timeout=0.01) is False  # a test holds it: never blocks
    deferred.release(fence)
    assert fence.wait()


def test_cuda_fence_timed_wait_polls_without_spinning(monkeypatch):
    calls = []
    t0 = time.monotonic()

    def query():
        calls.append(time.monotonic())
        return time.monotonic() - t0 > 0.03

    assert F._poll(query, timeout=1.0)
    assert len(calls) < 200  # slept between looks (doubling up to 1 ms)
    assert F._poll(lambda: False, timeout=0.01) is False


# ---- the arena: close waits for copies, then unpins, then unmaps -------------------------------------------

def test_arena_close_waits_for_pending_copies_before_unpinning_and_unmapping(monkeypatch):
    from engine.decode import arena as A

    arena = A.Arena.create(2, 4096, 4096)
    order = []

    class Event:
        def __init__(self, name):
            self.name = name

        def query(self):
            return False

        def synchronize(self):
            order.append(f"event {self.name}")

    class Cudart:
        def cudaHostUnregister(self, ptr):
            order.append("unregister")
            assert arena._bytes is not None, "the mapping must outlive the unregister"
            return 0

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(f"synchronize {device}"))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    shm = arena._shm
    real_close, real_unlink = shm.close, shm.unlink
    monkeypatch.setattr(shm, "close", lambda: (order.append("unmap"), real_close())[1])
    monkeypatch.setattr(shm, "unlink", lambda: (order.append("unlink"), real_unlink())[1])
    arena._pinned = arena._bytes.ctypes.data  # as pin() leaves it on a CUDA machine
    arena.track_copy(Event("d2h-1"))
    arena.track_copy(Event("d2h-2"))
    arena.close()
    assert order == ["event d2h-1", "event d2h-2", "synchronize 0", "synchronize 1", "unregister",
                     "unlink", "unmap"], order
    assert arena.closed and arena._pinned is None
    arena.close()  # idempotent
    assert order.count("unregister") == 1


def test_unpinned_arena_close_touches_no_cuda(monkeypatch):
    from engine.decode import arena as A

    arena = A.Arena.create(1, 4096, 4096)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronized"))
    arena.close()
    assert arena.closed


# ---- bench/gpu_check.py on this CPU machine ---------------------------------------------------------

@pytest.mark.timeout(300)
def test_gpu_check_runs_on_cpu_and_skips_the_cuda_parts(tmp_path):
    """`python bench/gpu_check.py` here: exit 0, one row per part, every CUDA part says
    it was skipped, the CPU-possible part (the kernel through the interpreter) passes."""
    out_json = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--json", str(out_json)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "no CUDA device: skipped" in proc.stdout
    import json

    report = json.loads(out_json.read_text())
    parts = {r["part"] for r in report["rows"]}
    assert {"kernel", "bandwidth", "reaper", "nosync", "unet", "layouts", "interpreter"} <= parts, parts
    assert all(r["status"] in ("ok", "skipped", "info") for r in report["rows"]), report["rows"]
    assert any(r["part"] == "interpreter" and r["status"] == "ok" for r in report["rows"])


def test_a_field_left_out_of_the_counts_is_not_copied():
    """A step that stages no noise (no stochastic sampler in it) copies the small arrays
    only: a field the counts leave out is unused (0 rows), not full. SDXL with 16 slots has
    a noise field of 4 MiB beside half a kilobyte of the rest."""
    fields = dict(FIELDS, noise=(np.float32, (16, 4 * 128 * 128)))
    bufs = PinnedBuffers(fields, "cpu", depth=1)
    stage = bufs.acquire()
    dev = stage.upload({"index": 3, "row_slot": 6})
    noise_offset = bufs.layout["noise"][0]
    assert bufs.last_upload_bytes <= noise_offset < 8192 and dev["noise"].shape == (0, 4 * 128 * 128)
    assert dev["coefs"].shape[0] == 0
    bufs.acquire().upload({"index": 3, "noise": 2})
    assert bufs.last_upload_bytes == noise_offset + 2 * 4 * 128 * 128 * 4
    bufs.acquire().upload()  # no counts: every field full
    assert bufs.last_upload_bytes == noise_offset + 16 * 4 * 128 * 128 * 4
