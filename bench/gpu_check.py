"""The GPU story of diffslot in one command on one CUDA device, ≤ 420 s with --quick.
It has never run on a device: no accelerator has been lent to this project yet, so every
target below is stated, not yet met.

    python3 bench/gpu_check.py [--only PART,...] [--quick] [--json OUT.json] [--device cuda:N] [--budget-s S]

    --only       comma-separated parts (names below), in the order below whatever the order given
    --quick      shorter timings and smaller runs (fewer requests, slots and steps; FLUX at 4 + 8 blocks)
    --json       the rows as JSON, rewritten after every part (a run stopped at its limit keeps them)
    --device     the CUDA device to run on (default: the current one)
    --budget-s   start no part after S seconds (default 300: with --quick no part takes much over
                 100 s, so the whole command ends within 420 s); the parts left get a FAIL row "not run"

The one prepared device run (15 device minutes in all, the machine's start included, at
most 10 minutes a command). Step 1, here, once (a registry is reachable from here, not
from the device): `bash bench/device_wheels.sh` downloads the wheels the lent machine
lacks (diffusers, msgspec, pyzmq, transformers, tokenizers, peft, accelerate and their
pure-Python needs, at this checkout's versions) into bench/.wheels (gitignored). Step 2,
on the device, with the carry list ["bench/.wheels"] and a 600 s limit:

    set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --quick --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

A part that failed can be rerun alone in the time left: `--quick --only PART --json ...`.
Every check's verdict is a function of `bench/gpu/judge.py` (its targets stated there),
fed a broken measurement by tests/test_gpu_check.py on CPU, where it must fail.

Parts (each prints table rows; a failure in one is reported and the others still run;
exit status 1 if any check failed). Each part is the module bench/gpu/<part>.py, with its
`run(args)`; every part's module is imported even where the part is skipped, so a CPU run
shows one that no longer imports:

  ptx          (CPU too) the update kernel's PTX: IEEE division (div.rn.f32, no
               div.approx/div.full), no FMA contraction, a NaN test before the clamp. On CUDA
               the PTX of the variants actually launched here (fp32/fp16/bf16 model outputs,
               from the JIT function's kernel cache); on CPU compiled for sm_90 with the
               launch's options.
  interpreter  (CPU too) the kernel through TRITON_INTERPRET=1 (a child process) against
               the torch reference, bit for bit: random cases, NaN outputs, strided views.
  kernel       the compiled kernel against the torch reference on CUDA, bit for bit (NaN
               where NaN): random cases in fp32/bf16/fp16 model outputs, every sampler's
               coefficient pattern (each kernel sampler × prediction type, first/middle/
               last steps), NaN model outputs, a learned-sigma `out[:, :C]` view; the
               inpainting blend kernel against its reference, bit for bit. Device
               guards, where there is a second device: the kernel, a fence and a whole
               EngineCore on cuda:N while another device is current (the engine against CPU).
  bandwidth    the kernel's achieved bandwidth (bytes it must move / median time over
               many back-to-back launches, triton.testing.do_bench) against a
               device-to-device copy of the same bytes in the same run, at sizes several
               times the 60 MB L2: at least 0.85 of the copy's.
  reaper       an EngineCore on CUDA (tiny model, mixed samplers, a cancel): a launch held
               behind `torch.cuda._sleep` (timed by CUDA events; at least 10 of the engine's
               steps as measured before it, 200 ms at least) keeps the canceled
               request's slot and epoch until its CUDA event completes; every fence
               completes; results equal the CPU run.
  nosync       no hidden synchronisation on the busy loop: (a) the whole lives of requests
               of every kind (plain, img2img, inpainting, plain-LoRA adapters, one loaded by
               the pool's loader thread meanwhile) on a tiny SD with the bucketed layout and
               CUDA graphs, every step() under `torch.cuda.set_sync_debug_mode("error")`:
               no synchronising call; (b) with the stream
               held by a long `_sleep`, `step()` returns in a fraction of the hold, for a
               middle step (noise, copies) and for the step that reaps a finished request
               (its publish must not drain the stream). Each hold is timed by CUDA events
               around it: `_sleep` counts SM cycles and the SM clock moves (345 → 1980 MHz).
  unet         an SD-1.5-architecture UNet2DConditionModel (random weights, 512×512 → 4×64×64
               latents, fp16; SD 1.5's config written out below) under the engine at full
               batch vs the same UNet's peak batched rate: useful rows/s ratio ≥ 0.85, host
               time per step() less its fence waits (the run-ahead window's and the idle
               reaper's).
  graphs       the bucketed layout with CUDA graphs (one captured denoiser call per bucket,
               replayed) against the same requests launched eagerly: equal final latents;
               every denoiser call while serving replayed a graph (the replays of the
               start-up captures not counted).
  layouts      compact vs padded vs bucketed (eager, and with CUDA graphs) at active
               fractions 1/8 … 1 on that UNet: time per step and per useful row, host time.
  png          that UNet with an SD-1.5-architecture AutoencoderKL (random weights, config
               written out): goodput of the same requests (steps staggered so completions
               spread out) with `png` outputs through the in-process decode stage
               (`--decode-workers 0`) over `latent` outputs through it, in the steady state
               (the middle half of the completions, the decode tail left out); ≥ 0.9.
  shapes       the embedded `shapes` folder (its own text encoder, UNet and VAE) in fp16:
               goodput with `latent`, `png` through the in-process decode, and `png` through
               one decode worker process (the page-locked shared arena; `engine._C` compiled
               here if this Python lacks it); every request served, no worker fault.
  lora         the gathered LoRA kernel (`engine.lora.kernel.add_lora_triton`) on SD-sized
               layers (32 rows × 4096 tokens × 320/640/1280 features, ranks 8/16/64 and
               mixed, 8–16 adapters by Zipf popularity, a quarter of the entries without
               one, one and two adapters a row): equal to `add_lora_reference` (fp16 and
               fp32, rows without adapters untouched); median time against a per-adapter
               loop of matmuls, against a device-to-device copy of the bytes it must move
               (the bandwidth bound), and against the base layer's F.linear. High ranks
               (64…256 ragged in one call; a graph captured at rank 8 replayed with a
               rank-256 adapter) and bf16 against an fp32 reference.
  lora_engine  LoRA inside the engine: a tiny SD with an adapter pool holding two adapters
               at once, bucketed + CUDA graphs, requests of every kind in waves (Linear,
               1×1 and LoCon adapters, images): all finish, equal to the CPU run; the pool
               evicted and stayed within its budget; the LoCon adapter moved the graphs'
               layout and every call while serving still replayed a graph.
  sdxl         an SDXL-architecture UNet2DConditionModel (random weights, SDXL base 1.0's
               config written out: text_time added conditioning, 2048-wide cross-attention;
               1024×1024 → 4×128×128, fp16) in the engine's own StableDiffusionXLModel
               (random 77×2048 prompt rows and 1280 pooled; per-request time ids mixed in
               one batch, zero negative rows for half): engine vs peak, as `unet`, ≥ 0.9.
  flux         a FLUX.1-dev-architecture FluxTransformer2DModel (random weights, real
               widths and all 19 + 38 blocks, said in its rows; 1024×1024 → 16×128×128
               unpacked latents, 4096 image + 512 text tokens, bf16; 4 + 8 blocks with
               --quick) in the engine's own FluxModel (packing, position ids, shift;
               embedded guidance differing per row): engine vs peak, as `unet`, ≥ 0.9.

  step_cache   per-request step caches on a FLUX.1-architecture transformer at 1024² (bf16,
               8 + 16 blocks; 4 + 8 with --quick) through EngineCore: a set skip pattern
               (MagCache, every other step) against the same trace uncached, ≥ 0.8 of the
               ideal 1 / (1 − skipped share); first_block deciding per request with nothing
               skipped (threshold 0) ≤ 1.15 × the uncached time; TaylorSeer Lite every other
               step through the bucketed layout's CUDA graphs against the same trace uncached
               through the same graphs, ≥ 0.8 of its ideal.
  qwen_image   a Qwen-Image-architecture transformer (bf16; 8 blocks with --quick) in the
               engine's own QwenImageModel at 512² and 1024²: requests one at a time against
               the engine's mixed batch of prompts of different lengths, in useful rows/s,
               beside the anchors' published ratios (SGLang: 3.2× at 512² batch 16, 1.02×
               at 1024² batch 2). Figures, no verdict.
  controlnet   per-request ControlNets (last, so a slow device's budget cuts it first): an
               SD-1.5-architecture UNet (fp16, 512²; one layer per block with --quick) in the
               engine's own StableDiffusionModel with two ControlNets built from it
               (`ControlNetModel.from_unet`), bench/controlnet.py's systems side by side: mixed
               (each ControlNet on its own rows in one call), ControlNet-keyed groups, every
               ControlNet on every row. One call of 16 guided requests, 5 on a ControlNet
               (CUDA-synchronised median of 10, 5 with --quick): the rows equal across systems,
               mixed's cost beyond a plain call ≤ 0.5 of all-rows'; then a burst of 48 requests
               (24 with --quick) served by each, only if its estimate keeps the part within 60 s
               (25 s with --quick), the build included: mixed ≥ 1.5× keyed goodput (judged by
               the keyed split's call cost over mixed's when the burst is left out).
The lent machine lacks those packages and has an older torch than setup.py pins: this
script unpacks the carried wheels into bench/.wheels/site and puts that first on sys.path
(the project itself is never installed there: it runs from this checkout). On a machine
without CUDA the CUDA parts print "no CUDA device: skipped" and the script exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import pathlib
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runs from the checkout, without installing the project
    sys.path.insert(0, str(REPO))

from bench.gpu.carried_wheels import use_carried_wheels  # noqa: E402

use_carried_wheels()  # before torch: the lent machine's diffusers and msgspec come from the wheels

import torch  # noqa: E402

from bench.gpu import report  # noqa: E402
from bench.gpu.report import row  # noqa: E402

CUDA = torch.cuda.is_available()
DEFAULT_BUDGET_S = 300.0  # with --quick no part runs much over 100 s: the command ends within 420 s
SKIP_NOTE = "no CUDA device: skipped"

PARTS = [  # name (its module bench/gpu/<name>.py), needs CUDA; run in this order
    ("ptx", False),
    ("interpreter", False),
    ("kernel", True),
    ("bandwidth", True),
    ("reaper", True),
    ("nosync", True),
    ("unet", True),
    ("graphs", True),
    ("layouts", True),
    ("png", True),
    ("shapes", True),
    ("lora", True),
    ("lora_engine", True),
    ("sdxl", True),
    ("flux", True),
    ("step_cache", True),
    ("qwen_image", True),
    ("controlnet", True),  # last: the budget cuts the newest part, not the older ones
]


def import_part(name: str):
    """The part's module, or None after a FAIL row when it does not import (an engine
    internal it uses moved): that part fails alone."""
    try:
        return importlib.import_module(f"bench.gpu.{name}")
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        row(name, "-", "import", f"{type(exc).__name__}: {str(exc)[:200]}", "FAIL")
        return None


def run_part(name: str, part, args) -> None:
    """Run one part; any exception is a FAIL row of that part, and the others still run."""
    t = time.perf_counter()
    print(f"[{name}]", flush=True)
    try:
        part.run(args)
    except Exception as exc:  # report and go on: one failure must not hide the other parts
        traceback.print_exc()
        row(name, "-", "exception", f"{type(exc).__name__}: {str(exc)[:200]}", "FAIL")
    finally:
        gc.collect()  # a part's models and engines (reference cycles) go before the next part's
        if CUDA:
            with contextlib.suppress(Exception):
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    print(f"[{name} done in {time.perf_counter() - t:.1f} s]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all): "
                        + ",".join(name for name, _ in PARTS))
    parser.add_argument("--quick", action="store_true", help="shorter timings, smaller runs (fewer requests, slots "
                        "and steps)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="also write the rows as JSON here (rewritten after every part)")
    parser.add_argument("--device", default=None, help="cuda:N to run on (default: the current CUDA device)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="start no part after this many seconds (default %(default)g: the whole command within "
                             "420 s with --quick): the parts left get a FAIL row 'not run'")
    parser.add_argument("--interpreter-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interpreter_worker:
        from bench.gpu.interpreter import worker

        return worker()
    only = {p for p in args.only.split(",") if p}
    unknown = only - {name for name, _ in PARTS}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if args.device is not None and CUDA:
        chosen = torch.device(args.device)
        if chosen.type != "cuda" or chosen.index is None or chosen.index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: one of cuda:0 … cuda:{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(chosen)  # every "cuda" tensor below goes there; engines get it explicitly
    started = time.perf_counter()
    device = f"{torch.cuda.get_device_name()} (cuda:{torch.cuda.current_device()})" if CUDA else "no CUDA device"
    header = dict(device=device, torch=torch.__version__, quick=args.quick)
    import triton

    print(f"gpu_check on {device}: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"triton {triton.__version__}, quick={args.quick}", flush=True)
    for name, needs_cuda in PARTS:
        if only and name not in only:
            continue
        part = import_part(name)
        if part is None:
            continue
        if needs_cuda and not CUDA:
            row(name, "-", "run", "-", "skipped", SKIP_NOTE)
            continue
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            row(name, "-", "run", "not run", "FAIL", f"--budget-s {args.budget_s:g} spent before it started")
            continue
        run_part(name, part, args)
        report.write_json(args.json, header, report.all_ok(), False)
    ok = report.all_ok()
    row("total", "-", "wall s", time.perf_counter() - started, "ok" if ok else "FAIL")
    print()
    report.print_table()
    report.write_json(args.json, header, ok, True)
    if args.json:
        print(f"wrote {args.json}")
    print("gpu_check: ALL OK" if ok else "gpu_check: SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
