"""The ceiling: the served engine against its own denoiser at full batch, under saturating load.

    python bench/ceiling.py [--model shapes|tiny-sd|PATH] [--slots 8] [--requests 48] [--steps 20]
                            [--guidance 3] [--repeats 3] [--threads N] [--engine-args "..."]
                            [--no-progress] [--quick] [--json OUT]

Three measurements of useful denoiser rows per second, in one run, interleaved (every
repeat measures all three, in a rotating order) so machine noise hits them alike:

  denoiser  the model's own batched call at full batch (`slots` requests × 2 rows at
            guidance > 1), back to back, in this process, as many calls as the engine
            makes for the requests below (so each measurement spans the same time): the
            ceiling;
  core      `EngineCore.step()` in a loop, in this process, on the same model: `--requests`
            requests of `--steps` steps submitted at once (output "latent"), rows/s = useful
            evaluations / wall time; the denoiser's share of it is timed by passing the core
            a `TimedDenoiser` model wrapper (nothing is patched);
  served    `python -m engine serve --model M --slots N` with DEFAULT flags otherwise (plus
            `--engine-args`): the same requests submitted at once by one client (progress
            messages on, as the client's default), rows/s = the Stats delta of useful
            evaluations / (first submit → last result).

All requests have the same step count, so the batch stays full until the last wave ends.
The engine process and this process get the same torch threads (`--threads`, default:
torch's own default in both). Printed: each repeat's rows/s and ratios, and the median
of the `--repeats` ratios; the target is served / denoiser ≥ 0.95 with default flags.
The served engine also reports the wall time it spent inside denoiser calls
(`EngineCore.stats()["denoiser_s"]`); its share of the run's wall time, times the mean
batch fullness, is the ratio at the denoiser's speed of that same moment: on a machine
whose speed drifts by ±15% from one second to the next (this one), it is the steadier
figure, printed as "in-run share" (the core's likewise, through `TimedDenoiser`).
The engine process's CPU time (with its children, the decode workers) over the served
run is printed too, and the same ratios per CPU second (useful rows / CPU time of the
process that did them): on a machine shared with other jobs the wall-clock ratio moves
with their load between measurements, the CPU-second ratio much less; CPU the engine
spends beside the denoiser (IO thread, messages, decode workers) lowers it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time

from workload_common import (REPO, TimedDenoiser, bench_model_folder, children_of, cpu_seconds, engine_command,
                             engine_env, machine_line, prompts_for)

TARGET = 0.95


def _params(args, prompts, i: int):
    from frontend import GenerateParams

    return GenerateParams(prompt=prompts[i % len(prompts)], steps=args.steps, sampler="euler", guidance=args.guidance,
                          seed=i, output="latent")


def measure_denoiser(model, args, prompts, rows_per_request: int) -> dict:
    import torch

    rows = args.slots * rows_per_request
    shape = model.latent_shape(model.native_size, model.native_size)
    x = torch.randn(rows, *shape)
    t = torch.linspace(999, 1, rows)
    cond = model.encode([prompts[i % len(prompts)] for i in range(rows)])
    with torch.no_grad():
        model.denoise(x, t, cond)
        # as many full-batch calls as the engine makes for the same requests, so both
        # measurements span the same time and the machine's drift hits them alike
        calls = args.steps * -(-args.requests // args.slots)
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(calls):
            model.denoise(x, t, cond)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return dict(rows_per_s=rows * calls / elapsed, ms_per_call=1e3 * elapsed / calls, rows=rows,
                rows_per_cpu_s=rows * calls / cpu)


def measure_core(model, args, prompts) -> dict:
    from engine.core import CoreConfig, DenoiseFinished, EngineCore

    timed = TimedDenoiser(model)
    core = EngineCore(timed, CoreConfig(slots=args.slots, max_queue=args.requests + 1))
    cpu, start = time.process_time(), time.perf_counter()
    for i in range(args.requests):
        core.add_request(f"c{i}", _params(args, prompts, i))
    while core.has_unfinished_requests():
        for out in core.step():
            if isinstance(out, DenoiseFinished):
                core.decode_done(out.request_id)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    useful = core.stats()["useful_evals"]
    return dict(rows_per_s=useful / wall, wall_s=wall, denoiser_share=timed.seconds / wall, rows_per_cpu_s=useful / cpu,
                batches=timed.calls, mean_rows=timed.rows / max(1, timed.calls))


def measure_served(client, pid: int, args, prompts) -> dict:
    before = client.stats()
    cpu0 = cpu_seconds(pid) + sum(cpu_seconds(k) for k in children_of(pid))
    start = time.perf_counter()
    handles = [client.submit(_params(args, prompts, i), progress=args.progress) for i in range(args.requests)]
    results = [h.result(timeout=600) for h in handles]
    wall = time.perf_counter() - start
    cpu1 = cpu_seconds(pid) + sum(cpu_seconds(k) for k in children_of(pid))
    after = client.stats()
    kinds = {type(r).__name__ for r in results}
    if kinds != {"Completed"}:
        raise RuntimeError(f"served run ended with {kinds}")
    useful = after["useful_evals"] - before["useful_evals"]
    batches = after["batches"] - before["batches"]
    return dict(rows_per_s=useful / wall, wall_s=wall, engine_cpu_s=cpu1 - cpu0, rows_per_cpu_s=useful / (cpu1 - cpu0),
                denoiser_share=(after["denoiser_s"] - before["denoiser_s"]) / wall,
                mean_rows=useful / max(1, batches))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shapes",
                    help="shapes (default, the embedded text model), tiny-sd, or a folder")
    ap.add_argument("--slots", type=int, default=None, help="default 8 (quick 4)")
    ap.add_argument("--requests", type=int, default=None, help="default 48 (quick 8)")
    ap.add_argument("--steps", type=int, default=None, help="default 20 (quick 4)")
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads here and in the engine "
                    "(default: torch's default in both)")
    ap.add_argument("--engine-args", default="", help="extra `python -m engine serve` flags, e.g. "
                    "'--decode-workers 1' (default: none, the engine's defaults)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="submit with progress=False")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 slots, 8 requests × 4 steps")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.slots = args.slots or (4 if args.quick else 8)
    args.requests = args.requests or (8 if args.quick else 48)
    args.steps = args.steps or (4 if args.quick else 20)
    import torch

    from engine.models.loading import load_model
    from engine.serve import transport
    from engine.protocol import GenerateParams
    from frontend.launcher import EngineProcess

    if args.threads:
        torch.set_num_threads(args.threads)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # unwind through `finally`: stop the engine
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ceiling-", dir=transport.runtime_dir()))
    folder, label = bench_model_folder(args.model, tmp)
    prompts = prompts_for(folder)
    model = load_model(folder, "cpu")
    rows_per_request = 2 if model.cfg_scale(GenerateParams(prompt="", guidance=args.guidance)) is not None else 1
    extra = shlex.split(args.engine_args)
    address = f"ipc://{tmp}/ceiling.sock"
    engine_args = ["--model", str(folder), "--slots", str(args.slots), *extra]
    if args.requests > 56:  # beyond the default queue bound of 64 (with room for the warm-up)
        engine_args[4:4] = ["--max-queue", str(args.requests + 8)]
    print(f"ceiling: model {label}, {args.slots} slots × {rows_per_request} rows, {args.requests} requests × "
          f"{args.steps} steps, guidance {args.guidance:g}, output latent, "
          f"progress {'on' if args.progress else 'off'}; "
          f"torch threads {torch.get_num_threads()} here and {args.threads or 'default'} in the engine; "
          f"engine: python -m engine serve {' '.join(engine_args)}; {machine_line()}", flush=True)
    engine = EngineProcess(engine_command(address, engine_args), address, tmp / "engine.log",
                           env=engine_env(args.threads), cwd=REPO, new_session=True)
    rows, code = [], None
    try:
        client = engine.connect(300.0)
        warm = argparse.Namespace(**{**vars(args), "steps": 2, "requests": args.slots})
        measure_served(client, engine.pid, warm, prompts)
        measure_core(model, warm, prompts)
        parts = ("denoiser", "core", "served")
        for r in range(args.repeats):
            got = {}
            for part in parts[r % 3:] + parts[:r % 3]:
                if part == "denoiser":
                    got[part] = measure_denoiser(model, args, prompts, rows_per_request)
                elif part == "core":
                    got[part] = measure_core(model, args, prompts)
                else:
                    got[part] = measure_served(client, engine.pid, args, prompts)
            base = got["denoiser"]["rows_per_s"]
            got["core_ratio"] = got["core"]["rows_per_s"] / base
            got["served_ratio"] = got["served"]["rows_per_s"] / base
            cpu_base = got["denoiser"]["rows_per_cpu_s"]
            got["core_cpu_ratio"] = got["core"]["rows_per_cpu_s"] / cpu_base
            got["served_cpu_ratio"] = got["served"]["rows_per_cpu_s"] / cpu_base
            rows.append(got)
            print(f"  repeat {r + 1}: denoiser {base:.1f} rows/s ({got['denoiser']['ms_per_call']:.1f} ms per "
                  f"{got['denoiser']['rows']}-row call), core {got['core']['rows_per_s']:.1f} "
                  f"({got['core_ratio']:.3f}), served {got['served']['rows_per_s']:.1f} ({got['served_ratio']:.3f}); "
                  f"engine CPU {got['served']['engine_cpu_s']:.1f} s over {got['served']['wall_s']:.1f} s wall",
                  flush=True)
        client.close()
    finally:
        code = engine.stop(30.0)
        if code == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"engine exited with {code}; its log is in {tmp}", file=sys.stderr)
    served = statistics.median(g["served_ratio"] for g in rows)
    core = statistics.median(g["core_ratio"] for g in rows)
    served_cpu = statistics.median(g["served_cpu_ratio"] for g in rows)
    core_cpu = statistics.median(g["core_cpu_ratio"] for g in rows)
    full_rows = args.slots * rows_per_request
    # busy share × batch fullness: the ratio at the denoiser's speed of that very moment
    served_share = statistics.median(g["served"]["denoiser_share"] * g["served"]["mean_rows"] / full_rows for g in rows)
    core_share = statistics.median(g["core"]["denoiser_share"] * g["core"]["mean_rows"] / full_rows for g in rows)
    print()
    print(f"{'repeat':<8}{'denoiser rows/s':>16}{'core rows/s':>13}{'served rows/s':>15}{'core/denoiser':>15}"
          f"{'served/denoiser':>17}")
    for k, g in enumerate(rows, 1):
        print(f"{k:<8}{g['denoiser']['rows_per_s']:>16.1f}{g['core']['rows_per_s']:>13.1f}"
              f"{g['served']['rows_per_s']:>15.1f}{g['core_ratio']:>15.3f}{g['served_ratio']:>17.3f}")
    print(f"core alone / denoiser = {core:.3f} (median of {len(rows)})")
    print(f"served engine / denoiser = {served:.3f} (median of {len(rows)}); target >= {TARGET}: "
          f"{'met' if served >= TARGET else 'MISSED'}")
    print(f"per CPU second (useful rows / CPU time of the process doing them; the engine's with its decode "
          f"workers): core/denoiser {core_cpu:.3f}, served/denoiser {served_cpu:.3f} (medians): what the engine "
          f"spends beside the denoiser, less moved by other jobs' load than the wall-clock ratio")
    print(f"in-run share (wall time inside full-batch denoiser calls × batch fullness, timed by the process "
          f"itself, so the machine's drift between measurements cancels): core {core_share:.3f}, served "
          f"{served_share:.3f} (medians); target >= {TARGET}: {'met' if served_share >= TARGET else 'MISSED'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(model=label, slots=args.slots, requests=args.requests, steps=args.steps,
                                             guidance=args.guidance, engine_args=engine_args, repeats=rows,
                                             served_ratio=served, core_ratio=core, served_cpu_ratio=served_cpu,
                                             core_cpu_ratio=core_cpu, served_share=served_share,
                                             core_share=core_share, engine_exit=code), indent=1))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
