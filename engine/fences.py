"""Completion fences (R6): one per launch; the reaper acts on a slot only once it is done.

- `CudaFences`: a CUDA event recorded on the current stream after the launch.
- `ImmediateFences`: CPU execution is synchronous, so a fence is done when recorded.
- `DeferredFences`: completions held back until a test releases them, in any order,
  to exercise slot protection and stale (slot, epoch) reports.
"""
from __future__ import annotations

import itertools

import torch


class Fence:
    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Block until done (used only at shutdown)."""


class ImmediateFences:
    def __init__(self):
        self._seq = itertools.count()

    def record(self) -> Fence:
        return Fence(next(self._seq))


class CudaFence(Fence):
    __slots__ = ("event",)

    def __init__(self, seq: int):
        super().__init__(seq)
        self.event = torch.cuda.Event()
        self.event.record()

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaFences:
    def __init__(self):
        self._seq = itertools.count()

    def record(self) -> Fence:
        return CudaFence(next(self._seq))


class DeferredFence(Fence):
    __slots__ = ("released",)

    def __init__(self, seq: int):
        super().__init__(seq)
        self.released = False

    def done(self) -> bool:
        return self.released

    def synchronize(self) -> None:
        self.released = True


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
    return CudaFences() if device.type == "cuda" else ImmediateFences()
