"""Mixed-workload benchmark: every system is the same engine process, driven by several
client processes; only the core (or its flags) differs.

    python bench/workload.py [--model shapes|tiny-sd|PATH] [--slots 16] [--duration S]
                             [--systems a,b,...] [--below 0.6] [--above 1.3] [--threads N]
                             [--cpus LIST] [--decode-workers N] [--quick] [--json OUT] [--plot OUT]

Systems (`--systems`; each one `python -m engine serve` with the same model, slots,
threads, CPU mask, decode stage and IO path):

  static+padded        the seed's fixed batch (`--admission static --layout padded`): a new
                       batch only when the last one has finished; every slot and both guidance
                       branches computed every step, finished and guidance-1 slots included;
  static+compact       a static batch without padding rows (`--admission static`): only the
                       rows of running requests, one row at guidance 1;
  continuous+compact   the engine's defaults: free slots refilled at every step boundary;
  diffusers-batched    `--core bench.baselines:make_pipeline_batch_core`: one diffusers pipeline
                       call per batch of queued requests with the same (steps, sampler, guidance,
                       size), run to completion (see bench/baselines.py);
  continuous+padded, continuous+bucketed   optional.

The workload (seeded): prompts "a {red|green|blue} {circle|square|triangle|cross}", three step
classes (`--steps`, default 5/20/50, shares 0.4/0.35/0.25), samplers euler, euler_ancestral,
ddim, dpmpp_2m and guidance 1 / 3 / 7.5 drawn uniformly, output PNG (decoded by the engine's
decode stage), a share of the longest requests canceled by their client at a random step,
spread over `--clients` client processes plus one slow reader.

Each system is measured three times, one system at a time (engines idle while waiting):
  probe   a burst of `--probe` requests at once (no cancels): completed/s is its capacity μ;
  below   Poisson arrivals at `--below` × the LOWEST capacity: every system is below its own;
  above   Poisson arrivals at `--above` × the HIGHEST capacity: every system is above its own.
The two offered rates are the same for every system, so each comparison is side by side.

Reported per run (the machine is shared, so each run also reports the CPU time its engine
process got, `cpu_s`, and images per engine CPU second, which other jobs' load moves less
than wall-clock rates): offered rate, load (offered / the system's μ), completed / canceled /
rejected / failed, goodput (usable images / time to the last result), service rate while
busy, time to usable output p50/p99 (all, and the shortest class with its queue delay), encode
time per request (`Timings.encode_s`, p50 ms), embedding-cache hit rate (core Stats
`embedding_cache_hits` / lookups, over the run), useful and padded evaluations (Stats deltas).
Then headline ratios (continuous+compact against each baseline, naming baseline and rate),
a RESULTS.md block, the JSON (`--json`; per run `arrival_rate`, `service_rate`, `backlog`,
as `python -m engine queue-instrument --from-run` reads them) and the plot (`--plot`).
`--quick` is the CI smoke (short steps and windows, about a minute and a half).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time
import traceback

from workload_common import (REPO, bench_model_folder, children_of, cmdline, cpu_seconds, engine_command,
                             engine_env, machine_line, parse_cpus, proc_status_kb, prompts_for, shm_leftovers)
from workload_report import headlines, print_table, results_block, summarize, write_plot
from workload_trace import ClientPool, StatsSampler, make_schedule, warm_up

SYSTEMS = {  # name → engine flags
    "static+padded": ["--admission", "static", "--layout", "padded"],
    "static+compact": ["--admission", "static", "--layout", "compact"],
    "continuous+padded": ["--admission", "continuous", "--layout", "padded"],
    "continuous+compact": ["--admission", "continuous", "--layout", "compact"],
    "continuous+bucketed": ["--admission", "continuous", "--layout", "bucketed"],
    "diffusers-batched": ["--core", "bench.baselines:make_pipeline_batch_core"],
}
DEFAULT_SYSTEMS = ("static+padded", "static+compact", "continuous+compact", "diffusers-batched")


class System:
    """One system's engine process: started once, used for its probe, below and above runs."""

    def __init__(self, name: str, args, folder: pathlib.Path, tmp: pathlib.Path):
        from frontend.launcher import EngineProcess

        self.name = name
        slug = name.replace("+", "-")
        self.address = f"ipc://{tmp}/{slug}.sock"
        engine_args = ["--model", str(folder), "--slots", str(args.slots), "--device", "cpu",
                       "--decode-workers", str(args.decode_workers), "--max-queue", str(args.max_queue),
                       "--log-level", "WARNING", *SYSTEMS[name]]
        self.command = engine_command(self.address, engine_args, args.cpus)
        print(f"[{name}] starting: python -m engine serve {' '.join(engine_args)}", flush=True)
        self.engine = EngineProcess(self.command, self.address, tmp / f"{slug}.log", env=engine_env(args.threads),
                                    cwd=REPO, new_session=True)
        self.client = None

    def connect(self):
        if self.client is None:
            self.client = self.engine.connect(300.0)
        return self.client

    def peak_mb(self) -> tuple[float, float]:
        hwm = proc_status_kb(self.engine.pid, "VmHWM") or 0
        workers = [proc_status_kb(k, "VmHWM") or 0 for k in children_of(self.engine.pid)
                   if b"resource_tracker" not in cmdline(k)]
        return hwm / 1024, sum(workers) / 1024

    def cpu_s(self) -> float:
        """CPU seconds the engine process and its children (decode workers) have used."""
        pid = self.engine.pid
        return cpu_seconds(pid) + sum(cpu_seconds(k) for k in children_of(pid))

    def stop(self) -> tuple[int, list[str]]:
        if self.client is not None:
            self.client.close()
            self.client = None
        pid = self.engine.pid
        code = self.engine.stop(30.0)
        return code, shm_leftovers(pid)


