"""Mixed-workload benchmark: every system is the same engine process, driven by several
client processes; only the core (or its flags), or the output kind its requests ask for, differs.

    python bench/workload.py [--model shapes|tiny-sd|PATH] [--slots 16] [--duration S]
                             [--systems a,b,...] [--below 0.6] [--above 1.3] [--idle 5] [--threads N]
                             [--cpus LIST] [--decode-workers N] [--quick] [--json OUT] [--plot OUT]

Systems (`--systems`; each one `python -m engine serve` with the same model, slots,
threads, CPU mask, decode stage and IO path):

  static+padded        the seed's fixed batch (`--admission static --layout padded`): a new
                       batch only when the last one has finished; every slot and both guidance
                       branches computed every step, finished and guidance-1 slots included;
  static+compact       a static batch without padding rows (`--admission static`): only the
                       rows of running requests, one row at guidance 1;
  continuous+compact   free slots refilled at every step boundary, in arrival order
                       (`--policy fifo`);
  continuous+srpt      the engine's defaults: the same with `--policy srpt`, least remaining work
                       admitted first, aged so that none starves;
  continuous+worker    the defaults with the decode stage in one worker process over the
                       shared arena (`--decode-workers 1`);
  continuous+inline    the defaults with the decode on the busy loop's thread between steps
                       (`--decode-workers 0`); the engine's default picks one of the two by
                       the cores its torch threads leave (engine.decode.factory);
  diffusers-batched    `--core bench.baselines:make_pipeline_batch_core`: one diffusers pipeline
                       call per batch of queued requests with the same (steps, sampler, guidance,
                       size), run to completion (see bench/baselines.py);
  NAME@latent          system NAME's engine flags, every request of its traces asking for
                       output="latent" instead of "png" (no VAE decode, no PNG encode), e.g.
                       continuous+compact@latent, continuous+srpt@latent;
  continuous+padded, continuous+bucketed   optional.
Systems that name no `--policy` run the engine's default admission order (srpt): for the
static batch it is the stronger baseline (short requests batched together wait for no long one).
Default: static+padded, static+compact, continuous+compact, continuous+srpt, continuous+worker,
continuous+inline, diffusers-batched, continuous+compact@latent, continuous+srpt@latent;
`--quick` drops static+padded, continuous+worker and continuous+inline.

The workload (seeded): prompts "a {red|green|blue} {circle|square|triangle|cross}", three step
classes (`--steps`, default 5/20/50, shares 0.4/0.35/0.25), samplers euler, euler_ancestral,
ddim, dpmpp_2m and guidance 1 / 3 / 7.5 drawn uniformly, output PNG (decoded by the engine's
decode stage) or latent (`@latent`), a share of the longest requests canceled by their client
at a random step, spread over `--clients` client processes plus one slow reader. A result is
usable when it is a Completed whose output is a PNG of the model's native size (signature and
IHDR), or a float32 latent of the model's latent shape (from its configs), finite, not constant.

Each system is measured four times, one system at a time (engines idle while waiting):
  idle    `--idle` single shortest-class requests (samplers and guidance of the mix in turn),
          each sent when the last one's result is in: the median time to usable output is
          the system's idle short latency;
  probe   a burst of `--probe` requests at once (no cancels): completed/s is its capacity μ;
  below   Poisson arrivals at `--below` × the LOWEST capacity: every system is below its own;
  above   Poisson arrivals at `--above` × the HIGHEST capacity: every system is above its own.
The two offered rates are the same for every system, so each comparison is side by side.

Reported per run (the machine is shared, so each run also reports the CPU time its engine
process got, `cpu_s`, and images per engine CPU second, which other jobs' load moves less
than wall-clock rates): offered rate, load (offered / the system's μ), completed / canceled /
rejected / failed, goodput (usable outputs / time to the last result), service rate while
busy, time to usable output (TTUO, the engine's `Timings.total_s`) p50/p99/mean of all, p50
of the shortest class with its queue delay, p99 of the longest class, encode time per
request (`Timings.encode_s`, p50 ms), embedding-cache hit rate (core Stats
`embedding_cache_hits` / lookups, over the run), useful and padded evaluations (Stats deltas).
Then the headlines: continuous+srpt (the defaults) against each baseline (naming baseline and rate), and
against targets, each printed met / MISSED:
  PNG goodput / latent goodput on the above run, per policy (fifo: continuous+compact vs
      continuous+compact@latent, srpt: continuous+srpt vs continuous+srpt@latent)  ≥ 0.9;
  shortest-class p50 TTUO on the above run / the same system's idle short latency, per
      policy (and per output kind)                                              ≤ 3;
  longest-class p99 TTUO on the above run, srpt / fifo (per output kind)        ≤ 1.5;
and, without a target, mean TTUO of both policies on the below and the above run. Then a
RESULTS.md block, the JSON (`--json`; per run `arrival_rate`, `service_rate`, `backlog`, as
`python -m engine queue-instrument --from-run` reads them, configs named SYSTEM@RUN, the run
after the last `@`; also `idle`, `engines` and `targets`) and the plot (`--plot`).
`--quick` is the CI smoke (short steps and windows, about two minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback

from workload_common import (REPO, bench_model_folder, children_of, cmdline, cpu_seconds, engine_command,
                             engine_env, machine_line, parse_cpus, proc_status_kb, prompts_for, shm_leftovers)
from workload_report import TARGETS, headlines, print_table, results_block, summarize, target_lines, write_plot
from workload_trace import OUTPUTS, ClientPool, StatsSampler, idle_latency, make_schedule, warm_up, with_output

SYSTEMS = {  # name → engine flags; `NAME@latent`: the same flags, every request asking for output="latent"
    "static+padded": ["--admission", "static", "--layout", "padded"],
    "static+compact": ["--admission", "static", "--layout", "compact"],
    "continuous+padded": ["--admission", "continuous", "--layout", "padded"],
    "continuous+compact": ["--admission", "continuous", "--layout", "compact", "--policy", "fifo"],
    "continuous+srpt": ["--admission", "continuous", "--layout", "compact", "--policy", "srpt"],
    # the decode stage named (after any common `--decode-workers`, so this one counts)
    "continuous+worker": ["--admission", "continuous", "--layout", "compact", "--policy", "srpt", "--decode-workers", "1"],
    "continuous+inline": ["--admission", "continuous", "--layout", "compact", "--policy", "srpt", "--decode-workers", "0"],
    "continuous+bucketed": ["--admission", "continuous", "--layout", "bucketed"],
    "diffusers-batched": ["--core", "bench.baselines:make_pipeline_batch_core"],
}
DEFAULT_SYSTEMS = ("static+padded", "static+compact", "continuous+compact", "continuous+srpt", "continuous+worker",
                   "continuous+inline", "diffusers-batched", "continuous+compact@latent", "continuous+srpt@latent")
#: `--quick`'s default: the CI smoke without static+padded (the slowest to serve), so that it stays near two minutes
QUICK_SYSTEMS = ("static+compact", "continuous+compact", "continuous+srpt", "diffusers-batched",
                 "continuous+compact@latent", "continuous+srpt@latent")


def parse_system(name: str) -> tuple[list[str], str]:
    """(engine flags, output kind) of a system name: a name of `SYSTEMS`, optionally ending in
    `@png` (the default) or `@latent`. KeyError or ValueError for an unknown one."""
    base, at, output = name.partition("@")
    output = output if at else "png"
    if output not in OUTPUTS:
        raise ValueError(f"unknown output {output!r} in {name!r}; known: {', '.join(OUTPUTS)}")
    return list(SYSTEMS[base]), output


def slug_of(index: int, name: str) -> str:
    """A file-name-safe, unique slug for a system's socket and log: `+`, `@` (a leading `@`
    is an abstract socket name to ZeroMQ's ipc://) and anything else but letters and digits
    become `-`; the index keeps slugs of different names apart."""
    return f"{index}-" + (re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "system")


class System:
    """One system's engine process: started once, used for its idle, probe, below and above runs."""

    def __init__(self, index: int, name: str, args, folder: pathlib.Path, tmp: pathlib.Path, expect: dict):
        from frontend.launcher import EngineProcess

        self.name = name
        flags, self.output = parse_system(name)
        self.expect = expect  # what a usable output looks like (workload_trace.usable)
        slug = slug_of(index, name)
        self.address = f"ipc://{tmp}/{slug}.sock"
        common = ["--decode-workers", str(args.decode_workers)] if args.decode_workers is not None else []
        engine_args = ["--model", str(folder), "--slots", str(args.slots), "--device", "cpu", *common,
                       "--max-queue", str(args.max_queue), "--log-level", "WARNING", *flags]
        self.flags = flags
        self.command = engine_command(self.address, engine_args, args.cpus)
        print(f"[{name}] starting: python -m engine serve {' '.join(engine_args)}"
              + (f" (every request output={self.output})" if self.output != "png" else ""), flush=True)
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
    """Replay one schedule against one system (asking for its output kind); summarize it."""
    schedule = with_output(schedule, system.output)
    client = system.connect()
    wait_idle(client)
    before = client.stats()
    t0 = time.monotonic() + 0.5  # every client connected and waiting by then
    deadline = t0 + (duration or 0.0) + args.drain_limit
    sampler = StatsSampler(client, t0)
    cpu0 = system.cpu_s()
    sampler.start()
    records, errors = pool.run(system.address, t0, schedule, deadline, tag, system.expect)
    sampler.stopping.set()
    sampler.join(timeout=10)
    wait_idle(client, 10.0)
    cpu_s = system.cpu_s() - cpu0
    after = client.stats()
    r = summarize(records, sampler.samples, before, after, schedule, duration, args.step_classes, cpu_s)
    r["errors"] = errors
    r["records"] = records
    r["output"] = system.output
    return r


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shapes", help="shapes (default, the embedded text model), tiny-sd, "
                    "or a StableDiffusionPipeline folder")
    ap.add_argument("--systems", default=None, help="comma-separated, of " + ", ".join(SYSTEMS) + "; a name may end "
                    "in @latent (every request of its trace asks for output=latent). Default: "
                    + ",".join(DEFAULT_SYSTEMS) + (" (also with --quick)" if QUICK_SYSTEMS == DEFAULT_SYSTEMS
                                                   else "; quick: " + ",".join(QUICK_SYSTEMS)))
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--steps", default=None, help="the three step classes (default 5,20,50; quick 2,4,8)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run (default 30, quick 2.5)")
    ap.add_argument("--probe", type=int, default=None, help="requests in the capacity burst (default 64, quick 6)")
    ap.add_argument("--idle", type=int, default=5, help="single shortest-class requests, one at a time, whose median "
                    "time to usable output is a system's idle short latency (default 5)")
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
                    help="decode workers of every engine (default: not passed, each engine's own default "
                         "for its cores and threads, engine.decode.factory)")
    ap.add_argument("--drain-limit", type=float, default=None, help="seconds allowed after arrivals end")
    ap.add_argument("--quick", action="store_true", help="CI smoke: short steps and windows")
    ap.add_argument("--json", type=pathlib.Path, default=REPO / "bench" / "results" / "workload.json")
    ap.add_argument("--plot", type=pathlib.Path, default=REPO / "bench" / "results" / "workload.png")
    return ap


