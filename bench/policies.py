"""Admission policies under mixed step counts: FIFO against SRPT (least remaining work
first, aged by the bypass bound), side by side on the same traces.

    python bench/policies.py [--requests 60] [--slots 8] [--repeats 2] [--threads 2] [--rate 40]
                             [--traces burst,saturated,below] [--srpt-aging X,...] [--quick]

The embedded `shapes` text model, `latent` outputs (the denoiser isolated), steps 4/20/50
in turn, samplers and guidance mixed, driven through the engine's own loop (`add_request`
at each request's arrival time, `step()`). Three traces: `burst` (every request arrives
at once: the queue is as long as it gets), `saturated` (Poisson arrivals at `--rate`,
default 40/s, several times the capacity: long requests hold slots when short ones
arrive) and `below` (Poisson arrivals at 0.6 × the capacity the burst measured).
Reported per policy: p50 time to usable output of the 4-step requests, p99 of the 50-step
requests, the mean over all, and goodput; and `idle`, a 4-step request alone on an idle
engine (median of 5), the reference of the target "4-step p50 under overload within 3× of
idle, long p99 within 1.5× FIFO's". `--srpt-aging 2,4,8,inf` runs SRPT once per aging
multiple (`srpt/aging=X`; inf: no bound on the work admitted past a waiting request)
instead of at the engine's default.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.core import CoreConfig, EngineCore
from engine.models.loading import load_model
from engine.models.shapes.draw import PROMPTS
from engine.protocol import GenerateParams
from trace_replay import replay
from workload_trace import MIXED_SAMPLERS as SAMPLERS  # the workload's sampler mix

POLICIES = {"fifo": dict(policy="fifo"), "srpt": dict(policy="srpt")}  # name → CoreConfig fields
TRACES = ("burst", "saturated", "below")


def policy_configs(names: list[str], srpt_aging: str | None) -> dict[str, dict]:
    """name → CoreConfig fields; with `srpt_aging` ("2,4,inf") srpt runs once per multiple."""
    configs = {}
    for name in names:
        if name == "srpt" and srpt_aging:
            for x in srpt_aging.split(","):
                configs[f"srpt/aging={x}"] = dict(POLICIES["srpt"], srpt_aging=float(x))
        else:
            configs[name] = POLICIES[name]
    return configs


def trace(n: int, rate: float | None, seed: int = 0) -> list[tuple[float, str, GenerateParams]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for k in range(n):
        steps = (4, 20, 50)[k % 3]
        out.append((t, f"r{k}", GenerateParams(prompt=PROMPTS[k % len(PROMPTS)], steps=steps,
                                                sampler=SAMPLERS[k % len(SAMPLERS)], guidance=(1.0, 3.0)[k % 2],
                                                seed=k, output="latent")))
        if rate is not None:
            t += rng.expovariate(rate)
    return out


def run(model, jobs, policy: dict, slots: int) -> dict:
    core = EngineCore(model, CoreConfig(slots=slots, **policy, max_queue=len(jobs) + 1,
                                        decode_buffers=2 * slots))
    steps_of = {rid: p.steps for _, rid, p in jobs}
    start = time.monotonic()
    ttuo = {rid: t for rid, (t, _) in replay(core, jobs).items()}
    wall = time.monotonic() - start
    by = {s: sorted(t for rid, t in ttuo.items() if steps_of[rid] == s) for s in (4, 20, 50)}

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return dict(short_p50=pct(by[4], 0.5), long_p99=pct(by[50], 0.99), mean=statistics.mean(ttuo.values()),
                goodput=len(ttuo) / wall)


def idle_short(model, slots: int, n: int = 5) -> float:
    """A 4-step request alone on an idle engine: its time to usable output."""
    out = []
    for k in range(n + 1):  # the first warms the schedule cache
        jobs = [(0.0, f"idle{k}", GenerateParams(prompt=PROMPTS[k % len(PROMPTS)], steps=4, sampler=SAMPLERS[k % 4],
                                                   guidance=3.0, seed=k, output="latent"))]
        out.append(run(model, jobs, POLICIES["fifo"], slots)["short_p50"])
    return statistics.median(out[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals/s of the saturated trace")
    parser.add_argument("--policies", default=",".join(POLICIES), help="of " + ", ".join(POLICIES))
    parser.add_argument("--traces", default=",".join(TRACES), help="of " + ", ".join(TRACES)
                        + " (below needs burst: its rate is 0.6 × the burst's goodput)")
    parser.add_argument("--srpt-aging", default=None, metavar="X,...",
                        help="run srpt once per aging multiple (inf: unbounded) instead of at the default")
    parser.add_argument("--quick", action="store_true", help="15 requests, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 15, 1
    torch.set_num_threads(args.threads)
    model = load_model("shapes")
    results = {}
    capacity = None
    policies = policy_configs(args.policies.split(","), args.srpt_aging)
    names = list(policies)
    traces = args.traces.split(",")
    if set(traces) - set(TRACES) or ("below" in traces and "burst" not in traces):
        parser.error(f"--traces: some of {', '.join(TRACES)}; below only with burst")
    idle = []
    for name in (t for t in TRACES if t in traces):
        for repeat in range(args.repeats):
            idle.append(idle_short(model, args.slots))
            for policy in names[repeat % 2:] + names[:repeat % 2]:  # alternate who runs first
                rate = {"burst": None, "saturated": args.rate}.get(name, 0.6 * capacity if capacity else None)
                r = run(model, trace(args.requests, rate, seed=repeat), policies[policy], args.slots)
                results.setdefault((name, policy), []).append(r)
        if name == "burst":
            capacity = statistics.median(r["goodput"] for r in results[("burst", names[0])])
    idle_s = statistics.median(idle)
    print(f"{args.requests} requests (steps 4/20/50), {args.slots} slots, {args.threads} torch threads, "
          f"{args.repeats} repeats (medians; seconds of time to usable output)")
    print(f"idle: a 4-step request alone {idle_s:.3f} s (median of {len(idle)} medians)")
    print(f"{'trace':<10} {'policy':<15} {'4-step p50':>11} {'/ idle':>7} {'50-step p99':>12} {'/ fifo':>7} "
          f"{'mean':>7} {'goodput img/s':>14}")
    medians = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in results.items()}
    for (name, policy), med in medians.items():
        fifo = medians.get((name, "fifo"), med)
        print(f"{name:<10} {policy:<15} {med['short_p50']:>11.3f} {med['short_p50'] / idle_s:>7.2f} "
              f"{med['long_p99']:>12.3f} {med['long_p99'] / fifo['long_p99']:>7.2f} {med['mean']:>7.3f} "
              f"{med['goodput']:>14.2f}")


if __name__ == "__main__":
    main()
