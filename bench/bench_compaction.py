"""Compaction vs padding: one engine step at several active fractions, per layout (R4).

    python bench/bench_compaction.py [--model shapes|tiny-sd|PATH] [--slots 64] [--repeats N]
                                     [--quick] [--json OUT] [--plot OUT.png]

The model is the embedded text model (`--model shapes`, a StableDiffusionPipeline folder),
or `tiny-sd` (the random-weight folder of `engine.testing.tiny_pipelines.build_sd`), or a
folder. For each layout (`padded`,
`compact`, `bucketed`) and each active fraction f (1/8, 1/4, 1/2, 3/4, 1) an EngineCore
with `--slots` slots gets round(f * slots) requests (prompts "a {color} {shape}", guidance
alternating 1.0 and 3.0, i.e. 1 and 2 rows per slot; samplers euler and dpmpp_2m, both
deterministic so no noise is drawn; steps enough that nobody finishes) admitted with
`core.admit()` (its preparation included); then the runner's `execute` of the scheduler's step plan is timed directly. All layouts are measured
in one run: every repeat runs every (fraction, layout) once, the layouts in a rotating
order, so machine noise hits all of them alike; the table reports medians over repeats.

Each step is split, without patching anything, into
  denoiser  the `model.denoise` call on the rows computed, timed by the model object the
            core is given (`workload_common.TimedDenoiser`, a wrapper that forwards the rest);
  host      step − denoiser: everything else `runner.run` does (row map, input gather, the
            per-slot update, fence and bookkeeping): the cost of the engine around the model;
  build     `runner.build_batch` alone (row map, per-row tables, host→device copies), timed by
            calling it once more before the step: the part of `host` that compaction adds.
Useful evals/s = useful rows (1 or 2 per active slot) / median step time; "vs padded" is
that rate over padded's at the same fraction.

The same measurement as pytest-benchmark tests (layout × fraction):

    pytest bench/bench_compaction.py --benchmark-enable --benchmark-only \\
        --benchmark-group-by=param:fraction

(model from $DIFFSLOT_BENCH_MODEL, default shapes; rounds from $DIFFSLOT_BENCH_ROUNDS).
Under plain `pytest` (benchmarks disabled by pytest.ini) each test runs one step as a
smoke, on the tiny test model with 8 slots and two fractions.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.core import CoreConfig, EngineCore  # noqa: E402
from engine.core.config import LAYOUTS as ALL_LAYOUTS  # noqa: E402
from engine.core.runner import bucket_rows  # noqa: E402
from engine.protocol import GenerateParams  # noqa: E402
from workload_common import PROMPTS, TimedDenoiser, bench_model_folder  # noqa: E402

LAYOUTS = tuple(sorted(ALL_LAYOUTS, key=lambda name: name != "padded"))  # padded first: the baseline row
FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
QUICK_FRACTIONS = (0.25, 1.0)
MIXED_SAMPLERS = ("euler", "dpmpp_2m")  # deterministic: `runner.build_batch` draws no noise
STEPS = 200  # per request; trajectories are rewound before anyone reaches the end
SMOKE_SLOTS = 8


# ---- model ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def load_bench_model(name: str = "shapes"):
    """(model, label): the text model (`shapes`), `tiny-sd`, or a folder. A tiny SD
    folder is built once per process."""
    from engine.models.loading import load_model

    folder, label = bench_model_folder(name, _scratch())
    return load_model(folder, device="cpu"), label


@functools.lru_cache(maxsize=None)
def _scratch() -> pathlib.Path:
    import atexit
    import shutil
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp(prefix="bench-compaction-"))
    atexit.register(shutil.rmtree, path, True)
    return path


# ---- one engine, one layout, one fraction ----------------------------------------------

@dataclasses.dataclass
class Sample:
    """One timed `runner.run`, in seconds."""

    total: float
    denoise: float = math.nan  # the model's denoiser call, as the TimedDenoiser saw it
    build: float = math.nan  # `runner.build_batch` alone, called once more before the step

    @property
    def host(self) -> float:
        return self.total - self.denoise


class StepBench:
    """An EngineCore of one layout with `active` requests admitted, ready to time one step."""

    def __init__(self, model, layout: str, slots: int, active: int, steps: int = STEPS):
        if not 1 <= active <= slots:
            raise ValueError(f"active must be in [1, {slots}], not {active}")
        self.layout, self.slots, self.active, self.steps = layout, slots, active, steps
        config = CoreConfig(slots=slots, layout=layout, admission="continuous", max_queue=slots,
                            decode_buffers=slots, max_steps=steps, device="cpu")
        self.timed = TimedDenoiser(model)
        self.core = core = EngineCore(self.timed, config)
        prompts = [p for p in model.prompts if p] or list(PROMPTS)  # class names, or free text
        for i in range(active):
            core.add_request(f"bench-{i}", GenerateParams(
                prompt=prompts[i % len(prompts)], steps=steps, sampler=MIXED_SAMPLERS[(i // 2) % len(MIXED_SAMPLERS)],
                guidance=1.0 if i % 2 == 0 else 3.0, seed=i, output="latent"))
        core.admit()
        (self.group,) = core.groups.values()
        group = self.group
        self.storage = storage = core.storage[group.key]
        if group.active != active or core.queue:
            raise RuntimeError(f"admitted {group.active} of {active} requests")
        self.initial_latents = storage.latents.clone()
        self.initial_history = storage.history.clone()
        batch = core.runner.build_batch(core.scheduler.next_step())  # the row map the timed steps will use
        self.rows = len(batch.row_slot)
        self.useful_rows = batch.useful_rows
        self.padded_rows = batch.padded_rows

    @property
    def fraction(self) -> float:
        return self.active / self.slots

    def prepare(self) -> None:
        """Untimed, before each step: drop the launch records the reaper would consume, and
        rewind every trajectory to its start before any would finish."""
        core, group = self.core, self.group
        core.inflight.clear()
        if int(group.step_index.max()) >= self.steps - 1:
            group.step_index[group.busy] = 0
            self.storage.latents.copy_(self.initial_latents)
            self.storage.history.copy_(self.initial_history)

    def step(self) -> None:
        """One engine step, exactly as the engine runs it: the scheduler's plan, the
        runner's execution, the scheduler's update from its outcome."""
        plan = self.core.scheduler.next_step()
        self.core.scheduler.update_from_output(plan, self.core.runner.execute(plan))

    def timed_step(self, breakdown: bool = True) -> Sample:
        self.prepare()
        build = math.nan
        if breakdown:
            start = time.perf_counter()
            self.core.runner.build_batch(self.core.scheduler.next_step())  # deterministic samplers draw no noise
            build = time.perf_counter() - start
        start = time.perf_counter()
        self.step()
        total = time.perf_counter() - start
        return Sample(total=total, denoise=self.timed.last_s, build=build)


def active_for(fraction: float, slots: int) -> int:
    return max(1, min(slots, round(fraction * slots)))


# ---- the side-by-side measurement --------------------------------------------------------

def measure(model, slots: int, fractions, layouts=LAYOUTS, repeats: int = 30, warmup: int = 3,
            progress=None) -> list[dict]:
    benches = {(f, layout): StepBench(model, layout, slots, active_for(f, slots))
               for f in fractions for layout in layouts}
    samples: dict[tuple, list[Sample]] = {key: [] for key in benches}
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(warmup + repeats):
            gc.collect()
            gc.disable()
            for f in fractions:
                k = r % len(layouts)  # rotate the order, so no layout always runs first
                for layout in layouts[k:] + layouts[:k]:
                    sample = benches[f, layout].timed_step()
                    if r >= warmup:
                        samples[f, layout].append(sample)
            if gc_was_enabled:
                gc.enable()
            if progress:
                progress(r + 1, warmup + repeats)
    finally:
        if gc_was_enabled:
            gc.enable()
    results = []
    for f in fractions:
        padded_rate = None
        for layout in layouts:
            bench, got = benches[f, layout], samples[f, layout]
            med = {part: statistics.median(getattr(s, part) for s in got)
                   for part in ("total", "build", "denoise", "host")}
            rate = bench.useful_rows / med["total"]
            if layout == "padded":
                padded_rate = rate
            results.append(dict(
                layout=layout, fraction=f, active_slots=bench.active, slots=slots, rows=bench.rows,
                useful_rows=bench.useful_rows, padded_rows=bench.padded_rows,
                step_ms=1e3 * med["total"], build_ms=1e3 * med["build"], denoise_ms=1e3 * med["denoise"],
                host_ms=1e3 * med["host"],
                step_ms_p25=1e3 * float(np.percentile([s.total for s in got], 25)),
                step_ms_p75=1e3 * float(np.percentile([s.total for s in got], 75)),
                useful_evals_per_s=rate,
                vs_padded=None if padded_rate is None else rate / padded_rate,
                samples_ms=[round(1e3 * s.total, 4) for s in got],
            ))
    return results


def denoiser_fit(results: list[dict]) -> tuple[float, float]:
    """Least squares: denoiser ms ≈ fixed + per_row * rows computed."""
    rows = np.array([r["rows"] for r in results], dtype=float)
    ms = np.array([r["denoise_ms"] for r in results])
    if len(set(rows)) < 2:
        return float(ms.mean()), 0.0
    per_row, fixed = np.polyfit(rows, ms, 1)
    return float(fixed), float(per_row)


COLUMNS = [  # header, key, format
    ("layout", "layout", "{:<9}"), ("fraction", "fraction", "{:>8.3f}"), ("active", "active_slots", "{:>6d}"),
    ("rows", "rows", "{:>5d}"), ("useful", "useful_rows", "{:>6d}"), ("step ms", "step_ms", "{:>8.2f}"),
    ("build ms", "build_ms", "{:>8.3f}"), ("denoiser ms", "denoise_ms", "{:>11.2f}"),
    ("host ms", "host_ms", "{:>8.3f}"),
    ("useful evals/s", "useful_evals_per_s", "{:>14.0f}"), ("vs padded", "vs_padded", "{:>9.2f}"),
]


def format_table(results: list[dict]) -> str:
    widths = [len(fmt.format(*([""] if key == "layout" else [0]))) for _, key, fmt in COLUMNS]
    head = "  ".join(h.ljust(w) if key == "layout" else h.rjust(w) for (h, key, _), w in zip(COLUMNS, widths))
    lines = [head, "-" * len(head)]
    last = None
    for r in results:
        if last is not None and r["fraction"] != last:
            lines.append("")
        last = r["fraction"]
        lines.append("  ".join(fmt.format(r[key]) if r[key] is not None else "-".rjust(w)
                               for (_, key, fmt), w in zip(COLUMNS, widths)))
    return "\n".join(lines)


def summary(results: list[dict]) -> list[str]:
    fixed, per_row = denoiser_fit(results)
    lines = [f"denoiser ≈ {fixed:.2f} ms + {per_row:.3f} ms × rows computed (least squares over "
             f"{len(results)} medians)"]
    builds = [r["build_ms"] for r in results]
    hosts = [r["host_ms"] / r["step_ms"] for r in results]
    lines.append(f"build_batch {min(builds):.3f}–{max(builds):.3f} ms; host work (step − denoiser) "
                 f"{100 * min(hosts):.1f}–{100 * max(hosts):.1f}% of the step")
    for layout in LAYOUTS:
        if layout == "padded":
            continue
        mine = [r for r in results if r["layout"] == layout]
        if not mine:
            continue
        worse = [f"{r['fraction']:g} ({r['vs_padded']:.2f}×)" for r in mine if r["vs_padded"] is not None
                 and r["vs_padded"] < 1.0]
        verdict = "slower than padded at fraction " + ", ".join(worse) if worse else "never slower than padded"
        lines.append(f"{layout}: {verdict}")
    return lines


def plot(results: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(padded="tab:red", compact="tab:blue", bucketed="tab:green")
    for layout in LAYOUTS:
        mine = [r for r in results if r["layout"] == layout]
        if not mine:
            continue
        f = [r["fraction"] for r in mine]
        left.plot(f, [r["useful_evals_per_s"] for r in mine], "o-", color=colors[layout], label=layout)
        right.plot(f, [r["step_ms"] for r in mine], "o-", color=colors[layout], label=f"{layout}: step")
        right.fill_between(f, [r["step_ms_p25"] for r in mine], [r["step_ms_p75"] for r in mine],
                           color=colors[layout], alpha=0.15, linewidth=0)
        right.plot(f, [r["host_ms"] for r in mine], "x:", color=colors[layout], label=f"{layout}: host")
    left.set(xlabel="active fraction of slots", ylabel="useful evaluations / s", title="throughput (median)")
    left.set_ylim(bottom=0)
    right.set(xlabel="active fraction of slots", ylabel="ms (log scale)", yscale="log",
              title="step time (median, IQR band) and host work")
    for ax in (left, right):
        ax.set_xticks(sorted({r["fraction"] for r in results}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shapes", help="shapes (default), tiny-sd, or a diffusers model folder")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 30; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed repeats first (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help=f"fractions {QUICK_FRACTIONS} and few repeats: a smoke run")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", type=pathlib.Path, help="write the results (and every sample) here")
    ap.add_argument("--plot", type=pathlib.Path, help="write a PNG: useful evals/s and step time vs fraction")
    args = ap.parse_args(argv)
    if args.slots < 1:
        ap.error("--slots must be positive")
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if repeats < 1 or warmup < 0:
        ap.error("--repeats must be positive and --warmup non-negative")
    fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    if args.threads:
        torch.set_num_threads(args.threads)

    model, label = load_bench_model(args.model)
    meta = dict(
        command=" ".join(["python", "bench/bench_compaction.py", *(sys.argv[1:] if argv is None else argv)]),
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), model=label,
        latent_shape=list(model.latent_shape(model.native_size, model.native_size)), slots=args.slots,
        repeats=repeats, warmup=warmup, torch=torch.__version__, torch_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(), cuda=torch.cuda.is_available(), machine=platform.machine(),
        python=platform.python_version(), device="cpu",
    )
    print(f"model={label} latent={tuple(meta['latent_shape'])} slots={args.slots} repeats={repeats} "
          f"warmup={warmup} torch={torch.__version__} threads={meta['torch_threads']} "
          f"cpus={meta['cpu_count']} device=cpu", flush=True)
    started = time.perf_counter()
    results = measure(model, args.slots, fractions, repeats=repeats, warmup=warmup,
                      progress=lambda i, n: print(f"  repeat {i}/{n}", file=sys.stderr, flush=True)
                      if i % 10 == 0 or i == n else None)
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"medians over {repeats} interleaved repeats, one runner.run each ({meta['wall_s']:.0f} s)")
    print(format_table(results))
    for line in summary(results):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(dict(meta=meta, results=results), indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, f"one engine step, {args.slots} slots, model {label}, "
                                 f"torch {torch.__version__}, threads={meta['torch_threads']}, CPU")
        print(f"wrote {args.plot}")
    return 0


# ---- pytest-benchmark face ----------------------------------------------------------------

def _benchmarks_disabled(config) -> bool:
    return bool(config.getoption("benchmark_disable", False)) and not config.getoption("benchmark_enable", False)


def pytest_generate_tests(metafunc):
    """layout × fraction; the plain-pytest smoke (benchmarks disabled) takes two fractions."""
    if metafunc.function.__name__ != "test_step":
        return
    smoke = _benchmarks_disabled(metafunc.config)
    metafunc.parametrize("fraction", QUICK_FRACTIONS if smoke else FRACTIONS)
    metafunc.parametrize("layout", LAYOUTS)


def test_step(benchmark, request, layout, fraction):
    smoke = _benchmarks_disabled(request.config)
    wanted = "tiny-sd" if smoke else os.environ.get("DIFFSLOT_BENCH_MODEL", "shapes")
    model, label = load_bench_model(wanted)
    if label != wanted:
        warnings.warn(f"benchmarking the {label} model: {wanted} is not available", stacklevel=1)
    slots = SMOKE_SLOTS if smoke else 64
    bench = StepBench(model, layout, slots, active_for(fraction, slots))
    expected_rows = {"padded": 2 * slots, "compact": bench.useful_rows,
                     "bucketed": bucket_rows(bench.useful_rows, 2 * slots)}[layout]
    assert bench.rows == expected_rows and bench.padded_rows == bench.rows - bench.useful_rows
    rounds = int(os.environ.get("DIFFSLOT_BENCH_ROUNDS", "30"))
    before = bench.group.step_index.copy()
    benchmark.pedantic(bench.step, setup=bench.prepare, rounds=rounds, warmup_rounds=3, iterations=1)
    parts = [bench.timed_step() for _ in range(1 if smoke else 5)]
    assert (bench.group.step_index != before).any(), "no slot advanced"
    assert torch.isfinite(bench.storage.latents).all()
    med = {p: 1e3 * statistics.median(getattr(s, p) for s in parts) for p in ("build", "denoise", "host")}
    benchmark.extra_info.update(
        model=label, slots=slots, active_slots=bench.active, rows=bench.rows, useful_rows=bench.useful_rows,
        build_ms=round(med["build"], 4), denoise_ms=round(med["denoise"], 4), host_ms=round(med["host"], 4))
    if benchmark.enabled and benchmark.stats is not None:
        benchmark.extra_info["useful_evals_per_s"] = round(bench.useful_rows / benchmark.stats.stats.median, 1)


if __name__ == "__main__":
    sys.exit(main())
