"""Helpers of the GPU path that the core uses around its launches.

- `PinnedBuffers`: persistent page-locked host staging for a step's small arrays (row
  map, index, coefficients, per-row timesteps and divisors), packed into one buffer, so
  a step costs one asynchronous host-to-device copy. A `non_blocking` copy from pageable
  memory is synchronous in practice (the driver stages it through its own pinned buffer
  and the host waits); from page-locked memory it is a real async copy. A ring of
  `depth` staging buffers, each released by the event recorded after its copy, lets the
  host fill step n+1 while step n's copy may still be reading its buffer.
- `RunAhead`: a bounded window of launches in flight (default 2: the host prepares step
  n+1 while the device runs step n, and never more), waiting on the oldest fence without
  spinning.
- `StepTimer`: the time a step takes *on the device* (CUDA events around the launch,
  read once they complete), for `step_time_ema` and `retry_after`; on CPU the host time.

All of them run on CPU tensors too (tests), where copies and events degenerate to
nothing.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import numpy as np
import torch

_ALIGN = 64  # bytes: every field starts on a cache line (and on any dtype's alignment)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _HostEvent:
    """The event of a CPU 'copy': done at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Staged:
    """One step's staging buffer: fill `host[name][:n]` (numpy, writable), then `upload()`.
    On CPU the returned views *are* the host buffer: valid until this ring slot comes round
    again (`depth` acquires later)."""

    def __init__(self, owner: "PinnedBuffers", k: int):
        self._owner, self._k = owner, k
        self.host: dict[str, np.ndarray] = owner._host_views[k]

    def upload(self, counts: dict[str, int] | None = None, stream=None) -> dict[str, torch.Tensor]:
        """One host-to-device copy of the staging buffer up to the end of the last field
        used; returns each field's device view, its first `counts[name]` rows. With
        `counts`, a field it does not name is unused this step (0 rows, nothing copied);
        without, every field is full. The ring slot is free again once this copy's event
        completes."""
        return self._owner._upload(self._k, counts, stream)


