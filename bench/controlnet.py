"""Per-request ControlNet: a mixed trace where some requests use one of two ControlNets,
against the two policies a serving system without per-row ControlNets has, on the same
trace, side by side in one process.

    python bench/controlnet.py [--duration 15] [--load 1.3] [--rate R] [--share 0.3] [--repeats 3]
                               [--slots 16] [--threads 1] [--quick] [--json OUT]

Model: the embedded `shapes` folder (`StableDiffusionPipeline`, UNet at 8×8 latents) and
two random ControlNets built from its UNet as diffusers' tests build them
(`engine.testing.tiny_conditioning.build_controlnet`: `ControlNetModel.from_unet`, the
zero-initialised projections made random), written to a temporary folder. Outputs are
`latent` (arrival → final latents: the figures isolate the denoiser). One torch thread by
default (`--threads`).

Systems (each driven in this process through the core calls only):

  mixed      `EngineCore` with both ControlNets: each runs once per call on the rows that
             use it at their step (a gathered sub-batch), plain rows pay nothing;
  keyed      the same core, but a request's group key also holds its ControlNet names, so
             only requests with the same ControlNets share a call (a batch keyed by ControlNet);
  all-rows   the same core, but every ControlNet used in a call runs on every row of it
             (rows without it at scale 0, as a batch that applies the ControlNet uniformly).

The trace (seeded, the same for every system): Poisson arrivals for `--duration` s at
`--rate`, or by default at `--load` × the mixed system's capacity (completed/s of a
burst of `--probe` requests); prompts from the shapes prompts; steps 4 / 10 / 20 (shares
0.4 / 0.35 / 0.25), sampler euler, guidance 3; `--share` of the requests (default 30%) use
one ControlNet (either one, equally), at scale 1.0 or 0.7, with a drawn silhouette image.

Reported per run: completed requests, goodput (completed images / (last completion − first
arrival)), p50 time to usable output of all requests and of the short (4-step) ones,
denoiser calls, mean rows per call; the ratio of mixed's goodput to keyed's and to
all-rows' per repeat and their medians (target: mixed ≥ 1.5× keyed). Each request's final
latents are compared across systems (worst relative L2 against mixed). Then the gathered
sub-batch's cost: one denoiser call of `--slots` guided requests (2 rows each) plain, with
one ControlNet on 30% of the requests' rows (gathered), and on every row.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.trace_replay import replay_records  # noqa: E402

STEP_CLASSES = (4, 10, 20)
STEP_SHARES = (0.4, 0.35, 0.25)
SAMPLER, GUIDANCE = "euler", 3.0
SYSTEMS = ("mixed", "keyed", "all-rows")
NETS = ("edges", "depth")
SIZE = 32  # every request at the shapes model's native size: a request without a height takes its control image's


def silhouette(rng: random.Random, size: int = SIZE) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), 0)
    x0, y0 = rng.randrange(size // 2), rng.randrange(size // 2)
    box = [x0, y0, x0 + rng.randint(4, size // 2), y0 + rng.randint(4, size // 2)]
    (ImageDraw.Draw(image).ellipse if rng.random() < 0.5 else ImageDraw.Draw(image).rectangle)(box, fill=(255,) * 3)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_trace(seed: int, rate: float | None, duration: float, prompts: list[str], share: float,
               count: int | None = None) -> list[dict]:
    """[{id, at, prompt, steps, seed, controls: [(name, image, scale)]}]; `rate` None: `count` at 0."""
    rng = random.Random(seed)
    trace, t = [], 0.0
    while True:
        if rate is not None:
            t += rng.expovariate(rate)
            if t >= duration:
                break
        elif len(trace) >= count:
            break
        controls = []
        if rng.random() < share:
            controls.append((rng.choice(NETS), silhouette(rng), 1.0 if rng.random() < 0.5 else 0.7))
        trace.append(dict(id=f"r{len(trace):04d}", at=t if rate is not None else 0.0, prompt=rng.choice(prompts),
                          steps=rng.choices(STEP_CLASSES, STEP_SHARES)[0], seed=rng.randrange(1 << 31),
                          controls=controls))
    return trace


def params_of(entry: dict):
    from engine.protocol import Control, GenerateParams

    return GenerateParams(prompt=entry["prompt"], negative_prompt="", steps=entry["steps"], sampler=SAMPLER,
                          guidance=GUIDANCE, seed=entry["seed"], output="latent", height=SIZE, width=SIZE,
                          controls=tuple(Control(name, image, scale=scale) for name, image, scale in entry["controls"]))


# ---- the systems -----------------------------------------------------------------------------

def make_core(system: str, model, slots: int, max_queue: int = 1 << 16):
    """The engine core of `system` on `model.device`: keyed puts a request's ControlNet
    names in its group key; mixed and all-rows are the engine as it is (all-rows runs under
    `every_row`)."""
    from engine.core import CoreConfig, EngineCore

    config = CoreConfig(slots=slots, device=str(model.device), max_queue=max_queue, max_groups=32)
    if system == "keyed":
        class ControlNetKeyedCore(EngineCore):
            """Requests share a call only with requests of the same ControlNets."""

            def add_request(self, request_id, params, arrival_time=None, partial_images=0):
                super().add_request(request_id, params, arrival_time, partial_images)
                request = self.requests[request_id]
                request.group_key = (*request.group_key, ("controls", tuple(c.name for c in params.controls)))

        return counting_calls(ControlNetKeyedCore(model, config))
    return counting_calls(EngineCore(model, config))


@contextlib.contextmanager
def every_row():
    """While it lasts, each call's ControlNets run on every real row of it: the rows that do
    not use one get it at scale 0 (their output unchanged, its compute spent)."""
    from engine.core.input_kinds.controls import ControlSlots

    original = ControlSlots.call

    def call(self, controlnets, row_slot, row_branch, slot_step, real):
        found = original(self, controlnets, row_slot, row_branch, slot_step, real)
        if found is None:
            return None
        rows = [int(r) for r in real.nonzero()[0]]
        for run in found.runs:
            present = set(run.rows)
            zero = run.factors[0] * 0
            for row in rows:
                if row not in present:
                    run.rows.append(row)
                    run.images.append(run.images[0])
                    run.factors.append(zero)
                    run.positions.append(0)
                    run.also.append(-1)
        return found

    ControlSlots.call = call
    try:
        yield
    finally:
        ControlSlots.call = original


def counting_calls(core):
    """The core with its runner's steps (one denoiser call each) counted in `core.calls`."""
    execute = core.runner.execute
    core.calls = 0

    def counted(plan):
        core.calls += 1
        return execute(plan)

    core.runner.execute = counted
    return core


