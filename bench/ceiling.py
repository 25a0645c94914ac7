"""The ceiling: the served engine's useful rows/s against its own denoiser at the engine's
own rows per call, for latent and for PNG outputs, under saturating load.

    python bench/ceiling.py [--model shapes|tiny-sd|PATH] [--slots 8] [--requests 48] [--steps 20]
                            [--guidance 3] [--repeats 3] [--threads N] [--engine-args "..."]
                            [--no-progress] [--quick] [--json OUT]

One engine process, `python -m engine serve --model M --slots N` with DEFAULT flags
otherwise (plus `--engine-args`), and one client. Every repeat measures, for each output
in turn ("latent", then "png"; the next repeat "png" first, and so on, so that a drift of
the machine's speed hits both alike):

  served    `--requests` requests of `--steps` steps (euler, `--guidance`) submitted at once
            by the client, progress messages on (the client's default; `--no-progress`
            turns them off), output = the output measured. A result counts only if it is
            usable as the workload benchmark judges it (`workload_trace.usable`: a PNG of
            the native size, or a finite latent of the model's shape). Over the Stats
            delta of the run: mean rows per call R = useful evaluations / batches; served
            rows/s = the counted results' useful evaluations (`Timings.evals`; all of the
            Stats delta when every result counts) / (first submit → last result).
  denoiser  right after it, in this process, on the same model, device and dtype as the
            engine's: the model's own batched call, `model.denoise(x, t, rows)` (the
            `model.run(ModelInputs)` the engine's runner calls, over the same per-row
            inputs: a request's conditional row and, at guidance > 1, its unconditional
            one, with the model's per-request inputs), at the row counts a call of whole
            requests has just below and above R, interleaved, as many calls in all as
            the served run made (its batches delta), so both measurements span about the
            same time. Rows/s at each count, interpolated linearly to R (R itself when
            it is a whole number of requests' rows): what the denoiser alone does at the
            engine's own batch size.

Headline: served / denoiser at R, the median of the repeats' ratios, for latent and for
PNG outputs (target for PNG >= 0.9), and PNG / latent served rows/s (the decode stage's
cost to goodput). Diagnostics: the engine's own time inside denoiser calls as a share of
the run's wall time (`denoiser_s` of its Stats; timed by the engine itself, so a drift
between the served and the denoiser measurement cancels out of it), the engine's rows/s
inside those calls against the denoiser alone at R (below 1: something beside the calls,
such as PNG decodes, slows the calls themselves), and rows per CPU second (the engine
process's CPU time with its children, the decode workers, against this process's during
the denoiser measurement: less moved than wall time by other jobs' load on a shared
machine). All requests have the same step count, so batches stay full until the last
wave. The engine and this process get the same torch threads (`--threads`, default:
torch's own default in both). On CUDA the engine replays captured graphs at bucketed row
counts (padded rows are not useful rows), while the denoiser here is the eager call.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time

from workload_common import (REPO, bench_model_folder, children_of, cpu_seconds, engine_command, engine_env,
                             machine_line, prompts_for)
from workload_trace import usable

TARGET_PNG = 0.9
OUTPUTS = ("latent", "png")


def params_for(args, prompts, i: int, output: str):
    from frontend import GenerateParams

    return GenerateParams(prompt=prompts[i % len(prompts)], steps=args.steps, sampler="euler", guidance=args.guidance,
                          seed=i, output=output)


def engine_cpu(pid: int) -> float:
    return cpu_seconds(pid) + sum(cpu_seconds(k) for k in children_of(pid))


def measure_served(client, pid: int, args, prompts, output: str, expect: dict) -> dict:
    before = client.stats()
    cpu0 = engine_cpu(pid)
    start = time.perf_counter()
    handles = [client.submit(params_for(args, prompts, i, output), progress=args.progress)
               for i in range(args.requests)]
    results = [h.result(timeout=600) for h in handles]
    wall = time.perf_counter() - start
    cpu = engine_cpu(pid) - cpu0
    after = client.stats()
    good = [r for r in results if usable(r, output, expect)]
    useful = after["useful_evals"] - before["useful_evals"]
    batches = after["batches"] - before["batches"]
    counted = sum(r.timings.evals for r in good)
    got = dict(output=output, submitted=len(results), counted=len(good),
               kinds=sorted({type(r).__name__ for r in results}), useful_evals=useful, counted_evals=counted,
               padded_evals=after["padded_evals"] - before["padded_evals"], batches=batches,
               mean_rows=useful / max(1, batches), wall_s=wall, rows_per_s=counted / wall, engine_cpu_s=cpu,
               rows_per_cpu_s=counted / cpu if cpu > 0 else float("nan"),
               denoiser_s=after["denoiser_s"] - before["denoiser_s"])
    got["denoiser_share"] = got["denoiser_s"] / wall
    got["in_call_rows_per_s"] = useful / got["denoiser_s"] if got["denoiser_s"] > 0 else float("nan")
    if output == "png":
        got["signatures"] = sorted({bytes(r.output[:8]).hex() for r in results
                                    if getattr(r, "output", None) is not None and not hasattr(r.output, "shape")})
        if good:
            import io

            from PIL import Image

            with Image.open(io.BytesIO(bytes(good[0].output))) as image:
                image.load()  # the whole file decodes, not only its header
                got["decoded_size"] = list(image.size)
    else:
        got["shapes"] = sorted({tuple(r.output.shape) for r in results if hasattr(getattr(r, "output", None), "shape")})
    return got


class DenoiserRows:
    """The model's batched denoiser call over `n` requests' rows, as the engine builds them:
    per request its conditional row and, with classifier-free guidance, its unconditional
    one (the negative text's conditioning), with the model's per-request inputs."""

    def __init__(self, model, args, prompts, device, rows_per_request: int):
        self.model, self.args, self.prompts, self.device = model, args, prompts, device
        self.rows_per_request = rows_per_request
        self.size = model.native_size
        self.shape = model.latent_shape(self.size, self.size)
        self._inputs: dict[int, tuple] = {}

    def inputs(self, requests: int) -> tuple:
        import torch

        if requests not in self._inputs:
            model, per = self.model, self.rows_per_request
            params = [params_for(self.args, self.prompts, i, "latent") for i in range(requests)]
            texts = [p.prompt for p in params] + [model.negative_text(params[0])] * (per == 2)
            encoded = model.encode(texts)
            rows, extra = [], {}
            for i, p in enumerate(params):
                rows += [encoded[i]] + [encoded[-1]] * (per == 2)
                for name, value in model.request_inputs(p, self.size, self.size).items():
                    extra.setdefault(name, []).append(value[:per])
            extra = {name: torch.cat(values).to(self.device) for name, values in extra.items()}
            n = requests * per
            x = torch.randn(n, *self.shape, device=self.device).to(model.dtype)
            t = torch.linspace(999, 1, requests, device=self.device).repeat_interleave(per)
            self._inputs[requests] = (x, t, rows, extra)
        return self._inputs[requests]

    def call(self, requests: int):
        x, t, rows, extra = self.inputs(requests)
        return self.model.denoise(x, t, rows, **extra)


def measure_denoiser(bench: DenoiserRows, mean_rows: float, calls: int) -> dict:
    """Rows/s of the denoiser alone at `mean_rows` rows per call: calls of whole requests'
    rows just below and above it, interleaved in proportion (`calls` in all), each count's
    rows/s interpolated linearly to `mean_rows`."""
    import torch

    per = bench.rows_per_request
    lo = max(1, math.floor(mean_rows / per + 1e-9))
    hi = max(1, math.ceil(mean_rows / per - 1e-9))
    frac = 0.0 if hi == lo else (mean_rows / per - lo) / (hi - lo)
    counts_ = [lo] if hi == lo else [lo, hi]
    calls = max(calls, len(counts_))
    n_hi = 0 if hi == lo else min(calls - 1, max(1, round(calls * frac)))
    cuda = bench.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    wall = {n: 0.0 for n in counts_}
    cpu = {n: 0.0 for n in counts_}
    made = {n: 0 for n in counts_}
    with torch.no_grad():
        for n in counts_:  # untimed: first-call costs (allocations, kernels) out of the way
            bench.call(n)
        sync()
        for j in range(calls):  # Bresenham: the hi calls spread evenly among the lo ones
            n = hi if (j + 1) * n_hi // calls > j * n_hi // calls else lo
            c0, w0 = time.process_time(), time.perf_counter()
            bench.call(n)
            sync()
            wall[n] += time.perf_counter() - w0
            cpu[n] += time.process_time() - c0
            made[n] += 1
    points = {n * per: dict(calls=made[n], ms_per_call=1e3 * wall[n] / made[n],
                            rows_per_s=n * per * made[n] / wall[n],
                            rows_per_cpu_s=n * per * made[n] / cpu[n] if cpu[n] > 0 else float("nan"))
              for n in counts_}
    a, b = points[lo * per], points[hi * per]
    return dict(rows=mean_rows, rows_lo=lo * per, rows_hi=hi * per, weight_hi=frac, calls=calls, points=points,
                rows_per_s=a["rows_per_s"] + frac * (b["rows_per_s"] - a["rows_per_s"]),
                rows_per_cpu_s=a["rows_per_cpu_s"] + frac * (b["rows_per_cpu_s"] - a["rows_per_cpu_s"]),
                wall_s=sum(wall.values()))


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


def _engine_device(extra: list[str]):
    """The device and dtype the engine will run on, from its flags (its own defaults otherwise)."""
    import torch

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    known, _ = ap.parse_known_args(extra)
    device = known.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device), known.dtype


def _median(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def _rows_text(rows: float) -> str:
    return f"{rows:g}" if abs(rows - round(rows)) < 1e-9 else f"{rows:.2f}"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.slots = args.slots or (4 if args.quick else 8)
    args.requests = args.requests or (8 if args.quick else 48)
    args.steps = args.steps or (4 if args.quick else 20)
    import torch

    from engine.models.loading import load_model
    from engine.protocol import GenerateParams
    from engine.serve import transport
    from frontend.launcher import EngineProcess

    if args.threads:
        torch.set_num_threads(args.threads)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # unwind through `finally`: stop the engine
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    extra = shlex.split(args.engine_args)
    device, dtype = _engine_device(extra)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ceiling-", dir=transport.runtime_dir()))
    folder, label = bench_model_folder(args.model, tmp)
    prompts = prompts_for(folder)
    model = load_model(folder, device, dtype=dtype)
    per = 2 if model.cfg_scale(GenerateParams(prompt="", guidance=args.guidance)) is not None else 1
    latent_shape = tuple(model.latent_shape(model.native_size, model.native_size))
    expect = dict(latent_shape=latent_shape, size=(model.native_size, model.native_size))  # what `usable` checks
    bench = DenoiserRows(model, args, prompts, device, per)
    address = f"ipc://{tmp}/ceiling.sock"
    engine_args = ["--model", str(folder), "--slots", str(args.slots), *extra]
    if args.requests > 56:  # beyond the default queue bound of 64 (with room for the warm-up)
        engine_args[4:4] = ["--max-queue", str(args.requests + 8)]
    print(f"ceiling: model {label} on {device} ({dtype}), {args.slots} slots × {per} rows, {args.requests} "
          f"requests × {args.steps} steps, guidance {args.guidance:g}, outputs latent and png, "
          f"progress {'on' if args.progress else 'off'}; torch threads {torch.get_num_threads()} here and "
          f"{args.threads or 'default'} in the engine; engine: python -m engine serve {' '.join(engine_args)}; "
          f"{machine_line()}", flush=True)
    engine = EngineProcess(engine_command(address, engine_args), address, tmp / "engine.log",
                           env=engine_env(args.threads), cwd=REPO, new_session=True)
    repeats, code, client = [], None, None
    try:
        client = engine.connect(300.0)
        warm = argparse.Namespace(**{**vars(args), "steps": 2, "requests": args.slots})
        for output in OUTPUTS:  # first-run costs (allocations, decode workers' first images) out of the way
            measure_served(client, engine.pid, warm, prompts, output, expect)
        measure_denoiser(bench, args.slots * per, 2)
        for r in range(args.repeats):
            got = {}
            for output in (OUTPUTS if r % 2 == 0 else OUTPUTS[::-1]):
                served = measure_served(client, engine.pid, args, prompts, output, expect)
                idle = engine_cpu(engine.pid)
                alone = measure_denoiser(bench, served["mean_rows"], served["batches"])
                alone["engine_cpu_s"] = engine_cpu(engine.pid) - idle  # the idle engine's: ~0, or it competes
                got[output] = dict(served=served, denoiser=alone, ratio=served["rows_per_s"] / alone["rows_per_s"],
                                   cpu_ratio=served["rows_per_cpu_s"] / alone["rows_per_cpu_s"],
                                   in_call_ratio=served["in_call_rows_per_s"] / alone["rows_per_s"])
                print(f"  repeat {r + 1} {output:<6}: served {served['rows_per_s']:.1f} rows/s "
                      f"({served['counted']}/{served['submitted']} counted, {served['batches']} calls of "
                      f"{served['mean_rows']:.2f} rows), denoiser at {_rows_text(served['mean_rows'])} rows "
                      f"{alone['rows_per_s']:.1f} rows/s: {got[output]['ratio']:.3f}; engine CPU "
                      f"{served['engine_cpu_s']:.1f} s over {served['wall_s']:.1f} s wall", flush=True)
            got["png_latent"] = got["png"]["served"]["rows_per_s"] / got["latent"]["served"]["rows_per_s"]
            repeats.append(got)
    finally:
        if client is not None:
            client.close()
        code = engine.stop(30.0)
        if code == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"engine exited with {code}; its log is in {tmp}", file=sys.stderr)
    n = len(repeats)
    medians = {}
    for output in OUTPUTS:
        runs = [g[output] for g in repeats]
        medians[output] = dict(
            ratio=_median(g["ratio"] for g in runs),
            rows=_median(g["served"]["mean_rows"] for g in runs),
            served_rows_per_s=_median(g["served"]["rows_per_s"] for g in runs),
            denoiser_rows_per_s=_median(g["denoiser"]["rows_per_s"] for g in runs),
            denoiser_share=_median(g["served"]["denoiser_share"] for g in runs),
            in_call_ratio=_median(g["in_call_ratio"] for g in runs),
            cpu_ratio=_median(g["cpu_ratio"] for g in runs))
    medians["png_latent"] = _median(g["png_latent"] for g in repeats)
    print()
    print(f"{'repeat':<8}{'output':<8}{'served rows/s':>14}{'rows/call':>11}{'denoiser rows/s':>17}"
          f"{'served/denoiser':>17}{'in-run share':>14}{'in-call':>9}{'per CPU s':>11}{'engine CPU s':>14}")
    for k, g in enumerate(repeats, 1):
        for output in OUTPUTS:
            m = g[output]
            s = m["served"]
            print(f"{k:<8}{output:<8}{s['rows_per_s']:>14.1f}{s['mean_rows']:>11.2f}"
                  f"{m['denoiser']['rows_per_s']:>17.1f}{m['ratio']:>17.3f}{s['denoiser_share']:>14.3f}"
                  f"{m['in_call_ratio']:>9.3f}{m['cpu_ratio']:>11.3f}{s['engine_cpu_s']:>14.1f}")
    lat, png = medians["latent"], medians["png"]
    print(f"served latent / denoiser at {_rows_text(lat['rows'])} rows = {lat['ratio']:.3f} (median of {n})")
    print(f"served png / denoiser at {_rows_text(png['rows'])} rows = {png['ratio']:.3f} (median of {n}); "
          f"target >= {TARGET_PNG}: {'met' if png['ratio'] >= TARGET_PNG else 'MISSED'}")
    print(f"png / latent goodput = {medians['png_latent']:.3f} (median of {n})")
    print(f"diagnostics (medians): in-run share (the engine's own time inside denoiser calls / wall; timed by "
          f"the engine, so drift between measurements cancels) latent {lat['denoiser_share']:.3f}, png "
          f"{png['denoiser_share']:.3f}; in-call (the engine's rows/s inside its calls / the denoiser alone at R) "
          f"latent {lat['in_call_ratio']:.3f}, png {png['in_call_ratio']:.3f}; per CPU second (useful rows / CPU "
          f"time of the process doing them, the engine's with its decode workers) latent {lat['cpu_ratio']:.3f}, "
          f"png {png['cpu_ratio']:.3f}")
    short = [f"{o} {g[o]['served']['counted']}/{g[o]['served']['submitted']}" for g in repeats for o in OUTPUTS
             if g[o]["served"]["counted"] != g[o]["served"]["submitted"]]
    if short:
        print(f"results that did not count (not a Completed with the output asked for): {', '.join(short)}",
              file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            model=label, device=str(device), dtype=dtype, slots=args.slots, requests=args.requests,
            steps=args.steps, guidance=args.guidance, rows_per_request=per, progress=args.progress,
            latent_shape=list(latent_shape), native_size=model.native_size, engine_args=engine_args,
            target_png=TARGET_PNG, repeats=repeats, medians=medians, engine_exit=code), indent=1, default=list))
    return 0 if code == 0 and not short else 1


if __name__ == "__main__":
    sys.exit(main())
