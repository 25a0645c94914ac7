"""Interactive requests over a saturating backlog of batch requests: priorities with and
without step-level preemption, against today's single-class SRPT, side by side.

    python bench/priorities.py [--slots 8] [--backlog 16] [--interactive 12] [--rate 3]
                               [--repeats 2] [--threads 2] [--quick]

The embedded `shapes` model, `latent` outputs (the denoiser isolated), driven through the
engine's own loop (`add_request` at each request's arrival, `step()`). The backlog:
`--backlog` 50-step batch requests (priority −10) at t = 0, enough to fill every slot
for several waves; over it, `--interactive` requests of 4, 8 or 20 steps (priority 10)
arrive as a Poisson stream at `--rate`/s. Systems:

- `preempt`: priorities, and a higher priority parks running batch requests (the default);
- `priority`: priorities, no preemption (`--no-preemption`);
- `srpt`: every request at priority 0, the single-class SRPT with aging of before.

Reported: the interactive requests' time to usable output over the same request's on an
idle engine (p50 and p99 of that ratio; idle measured per step count, median of 3),
the batch goodput (batch images per second until the last one finished) over the
backlog alone, preemptions and the bytes parked. Targets: interactive p50 ≤ 1.5× idle,
p99 ≤ 3× idle, batch goodput ≥ 0.9 × the backlog alone.
"""
from __future__ import annotations

import argparse
import random
import statistics

import torch

from engine.core import CoreConfig, EngineCore
from engine.models.loading import load_model
from engine.models.shapes.draw import PROMPTS
from engine.protocol import PRIORITY_CLASSES, GenerateParams
from trace_replay import replay
from workload_trace import MIXED_SAMPLERS as SAMPLERS  # the workload's sampler mix

SYSTEMS = {"preempt": dict(preemption=True), "priority": dict(preemption=False), "srpt": dict(preemption=False)}
INTERACTIVE_STEPS = (4, 8, 20)
BATCH_STEPS = 50


def jobs(backlog: int, interactive: int, rate: float, seed: int, classes: bool) -> list:
    """(arrival s, id, params) sorted by arrival; `classes` False: everyone at priority 0."""
    rng = random.Random(seed)
    batch_priority = PRIORITY_CLASSES["batch"] if classes else 0
    interactive_priority = PRIORITY_CLASSES["interactive"] if classes else 0
    out = [(0.0, f"b{k}", GenerateParams(prompt=PROMPTS[k % len(PROMPTS)], steps=BATCH_STEPS,
                                         sampler=SAMPLERS[k % len(SAMPLERS)], guidance=3.0, seed=k,
                                         output="latent", priority=batch_priority)) for k in range(backlog)]
    t = 0.2  # the backlog has filled the slots
    for k in range(interactive):
        out.append((t, f"i{k}", GenerateParams(prompt=PROMPTS[(k + 5) % len(PROMPTS)],
                                               steps=INTERACTIVE_STEPS[k % len(INTERACTIVE_STEPS)],
                                               sampler=SAMPLERS[k % len(SAMPLERS)], guidance=3.0, seed=1000 + k,
                                               output="latent", priority=interactive_priority)))
        t += rng.expovariate(rate)
    return sorted(out, key=lambda job: job[0])


def run(model, work: list, config: dict, slots: int) -> dict:
    core = EngineCore(model, CoreConfig(slots=slots, max_queue=len(work) + 1, decode_buffers=2 * slots, **config))
    arrival_of = {rid: arrival for arrival, rid, _ in work}
    ttuo = {rid: t for rid, (t, _) in replay(core, work).items()}
    batch_done = max((arrival_of[rid] + t for rid, t in ttuo.items() if rid.startswith("b")), default=float("nan"))
    stats = core.stats()
    return dict(ttuo=ttuo, batch_goodput=sum(rid.startswith("b") for rid in ttuo) / batch_done,
                preemptions=stats["preemptions"], parked_bytes=stats["parked_bytes_total"], park_s=stats["park_s"])


