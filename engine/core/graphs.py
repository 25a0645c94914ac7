"""CUDA graphs of the denoiser for the `bucketed` layout: a few fixed row counts (powers of
two), each captured once on fixed input buffers and replayed every step after, so a step
costs one graph launch instead of hundreds of kernel launches from Python.

A replay reads the inputs from the buffers it was captured on and writes its output into
the buffer the capture returned: `GraphedDenoiser.__call__` copies the step's
`ModelInputs` fields in, replays, and returns that output buffer. The buffer
is rewritten by the next replay of the same size, which is safe because everything that
reads it (the update kernel, previews) is enqueued on the same stream before that replay.

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


class GraphedDenoiser:
    """`model.run` through one graph per (field, shape, dtype) of its `ModelInputs`: the
    same per-row input structure as the eager path, captured on buffers of its fields."""

    def __init__(self, model, capture, layout_version=None, max_graphs: int = 32):
        self.model, self.capturer = model, capture
        # key → (replay, output, input buffers), least recently replayed first; at most
        # `max_graphs` (every size a client asks for would otherwise keep its graph)
        self.graphs: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self.max_graphs = max_graphs
        self.evictions = 0
        self.failed: set[tuple] = set()  # keys whose capture raised: those run eagerly
        self.replays = 0
        # what else a capture depends on: the adapter pool's layer layout
        # (`AdapterResidency.layout_version`), read at every call
        self.layout_version = layout_version or (lambda: 0)

    def __call__(self, inputs: ModelInputs) -> torch.Tensor:
        named = inputs.named()
        key = tuple((name, tuple(a.shape), a.dtype) for name, a in named.items()) + (self.layout_version(),)
        if key in self.failed:
            return self.model.run(inputs)
        entry = self.graphs.get(key)
        if entry is None:
            names = tuple(named)
            buffers = tuple(a.clone() for a in named.values())

            def run(*tensors):
                return self.model.run(ModelInputs(**dict(zip(names, tensors))))

            try:
                replay, output = self.capturer.capture(run, buffers)
            except Exception as exc:  # a model that cannot be captured still runs, eagerly
                log.warning("CUDA graph capture of %d rows failed (%s: %s): that size runs eagerly",
                            inputs.rows, type(exc).__name__, exc)
                self.failed.add(key)
                return self.model.run(inputs)
            entry = self.graphs[key] = (replay, output, buffers)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)  # its memory returns to the shared pool
                self.evictions += 1
            log.info("captured a CUDA graph of the denoiser at %d rows (%d graphs)", inputs.rows, len(self.graphs))
        self.graphs.move_to_end(key)
        replay, output, buffers = entry
        for buffer, value in zip(buffers, named.values()):
            buffer.copy_(value, non_blocking=True)
        replay()
        self.replays += 1
        return output
