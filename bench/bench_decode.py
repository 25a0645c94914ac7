"""Decode stage throughput and hand-off latency (R7).

    python bench/bench_decode.py [--quick] [--workers 1 2 4] [--images 96] [--output png|uint8]
                                 [--model shapes|PATH] [--device cpu|cuda]

For each worker count it starts a `MultiProcessDecodeStage` (workers load the VAE
themselves; one warm-up decode each), then
  throughput   submits --images final latents at once (the engine side queues what
               does not fit the arena) and times first submit → last output copied out:
               images/s, with decode + post-processing (PNG or uint8) in the workers;
  hand-off     one request at a time with every worker idle: publish → a worker has
               claimed the buffer and starts decoding (futex wake + CAS), p50 / p99.
The model is the embedded `shapes` model when its weights exist; otherwise a VAE of the
same architecture with random weights (same compute, says so in the output).
Importing this module does nothing (pytest collects bench_*.py).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def _model_folder(name: str, scratch: pathlib.Path) -> tuple[pathlib.Path, str]:
    from engine.models import resolve

    try:
        return resolve(name), name
    except FileNotFoundError:
        if name != "shapes":
            raise
    import torch

    from engine.models.shapes.train import make_vae

    torch.manual_seed(0)
    make_vae().save_pretrained(scratch / "vae")
    return scratch, "shapes architecture, random weights (trained weights not present yet)"


def _measure(folder, workers: int, images: int, handoffs: int, kind: str, device: str,
             threads: int | None) -> dict:
    import numpy as np
    import torch

    from engine.decode.workers import MultiProcessDecodeStage
    from engine.protocol import GenerateParams, Timings

    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    started = time.perf_counter()
    stage = MultiProcessDecodeStage(folder, workers=workers, buffers=max(8, 2 * workers), device=device,
                                    threads_per_worker=threads)
    start_s = time.perf_counter() - started
    try:
        side = stage.native_size // stage.vae_scale
        shape = (stage.latent_channels, side, side)  # the native image size
        gen = torch.Generator().manual_seed(0)
        latents = [torch.randn(shape, generator=gen) for _ in range(8)]
        params = GenerateParams("a red circle", output=kind)

        def run(n: int, prefix: str) -> float:
            t0 = time.perf_counter()
            for k in range(n):
                stage.submit(f"{prefix}{k}", latents[k % len(latents)], params, Timings(), time.monotonic())
            done = 0
            while done < n:
                for out in stage.poll():
                    assert out.error is None, out.error
                    done += 1
                time.sleep(0.0002)
            return time.perf_counter() - t0

        run(2 * workers, "warm")
        wall = run(images, "t")
        stage.handoff_ns.clear()
        for k in range(handoffs):  # idle workers: the pure hand-off
            run(1, f"h{k}-")
            time.sleep(0.002)
        lat = np.array(stage.handoff_ns, dtype=np.float64) / 1e3
        return {"workers": workers, "threads": threads, "start_s": start_s, "images": images,
                "wall_s": wall, "ips": images / wall, "p50_us": float(np.percentile(lat, 50)),
                "p99_us": float(np.percentile(lat, 99)), "samples": len(lat)}
    finally:
        stage.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer images and samples (a smoke run)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--handoffs", type=int, default=200)
    ap.add_argument("--output", choices=("png", "uint8"), default="png")
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per worker (default: CPU cores / workers, at least 1)")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.handoffs = min(args.images, 16), min(args.handoffs, 30)
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="diffslot-bench-") as scratch:
        folder, label = _model_folder(args.model, pathlib.Path(scratch))
        rows = [_measure(folder, n, args.images, args.handoffs, args.output, args.device, args.threads)
                for n in args.workers]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"decode stage: model {label}; output {args.output}; device {args.device}; "
          f"{os.cpu_count()} CPU cores, load average {load:.1f} at the end")
    print(f"images of the native size; {args.images} per throughput run, {args.handoffs} hand-offs\n")
    print(f"{'workers':>7} {'threads':>7} {'start_s':>8} {'images/s':>9} {'wall_s':>7} "
          f"{'handoff p50 µs':>15} {'p99 µs':>8} {'n':>4}")
    for r in rows:
        print(f"{r['workers']:>7} {r['threads']:>7} {r['start_s']:>8.1f} {r['ips']:>9.1f} {r['wall_s']:>7.2f} "
              f"{r['p50_us']:>15.0f} {r['p99_us']:>8.0f} {r['samples']:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
