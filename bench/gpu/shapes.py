"""Part `shapes`: the embedded `shapes` folder (its own text encoder, UNet and VAE) in fp16:
goodput with `latent`, `png` through the in-process decode, and `png` through one decode
worker process (the page-locked shared arena; `engine._C` compiled here if this Python
lacks it); every request served, no worker fault."""
from __future__ import annotations

import importlib
import os
import pathlib
import shutil
import subprocess
import sysconfig
import time

import torch

from engine.decode.factory import make_decode_stage
from engine.decode.stage import DecodeConfig
from engine.models.loading import load_model
from engine.models.shapes.draw import PROMPTS

from .engine_internals import CoreConfig
from .report import check, row
from .served import generate_requests, serve_in_process, served_row

REPO = pathlib.Path(__file__).resolve().parents[2]


def ensure_c_extension() -> str:
    """`engine._C` (the decode arena's atomics) for this Python: compiled here with the C
    compiler when missing (the lent machine's Python is not the checkout's)."""
    try:
        importlib.import_module("engine._C")
        return "present"
    except ImportError:
        pass
    target = REPO / "engine" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("engine._C is missing and there is no C compiler to build it")
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
           str(REPO / "csrc" / "atomics.c"), "-o", str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"building engine._C failed: {proc.stderr[-400:]}")
    importlib.invalidate_caches()
    importlib.import_module("engine._C")
    return f"built {target.name}"


def run(args) -> None:
    """The embedded `shapes` text-to-image folder (its own CLIP encoder, UNet, VAE) in fp16
    on CUDA: `latent`, `png` with the in-process decode, and `png` with one decode worker
    process (the page-locked shared arena: `engine._C`), same requests each."""
    device = f"cuda:{torch.cuda.current_device()}"  # explicit: the worker process picks its device from it
    t0 = time.perf_counter()
    model = load_model("shapes", device, dtype=torch.float16)
    row("shapes", "load_model('shapes', fp16)", "s", time.perf_counter() - t0, "info",
        f"{model.geometry}, {sum(p.numel() for p in model.denoiser.parameters()) / 1e6:.1f} M UNet parameters")
    slots, n, steps = 16, (48 if args.quick else 64), (10 if args.quick else 20)
    config = CoreConfig(slots=slots, max_steps=64, device=device)
    results = {}
    stage = make_decode_stage(model, 0)
    try:
        serve_in_process(model, stage, generate_requests("warm", 2, "png", 2, PROMPTS), config)
        for kind in ("latent", "png"):
            results[kind] = serve_in_process(model, stage, generate_requests(kind, n, kind, steps, PROMPTS), config)
    finally:
        stage.close()
    ok = all([served_row("shapes", f"{n} x {steps} steps, {kind}, in-process decode", r, n)
              for kind, r in results.items()])
    base = results["latent"]["goodput"]
    row("shapes", "png, in-process decode / latent", "goodput ratio", results["png"]["goodput"] / base,
        "info" if ok else "FAIL")
    built = ensure_c_extension()  # before the stage: the arena's atomics
    t0 = time.perf_counter()
    stage = make_decode_stage(model, DecodeConfig(workers=1), buffers=config.decode_buffers)
    try:
        row("shapes", "one decode worker", "started (s)", time.perf_counter() - t0, "info",
            f"engine._C {built}; arena page-locked: {getattr(stage.arena, '_pinned', None) is not None}")
        serve_in_process(model, stage, generate_requests("warmw", 2, "png", 2, PROMPTS), config)
        worker = serve_in_process(model, stage, generate_requests("pngw", n, "png", steps, PROMPTS), config)
        worker_stats = stage.stats()
    finally:
        stage.close()
    ok = served_row("shapes", f"{n} x {steps} steps, png, one decode worker", worker, n)
    row("shapes", "png, one decode worker / latent", "goodput ratio", worker["goodput"] / base,
        "info" if ok else "FAIL")
    faults = {k: v for k, v in worker_stats.items() if k in ("decode_failed", "decode_worker_deaths",
                                                             "decode_worker_hangs") and v}
    check("shapes", "one decode worker", "worker faults", len(faults), not faults, str(faults or ""))
