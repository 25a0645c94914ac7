"""One fixed mixed arrival schedule through EngineCore, in-process, per layout × admission.

    python bench/bench_core_schedule.py [--slots 8] [--model tiny|shapes|PATH] [--requests 24]
                                        [--every 2] [--threads 1]

The schedule (deterministic, the same for every configuration): `--requests` requests,
one arriving before every `--every`-th step() call, cycling through step counts
(20, 5, 50, 2, 10, 30, 1, 15), samplers (euler, euler_ancestral, ddim, dpmpp_2m),
guidance (3, 1, 7.5: one row per step at guidance 1, two otherwise), conditions and
seeds; output="latent", so no VAE is needed. Each finished request is acknowledged with
decode_done at once (no decode stage: this measures the denoising core alone).

For each layout (compact, padded, bucketed) × admission (continuous, static) it prints:
  batches      step() calls that ran a denoiser batch
  useful       useful denoiser rows (evaluations) over all requests
  padded       rows computed that served no one
  useful%      useful / (useful + padded)
  wall_s       wall time of the whole schedule
  ttf_ms       mean time to finish per request: arrival → DenoiseFinished
  ttf_batches  the same in batches (arrival step() call → finishing call), machine-independent
The evaluation counts are deterministic; the times depend on the machine.

`--model tiny` (default) is the random-weight test UNet of tests/reference.py; `shapes`
(or a diffusers folder) loads that model's UNet, once its trained weights exist.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parent.parent

import torch  # noqa: E402

from engine.core import ADMISSIONS, LAYOUTS, CoreConfig, DenoiseFinished, EngineCore, RequestCanceled  # noqa: E402
from engine.protocol import GenerateParams  # noqa: E402

STEPS = (20, 5, 50, 2, 10, 30, 1, 15)
MIXED_SAMPLERS = ("euler", "euler_ancestral", "ddim", "dpmpp_2m")
GUIDANCE = (3.0, 1.0, 7.5)


def load(name: str):
    if name == "tiny":
        from engine.testing.reference import tiny_model
        return tiny_model("epsilon")
    from engine.models.loading import load_model
    return load_model(name, device="cpu", load_vae=False)


def schedule(model, requests: int, every: int, steps=STEPS) -> dict[int, list[tuple[str, GenerateParams]]]:
    conditions = model.conditions[:-1] or model.conditions
    arrivals: dict[int, list] = {}
    for i in range(requests):
        p = GenerateParams(prompt=conditions[i % len(conditions)], steps=steps[i % len(steps)],
                           sampler=MIXED_SAMPLERS[i % len(MIXED_SAMPLERS)], guidance=GUIDANCE[i % len(GUIDANCE)],
                           seed=i, output="latent")
        arrivals.setdefault(i * every, []).append((f"r{i:02d}", p))
    return arrivals


def useful_rows(arrivals) -> int:
    return sum((1 if p.guidance == 1.0 else 2) * p.steps for v in arrivals.values() for _, p in v)


def run(model, arrivals, slots: int, layout: str, admission: str) -> dict:
    n = sum(len(v) for v in arrivals.values())
    core = EngineCore(model, CoreConfig(slots=slots, layout=layout, admission=admission, max_queue=n,
                                        decode_buffers=max(slots, 1)))
    arrived_at: dict[str, tuple[float, int]] = {}
    finished: dict[str, tuple[float, int]] = {}
    calls, last = 0, max(arrivals)
    start = time.perf_counter()
    while calls <= last or core.has_unfinished_requests():
        for rid, p in arrivals.get(calls, ()):
            core.add_request(rid, p)
            arrived_at[rid] = (core.clock(), calls)
        for out in core.step():
            if isinstance(out, DenoiseFinished):
                finished[out.request_id] = (out.finished_at, calls)
                core.decode_done(out.request_id)
            elif isinstance(out, RequestCanceled):
                raise RuntimeError(f"{out.request_id} canceled")
        calls += 1
    wall = time.perf_counter() - start
    assert len(finished) == n, "not every request finished"
    s = core.stats()
    return dict(
        layout=layout, admission=admission, batches=s["batches"], useful=s["useful_evals"],
        padded=s["padded_evals"], ratio=s["useful_ratio"], wall_s=wall,
        ttf_ms=1e3 * statistics.fmean(finished[r][0] - arrived_at[r][0] for r in finished),
        ttf_batches=statistics.fmean(finished[r][1] - arrived_at[r][1] + 1 for r in finished),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--model", default="tiny", help="tiny (default), shapes, or a diffusers model folder")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--every", type=int, default=2, help="step() calls between arrivals")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--admissions", default=",".join(ADMISSIONS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "__array__ implementation doesn't accept a copy keyword", DeprecationWarning)

    model = load(args.model)
    arrivals = schedule(model, args.requests, args.every)
    rows_per_step = useful_rows(arrivals)
    print(f"model={args.model} slots={args.slots} requests={args.requests} every={args.every} "
          f"threads={torch.get_num_threads()} torch={torch.__version__} (useful rows in the schedule: "
          f"{rows_per_step})")
    run(model, {0: arrivals[0]}, args.slots, "compact", "continuous")  # warm-up

    header = f"{'layout':9s} {'admission':10s} {'batches':>7s} {'useful':>7s} {'padded':>7s} {'useful%':>7s} " \
             f"{'wall_s':>7s} {'ttf_ms':>8s} {'ttf_batches':>11s}"
    print(header)
    print("-" * len(header))
    for layout in args.layouts.split(","):
        for admission in args.admissions.split(","):
            r = run(model, arrivals, args.slots, layout, admission)
            print(f"{r['layout']:9s} {r['admission']:10s} {r['batches']:7d} {r['useful']:7d} {r['padded']:7d} "
                  f"{100 * r['ratio']:6.1f}% {r['wall_s']:7.2f} {r['ttf_ms']:8.1f} {r['ttf_batches']:11.1f}",
                  flush=True)
    return 0


def test_schedule_smoke():
    """Under pytest (pytest.ini collects bench_*.py): a short schedule through every
    layout × admission on the tiny model; the counts agree with each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        warnings.filterwarnings("ignore", "__array__ implementation doesn't accept", DeprecationWarning)
        model = load("tiny")
        arrivals = schedule(model, requests=6, every=1, steps=(3, 1, 5, 2))
        slots = 2
        results = {(r["layout"], r["admission"]): r
                   for r in (run(model, arrivals, slots, layout, admission)
                             for layout in LAYOUTS for admission in ADMISSIONS)}
    finally:
        torch.set_num_threads(threads)
    for (layout, admission), r in results.items():
        assert r["useful"] == useful_rows(arrivals)
        assert r["batches"] == results[("compact", admission)]["batches"]  # the layout changes rows, not steps
        if layout == "compact":
            assert r["padded"] == 0 and r["ratio"] == 1.0
        elif layout == "padded":
            assert r["useful"] + r["padded"] == r["batches"] * 2 * slots
        else:
            assert 0 <= r["padded"] <= results[("padded", admission)]["padded"]
        assert r["ttf_ms"] > 0 and r["ttf_batches"] >= 1


if __name__ == "__main__":
    sys.exit(main())