def wait_idle(client, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        s = client.stats()
        if not s.get("queue_depth") and not s.get("slots_busy") and not s.get("requests_in_flight"):
            return
        time.sleep(0.1)


def run_once(system: System, pool: ClientPool, schedule: list[dict], duration: float | None, args,
             tag: str) -> dict:
    """Replay one schedule against one system; summarize it."""
    client = system.connect()
    wait_idle(client)
    before = client.stats()
    t0 = time.monotonic() + 0.5  # every client connected and waiting by then
    deadline = t0 + (duration or 0.0) + args.drain_limit
    sampler = StatsSampler(client, t0)
    cpu0 = system.cpu_s()
    sampler.start()
    records, errors = pool.run(system.address, t0, schedule, deadline, tag)
    sampler.stopping.set()
    sampler.join(timeout=10)
    wait_idle(client, 10.0)
    cpu_s = system.cpu_s() - cpu0
    after = client.stats()
    r = summarize(records, sampler.samples, before, after, schedule, duration, args.step_classes, cpu_s)
    r["errors"] = errors
    r["records"] = records
    return r


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shapes", help="shapes (default, the embedded text model), tiny-sd, "
                    "or a StableDiffusionPipeline folder")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS))
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--steps", default=None, help="the three step classes (default 5,20,50; quick 2,4,8)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run (default 30, quick 2.5)")
    ap.add_argument("--probe", type=int, default=None, help="requests in the capacity burst (default 64, quick 6)")
    ap.add_argument("--below", type=float, default=0.6, help="below-capacity rate / the lowest capacity")
    ap.add_argument("--above", type=float, default=1.3, help="above-capacity rate / the highest capacity")
    ap.add_argument("--clients", type=int, default=None, help="client processes besides the slow one (3; quick 2)")
    ap.add_argument("--slow-read", type=float, default=None, help="the slow client's delay per result, s "
                    "(default 0.5, quick 0.2)")
    ap.add_argument("--cancel-share", type=float, default=0.3, help="share of the longest requests canceled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of every engine process (default: CPUs − 1, at least 1)")
    ap.add_argument("--cpus", default=None, help="pin every engine process (and its decode workers) to these "
                    "CPUs, e.g. 1 or 0-1 (default: not pinned)")
    ap.add_argument("--decode-workers", type=int, default=None,
                    help="decode workers of every engine (default: engine.decode.factory's default for the CPU)")
    ap.add_argument("--drain-limit", type=float, default=None, help="seconds allowed after arrivals end")
    ap.add_argument("--quick", action="store_true", help="CI smoke: short steps and windows")
    ap.add_argument("--json", type=pathlib.Path, default=REPO / "bench" / "results" / "workload.json")
    ap.add_argument("--plot", type=pathlib.Path, default=REPO / "bench" / "results" / "workload.png")
    return ap


