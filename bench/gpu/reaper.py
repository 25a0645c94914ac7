"""Part `reaper`: an EngineCore on CUDA (tiny model, mixed samplers, a cancel): a launch
held behind `torch.cuda._sleep` (the hold timed by CUDA events, sized from the engine's
measured step time: `judge.HOLD_STEPS` steps at least) keeps the canceled
request's slot and epoch until its CUDA event completes; every fence completes; results
equal the CPU run."""
from __future__ import annotations

import time

import torch

from engine.testing.reference import rel_l2

from . import judge
from .cancel_plan import PLAN, run_plan
from .report import check, row


def run(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    gpu, gpu_canceled, checks, _ = run_plan("cuda", hold_at_cancel=True)
    holds_ms = run_plan.holds_ms
    cpu, cpu_canceled, _, _ = run_plan("cpu", hold_at_cancel=False)
    held_s = holds_ms[0] / 1e3 if len(holds_ms) == 1 else 0.0
    verdict = judge.reaper_hold(held_s, run_plan.step_s)
    check("reaper", "held launch + cancel", "hold ms (CUDA events)", held_s * 1e3, verdict.ok,
          f"{verdict.note}; planned {judge.hold_seconds(run_plan.step_s) * 1e3:.0f} ms by the cycle calibration")
    for name, ok in checks.items():
        check("reaper", "held launch + cancel", name, ok, bool(ok))
    both = sorted(gpu_canceled) == sorted(cpu_canceled) == ["victim"]
    check("reaper", "cancel", "victim canceled on cuda and cpu", both, both)
    for rid, sampler, steps, g, seed, _, cancel in PLAN:
        if cancel is not None:
            continue
        if rid not in gpu or rid not in cpu:
            check("reaper", rid, "finished", False, False)
            continue
        err = rel_l2(gpu[rid], cpu[rid])
        check("reaper", f"{rid} ({sampler}, {steps} steps, g={g:g})", "rel L2 cuda vs cpu", err, err <= 1e-4)
    row("reaper", "cuda + cpu runs", "wall s", time.perf_counter() - t0)