def main(argv=None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    listed = args.systems or ",".join(QUICK_SYSTEMS if args.quick else DEFAULT_SYSTEMS)
    names = list(dict.fromkeys(n.strip() for n in listed.split(",") if n.strip()))
    unknown = []
    for n in names:
        try:
            parse_system(n)
        except (KeyError, ValueError):
            unknown.append(n)
    if unknown or not names:
        print(f"error: unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}, each optionally ending in "
              + " or ".join(f"@{o}" for o in OUTPUTS), file=sys.stderr)
        return 2
    if args.idle < 1:
        print("error: --idle must be at least 1", file=sys.stderr)
        return 2
    from engine.decode.factory import default_decode_workers
    from engine.models.geometry import geometry_of

    args.step_classes = tuple(int(s) for s in (args.steps or ("2,4,8" if args.quick else "5,20,50")).split(","))
    args.duration = args.duration or (2.5 if args.quick else 30.0)
    args.probe = args.probe or (6 if args.quick else 64)
    args.clients = args.clients or (2 if args.quick else 3)
    args.slow_read = args.slow_read if args.slow_read is not None else (0.2 if args.quick else 0.5)
    args.drain_limit = args.drain_limit or (60.0 if args.quick else 240.0)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    args.cpus = parse_cpus(args.cpus)
    # what each engine picks for itself when `--decode-workers` is not given
    default_workers = default_decode_workers("cpu", len(args.cpus) if args.cpus else None)

    from engine.serve import transport

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # unwind through `finally`: reap the engines
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="wl-", dir=transport.runtime_dir()))
    systems, pool, keep = [], None, False
    try:
        folder, label = bench_model_folder(args.model, tmp)
        prompts = prompts_for(folder)
        geometry = geometry_of(folder)  # requests ask for the native size: what a usable output is
        expect = dict(size=[geometry.native_size] * 2,
                      latent_shape=list(geometry.latent_shape(geometry.native_size, geometry.native_size)))
        total_clients = args.clients + 1
        args.max_queue = 4096
        systems = [System(k, name, args, folder, tmp, expect) for k, name in enumerate(names)]  # start-ups overlap
        pool = ClientPool(total_clients, args.slow_read)
        for system in systems:
            began = time.monotonic()
            warm_up(system.connect(), prompts[0], args.step_classes, system.output)
            print(f"[{system.name}] ready and warm in {time.monotonic() - began:.1f} s", flush=True)

        runs, capacities, failed, idle = {}, {}, [], {}
        shortest = min(args.step_classes)
        for system in systems:  # one at a time: every other engine idle too
            try:
                wait_idle(system.connect())
                idle[system.name] = q = idle_latency(system.connect(), prompts, shortest, system.output, expect,
                                                     n=args.idle, seed=args.seed + 2)
            except Exception:
                failed.append(system.name)
                print(f"[{system.name}] idle measurement FAILED:\n{traceback.format_exc()}\n{system.engine.log()}",
                      file=sys.stderr)
                continue
            print(f"[{system.name}] idle short latency: median {q['median_s'] or 0:.3f} s of {q['usable']} usable "
                  f"of {q['n']} single {shortest}-step requests", flush=True)

        burst = make_schedule(args.seed + 1, None, 0.0, total_clients, prompts, args.step_classes, 0.0,
                              count=args.probe)
        for system in systems:
            if system.name in failed:
                continue
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
                    cpus=",".join(map(str, args.cpus)) if args.cpus else "",
                    decode_workers=args.decode_workers if args.decode_workers is not None
                    else f"the engine's default ({default_workers})",
                    duration=args.duration, probe=args.probe, below=args.below, above=args.above, rates=rates,
                    step_classes=list(args.step_classes), clients=args.clients, quick=args.quick,
                    systems=names, idle_requests=args.idle, targets=TARGETS,
                    machine=machine_line(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    command="python bench/workload.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    wall_s=time.monotonic() - started)
        print()
        print_table(runs)
        print()
        print("idle short latency (median of single " + f"{shortest}-step requests, one at a time): "
              + ", ".join(f"{k} {v['median_s'] or 0:.3f} s" for k, v in idle.items()))
        for line in headlines(runs, capacities, idle):
            print(line)
        print("\nengine processes:", ", ".join(
            f"{k}: exit {v['exit_code']}, peak {v['peak_rss_mb']:.0f} MB"
            + (f", shm left {v['shm_leftovers']}" if v["shm_leftovers"] else "") for k, v in ends.items()))
        print("\n---- RESULTS.md block ----")
        print(results_block(runs, capacities, meta, idle))
        # config names are SYSTEM@RUN: the run is after the last `@` (a system may end in @latent)
        configs = {f"{system}@{run}": {k: v for k, v in r.items() if k != "records"} | ends.get(system, {})
                   for (system, run), r in runs.items()}
        engines = {s.name: dict(flags=s.flags, output=s.output, address=s.address, pid=s.engine.pid)
                   | ends.get(s.name, {})
                   for s in systems}
        report = dict(meta=meta, capacities=capacities, idle=idle, engines=engines,
                      targets=[{k: v for k, v in t.items() if k != "line"} for t in target_lines(runs, idle)],
                      configs=configs, records={f"{s}@{r}": v["records"] for (s, r), v in runs.items()})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=float))
        print(f"\nwrote {args.json}")
        if args.plot:
            write_plot(args.plot, runs, meta)
            print(f"wrote {args.plot}")
        bad = failed + [f"{s}@{r}" for (s, r), v in runs.items() if v["errors"] or v["failed"] or v["unusable"]]
        bad += [f"{k} (idle)" for k, v in idle.items() if v["usable"] < v["n"]]
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
