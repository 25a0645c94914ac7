"""A model under an EngineCore against the same model's denoiser alone: the denoiser's peak
batched rate, an engine stepped for a while or to the end (rows, host time per step less
its fence waits), and the check that a random-weight model's output is usable at all.
Shared by the unet, graphs, layouts, sdxl and flux parts."""
from __future__ import annotations

import statistics
import time

import torch
import triton.testing

from engine.protocol import GenerateParams

from .engine_internals import (CoreConfig, DenoiseFinished, EngineCore, RequestFailed, cuda_graph_counts,
                               time_fence_waits)
from . import judge
from .report import check, row


def denoiser_peak_ms(model, rows: int, **request_inputs) -> float:
    """The model's denoiser alone (`model.denoise`, the core's `run` with its inputs), `rows`
    rows at the native size: median ms over back-to-back calls (triton.testing.do_bench)."""
    shape = model.latent_shape(model.native_size, model.native_size)
    x = torch.randn(rows, *shape, device=model.device, dtype=model.dtype)
    t = torch.randint(0, 1000, (rows,), device=model.device).float()
    conds = model.encode([f"p{k}" for k in range(rows)])
    with torch.no_grad():
        return triton.testing.do_bench(lambda: model.denoise(x, t, conds, **request_inputs), warmup=100, rep=600,
                                       return_mode="median")


def run_engine_steps(model, slots: int, active: int, layout: str, steps_each: int, measure: int | None,
                     guidance: float = 7.5, sampler: str = "euler", device: str = "cuda", prompts=None,
                     cuda_graphs: bool = True, latents: dict | None = None, params=None):
    """An EngineCore on the model with `active` requests; returns (wall s, steps, useful rows,
    total rows, host s per step list, finished, failed). Host time per step is `step()`'s
    time less its fence waits (`time_fence_waits`; their total over the timed steps in
    `run_engine_steps.waited_s`). `measure`: time only that many steps after two warm-up
    steps (requests stay active); None: run every request to the end. `params(k)`: extra
    GenerateParams fields of request k (they override the defaults here)."""
    core = EngineCore(model, CoreConfig(slots=slots, layout=layout, max_steps=max(64, steps_each), device=device,
                                        trajectory_budget_bytes=1 << 36, output_budget_bytes=1 << 36,
                                        cuda_graphs=cuda_graphs))
    # the start-up capture replays each bucket's graph once: not a replay while serving
    run_engine_steps.replays_at_start = cuda_graph_counts(core)[1]
    prompts = prompts or [f"prompt {k}" for k in range(5)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for k in range(active):
        fields = dict(prompt=prompts[k % len(prompts)], negative_prompt="", steps=steps_each, sampler=sampler,
                      guidance=guidance, seed=k, output="latent")
        fields.update(params(k) if params is not None else {})
        core.add_request(f"r{k}", GenerateParams(**fields))
    finished = failed = 0
    spent = time_fence_waits(core)

    def step():
        nonlocal finished, failed
        waited = spent["s"]
        t0 = time.perf_counter()
        outs = core.step()
        host = time.perf_counter() - t0 - (spent["s"] - waited)
        for o in outs:
            if isinstance(o, DenoiseFinished):
                finished += 1
                if latents is not None:
                    latents[o.request_id] = o.latents.clone()
                core.decode_done(o.request_id)
            elif isinstance(o, RequestFailed):
                failed += 1
        return host

    with torch.no_grad():
        for _ in range(2):
            step()
        sync()
        s0 = core.stats()
        b0 = core.batches
        hosts = []
        waited0 = spent["s"]
        t0 = time.perf_counter()
        if measure is None:
            while core.has_unfinished_requests():
                hosts.append(step())
        else:
            for _ in range(measure):
                hosts.append(step())
        sync()
        wall = time.perf_counter() - t0
        run_engine_steps.waited_s = spent["s"] - waited0
        if measure is None:
            while core.has_unfinished_requests():
                step()
    s1 = core.stats()
    useful = s1["useful_evals"] - s0["useful_evals"]
    total = useful + s1["padded_evals"] - s0["padded_evals"]
    # read by the graphs and layouts parts
    run_engine_steps.graphs, run_engine_steps.replays = cuda_graph_counts(core)
    run_engine_steps.calls = core.batches
    return wall, core.batches - b0, useful, total, hosts, finished, failed


def finite_output_check(part: str, model, label: str, **request_inputs) -> bool:
    """One call of two rows at the native size (prompt "a" at t=500, "" at t=20): the
    random-weight denoiser's output is finite and latent-shaped (the engine fails a request
    whose latents turn non-finite, so a run on such weights would measure nothing)."""
    shape = model.latent_shape(model.native_size, model.native_size)
    x = torch.randn(2, *shape, device=model.device, dtype=model.dtype)
    with torch.no_grad():
        out = model.denoise(x, torch.tensor([500.0, 20.0], device=model.device), model.encode(["a", ""]),
                            **request_inputs)
    finite = bool(torch.isfinite(out).all())
    shaped = tuple(out.shape) == tuple(x.shape)
    return check(part, f"random-weight {label} output", "finite, latent-shaped", finite and shaped, finite and shaped,
                 f"std {float(out.float().std()):.3g}, shape {tuple(out.shape)}")


def engine_vs_peak(part: str, model, label: str, slots: int, rows_per_request: int, steps: int, params=None,
                   sampler: str = "euler", guidance: float = 7.5, peak_inputs: dict | None = None) -> None:
    """The denoiser's peak batched rate at the engine's full batch (slots × rows per request)
    against an EngineCore serving `slots` requests to the end (compact layout): useful
    rows/s over peak rows/s, at least the part's `judge.THROUGHPUT_TARGETS`, and host
    time per step() less its fence waits."""
    rows = slots * rows_per_request
    ms = denoiser_peak_ms(model, rows, **(peak_inputs or {}))
    peak = rows / (ms / 1e3)
    row(part, f"{label} alone, batch {rows}", "median ms / rows/s", ms, "info", f"{peak:.2f} rows/s")
    wall, batches, useful, total, hosts, finished, failed = run_engine_steps(
        model, slots, slots, "compact", steps, None, guidance=guidance, sampler=sampler, params=params)
    rate = useful / wall
    verdict = judge.throughput(part, rate, peak, finished, slots, failed)
    check(part, f"engine {slots} requests x {steps} steps, compact", f"useful rows/s / {label} peak", rate / peak,
          verdict.ok, f"{verdict.note}; {rate:.2f} rows/s, {batches} batches, "
          f"{useful / max(1, batches):.1f} useful rows per call")
    hosts_ms = sorted(h * 1e3 for h in hosts)
    row(part, "engine, host time per step() less fence waits", "median ms", statistics.median(hosts_ms), "info",
        f"p90 {hosts_ms[int(0.9 * (len(hosts_ms) - 1))]:.2f} ms vs {wall / max(1, batches) * 1e3:.1f} ms per step; "
        f"fence waits {run_engine_steps.waited_s:.2f} of {wall:.2f} s (host ≪ device: the host runs ahead)")