def drive(core, trace: list[dict], limit_s: float) -> dict:
    """Replay `trace` against `core` through its public calls; per-request records."""
    return replay_records(core, trace, params_of, limit_s)


def run_system(system: str, model, trace: list[dict], slots: int, limit_s: float) -> dict:
    core = make_core(system, model, slots)
    with every_row() if system == "all-rows" else contextlib.nullcontext():
        records = drive(core, trace, limit_s)
    stats = core.stats()
    done = [r for r in records.values() if r["state"] == "done"]
    short = [records[e["id"]]["ttuo"] for e in trace if e["steps"] == STEP_CLASSES[0]
             and records.get(e["id"], {}).get("state") == "done"]
    span = max(r["done_at"] for r in done) - min(e["at"] for e in trace) if done else float("nan")
    calls = core.calls
    rows = int(stats["useful_evals"]) + int(stats["padded_evals"])
    return dict(system=system, completed=len(done), failed=sum(r["state"] == "failed" for r in records.values()),
                goodput=len(done) / span if span > 0 else float("nan"),
                p50=statistics.median(r["ttuo"] for r in done) if done else float("nan"),
                p50_short=statistics.median(short) if short else float("nan"),
                calls=calls, rows_per_call=rows / calls if calls else float("nan"), groups=len(core.groups),
                records=records)


def capacity(model, prompts: list[str], share: float, slots: int, probe: int, seed: int) -> float:
    trace = make_trace(seed, None, 0.0, prompts, share, count=probe)
    result = run_system("mixed", model, trace, slots, 600.0)
    return result["goodput"]


def call_cost(model, slots: int, share: float, repeats: int) -> dict:
    """ms of one denoiser call of `slots` guided requests (2 rows each): plain, with one
    ControlNet on `share` of the requests' rows (gathered), and on every row."""
    import numpy as np
    import torch

    from engine.core.input_kinds.controls import ControlSlot, ControlSlots
    from engine.models.controlnet import ControlEntry, control_factors
    from engine.models.model import model_inputs

    rows = 2 * slots
    shape = model.latent_shape(model.native_size, model.native_size)
    cond = model.encode(["a red circle"])[0]
    sample = torch.randn(rows, *shape)
    inputs = model_inputs(sample, torch.full((rows,), 500.0), [cond] * rows)
    net = model.controlnets[NETS[0]]
    image = model.prepare_control_image(
        __import__("PIL.Image", fromlist=["Image"]).open(io.BytesIO(silhouette(random.Random(0)))),
        model.native_size, model.native_size, None, net)
    state = ControlSlots(model.device)
    using = max(1, round(share * slots))
    row_slot = np.repeat(np.arange(slots), 2)
    branch = np.tile([0, 1], slots)
    real = np.ones(rows, dtype=bool)
    steps = np.zeros(slots, dtype=np.int64)

    def gathered(count):
        state.slots.clear()
        for slot in range(count):
            state.place(slot, ControlSlot([ControlEntry(NETS[0], image, np.ones(1, bool),
                                                        control_factors(1.0, False, net))], False, False, 0))
        return state.call(model.controlnets, row_slot, branch, steps, real)

    timings = {}
    for name, controls in (("plain", lambda: None), ("gathered", lambda: gathered(using)),
                           ("every row", lambda: gathered(slots))):
        times = []
        with torch.no_grad():
            for k in range(repeats + 1):
                call = controls()
                started = time.perf_counter()
                model.run(dataclass_replace(inputs, controls=call))
                if k:
                    times.append(time.perf_counter() - started)
        timings[name] = 1000 * statistics.median(times)
    timings["gathered rows"] = 2 * using
    return timings


