"""Step caches on the served engine, with what users get by default: PNG outputs, progress
after every step, a Poisson trace with cancels, one engine process and its decode worker.

    python bench/step_cache_served.py [--model shapes-dit] [--cache mag:0.06] [--requests 48]
                                      [--rate 4] [--cancel-share 0.1] [--repeats 2] [--size 32] [--quick]

One `python -m engine serve` on loopback (an ipc socket, CPU), one `AsyncClient`. The same
trace — prompts, seeds, 20 or 30 steps, arrivals, and which requests are canceled when —
is sent once with every request's `cache=StepCache("off")` and once with the `--cache`
setting, alternating which goes first over `--repeats`, so both see the same machine.
Reported per run: completed and canceled requests, goodput (completed images per second,
from the first arrival to the last answer), p50 and p90 time to usable output (send →
PNG in hand), steps skipped per completed request, the evaluations canceled requests
had cost (wasted work), and the share of PNGs the shapes classifier reads as their prompt.
The `--rate` default is about twice the uncached engine's saturated capacity on a 2-core
CPU (bench/RESULTS.md: about 2 requests/s), so the uncached run queues and goodput
measures the engine, not the arrivals.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from engine.models.shapes.classify import classify  # noqa: E402
from engine.models.shapes.draw import PROMPTS  # noqa: E402
from engine.protocol import Completed, GenerateParams, StepCache, parse_step_cache  # noqa: E402
from frontend.async_client import AsyncClient  # noqa: E402
from frontend.launcher import EngineProcess, serve_command, stop_process  # noqa: E402


def trace(count: int, rate: float, cancel_share: float, steps: int, size: int, seed: int = 0) -> list[tuple]:
    """(arrival s, params without a cache, cancel after s or None), by arrival."""
    rng = random.Random(seed)
    now, work = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        params = GenerateParams(prompt=rng.choice(PROMPTS), steps=rng.choice((steps, steps * 3 // 2)),
                                seed=rng.randrange(1 << 30), height=size, width=size)
        work.append((now, params, rng.uniform(0.2, 3.0) if rng.random() < cancel_share else None))
    return work


async def one(client: AsyncClient, params: GenerateParams, cancel_after: float | None, start: float) -> dict:
    sent = time.monotonic()
    steps_seen = []
    task = asyncio.ensure_future(client.generate(params, on_progress=steps_seen.append))
    if cancel_after is not None:
        done, _ = await asyncio.wait({task}, timeout=cancel_after)
        if not done:
            task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        return {"outcome": "canceled", "answered": time.monotonic() - start}
    answered = time.monotonic()
    record = {"outcome": type(result).__name__.lower(), "answered": answered - start, "latency": answered - sent,
              "progress": len(steps_seen)}
    if isinstance(result, Completed):
        record["cached_steps"] = result.timings.cached_steps
        record["image"] = np.asarray(Image.open(io.BytesIO(result.output)).convert("RGB"))
        record["prompt"] = params.prompt.removeprefix("a ")
    return record


async def run_trace(address: str, work: list[tuple], cache: StepCache) -> tuple[list[dict], float, int]:
    """(each request's record, the run's wall seconds, the evaluations canceled requests cost)"""
    async with AsyncClient(address, name="step-cache-bench") as client:
        wasted_before = (await client.stats())["canceled_evals"]
        start = time.monotonic()
        tasks = []
        for arrival, params, cancel_after in work:
            await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
            cached = GenerateParams(**{f: getattr(params, f) for f in params.__struct_fields__ if f != "cache"},
                                    cache=cache)
            tasks.append(asyncio.ensure_future(one(client, cached, cancel_after, start)))
        records = await asyncio.gather(*tasks)
        wall = max(r["answered"] for r in records) - work[0][0]
        await asyncio.sleep(0.5)  # the last cancel's drain reaches the stats
        return records, wall, (await client.stats())["canceled_evals"] - wasted_before


def summarize(name: str, records: list[dict], wall: float, wasted: int) -> dict:
    done = [r for r in records if r["outcome"] == "completed"]
    latencies = sorted(r["latency"] for r in done)
    accuracy = float(np.mean([c == r["prompt"] for c, r in zip(classify(np.stack([r["image"] for r in done])), done)]))
    return {"name": name, "completed": len(done), "canceled": sum(r["outcome"] == "canceled" for r in records),
            "other": sum(r["outcome"] not in ("completed", "canceled") for r in records),
            "goodput": len(done) / wall, "p50": statistics.median(latencies),
            "p90": latencies[int(0.9 * (len(latencies) - 1))],
            "skipped": statistics.mean(r.get("cached_steps", 0.0) for r in done),
            "wasted": wasted,
            "progress_ok": all(r["progress"] >= 1 for r in done), "accuracy": accuracy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shapes-dit")
    ap.add_argument("--cache", default="mag:0.06", help="the cached runs' setting, as `serve --cache` takes it")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    ap.add_argument("--cancel-share", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--size", type=int, default=32, help="image side in pixels (shapes-dit draws 32×32)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="8 requests, one repeat (the smoke test)")
    args = ap.parse_args(argv)
    count, repeats = (8, 1) if args.quick else (args.requests, args.repeats)
    work = trace(count, args.rate, args.cancel_share, args.steps, args.size)
    configs = {"off": StepCache("off"), args.cache: parse_step_cache(args.cache)}
    directory = pathlib.Path(tempfile.mkdtemp(prefix="diffslot-cache-bench-"))
    address = f"ipc://{directory / 'engine.sock'}"
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    engine = EngineProcess(serve_command(address, "--model", args.model, "--slots", str(args.slots), "--device", "cpu"),
                           address, directory / "engine.log", env=env, cwd=REPO)
    rows = []
    try:
        engine.wait_ready(180)
        for repeat in range(repeats):
            order = list(configs.items()) if repeat % 2 == 0 else list(configs.items())[::-1]
            for name, cache in order:
                records, wall, wasted = asyncio.run(run_trace(address, work, cache))
                rows.append((repeat, summarize(name, records, wall, wasted)))
                print(f"  repeat {repeat} {name}: {wall:.1f} s", flush=True)
    finally:
        stop_process(engine.popen)
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\nmodel {args.model}, {count} requests at {args.rate:g}/s ({args.steps} and {args.steps * 3 // 2} steps), "
          f"{args.cancel_share:.0%} canceled, PNG outputs, progress on, {args.slots} slots")
    print("| repeat | cache | completed | canceled | goodput img/s | p50 s | p90 s | steps skipped/req | "
          "wasted evals | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for repeat, r in rows:
        print(f"| {repeat} | {r['name']} | {r['completed']} | {r['canceled']} | {r['goodput']:.2f} | {r['p50']:.2f} | "
              f"{r['p90']:.2f} | {r['skipped']:.1f} | {r['wasted']} | {r['accuracy']:.3f} |")
    by_name: dict[str, list[float]] = {}
    for _, r in rows:
        by_name.setdefault(r["name"], []).append(r["goodput"])
    ratios = [c / o for c, o in zip(by_name[args.cache], by_name["off"])]
    print(f"goodput {args.cache} / off per repeat: {', '.join(f'{x:.2f}' for x in ratios)}")
    broken = [r["name"] for _, r in rows if r["other"] or not r["progress_ok"]]
    if broken:
        print(f"runs with failed requests or no progress: {broken}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
