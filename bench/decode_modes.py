"""PNG outputs against latent outputs: what each decode stage costs the denoiser.

    python bench/decode_modes.py [--requests 48] [--slots 8] [--repeats 3] [--threads 2] [--quick]

One saturating trace on the embedded `shapes` text model (all requests queued at once;
steps 4/20/50 in turn; samplers and guidance mixed; a few long ones canceled midway),
run through the engine's own loop (`core.step()`, then the decode stage's `poll()`, as
the engine process's busy loop does) once per configuration, interleaved over repeats:

  latent          no decode at all (the ceiling of this trace);
  png inline      `--in-process-decode inline`: decoded on the loop's thread between steps;
  png thread      `--in-process-decode thread`: decoded on a thread beside the loop;
  png worker      `--decode-workers 1`: one worker process (one torch thread) over the arena.

Goodput is completed images per second of wall time; the ratio to `latent` in the same
repeat is the headline (target ≥ 0.9), and the denoiser's mean time per call shows what a
decode beside it does to the call itself.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled, RequestFailed
from engine.decode.factory import make_decode_stage
from engine.decode.stage import DecodeConfig
from engine.models.loading import load_model
from engine.models.shapes.draw import PROMPTS
from engine.protocol import GenerateParams
from workload_trace import MIXED_SAMPLERS as SAMPLERS  # the workload's sampler mix

CONFIGS = {
    "latent": ("latent", None),
    "png inline": ("png", DecodeConfig(workers=0, in_process="inline")),
    "png thread": ("png", DecodeConfig(workers=0, in_process="thread")),
    "png worker": ("png", DecodeConfig(workers=1)),
}


class TimedRun:
    """Wraps `model.run` to time the denoiser's calls."""

    def __init__(self, model):
        self.model, self.inner = model, model.run
        self.seconds = self.calls = self.rows = 0

    def __call__(self, inputs):
        start = time.perf_counter()
        out = self.inner(inputs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += inputs.rows
        return out


def trace(n: int, output: str) -> list[tuple[str, GenerateParams, bool]]:
    out = []
    for k in range(n):
        steps = (4, 20, 50)[k % 3]
        params = GenerateParams(prompt=PROMPTS[k % len(PROMPTS)], steps=steps, sampler=SAMPLERS[k % len(SAMPLERS)],
                                guidance=(1.0, 3.0, 7.5)[k % 3 if k % 5 else 1], seed=k, output=output)
        out.append((f"r{k}", params, steps == 50 and k % 4 == 2))  # a few long ones canceled midway
    return out


def run_once(model, output: str, decode: DecodeConfig | None, n: int, slots: int) -> dict:
    core = EngineCore(model, CoreConfig(slots=slots, max_queue=n + 1, decode_buffers=2 * slots))
    stage = None if decode is None else make_decode_stage(model, decode, buffers=2 * slots)
    timed = TimedRun(model)
    model.run = timed
    try:
        jobs = trace(n, output)
        victims = {rid for rid, _, cancel in jobs if cancel}
        start = time.perf_counter()
        for rid, params, _ in jobs:
            core.add_request(rid, params)
        done = pending = 0
        steps_seen = {}
        while core.has_unfinished_requests() or pending:
            for out in core.step():
                if isinstance(out, DenoiseFinished):
                    if stage is None:
                        core.decode_done(out.request_id)
                        done += 1
                    else:
                        stage.submit(out.request_id, out.latents, out.params, out.timings)
                        pending += 1
                elif isinstance(out, (RequestCanceled, RequestFailed)):
                    pass
                elif hasattr(out, "step") and out.request_id in victims:
                    steps_seen[out.request_id] = out.step
                    if out.step == 10:
                        core.abort_requests([out.request_id])
            if stage is not None:
                for decoded in stage.poll():
                    pending -= 1
                    core.decode_done(decoded.request_id)
                    done += decoded.error is None
                if pending and not core.has_work():
                    time.sleep(0.0005)  # only decodes left: let them finish
        wall = time.perf_counter() - start
    finally:
        del model.run
        if stage is not None:
            stage.close()
    return dict(goodput=done / wall, wall=wall, done=done, call_ms=1e3 * timed.seconds / max(1, timed.calls),
                rows_per_call=timed.rows / max(1, timed.calls), denoiser_share=timed.seconds / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="12 requests, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 12, 1
    torch.set_num_threads(args.threads)
    model = load_model("shapes")
    names = [c for c in args.configs.split(",") if c]
    results = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:
            output, decode = CONFIGS[name]
            results[name].append(run_once(model, output, decode, args.requests, args.slots))
    latent = results.get("latent")
    print(f"{args.requests} requests, {args.slots} slots, {args.threads} torch threads, {args.repeats} repeats "
          "(medians; ratio = goodput / latent goodput in the same repeat)")
    print(f"{'configuration':<14} {'goodput img/s':>14} {'vs latent':>10} {'denoiser ms/call':>17} "
          f"{'rows/call':>10} {'denoiser share':>15}")
    for name, runs in results.items():
        ratio = statistics.median(r["goodput"] / l["goodput"] for r, l in zip(runs, latent)) if latent else float("nan")
        print(f"{name:<14} {statistics.median(r['goodput'] for r in runs):>14.2f} {ratio:>10.2f} "
              f"{statistics.median(r['call_ms'] for r in runs):>17.1f} "
              f"{statistics.median(r['rows_per_call'] for r in runs):>10.1f} "
              f"{statistics.median(r['denoiser_share'] for r in runs):>15.2f}")


if __name__ == "__main__":
    main()