class PinnedBuffers:
    """Persistent page-locked host buffers and their device twins, in a ring of `depth`.

    `fields`: name → (dtype, shape at capacity); the first dimension is the row count a
    step may use less of. `device`: where the step runs. `pin`: page-lock the host side
    (default: when `device` is CUDA). `event_factory`: makes the event recorded after a
    copy (default: a CUDA event on the device's current stream); tests pass their own.
    """

    def __init__(self, fields: dict[str, tuple], device: torch.device | str = "cpu", depth: int = 2,
                 pin: bool | None = None, event_factory: Callable[[], object] | None = None):
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.device = torch.device(device)
        self.depth = depth
        self._cuda = self.device.type == "cuda"
        pin = self._cuda if pin is None else pin
        self.layout: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, (dtype, shape) in fields.items():
            dtype = np.dtype(dtype)
            shape = tuple(int(d) for d in shape)
            self.layout[name] = (offset, dtype, shape)
            offset = _align(offset + dtype.itemsize * int(np.prod(shape)))
        self.nbytes = max(offset, _ALIGN)
        self._host = [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(depth)]
        self._host_views = [self._views_np(h.numpy()) for h in self._host]
        self._dev = [torch.empty(self.nbytes, dtype=torch.uint8, device=self.device) for _ in range(depth)] \
            if self._cuda else self._host
        self._events: list = [None] * depth
        self._next = 0
        self._event_factory = event_factory
        self.uploads = 0  # upload() calls (each at most one host-to-device copy)
        self.last_upload_bytes = 0  # bytes the last upload() copied
        self.waits = 0  # acquires that had to wait for a ring slot's earlier copy

    @property
    def pinned(self) -> bool:
        return self._host[0].is_pinned()

    def _views_np(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for name, (offset, dtype, shape) in self.layout.items():
            count = int(np.prod(shape))
            out[name] = buf[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
        return out

    def acquire(self) -> Staged:
        """The next staging buffer of the ring, once the copy that last read it is done."""
        k = self._next
        self._next = (k + 1) % self.depth
        event = self._events[k]
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        self._events[k] = None
        return Staged(self, k)

    def _upload(self, k: int, counts: dict[str, int] | None, stream) -> dict[str, torch.Tensor]:
        for name in counts or ():
            if name not in self.layout:
                raise KeyError(f"no staged field {name!r}")

        def rows_of(name: str, shape: tuple) -> int:
            return shape[0] if counts is None else counts.get(name, 0)

        end = 0  # fields lie in order: copy up to the end of the last used row
        for name, (offset, dtype, shape) in self.layout.items():
            rows = rows_of(name, shape)
            if rows > shape[0] or rows < 0:
                raise ValueError(f"{name}: {rows} rows staged, capacity {shape[0]}")
            if rows:
                end = max(end, offset + rows * int(np.prod(shape[1:])) * dtype.itemsize)
        host, dev = self._host[k], self._dev[k]
        if self._cuda and end:
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                dev[:end].copy_(host[:end], non_blocking=True)
            event = self._event_factory() if self._event_factory else torch.cuda.Event()
            if self._event_factory is None:
                event.record(stream)
        else:
            event = self._event_factory() if self._event_factory else _HostEvent()
        self._events[k] = event
        self.uploads += 1
        self.last_upload_bytes = end
        views = {}
        for name, (offset, dtype, shape) in self.layout.items():
            rows = rows_of(name, shape)
            count = int(np.prod(shape[1:])) * rows
            tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
            views[name] = dev[offset:offset + count * dtype.itemsize].view(tdtype).view(rows, *shape[1:])
        return views


class RunAhead:
    """At most `limit` launches in flight: `wait_for_room()` before a launch, `admit(fence)`
    after it. Waiting sleeps on the oldest fence (`Fence.wait`) instead of spinning."""

    def __init__(self, limit: int = 2):
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._fences: collections.deque = collections.deque()
        self.waited = 0  # launches that had to wait for room

    def _drop_done(self) -> None:
        while self._fences and self._fences[0].done():
            self._fences.popleft()
        if any(f.done() for f in self._fences):  # fences complete in order on one stream; not on CPU tests
            self._fences = collections.deque(f for f in self._fences if not f.done())

    @property
    def in_flight(self) -> int:
        self._drop_done()
        return len(self._fences)

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block until fewer than `limit` launches are in flight (or `timeout` passes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while self.in_flight >= self.limit:
            waited = True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if not self._fences[0].wait(left) and not self._fences[0].done():
                return False  # timed out, or a fence nobody but a test completes (DeferredFence)
        self.waited += waited
        return True

    def admit(self, fence) -> None:
        self._fences.append(fence)


class StepTimer:
    """Device time per step, as an exponential moving average (`ema`, seconds).

    On CUDA, `start()` records a timing event on the device's current stream before the
    step's first launch and `stop(token)` one after its last; `poll()` reads the pairs
    that have completed. Host enqueue time (what `perf_counter` around the launches
    measures on CUDA) says nothing about how long the device takes. On CPU the step is
    synchronous and the host time is the step time."""

    def __init__(self, device: torch.device | str = "cpu", alpha: float = 0.1):
        self.device = torch.device(device)
        self.alpha = alpha
        self.ema = 0.0
        self.samples = 0
        self._pending: collections.deque = collections.deque()

    def _update(self, seconds: float) -> None:
        self.samples += 1
        self.ema = seconds if self.samples == 1 else (1 - self.alpha) * self.ema + self.alpha * seconds

    def start(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def stop(self, token) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._pending.append((token, end))
        else:
            self._update(time.perf_counter() - token)

    def poll(self) -> float:
        """Fold in every completed step; returns the current average (seconds)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._update(start.elapsed_time(end) / 1e3)
        return self.ema
