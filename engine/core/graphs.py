"""CUDA graphs of the denoiser for the `bucketed` layout: a few fixed row counts (powers of
two), each captured once on fixed input buffers and replayed every step after, so a step
costs one graph launch instead of hundreds of kernel launches from Python.

A replay reads the inputs from the buffers it was captured on and writes its output into
the buffer the capture returned: `GraphedDenoiser.__call__` copies the step's
`ModelInputs` fields in, replays, and returns that output buffer. The buffer
is rewritten by the next replay of the same size, which is safe because everything that
reads it (the update kernel, previews) is enqueued on the same stream before that replay.

A graph is keyed by the fields' shapes, dtypes and memory formats, and by the adapter
pool's `layout_version`, which moves only when a k×k conv layer's adapters change: the
LoRA kernels of Linear and 1×1 conv layers read the pool's device tables, updated in
place, so loading or evicting a plain LoRA adapter keeps every graph. A capture that runs
out of device memory is tried again later (after a growing number of calls); any other
capture failure makes that key run eagerly for good.

`CudaGraphCapture` is the real thing; `EagerCapture` has the same contract on any device
(the captured function is re-run on the buffers at replay), so the CPU tests check the
copy-in, the keys and the fallbacks that the CUDA path relies on.
"""
from __future__ import annotations

import collections
import logging

import torch

from engine.models.inputs import ModelInputs

log = logging.getLogger("diffslot.engine")


class CudaGraphCapture:
    """`capture(fn, inputs)` → (replay, output): `fn(*inputs)` recorded as a CUDA graph after
    a warm-up on a side stream (as `torch.cuda.graphs` recommends: lazy inits and autotuning
    must not happen inside the capture). All graphs share one memory pool."""

    def __init__(self, device: torch.device, warmup: int = 2):
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn, inputs: tuple[torch.Tensor, ...]):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread's CUDA work (the in-process decode) does not break the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = fn(*inputs)
        return graph.replay, output


class EagerCapture:
    """The same contract without a device: replay re-runs `fn` on the captured buffers."""

    def __init__(self):
        self.captures = 0

    def capture(self, fn, inputs: tuple[torch.Tensor, ...]):
        self.captures += 1
        output = fn(*inputs)

        def replay():
            output.copy_(fn(*inputs))

        return replay, output


def _memory_format(a: torch.Tensor) -> str:
    if a.dim() == 4 and not a.is_contiguous() and a.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "contiguous" if a.is_contiguous() else "strided"


def _out_of_memory(exc: Exception) -> bool:
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc)


class GraphedDenoiser:
    """`model.run` through one graph per (field, shape, dtype, memory format) of its
    `ModelInputs`: the same per-row input structure as the eager path, captured on buffers
    of its fields."""

    #: calls to wait before trying a capture again after it ran out of memory (doubling)
    RETRY_AFTER_CALLS = 8
    MAX_RETRY_AFTER_CALLS = 1024

    def __init__(self, model, capture, layout_version=None, max_graphs: int = 32):
        self.model, self.capturer = model, capture
        # key → (replay, output, input buffers), least recently replayed first; at most
        # `max_graphs` (every size a client asks for would otherwise keep its graph)
        self.graphs: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self.max_graphs = max_graphs
        self.evictions = 0
        self.failed: set[tuple] = set()  # keys whose capture raised other than for memory: those run eagerly
        self._retry: dict[tuple, tuple[int, int]] = {}  # key → (call to retry at, wait after the next failure)
        self.calls = 0
        self.replays = 0
        self.captures = 0
        self.out_of_memory = 0  # captures that ran out of memory (each tried again later)
        # what else a capture depends on (`AdapterResidency.layout_version`), read at every call
        self.layout_version = layout_version or (lambda: 0)
        self._version = None

    def key(self, inputs: ModelInputs) -> tuple:
        named = inputs.named()
        return tuple((name, tuple(a.shape), a.dtype, _memory_format(a)) for name, a in named.items()) + (
            self.layout_version(),)

    def __call__(self, inputs: ModelInputs) -> torch.Tensor:
        self.calls += 1
        if inputs.controls is not None:  # its ControlNets' sub-batches change from step to step: eager
            return self.model.run(inputs)
        version = self.layout_version()
        if version != self._version:  # graphs of another adapter layout are never replayed again
            self.evictions += len(self.graphs)
            self.graphs.clear()
            self.failed.clear()
            self._retry.clear()
            self._version = version
        named = inputs.named()
        key = self.key(inputs)
        if key in self.failed:
            return self.model.run(inputs)
        entry = self.graphs.get(key)
        if entry is None:
            retry = self._retry.get(key)
            if retry is not None and self.calls < retry[0]:
                return self.model.run(inputs)
            entry = self._capture(key, named, inputs)
            if entry is None:
                return self.model.run(inputs)
        self.graphs.move_to_end(key)
        replay, output, buffers = entry
        for buffer, value in zip(buffers, named.values()):
            buffer.copy_(value, non_blocking=True)
        replay()
        self.replays += 1
        return output

    def _capture(self, key: tuple, named: dict, inputs: ModelInputs):
        names = tuple(named)
        # clone keeps each field's memory format, which the key names
        buffers = tuple(a.clone() for a in named.values())

        def run(*tensors):
            return self.model.run(ModelInputs(**dict(zip(names, tensors))))

        try:
            replay, output = self.capturer.capture(run, buffers)
        except Exception as exc:
            if _out_of_memory(exc):  # transient: other graphs or requests held the memory
                self.out_of_memory += 1
                wait = self._retry.get(key, (0, self.RETRY_AFTER_CALLS))[1]
                self._retry[key] = (self.calls + wait, min(2 * wait, self.MAX_RETRY_AFTER_CALLS))
                log.warning("CUDA graph capture of %d rows ran out of memory: eager for %d calls, then again",
                            inputs.rows, wait)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                return None
            # a model that cannot be captured still runs, eagerly
            log.warning("CUDA graph capture of %d rows failed (%s: %s): that size runs eagerly",
                        inputs.rows, type(exc).__name__, exc)
            self.failed.add(key)
            return None
        self._retry.pop(key, None)
        self.captures += 1
        entry = self.graphs[key] = (replay, output, buffers)
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)  # its memory returns to the shared pool
            self.evictions += 1
        log.info("captured a CUDA graph of the denoiser at %d rows (%d graphs)", inputs.rows, len(self.graphs))
        return entry
