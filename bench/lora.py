"""Per-request LoRA: mixed adapters in one denoiser call against the two
policies users have today, on the same trace, side by side in one process.

    python bench/lora.py [--adapters 16] [--rank 8] [--duration 15] [--load 1.3] [--rate R]
                         [--repeats 3] [--slots 16] [--threads 1] [--zipf 1.0] [--resident 16]
                         [--quick] [--no-overhead] [--json OUT]

Model: the embedded `shapes` text-to-image folder (`StableDiffusionPipeline`, UNet at 8×8
latents). `--adapters` random rank-`--rank` LoRAs on the UNet's attention q/k/v/out
(`engine.testing.loras.make_lora`: PEFT, `init_lora_weights=False`, saved as diffusers
saves them) are written to a temporary folder. Outputs are `latent`: time to usable
output is arrival → final latents, so the figures isolate the denoiser (no VAE decode;
there is no PNG variant). One torch thread by default (`--threads`), in every system: on
this shared 2-core machine two threads stall 3–10× whenever another job runs.

Systems (each driven in this process through the core calls only: add_request, step,
abort_requests, decode_done; stats read from `stats()`):

  mixed      `EngineCore(model, config, adapters=AdapterPool(...))`: every request's
             adapters and scales are per-row inputs, so requests with different adapter
             sets share one denoiser call;
  keyed      the same core, but a request's group key also holds its sorted (adapter,
             scale) pairs, so only requests with the same adapter set and scales share a
             call (vLLM-Omni's step mode keys its batch so); `max_groups` is raised to 32
             so that the number of groups is not the bound;
  fuse       a diffusers-style batched server (bench/baselines.py's `PipelineBatchCore`:
             one pipeline call per batch of queued requests with the same steps, sampler,
             guidance, size, and here adapter set and scales), which around each call
             does what diffusers users do: `load_lora_weights` (an adapter not loaded yet;
             at most `--resident` stay loaded, least recently used deleted),
             `set_adapters(names, adapter_weights=scales)` + `fuse_lora`, the call, then
             `unfuse_lora` (no adapter: `disable_lora`). It runs a second copy of the
             shapes pipeline, loaded by diffusers, untouched by the pool.

The trace (seeded, the same for every system): Poisson arrivals for `--duration` s at
`--rate`, or by default at `--load` × the mixed system's capacity (completed/s of a burst
of `--probe` requests), so every system is above its capacity; prompts drawn from the 12
shapes prompts; steps 4 / 10 / 20 (shares 0.4 / 0.35 / 0.25), sampler euler, guidance 3;
adapters by Zipf popularity (exponent `--zipf`) over the adapters: 20% of requests none,
60% one, 20% two distinct ones; each adapter at scale 1.0 (75%) or 0.7; `--cancel-share`
of the requests (taken from the 20-step class) canceled by the driver when their progress
reaches a random step. The adapter pool's budget holds `--resident` adapters (default:
all), and each system starts cold (a fresh pool, or no adapter loaded in diffusers).

Repeats run the three systems back to back in a rotating order (noise on this shared
machine hits them alike). Reported per run: completed and canceled requests, goodput
(completed images / (last completion − first arrival)), p50 / p99 time to usable output,
denoiser calls and mean rows per call (useful + padded rows / calls; padded: a canceled
request's rows a pipeline call cannot drop), adapter loads, and the ratio of mixed's
goodput to keyed's and to fuse's per repeat, with their medians (target: mixed ≥ 2×
keyed at 16 adapters). Each request's final latents are compared across systems
(worst relative L2 against mixed; the fused weights differ from the unfused path only in
rounding). Then, unless `--no-overhead`, `bench/lora_overhead.py` measures the LoRA path's
overhead over a base call at `--rank` (target ≤ 25% on CPU through the torch reference).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench.baselines, when run as `python bench/lora.py` from anywhere
    sys.path.insert(0, str(REPO))

from bench.trace_replay import replay_records  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
STEP_CLASSES = (4, 10, 20)
STEP_SHARES = (0.4, 0.35, 0.25)
SAMPLER, GUIDANCE = "euler", 3.0
SYSTEMS = ("mixed", "keyed", "fuse")


# ---- the trace -------------------------------------------------------------------------------

def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def make_trace(seed: int, rate: float | None, duration: float, names: list[str], prompts: list[str],
               steps: tuple[int, ...], zipf: float, cancel_share: float, count: int | None = None) -> list[dict]:
    """[{id, at (s after t0), params fields, cancel_at (step or None)}]; `rate` None: all at 0."""
    rng = random.Random(seed)
    weights = zipf_weights(len(names), zipf)
    trace, t = [], 0.0
    while True:
        if rate is not None:
            t += rng.expovariate(rate)
            if t >= duration:
                break
        elif len(trace) >= count:
            break
        u = rng.random()
        chosen = []
        if u >= 0.2:
            chosen.append(rng.choices(names, weights)[0])
            if u >= 0.8:
                while True:
                    other = rng.choices(names, weights)[0]
                    if other != chosen[0]:
                        chosen.append(other)
                        break
        loras = {name: (1.0 if rng.random() < 0.75 else 0.7) for name in chosen}
        n_steps = rng.choices(steps, STEP_SHARES if len(steps) == len(STEP_SHARES) else None)[0]
        trace.append(dict(id=f"r{len(trace):04d}", at=t if rate is not None else 0.0,
                          prompt=rng.choice(prompts), steps=n_steps, seed=rng.randrange(1 << 31), loras=loras,
                          cancel_at=None))
    longest = [r for r in trace if r["steps"] == max(steps)]
    cancels = max(1, round(cancel_share * len(trace))) if cancel_share > 0 else 0
    for r in rng.sample(longest, min(len(longest), cancels)):
        r["cancel_at"] = rng.randint(1, r["steps"] - 1)
    return trace


def params_of(entry: dict):
    from engine.protocol import GenerateParams

    # negative_prompt "": what the engine encodes for none, and what PipelineBatchCore can pass to encode_prompt
    return GenerateParams(prompt=entry["prompt"], negative_prompt="", steps=entry["steps"], sampler=SAMPLER,
                          guidance=GUIDANCE, seed=entry["seed"], output="latent", loras=dict(entry["loras"]))


def lora_key(loras: dict) -> tuple:
    return tuple(sorted((name, float(scale)) for name, scale in loras.items()))


# ---- the systems -----------------------------------------------------------------------------

def keyed_core_class():
    from engine.core import EngineCore

    class AdapterKeyedCore(EngineCore):
        """EngineCore whose requests share a call only when their adapter sets and scales
        agree: each request's group key is extended with its sorted (adapter, scale) pairs
        as it is queued (admission, which reads the key, comes at the next step)."""

        def add_request(self, request_id, params, arrival_time=None, partial_images=0):
            super().add_request(request_id, params, arrival_time, partial_images)
            request = self.requests[request_id]
            request.group_key = (*request.group_key, ("loras", lora_key(params.loras)))

    return AdapterKeyedCore


class _LoraKey(tuple):
    """The baseline's 5-tuple batch key (it unpacks it), compared with the adapter set too."""

    def __new__(cls, base: tuple, loras: tuple):
        key = super().__new__(cls, base)
        key.loras = loras
        return key

    def __eq__(self, other):
        return tuple.__eq__(self, other) and self.loras == getattr(other, "loras", ())

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((tuple(self), self.loras))