def idle_times(model, slots: int, repeats: int = 3) -> dict[int, float]:
    """Each interactive step count alone on an idle engine: its time to usable output."""
    idle = {}
    for steps in INTERACTIVE_STEPS:
        times = []
        for k in range(repeats + 1):  # the first warms the schedule cache
            work = [(0.0, "idle", GenerateParams(prompt=PROMPTS[k % len(PROMPTS)], steps=steps, guidance=3.0,
                                                 sampler=SAMPLERS[k % len(SAMPLERS)], seed=k, output="latent"))]
            times.append(run(model, work, {}, slots)["ttuo"]["idle"])
        idle[steps] = statistics.median(times[1:])
    return idle


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--backlog", type=int, default=16, help="50-step batch requests at t = 0")
    parser.add_argument("--interactive", type=int, default=12)
    parser.add_argument("--rate", type=float, default=3.0, help="interactive arrivals/s")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="of " + ", ".join(SYSTEMS))
    parser.add_argument("--quick", action="store_true", help="4 slots, a backlog of 6, 4 interactive, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.slots, args.backlog, args.interactive, args.repeats = 4, 6, 4, 1
    torch.set_num_threads(args.threads)
    model = load_model("shapes")
    systems = args.systems.split(",")
    if set(systems) - set(SYSTEMS):
        parser.error(f"--systems: some of {', '.join(SYSTEMS)}")
    idle = idle_times(model, args.slots)
    alone, results = [], {name: [] for name in systems}
    steps_of = {}
    for repeat in range(args.repeats):
        backlog_only = jobs(args.backlog, 0, args.rate, repeat, classes=True)
        alone.append(run(model, backlog_only, {}, args.slots)["batch_goodput"])
        for name in systems[repeat % len(systems):] + systems[:repeat % len(systems)]:  # alternate the order
            work = jobs(args.backlog, args.interactive, args.rate, repeat, classes=name != "srpt")
            steps_of.update({rid: p.steps for _, rid, p in work})
            results[name].append(run(model, work, SYSTEMS[name], args.slots))
    batch_alone = statistics.median(alone)
    print(f"{args.backlog} × {BATCH_STEPS}-step batch requests at t=0, {args.interactive} interactive "
          f"({'/'.join(map(str, INTERACTIVE_STEPS))} steps) at {args.rate}/s, {args.slots} slots, "
          f"{args.threads} torch threads, {args.repeats} repeat(s); `shapes`, latent outputs")
    print("idle: " + ", ".join(f"{s} steps {t:.3f} s" for s, t in idle.items())
          + f"; the backlog alone {batch_alone:.2f} img/s")
    print(f"{'system':<9} {'interactive p50/idle':>21} {'p99/idle':>9} {'batch goodput/alone':>20} "
          f"{'preemptions':>12} {'KB parked':>10} {'park s':>7}")
    for name in systems:
        ratios = [t / idle[steps_of[rid]] for r in results[name] for rid, t in r["ttuo"].items()
                  if rid.startswith("i")]
        goodput = statistics.median(r["batch_goodput"] for r in results[name]) / batch_alone
        p50, p99 = pct(ratios, 0.5), pct(ratios, 0.99)
        preempt = statistics.median(r["preemptions"] for r in results[name])
        moved = statistics.median(r["parked_bytes"] for r in results[name]) / 1e3
        park_s = statistics.median(r["park_s"] for r in results[name])
        print(f"{name:<9} {p50:>21.2f} {p99:>9.2f} {goodput:>20.2f} {preempt:>12.0f} {moved:>10.1f} {park_s:>7.3f}")
    print("targets: interactive p50 ≤ 1.5× idle, p99 ≤ 3× idle; batch goodput ≥ 0.9 × alone")


if __name__ == "__main__":
    main()
