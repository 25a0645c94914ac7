"""Choosing the decode stage for `--decode-workers N` (and its default)."""
from __future__ import annotations

import os
from typing import Callable

from engine.decode.in_process import InProcessDecodeStage
from engine.decode.stage import DecodeStage

#: Cores per decode worker process on a CPU machine: below this many cores per worker, a
#: worker takes cores the denoiser wants (measured on 2 cores, issue 14: the served engine
#: at 0.64-0.75 of the denoiser's rows/s with two workers, 0.90 with one).
CPU_CORES_PER_WORKER = 8


def default_decode_workers(device: str = "cpu", cpus: int | None = None) -> int:
    """The `--decode-workers` default, sized to the device and the cores.

    - CUDA: one worker process (the VAE on the device, off the denoiser's stream); more
      would add CUDA contexts time-slicing the same device.
    - CPU: the denoiser uses every core through torch's threads, so a worker process
      takes cores from it. With fewer than 2 × CPU_CORES_PER_WORKER cores: 0 (decode on
      one thread of the engine process, which only wakes when an image output finishes;
      "latent" outputs never touch it); beyond that, one worker per CPU_CORES_PER_WORKER
      cores after the first CPU_CORES_PER_WORKER, at most 4.
    """
    if str(device).startswith("cuda"):
        return 1
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(4, cpus // CPU_CORES_PER_WORKER - 1))


def make_decode_stage(model, workers: int | None, on_ready: Callable[[], None] | None = None, *,
                      buffers: int | None = None, **options) -> DecodeStage:
    """The decode stage for `--decode-workers N` (None: `default_decode_workers` for the
    model's device).

    N ≥ 1: `engine.decode.workers.MultiProcessDecodeStage` — N worker processes, each
    loading the model's VAE from its folder, fed through a shared-memory arena of
    `buffers` decode buffers (default: CoreConfig's `decode_buffers`, 8; pass the core's
    value so the arena holds every decode admission reserves). Blocks until the workers
    have loaded their model; raises if they cannot. `options` go to the stage
    (decode_timeout_s, max_size, threads_per_worker, ...). "latent" outputs are answered
    in the engine at submit, without a worker.
    N == 0: decode on a thread of the engine process (`InProcessDecodeStage`).
    """
    device = str(getattr(model, "device", "cpu"))
    if workers is None:
        workers = default_decode_workers(device)
    if workers <= 0:
        return InProcessDecodeStage(model, on_ready=on_ready)
    from engine.decode.workers import MultiProcessDecodeStage  # loads the arena's C atomics

    options.setdefault("pin_memory", device.startswith("cuda"))
    # FIX [workload bench, issue 7]: on a CPU device the denoiser shares the cores with the decode
    # workers, and the stage's default of cpu_count // workers torch threads per worker
    # oversubscribes them: on 2 cores with the denoiser busy, one shapes-model VAE decode took
    # ~430 ms p50 with 2 threads vs ~15 ms with 1 (OpenMP threads waiting on descheduled
    # siblings), and decode dominated time to usable output. On CPU, one thread per worker.
    if not device.startswith("cuda"):
        options.setdefault("threads_per_worker", 1)
    return MultiProcessDecodeStage(model, workers, buffers or 8, device, on_ready=on_ready, **options)
