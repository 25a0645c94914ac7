"""The only module of the GPU check that imports `engine.core`, and the only one that
reaches into an `EngineCore`'s parts (its run-ahead window, reaper, fences and CUDA
graphs): those internals move as the core is refactored, so a move is fixed here once.

The parts read `EngineCore`'s public surface (`add_request`, `step`, `abort_requests`,
`decode_done`, `stats`, `has_work`, `has_unfinished_requests`, `batches`, `requests`)
directly; the reaper part also reads a running request's slot (`group`, `slot`,
`stopping`; the group's `last_fence`, `epoch`, `requests`), which is what it checks.
"""
from __future__ import annotations

import time

from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled, RequestFailed
from engine.core import kernels as _update_kernel
from engine.core.fences import CudaFences
from engine.core.kernels import (blend_known_region_reference, blend_known_region_triton, update_slots_reference,
                                 update_slots_triton)
from engine.core.solvers import A, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q, build_schedule

__all__ = [
    "A", "CLIP", "D", "E", "G", "HC", "KEEP_HIST", "KS", "KT", "M", "NUM_COEFS", "P", "Q", "CoreConfig", "CudaFences",
    "DenoiseFinished", "EngineCore", "RequestCanceled", "RequestFailed", "blend_known_region_reference",
    "blend_known_region_triton", "build_schedule", "cuda_graph_counts",
    "record_fences", "time_fence_waits", "update_kernel_jit", "update_kernel_launch_options",
    "update_slots_reference", "update_slots_triton",
]


def update_kernel_jit():
    """The update kernel's Triton JIT function (its compiled variants live in its cache)."""
    return _update_kernel._update_slots_kernel


def update_kernel_launch_options() -> dict:
    """The compile options every launch of the update kernel passes."""
    return dict(_update_kernel.LAUNCH_OPTIONS)


def time_fence_waits(core) -> dict:
    """Count the seconds the core sleeps on fences (the run-ahead window's wait for room,
    the idle reaper's wait): host time per step is a step's time less these."""
    spent = {"s": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0
        return wrapper

    if core.window is not None:
        core.window.wait_for_room = timed(core.window.wait_for_room)
    core.reaper.wait = timed(core.reaper.wait)
    return spent


def record_fences(core) -> list:
    """Every fence the core records from now on, appended to the list returned."""
    fences = []
    record = core.fences.record
    core.fences.record = lambda *a, **k: fences.append(record(*a, **k)) or fences[-1]
    return fences


def cuda_graph_counts(core) -> tuple[int, int]:
    """(CUDA graphs captured, replays) of the core's denoiser; (0, 0) when it runs eagerly."""
    if core.graphed is None:
        return 0, 0
    return len(core.graphed.graphs), core.graphed.replays
