"""Step caches on a mixed trace: the same requests with caching off and with each kind at
several settings, side by side in one run.

    python bench/step_cache.py [--model shapes-dit] [--requests 48] [--slots 8] [--steps 20]
                               [--threads 2] [--quick | --configs off,mag:0.04,...]

Driven through the engine's own loop (`EngineCore`: every request added at t = 0, then
`step()` until all are done: the saturated case), `latent` outputs decoded afterwards by
the model's VAE (outside the timing) and read by the shapes classifier. The trace mixes
prompts, seeds and step counts (`--steps` and 1.5× it). Reported per configuration:

- goodput: requests per second of denoising, and its ratio over caching off;
- tail rows per call: the rows that ran the transformer past its first block (or at all),
  per denoiser call (caching off: every row);
- hit rate: the share of (request, step) decisions that skipped work;
- accuracy: the share of images the classifier reads as their prompt, and the points lost
  against caching off;
- MAD: the mean absolute pixel difference (0–255) from the same request uncached.

Target (issue: step caching): ≥ 1.5× goodput at ≤ 2 points of accuracy lost.

MagCache needs the model's magnitude ratios: the folder's `mag_ratios.json`, else they are
calibrated here first with diffusers' own `MagCacheConfig(calibrate=True)` on the
pipeline (one request, `--steps` steps), and printed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import random
import re
import time

import numpy as np
import torch

from engine.core import CoreConfig, EngineCore
from engine.models import resolve
from engine.models.loading import load_model
from engine.models.shapes.classify import classify
from engine.models.shapes.draw import PROMPTS
from engine.protocol import GenerateParams, StepCache


def trace(count: int, steps: int, size: int | None, seed: int = 0) -> list[tuple[str, GenerateParams]]:
    rng = random.Random(seed)
    return [(f"r{k}", GenerateParams(prompt=rng.choice(PROMPTS), steps=rng.choice((steps, steps * 3 // 2)),
                                     seed=rng.randrange(1 << 30), output="latent", height=size, width=size))
            for k in range(count)]


def calibrate_mag_ratios(folder, steps: int, size: int | None = None) -> list[float]:
    """diffusers' own MagCache calibration on the folder's pipeline (one request)."""
    import diffusers
    from diffusers.hooks import MagCacheConfig, apply_mag_cache

    from engine.models.geometry import pipeline_class_of

    pipe = getattr(diffusers, pipeline_class_of(folder)).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    apply_mag_cache(pipe.transformer, MagCacheConfig(calibrate=True, num_inference_steps=steps))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pipe(PROMPTS[0], num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="latent",
         height=size, width=size)
    found = re.findall(r"\[([0-9eE., +-]+)\]", printed.getvalue())
    if not found:
        raise RuntimeError(f"no calibration printed: {printed.getvalue()!r}")
    return [float(x) for x in found[-1].split(",")]


def configurations(ratios: list[float], quick: bool) -> dict[str, StepCache | None]:
    configs = {"off": None,
               "first_block 0.05": StepCache("first_block", threshold=0.05),
               "first_block 0.1": StepCache("first_block", threshold=0.1),
               "first_block 0.2": StepCache("first_block", threshold=0.2),
               "mag 0.06": StepCache("mag", threshold=0.06, mag_ratios=tuple(ratios)),
               "mag 0.12": StepCache("mag", threshold=0.12, mag_ratios=tuple(ratios)),
               "taylorseer 5/3": StepCache("taylorseer"),
               "taylorseer 2/2": StepCache("taylorseer", cache_interval=2, disable_cache_before_step=2)}
    if quick:
        configs = {k: v for k, v in configs.items() if k in ("off", "first_block 0.1", "mag 0.06", "taylorseer 2/2")}
    return configs


def named_configuration(text: str, ratios: list[float]) -> tuple[str, StepCache | None]:
    """`off`, `first_block:T`, `mag:T`, `taylorseer:INTERVAL/BEFORE` or `taylorseer-lite:INTERVAL/BEFORE`
    → (its table name, its cache)."""
    kind, _, value = text.partition(":")
    if kind == "off":
        return "off", None
    if kind in ("taylorseer", "taylorseer-lite"):
        interval, _, before = value.partition("/")
        return f"{kind} {interval}/{before}", StepCache("taylorseer", cache_interval=int(interval),
                                                        disable_cache_before_step=int(before),
                                                        use_lite_mode=kind == "taylorseer-lite" or None)
    if kind not in ("first_block", "mag"):
        raise ValueError(f"{text!r}: off, first_block:T, mag:T, taylorseer:INTERVAL/BEFORE or "
                         "taylorseer-lite:INTERVAL/BEFORE")
    extra = {"mag_ratios": tuple(ratios)} if kind == "mag" else {}
    return f"{kind} {float(value):g}", StepCache(kind, threshold=float(value), **extra)


def run(model, jobs, cache: StepCache | None, slots: int) -> dict:
    core = EngineCore(model, CoreConfig(slots=slots, max_queue=len(jobs) + 1))
    with_cache = [(rid, p if cache is None else GenerateParams(**{**_fields(p), "cache": cache})) for rid, p in jobs]
    results = {}
    started = time.perf_counter()
    for rid, p in with_cache:
        core.add_request(rid, p)
    while core.has_unfinished_requests():
        for out in core.step():
            latents = getattr(out, "latents", None)
            if latents is not None:
                results[out.request_id] = latents.clone()
                core.decode_done(out.request_id)
    seconds = time.perf_counter() - started
    stats = core.stats()
    runner = core.runner
    calls = max(1, core.batches)
    return {"seconds": seconds, "results": results, "rows_per_call": (runner.useful_rows - runner.cache_rows_skipped) / calls,
            "hit_rate": stats["cache_hit_rate"]}


def _fields(p: GenerateParams) -> dict:
    import msgspec

    return msgspec.structs.asdict(p)


@torch.no_grad()
def images_of(model, results: dict, order: list[str]) -> np.ndarray:
    latents = torch.stack([results[rid] for rid in order])
    return np.concatenate([model.decode(latents[i:i + 16]) for i in range(0, len(order), 16)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shapes-dit")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", type=int, default=None, help="image side in pixels (default: the model's native)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 configurations")
    ap.add_argument("--configs", default=None,
                    help="comma-separated instead of the fixed list: off, first_block:T, mag:T, "
                         "taylorseer:INTERVAL/BEFORE, taylorseer-lite:INTERVAL/BEFORE (the first is the baseline)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = resolve(args.model)
    model = load_model(folder)
    ratios = model.mag_ratios
    if not (folder / "mag_ratios.json").exists():  # FLUX.1's own ratios fit FLUX.1, not another FLUX folder
        ratios = calibrate_mag_ratios(folder, args.steps, args.size)
        print(f"calibrated mag_ratios ({args.steps} steps): {[round(r, 4) for r in ratios]}")
    jobs = trace(args.requests, args.steps, args.size)
    order = [rid for rid, _ in jobs]
    wanted = [p.prompt.removeprefix("a ") for _, p in jobs]
    rows, baseline = [], None
    configs = configurations(list(ratios), args.quick) if args.configs is None else \
        dict(named_configuration(c, list(ratios)) for c in args.configs.split(","))
    for name, cache in configs.items():
        got = run(model, jobs, cache, args.slots)
        images = images_of(model, got["results"], order)
        readable = images.shape[1:3] == (32, 32)  # the classifier reads the shapes' 32×32 drawings
        accuracy = float(np.mean([r == w for r, w in zip(classify(images), wanted)])) if readable else float("nan")
        if baseline is None:
            baseline = {"seconds": got["seconds"], "images": images, "accuracy": accuracy}
        mad = float(np.abs(images.astype(np.float32) - baseline["images"].astype(np.float32)).mean())
        rows.append((name, len(jobs) / got["seconds"], baseline["seconds"] / got["seconds"], got["rows_per_call"],
                     got["hit_rate"], accuracy, 100 * (baseline["accuracy"] - accuracy), mad))
        print(f"  {name}: {got['seconds']:.1f} s", flush=True)
    print(f"\nmodel {args.model}, {args.requests} requests ({args.steps} and {args.steps * 3 // 2} steps), "
          f"{args.slots} slots, {args.threads} threads")
    print("| cache | goodput (req/s) | × off | tail rows/call | hit rate | accuracy | points lost | MAD |")
    print("|---|---|---|---|---|---|---|---|")
    for name, goodput, ratio, per_call, hit, acc, lost, mad in rows:
        print(f"| {name} | {goodput:.2f} | {ratio:.2f} | {per_call:.2f} | {hit:.2f} | {acc:.3f} | {lost:+.1f} | "
              f"{mad:.2f} |")


if __name__ == "__main__":
    main()