def main(argv=None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        print(f"error: unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    from engine.decode.factory import default_decode_workers

    args.step_classes = tuple(int(s) for s in (args.steps or ("2,4,8" if args.quick else "5,20,50")).split(","))
    args.duration = args.duration or (2.5 if args.quick else 30.0)
    args.probe = args.probe or (6 if args.quick else 64)
    args.clients = args.clients or (2 if args.quick else 3)
    args.slow_read = args.slow_read if args.slow_read is not None else (0.2 if args.quick else 0.5)
    args.drain_limit = args.drain_limit or (60.0 if args.quick else 240.0)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    args.cpus = parse_cpus(args.cpus)
    if args.decode_workers is None:
        args.decode_workers = default_decode_workers("cpu", len(args.cpus) if args.cpus else None)

    from engine.serve import transport

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # unwind through `finally`: reap the engines
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="wl-", dir=transport.runtime_dir()))
    systems, pool, keep = [], None, False
    try:
        folder, label = bench_model_folder(args.model, tmp)
        prompts = prompts_for(folder)
        total_clients = args.clients + 1
        args.max_queue = 4096
        systems = [System(name, args, folder, tmp) for name in names]  # start-ups overlap
        pool = ClientPool(total_clients, args.slow_read)
        for system in systems:
            began = time.monotonic()
            warm_up(system.connect(), prompts[0], args.step_classes)
            print(f"[{system.name}] ready and warm in {time.monotonic() - began:.1f} s", flush=True)

        runs, capacities, failed = {}, {}, []
        burst = make_schedule(args.seed + 1, None, 0.0, total_clients, prompts, args.step_classes, 0.0,
                              count=args.probe)
        for system in systems:
            try:
                r = run_once(system, pool, burst, None, args, "p")
            except Exception:
                failed.append(system.name)
                print(f"[{system.name}] probe FAILED:\n{traceback.format_exc()}\n{system.engine.log()}",
                      file=sys.stderr)
                continue
            capacities[system.name] = r["completed"] / r["wall_s"] if r["wall_s"] else 0.0
            print(f"[{system.name}] capacity probe: {r['completed']} of {len(burst)} in {r['wall_s']:.1f} s "
                  f"= {capacities[system.name]:.2f}/s", flush=True)
        if not capacities or not all(capacities.values()):
            print(f"error: a capacity probe completed nothing: {capacities}", file=sys.stderr)
            keep = True
            return 1
        rates = {"below": args.below * min(capacities.values()), "above": args.above * max(capacities.values())}
        for run, rate in rates.items():
            schedule = make_schedule(args.seed, rate, args.duration, total_clients, prompts, args.step_classes,
                                     args.cancel_share)
            print(f"{run} capacity: {len(schedule)} requests over {args.duration:g} s at {rate:.2f}/s", flush=True)
            for system in systems:
                if system.name in failed:
                    continue
                try:
                    r = run_once(system, pool, schedule, args.duration, args, run[0])
                except Exception:
                    failed.append(system.name)
                    print(f"[{system.name}] {run} FAILED:\n{traceback.format_exc()}\n{system.engine.log()}",
                          file=sys.stderr)
                    continue
                r["offered"] = rate
                r["capacity"] = capacities[system.name]
                r["load"] = rate / capacities[system.name] if capacities[system.name] else None
                runs[system.name, run] = r
                print(f"[{system.name}] {run}: {r['completed']} completed, goodput {r['goodput']:.2f}/s, "
                      f"p50 TTUO {r['ttuo_p50'] or 0:.2f} s", flush=True)
        pool.close()
        pool = None
        ends = {}
        for system in systems:
            peak, workers = system.peak_mb()
            code, leftovers = system.stop()
            ends[system.name] = dict(exit_code=code, shm_leftovers=leftovers, peak_rss_mb=round(peak, 1),
                                     decode_workers_mb=round(workers, 1))
        meta = dict(model=label, model_path=str(folder), slots=args.slots, threads=args.threads,
                    cpus=",".join(map(str, args.cpus)) if args.cpus else "", decode_workers=args.decode_workers,
                    duration=args.duration, probe=args.probe, below=args.below, above=args.above, rates=rates,
                    step_classes=list(args.step_classes), clients=args.clients, quick=args.quick,
                    machine=machine_line(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    command="python bench/workload.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    wall_s=time.monotonic() - started)
        print()
        print_table(runs)
        print()
        for line in headlines(runs, capacities):
            print(line)
        print("\nengine processes:", ", ".join(
            f"{k}: exit {v['exit_code']}, peak {v['peak_rss_mb']:.0f} MB"
            + (f", shm left {v['shm_leftovers']}" if v["shm_leftovers"] else "") for k, v in ends.items()))
        print("\n---- RESULTS.md block ----")
        print(results_block(runs, capacities, meta))
        configs = {f"{system}@{run}": {k: v for k, v in r.items() if k != "records"} | ends.get(system, {})
                   for (system, run), r in runs.items()}
        report = dict(meta=meta, capacities=capacities, configs=configs,
                      records={f"{s}@{r}": v["records"] for (s, r), v in runs.items()})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=float))
        print(f"\nwrote {args.json}")
        if args.plot:
            write_plot(args.plot, runs, meta)
            print(f"wrote {args.plot}")
        bad = failed + [f"{s}@{r}" for (s, r), v in runs.items() if v["errors"] or v["failed"]]
        bad += [k for k, v in ends.items() if v["exit_code"] != 0 or v["shm_leftovers"]]
        if bad:
            keep = True
            print(f"errors in: {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    except BaseException:
        keep = True
        raise
    finally:
        if pool is not None:
            pool.close()
        for system in systems:
            if system.engine.popen.poll() is None:
                system.stop()
        if keep:
            print(f"engine logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