def fuse_core_class():
    from bench.baselines import PipelineBatchCore

    class FusePerCallCore(PipelineBatchCore):
        """PipelineBatchCore batching by adapter set and scales too, fusing the call's
        adapters into the UNet around each pipeline call (see the module docstring)."""

        def __init__(self, model, config, lora_dir: pathlib.Path, resident: int):
            if not hasattr(model, "guided"):  # PipelineBatchCore asks the model so; models now answer cfg_scale
                model.guided = lambda guidance: float(guidance) > 1.0  # (as the SD pipeline decides)
            super().__init__(model, config)
            self.lora_dir, self.resident = pathlib.Path(lora_dir), resident
            self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
            self.adapter_loads = self.adapter_deletes = 0
            self.fuse_s = 0.0  # load + set_adapters + fuse + unfuse, summed over calls
            self.parts = collections.Counter()  # seconds of each part

        def _validate(self, p):
            return _LoraKey(super()._validate(p), lora_key(p.loras))

        def _timed(self, part: str, fn, *args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                self.parts[part] += spent
                self.fuse_s += spent

        def _run_call(self, call):  # on the pipeline thread
            import torch

            torch.set_num_threads(self._threads)  # a new thread: OpenMP's default otherwise
            loras = call.requests[0].params.loras
            pipe = self.pipe
            fused = False
            try:
                if loras:
                    for name in loras:
                        if name in self.loaded:
                            self.loaded.move_to_end(name)
                            continue
                        while len(self.loaded) >= self.resident:
                            victim, _ = self.loaded.popitem(last=False)
                            self._timed("delete", pipe.delete_adapters, [victim])
                            self.adapter_deletes += 1
                        self._timed("load", pipe.load_lora_weights, self.lora_dir / name, adapter_name=name)
                        self.loaded[name] = None
                        self.adapter_loads += 1
                    self._timed("set_adapters", pipe.enable_lora)
                    self._timed("set_adapters", pipe.set_adapters, list(loras), adapter_weights=list(loras.values()))
                    self._timed("fuse", pipe.fuse_lora, components=["unet"], adapter_names=list(loras))
                    fused = True
                elif self.loaded:
                    self._timed("set_adapters", pipe.disable_lora)
            except BaseException as exc:
                self._events.put(("error", f"fusing {list(loras)} failed: {exc!r}"))
                return
            try:
                super()._run_call(call)
            finally:
                if fused:
                    self._timed("unfuse", pipe.unfuse_lora, components=["unet"])

    return FusePerCallCore


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


class Bench:
    def __init__(self, args, lora_dir: pathlib.Path):
        from engine.models.loading import load_model

        self.args, self.lora_dir = args, lora_dir
        self.model = load_model("shapes")  # the engine's (the pool wraps its layers)
        self.fuse_model = load_model("shapes")  # diffusers' own copy for the fuse baseline
        self.fuse_model.pipe.set_progress_bar_config(disable=True)
        self.pool, self.adapter_bytes = None, None

    def make_core(self, system: str):
        from engine.core import CoreConfig, EngineCore
        from engine.lora import AdapterPool

        args = self.args
        config = CoreConfig(slots=args.slots, max_queue=1 << 16, max_groups=32)
        if system == "fuse":
            pipe = self.fuse_model.pipe
            if getattr(pipe.unet, "peft_config", None):  # cold start: no adapter loaded
                pipe.unload_lora_weights()
            return fuse_core_class()(self.fuse_model, config, self.lora_dir, args.resident)
        if self.pool is not None:
            self.pool.uninstall()
        if self.adapter_bytes is None:  # the largest adapter's bytes on the device: the budget's unit
            pool = AdapterPool(self.model, self.lora_dir, budget_bytes=1 << 40)
            self.adapter_bytes = max(pool.nbytes([name]) for name in pool.names())
            pool.uninstall()
        # a fresh pool per run: every system starts cold
        self.pool = AdapterPool(self.model, self.lora_dir, budget_bytes=args.resident * self.adapter_bytes,
                                max_resident=max(64, args.adapters))
        cls = keyed_core_class() if system == "keyed" else EngineCore
        return cls(self.model, config, adapters=self.pool)

    def adapter_loads(self, system: str, core) -> int:
        return core.adapter_loads if system == "fuse" else int(core.stats()["adapter_loads"])


def drive(core, trace: list[dict], limit_s: float) -> dict:
    """Replay `trace` against `core` through its public calls; per-request records."""
    return replay_records(core, trace, params_of, limit_s)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(system: str, core, records: dict, trace: list[dict], loads: int, wall_s: float, cpu_s: float) -> dict:
    stats = core.stats()
    done = [r for r in records.values() if r["state"] == "done"]
    span = max((r["done_at"] for r in done), default=0.0) - min(e["at"] for e in trace)
    rows = stats["useful_evals"] + stats["padded_evals"]
    calls = stats["batches"]
    ttuo = [r["ttuo"] for r in done]
    out = dict(system=system, requests=len(trace), completed=len(done),
               canceled=sum(r["state"] == "canceled" for r in records.values()),
               failed=sum(r["state"] == "failed" for r in records.values()),
               goodput=len(done) / span if span > 0 else 0.0, ttuo_p50=quantile(ttuo, 0.5),
               ttuo_p99=quantile(ttuo, 0.99), calls=calls, rows_per_call=rows / calls if calls else 0.0,
               useful_evals=stats["useful_evals"], padded_evals=stats["padded_evals"], adapter_loads=loads,
               wall_s=wall_s, cpu_s=cpu_s, img_per_cpu_s=len(done) / cpu_s if cpu_s > 0 else 0.0)
    if system == "fuse":
        out["fuse_ms_per_call"] = 1e3 * core.fuse_s / max(1, stats["pipeline_calls"])
        out["pipeline_calls"] = stats["pipeline_calls"]
        out["fuse_parts_ms_per_call"] = {k: round(1e3 * v / max(1, stats["pipeline_calls"]), 2)
                                         for k, v in core.parts.items()}
    else:
        out["groups_evicted"] = stats.get("groups_evicted", 0)
        out["denoiser_ms_per_call"] = 1e3 * stats["denoiser_s"] / calls if calls else 0.0
    return out


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_overhead(args) -> tuple[list[str], float | None]:
    command = [sys.executable, str(REPO / "bench" / "lora_overhead.py"), "--rows", str(args.overhead_rows),
               "--threads", str(args.threads), "--rank", str(args.rank), "--rounds", str(args.overhead_rounds),
               "--targets", ",".join(TARGETS)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0:
        return [f"lora_overhead.py failed ({proc.returncode}): {proc.stderr[-500:]}"], None
    worst = None
    for line in lines:
        if "adapter" in line and line.rstrip().endswith("%"):
            pct = float(line.split()[-1].rstrip("%"))
            worst = pct if worst is None else max(worst, pct)
    return [" ".join(command[1:]).replace(str(REPO) + "/", ""), *lines], worst


def fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def print_table(results: list[dict]) -> list[str]:
    header = ("| system | repeat | done | canc | goodput img/s | img / CPU s | ttuo p50 s | ttuo p99 s "
              "| denoiser calls | rows / call | ms / call | adapter loads |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        per_call = r.get("denoiser_ms_per_call")
        per_call = f"{per_call:.0f}" if per_call is not None else f"{r['fuse_ms_per_call']:.0f} (fuse)"
        lines.append(f"| {r['system']} | {r['repeat']} | {r['completed']} | {r['canceled']} "
                     f"| {fmt(r['goodput'])} | {fmt(r['img_per_cpu_s'])} | {fmt(r['ttuo_p50'])} | {fmt(r['ttuo_p99'])} "
                     f"| {r['calls']} | {fmt(r['rows_per_call'], '.1f')} | {per_call} | {r['adapter_loads']} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on this shared "
                    "2-core machine 2 threads stall 3-10× whenever another job runs)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 15, quick 1.5)")
    ap.add_argument("--rate", type=float, default=None, help="arrivals/s (default: --load × mixed's capacity)")
    ap.add_argument("--load", type=float, default=1.3, help="offered rate / mixed's probed capacity")
    ap.add_argument("--probe", type=int, default=None, help="requests in the capacity burst (default 48)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of the three systems (default 3, quick 1)")
    ap.add_argument("--steps", default=None, help="step classes (default 4,10,20; quick 2,3,4)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    ap.add_argument("--resident", type=int, default=None, help="adapters the pool's budget (and the fuse "
                    "baseline's loaded set) holds (default: all)")
    ap.add_argument("--cancel-share", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--no-overhead", action="store_true", help="skip bench/lora_overhead.py")
    ap.add_argument("--overhead-rows", type=int, default=16)
    ap.add_argument("--overhead-rounds", type=int, default=None, help="default 40, quick 3")
    ap.add_argument("--quick", action="store_true", help="CI smoke: a few short requests, one repeat")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    return ap


def main(argv=None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        print(f"error: --systems takes {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    steps = tuple(int(s) for s in (args.steps or ("2,3,4" if args.quick else "4,10,20")).split(","))
    args.duration = args.duration or (1.5 if args.quick else 15.0)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.probe = args.probe or (8 if args.quick else 48)
    args.resident = args.resident or args.adapters
    args.overhead_rounds = args.overhead_rounds or (3 if args.quick else 40)
    if args.quick and args.rate is None:
        args.rate = 8.0  # no probe: a short, fixed trace

    import torch

    torch.set_num_threads(args.threads)
    quiet_libraries()
    from engine.models.shapes.draw import PROMPTS
    from engine.testing.loras import make_lora

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="diffslot-lora-bench-"))
    try:
        lora_dir = tmp / "loras"
        lora_dir.mkdir()
        bench = Bench(args, lora_dir)
        names = [f"a{i:02d}" for i in range(args.adapters)]
        made = time.monotonic()
        spec = {"unet": dict(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS)}
        for i, name in enumerate(names):
            make_lora(bench.fuse_model.pipe, name, 1000 + i, spec, lora_dir / name)
        print(f"{args.adapters} adapters, rank {args.rank} on {','.join(TARGETS)}, made in "
              f"{time.monotonic() - made:.1f} s; torch threads {args.threads}; slots {args.slots}; "
              f"resident {args.resident}", flush=True)
        prompts = list(PROMPTS)
        limit = 120.0 if args.quick else 600.0

        # warm every path once (first calls allocate and build schedules)
        warm = make_trace(args.seed + 7, None, 0.0, names, prompts, (2,), args.zipf, 0.0, count=3)
        for system in systems:
            drive(bench.make_core(system), warm, limit)

        rate = args.rate
        if rate is None:
            burst = make_trace(args.seed + 1, None, 0.0, names, prompts, steps, args.zipf, 0.0, count=args.probe)
            core = bench.make_core("mixed")
            began = time.monotonic()
            recs = drive(core, burst, limit)
            capacity = sum(r["state"] == "done" for r in recs.values()) / (time.monotonic() - began)
            rate = args.load * capacity
            print(f"mixed capacity probe: {len(burst)} requests at once, {capacity:.2f}/s; offered rate "
                  f"{args.load:g} × that = {rate:.2f}/s", flush=True)
        trace = make_trace(args.seed, rate, args.duration, names, prompts, steps, args.zipf, args.cancel_share)
        sets = collections.Counter(lora_key(r["loras"]) for r in trace)
        print(f"trace: {len(trace)} requests over {args.duration:g} s at {rate:.2f}/s; "
              f"{sum(not r['loras'] for r in trace)} without adapter, {sum(len(r['loras']) == 2 for r in trace)} "
              f"with two; {len(sets)} distinct adapter sets with scales; "
              f"{sum(r['cancel_at'] is not None for r in trace)} canceled", flush=True)

        results, latents = [], collections.defaultdict(dict)
        for repeat in range(args.repeats):
            order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
            for system in order:
                core = bench.make_core(system)
                began, cpu0 = time.monotonic(), time.process_time()
                records = drive(core, trace, limit)
                wall, cpu = time.monotonic() - began, time.process_time() - cpu0
                r = summarize(system, core, records, trace, bench.adapter_loads(system, core), wall, cpu)
                r["repeat"] = repeat + 1
                results.append(r)
                for rid, rec in records.items():
                    if rec["state"] == "done":
                        latents[system][rid] = rec["latents"]
                print(f"[{system} #{repeat + 1}] {r['completed']} done, {r['canceled']} canceled, {r['failed']} failed,"
                      f" goodput {r['goodput']:.2f}/s, p50 {fmt(r['ttuo_p50'])} s, {r['rows_per_call']:.1f} rows/call,"
                      f" {r['adapter_loads']} loads, {wall:.1f} s"
                      + (f", denoiser {r['denoiser_ms_per_call']:.0f} ms/call" if "denoiser_ms_per_call" in r else
                         f", {r['pipeline_calls']} pipeline calls, per call ms: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in r["fuse_parts_ms_per_call"].items())),
                      flush=True)

        print()
        table = print_table(results)
        print("\n".join(table))
        ratio_lines = []
        for other in [s for s in ("keyed", "fuse") if s in systems and "mixed" in systems]:
            ratios, cpu_ratios = [], []
            for repeat in range(1, args.repeats + 1):
                run = {r["system"]: r for r in results if r["repeat"] == repeat}
                ratios.append(run["mixed"]["goodput"] / run[other]["goodput"] if run[other]["goodput"] else math.inf)
                cpu_ratios.append(run["mixed"]["img_per_cpu_s"] / run[other]["img_per_cpu_s"]
                                  if run[other]["img_per_cpu_s"] else math.inf)
            p50 = {s: statistics.median([r["ttuo_p50"] for r in results if r["system"] == s and r["ttuo_p50"]])
                   for s in ("mixed", other)}
            ratio_lines.append(f"mixed / {other} goodput: " + ", ".join(f"{x:.2f}×" for x in ratios)
                               + f" (median {statistics.median(ratios):.2f}×); per CPU second "
                               + ", ".join(f"{x:.2f}×" for x in cpu_ratios)
                               + f" (median {statistics.median(cpu_ratios):.2f}×); p50 time to usable output "
                               f"{other} / mixed {p50[other] / p50['mixed']:.1f}× (medians)")
        worst = {}
        for system in [s for s in systems if s != "mixed" and "mixed" in systems]:
            common = set(latents[system]) & set(latents["mixed"])
            if common:
                worst[system] = max(rel_l2(latents[system][k], latents["mixed"][k]) for k in common)
        for other, err in worst.items():
            ratio_lines.append(f"final latents, worst relative L2 of {other} against mixed: {err:.1e}")
        print()
        print("\n".join(ratio_lines))

        overhead_lines, overhead = [], None
        if not args.no_overhead:
            overhead_lines, overhead = run_overhead(args)
            print("\n$ python " + "\n".join(overhead_lines))
        meta = dict(command="python bench/lora.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), adapters=args.adapters, rank=args.rank,
                    slots=args.slots, threads=args.threads, rate=rate, duration=args.duration, steps=list(steps),
                    zipf=args.zipf, resident=args.resident, requests=len(trace), distinct_sets=len(sets),
                    wall_s=time.monotonic() - started, cpus=os.cpu_count(), load_avg=os.getloadavg())
        load = ", ".join(f"{x:.1f}" for x in meta["load_avg"])
        print(f"\nwall {meta['wall_s']:.0f} s; load average at the end {load}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(meta=meta, results=results, ratios=ratio_lines, worst_rel_l2=worst,
                                                 overhead_worst_pct=overhead, overhead=overhead_lines), indent=1))
        bad = [f"{r['system']}#{r['repeat']}" for r in results if r["failed"]]
        if bad:
            print(f"failed requests in: {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
