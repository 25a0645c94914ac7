"""Admission policies under mixed step counts: FIFO against SRPT (least remaining work
first, aged by the bypass bound), side by side on the same traces.

    python bench/policies.py [--requests 60] [--slots 8] [--repeats 2] [--threads 2] [--quick]

The embedded `shapes` text model, `latent` outputs (the denoiser isolated), steps 4/20/50
in turn, samplers and guidance mixed, driven through the engine's own loop (`add_request`
at each request's arrival time, `step()`). Two traces: `overload` (every request arrives
at once: the queue is as long as it gets) and `below` (Poisson arrivals at 0.6 × the
capacity the overload run measured). Reported per policy: p50 time to usable output of
the 4-step requests, p99 of the 50-step requests, the mean over all, and goodput.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.core import CoreConfig, DenoiseFinished, EngineCore
from engine.models.loading import load_model
from engine.models.shapes.draw import PROMPTS
from engine.protocol import GenerateParams

SAMPLERS = ("euler", "euler_ancestral", "ddim", "dpmpp_2m")


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


def run(model, jobs, policy: str, slots: int) -> dict:
    core = EngineCore(model, CoreConfig(slots=slots, policy=policy, max_queue=len(jobs) + 1,
                                        decode_buffers=2 * slots))
    steps_of = {rid: p.steps for _, rid, p in jobs}
    arrival_of = {rid: arrival for arrival, rid, _ in jobs}
    pending = list(jobs)
    ttuo = {}
    start = time.monotonic()
    while pending or core.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            arrival, rid, params = pending.pop(0)
            core.add_request(rid, params, arrival_time=start + arrival)
        if not core.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, pending[0][0] - now)))
            continue
        for out in core.step():  # `finished_at` is on the core's clock, time.monotonic
            if isinstance(out, DenoiseFinished):
                ttuo[out.request_id] = out.finished_at - (start + arrival_of[out.request_id])
                core.decode_done(out.request_id)
    wall = time.monotonic() - start
    by = {s: sorted(t for rid, t in ttuo.items() if steps_of[rid] == s) for s in (4, 20, 50)}

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    return dict(short_p50=pct(by[4], 0.5), long_p99=pct(by[50], 0.99), mean=statistics.mean(ttuo.values()),
                goodput=len(ttuo) / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="15 requests, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 15, 1
    torch.set_num_threads(args.threads)
    model = load_model("shapes")
    results = {}
    capacity = None
    for name in ("overload", "below"):
        for repeat in range(args.repeats):
            for policy in ("fifo", "srpt"):
                rate = None if name == "overload" else 0.6 * capacity
                r = run(model, trace(args.requests, rate, seed=repeat), policy, args.slots)
                results.setdefault((name, policy), []).append(r)
        if name == "overload":
            capacity = statistics.median(r["goodput"] for r in results[("overload", "fifo")])
    print(f"{args.requests} requests (steps 4/20/50), {args.slots} slots, {args.threads} torch threads, "
          f"{args.repeats} repeats (medians; seconds of time to usable output)")
    print(f"{'trace':<9} {'policy':<6} {'4-step p50':>11} {'50-step p99':>12} {'mean':>7} {'goodput img/s':>14}")
    for (name, policy), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name:<9} {policy:<6} {med['short_p50']:>11.3f} {med['long_p99']:>12.3f} {med['mean']:>7.3f} "
              f"{med['goodput']:>14.2f}")


if __name__ == "__main__":
    main()