def dataclass_replace(inputs, **fields):
    import dataclasses

    return dataclasses.replace(inputs, **fields)


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--load", type=float, default=1.3, help="arrival rate as a multiple of mixed's capacity")
    ap.add_argument("--rate", type=float, default=None, help="arrivals/s (default: --load × capacity)")
    ap.add_argument("--share", type=float, default=0.3, help="requests that use a ControlNet")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--probe", type=int, default=48, help="requests of the capacity burst")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke: short trace, one repeat")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.repeats, args.probe, args.slots = 3.0, 1, 12, 8
    import torch

    torch.set_num_threads(args.threads)
    quiet_libraries()
    from engine.models import SHAPES_DIR
    from engine.models.controlnet import attach_controlnets
    from engine.models.loading import load_model
    from engine.testing.pipeline_oracle import rel_l2
    from engine.testing.tiny_conditioning import build_controlnet

    with tempfile.TemporaryDirectory(prefix="controlnet-bench-") as tmp:
        paths = {name: build_controlnet(pathlib.Path(tmp) / name, SHAPES_DIR, seed=k + 1)
                 for k, name in enumerate(NETS)}
        model = load_model("shapes")
        attach_controlnets(model, paths)
    from engine.models.shapes.draw import PROMPTS

    prompts = list(PROMPTS)
    rate = args.rate or args.load * capacity(model, prompts, args.share, args.slots, args.probe, args.seed)
    print(f"shapes, ControlNets {', '.join(NETS)} ({args.share:.0%} of requests), {args.slots} slots, "
          f"{args.threads} thread(s); trace {args.duration:g} s at {rate:.2f}/s")
    header = f"{'run':>3} {'system':<9} {'done':>5} {'goodput/s':>10} {'p50 s':>7} {'p50 short s':>12} " \
             f"{'calls':>6} {'rows/call':>9} {'groups':>6}"
    print(header)
    report = {"rate": rate, "runs": [], "ratios": {"keyed": [], "all-rows": []}, "worst_rel_l2": 0.0}
    for repeat in range(args.repeats):
        trace = make_trace(args.seed + 1 + repeat, rate, args.duration, prompts, args.share)
        order = SYSTEMS[repeat % 3:] + SYSTEMS[:repeat % 3]
        results = {}
        for system in order:
            results[system] = run_system(system, model, trace, args.slots, 60 * args.duration + 600)
        for system in SYSTEMS:
            r = results[system]
            print(f"{repeat:>3} {system:<9} {r['completed']:>5} {r['goodput']:>10.2f} {r['p50']:>7.2f} "
                  f"{r['p50_short']:>12.2f} {r['calls']:>6} {r['rows_per_call']:>9.1f} {r['groups']:>6}")
            report["runs"].append({k: v for k, v in r.items() if k != "records"} | {"repeat": repeat})
        mixed = results["mixed"]
        for system in ("keyed", "all-rows"):
            report["ratios"][system].append(mixed["goodput"] / results[system]["goodput"])
            for rid, rec in results[system]["records"].items():
                ref = mixed["records"].get(rid)
                if rec["state"] == "done" and ref and ref["state"] == "done":
                    report["worst_rel_l2"] = max(report["worst_rel_l2"], rel_l2(rec["latents"], ref["latents"]))
    for system, ratios in report["ratios"].items():
        print(f"mixed / {system} goodput: {' '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
    print(f"worst relative L2 of a request's latents against mixed: {report['worst_rel_l2']:.2e}")
    cost = call_cost(model, args.slots, args.share, 3 if args.quick else 10)
    report["call_ms"] = cost
    print(f"one call of {args.slots} guided requests: plain {cost['plain']:.1f} ms, ControlNet gathered on "
          f"{cost['gathered rows']} rows {cost['gathered']:.1f} ms, on every row {cost['every row']:.1f} ms")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
