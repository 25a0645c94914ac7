"""Choosing the decode stage for `--decode-workers N` (and its default)."""
from __future__ import annotations

import os
from typing import Callable

from engine.decode.in_process import InProcessDecodeStage
from engine.decode.inline import InlineDecodeStage
from engine.decode.stage import DecodeConfig, DecodeStage

#: Cores per decode worker process on a CPU machine beyond the first worker: below this
#: many cores per worker, more workers take cores the denoiser wants (measured on 2 cores:
#: the served engine at 0.64-0.75 of the denoiser's rows/s with two workers, 0.90 with one).
CPU_CORES_PER_WORKER = 8
#: `--in-process-decode`: on the busy loop's thread, on a thread beside it, or by device
IN_PROCESS_MODES = ("auto", "inline", "thread")


def default_decode_workers(device: str = "cpu", cpus: int | None = None) -> int:
    """The `--decode-workers` default, sized to the device and the cores.

    - CUDA: one worker process (the VAE on the device, off the denoiser's stream); more
      would add CUDA contexts time-slicing the same device.
    - CPU, 2 cores or more: one worker process, and beyond 2 × CPU_CORES_PER_WORKER cores
      one per CPU_CORES_PER_WORKER cores after the first CPU_CORES_PER_WORKER, at most 4.
      Measured on 2 cores (bench/RESULTS.md): with torch's default threads the served
      engine's PNG rows/s were the same with one worker as with the decode on the busy
      loop's thread (288 and 288), and with one torch thread the worker, on the core the
      denoiser leaves, gave 1.15× the goodput above capacity; a worker costs its own
      process (~470 MB resident with the `shapes` VAE).
    - CPU, 1 core: 0 — the decode runs on the busy loop's thread between steps, several
      latents per VAE call, so nothing computes beside the denoiser.
    "latent" outputs never touch the decode stage.
    """
    if str(device).startswith("cuda"):
        return 1
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < 2:
        return 0
    return max(1, min(4, cpus // CPU_CORES_PER_WORKER - 1))


def make_decode_stage(model, config: DecodeConfig | int | None = None, on_ready: Callable[[], None] | None = None,
                      *, buffers: int | None = None) -> DecodeStage:
    """The decode stage `config` asks for (an int N is `DecodeConfig(workers=N)`; workers
    None: `default_decode_workers` for the model's device).

    N ≥ 1: `engine.decode.workers.MultiProcessDecodeStage` — N worker processes, each
    loading the model's VAE from its folder, fed through a shared-memory arena of
    `buffers` decode buffers (default 8; pass the core's `decode_buffers` so the arena
    holds every decode admission reserves). Blocks until the workers have loaded their
    model; raises if they cannot. "latent" outputs are answered in the engine at submit,
    without a worker.
    N == 0: decode on a thread of the engine process (`InProcessDecodeStage`).
    Either way a decode past `decode_timeout_s` fails its request.
    """
    if not isinstance(config, DecodeConfig):
        config = DecodeConfig(workers=config)
    device = str(getattr(model, "device", "cpu"))
    workers = default_decode_workers(device) if config.workers is None else config.workers
    if workers <= 0:
        if config.in_process not in IN_PROCESS_MODES:
            raise ValueError(f"in-process decode {config.in_process!r}: one of {', '.join(IN_PROCESS_MODES)}")
        if config.in_process == "inline" or (config.in_process == "auto" and not device.startswith("cuda")):
            return InlineDecodeStage(model, on_ready=on_ready)
        return InProcessDecodeStage(model, on_ready=on_ready, decode_timeout_s=config.decode_timeout_s)
    from engine.decode.workers import MultiProcessDecodeStage  # loads the arena's C atomics

    pin_memory = device.startswith("cuda") if config.pin_memory is None else config.pin_memory
    # On a CPU device the denoiser shares the cores with the decode workers: more than one
    # torch thread per worker oversubscribes them (on 2 cores with the denoiser busy, a
    # shapes-model VAE decode took ~430 ms p50 with 2 threads vs ~15 ms with 1: OpenMP
    # threads waiting on descheduled siblings). On CUDA the stage's own default applies.
    threads = config.threads_per_worker
    if threads is None and not device.startswith("cuda"):
        threads = 1
    return MultiProcessDecodeStage(model, workers, buffers or 8, device, on_ready=on_ready, max_size=config.max_size,
                                   decode_timeout_s=config.decode_timeout_s or None, threads_per_worker=threads,
                                   pin_memory=pin_memory, start_timeout_s=config.start_timeout_s)
