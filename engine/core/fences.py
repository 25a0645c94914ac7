"""Completion fences: one per launch; the reaper acts on a slot only once it is done.

- `CudaFences(device)`: a CUDA event recorded on the current stream *of the tensors'
  device* (not the process's current device) after the launch.
- `ImmediateFences`: CPU execution is synchronous, so a fence is done when recorded.
- `DeferredFences`: completions held back until a test releases them, in any order,
  to exercise slot protection and stale (slot, epoch) reports.
"""
from __future__ import annotations

import itertools
import time

import torch


class Fence:
    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Block until done (used only at shutdown)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds (None: no limit) pass, without spinning
        the host; True if done. The busy loop calls this when fences are all it has."""
        return self.done()


class ImmediateFences:
    def __init__(self):
        self._seq = itertools.count()

    def record(self) -> Fence:
        return Fence(next(self._seq))


class CudaFence(Fence):
    """A CUDA event recorded on `stream` (the current stream of the launch's device).

    The event is created with `blocking=True` (cudaEventBlockingSync), so `synchronize`
    and `wait` put the host thread to sleep instead of spinning a core."""

    __slots__ = ("event", "device")

    def __init__(self, seq: int, stream=None):
        super().__init__(seq)
        stream = stream if stream is not None else torch.cuda.current_stream()
        self.device = stream.device
        self.event = torch.cuda.Event(blocking=True)
        self.event.record(stream)

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            self.event.synchronize()  # a blocking-sync event: the thread sleeps in the driver
            return True
        return _poll(self.event.query, timeout)


def _poll(query, timeout: float) -> bool:
    """query() until it is true or `timeout` passes, sleeping between looks (10 µs, doubling
    to 1 ms): CUDA events have no timed wait."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not query():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1e-3)
    return True


class CudaFences:
    """Fences for launches on `device` (default: the current CUDA device at construction).

    `record()` records on the current stream of *that* device, so an engine on cuda:1
    fences its own launches even when the process's current device is cuda:0."""

    def __init__(self, device: torch.device | str | int | None = None):
        self._seq = itertools.count()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            raise ValueError(f"CudaFences needs a cuda device, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def record(self, stream=None) -> Fence:
        """A fence after everything enqueued so far on `stream` (default: the device's current stream)."""
        return CudaFence(next(self._seq), stream if stream is not None else torch.cuda.current_stream(self.device))


class DeferredFence(Fence):
    __slots__ = ("released",)

    def __init__(self, seq: int):
        super().__init__(seq)
        self.released = False

    def done(self) -> bool:
        return self.released

    def synchronize(self) -> None:
        self.released = True

    def wait(self, timeout: float | None = None) -> bool:
        return self.released  # only a test releases it: never block on one


class DeferredFences:
    """Fences that complete only when `release` (or `release_all`) says so."""

    def __init__(self):
        self._seq = itertools.count()
        self.pending: list[DeferredFence] = []

    def record(self) -> DeferredFence:
        fence = DeferredFence(next(self._seq))
        self.pending.append(fence)
        return fence

    def release(self, fence: DeferredFence) -> None:
        fence.released = True
        self.pending.remove(fence)

    def release_all(self) -> None:
        for fence in self.pending:
            fence.released = True
        self.pending.clear()


def fences_for(device: torch.device):
    device = torch.device(device)
    return CudaFences(device) if device.type == "cuda" else ImmediateFences()
