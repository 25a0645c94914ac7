"""The GPU story of diffslot in one command: one CUDA device, < 8 minutes with --quick.

    python3 bench/gpu_check.py [--only PART,...] [--quick] [--json OUT.json] [--device cuda:N] [--budget-s S]

    --only       comma-separated parts (names below), in the order below whatever the order given
    --quick      shorter timings and smaller runs (fewer requests, slots and steps)
    --json       the rows as JSON, rewritten after every part (a run stopped at its limit keeps them)
    --device     the CUDA device to run on (default: the current one)
    --budget-s   start no part after S seconds; the parts left get a FAIL row "not run"

The one prepared device run (15 device minutes in all, the machine's start included):
here, `bash bench/device_wheels.sh` once (diffusers and msgspec wheels into bench/.wheels);
then on the device, carrying `bench/.wheels`, with a 600 s limit:

    set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --quick --budget-s 420 --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

A part that failed can be rerun alone in the time left: `--quick --only PART --json ...`.

Parts (each prints table rows; a failure in one is reported and the others still run;
exit status 1 if any check failed):

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
               last steps), NaN model outputs, a learned-sigma `out[:, :C]` view. Device
               guards, where there is a second device: the kernel, a fence and a whole
               EngineCore on cuda:N while another device is current (the engine against CPU).
  bandwidth    the kernel's achieved bandwidth (bytes it must move / median time over
               many back-to-back launches, triton.testing.do_bench) against a
               device-to-device copy of the same bytes in the same run, at sizes several
               times the 60 MB L2.
  reaper       an EngineCore on CUDA (tiny model, mixed samplers, a cancel): a launch held
               behind `torch.cuda._sleep` (the hold timed by CUDA events) keeps the canceled
               request's slot and epoch until its CUDA event completes; every fence
               completes; results equal the CPU run.
  nosync       no hidden synchronisation in a step: (a) steps under
               `torch.cuda.set_sync_debug_mode("warn")` raise no warning; (b) with the stream
               held by a long `_sleep`, `step()` returns in a fraction of the hold, for a
               middle step (noise, copies) and for the step that reaps a finished request
               (its publish must not drain the stream). Each hold is timed by CUDA events
               around it: `_sleep` counts SM cycles and the SM clock moves (345 → 1980 MHz).
  unet         an SD-1.5-architecture UNet2DConditionModel (random weights, 512×512 → 4×64×64
               latents, fp16; SD 1.5's config written out below) under the engine at full
               batch vs the same UNet's peak batched rate: useful rows/s ratio, host time per
               step() less its fence waits (the run-ahead window's and the idle reaper's).
  graphs       the bucketed layout with CUDA graphs (one captured denoiser call per bucket,
               replayed) against the same requests launched eagerly: equal final latents.
  layouts      compact vs padded vs bucketed (eager, and with CUDA graphs) at active
               fractions 1/8 … 1 on that UNet: time per step and per useful row, host time.
  png          that UNet with an SD-1.5-architecture AutoencoderKL (random weights, config
               written out): goodput of the same requests with `png` outputs through the
               in-process decode stage (`--decode-workers 0`) over `latent` outputs through
               it; target ≥ 0.9.
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
               (the bandwidth bound), and against the base layer's F.linear.
  sdxl         an SDXL-architecture UNet2DConditionModel (random weights, SDXL base 1.0's
               config written out: text_time added conditioning, 2048-wide cross-attention;
               1024×1024 → 4×128×128, fp16) in the engine's own StableDiffusionXLModel
               (random 77×2048 prompt rows and 1280 pooled; per-request time ids mixed in
               one batch, zero negative rows for half): engine vs peak, as `unet`.
  flux         a FLUX.1-dev-architecture FluxTransformer2DModel (random weights, real
               widths and all 19 + 38 blocks, said in its rows; 1024×1024 → 16×128×128
               unpacked latents, 4096 image + 512 text tokens, bf16) in the engine's own FluxModel
               (packing, position ids, shift; embedded guidance differing per row): engine
               vs peak, as `unet`.

The lent machine has no diffusers and no msgspec and an older torch than setup.py pins:
`bash bench/device_wheels.sh` (here) downloads the wheels into bench/.wheels; this script
unpacks them into bench/.wheels/site and puts that on sys.path (the project itself is
never installed there: it runs from this checkout). On a machine without CUDA the CUDA
parts print "no CUDA device: skipped" and the script exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import zipfile

REPO = pathlib.Path(__file__).resolve().parents[1]
WHEELS = REPO / "bench" / ".wheels"


def _use_carried_wheels() -> None:
    """Put bench/.wheels' packages on sys.path when the machine lacks them (the lent GPU
    machine): each wheel unzipped once into bench/.wheels/site (a wheel is a zip of its
    installed files). Nothing is installed into the machine's Python."""
    missing = []
    for module in ("diffusers", "msgspec"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if not missing:
        return
    site = WHEELS / "site"
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        print(f"gpu_check: {', '.join(missing)} missing and no wheels in {WHEELS} (run bench/device_wheels.sh here)",
              flush=True)
        return
    stamp = site / ".unpacked"
    names = "\n".join(w.name for w in wheels)
    if not stamp.exists() or stamp.read_text() != names:
        site.mkdir(parents=True, exist_ok=True)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        stamp.write_text(names)
    sys.path.insert(0, str(site))


if str(REPO) not in sys.path:  # runs from the checkout, without installing the project
    sys.path.insert(0, str(REPO))
_use_carried_wheels()

import torch  # noqa: E402

ROWS: list[dict] = []
CUDA = torch.cuda.is_available()
SKIP_NOTE = "no CUDA device: skipped"


def row(part: str, case: str, metric: str, value, status: str = "info", note: str = "") -> dict:
    """status: ok | FAIL | skipped | info."""
    r = dict(part=part, case=case, metric=metric, value=value, status=status, note=note)
    ROWS.append(r)
    print(f"  {part:<11} {case:<34} {metric:<38} {fmt(value):>12}  {status:<7} {note}", flush=True)
    return r


def check(part: str, case: str, metric: str, value, ok: bool, note: str = "") -> bool:
    row(part, case, metric, value, "ok" if ok else "FAIL", note)
    return ok


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_table() -> None:
    cols = ("part", "case", "metric", "value", "status", "note")
    cells = [[str(r["part"]), str(r["case"]), str(r["metric"]), fmt(r["value"]), r["status"], str(r["note"])]
             for r in ROWS]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for x in cells:
        print("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float, int]:
    """(equal as float32 values with NaN where NaN, max |Δ| over non-NaN, elements differing)."""
    a, b = a.float(), b.float()
    nan_same = bool(torch.equal(a.isnan(), b.isnan()))
    an, bn = a.nan_to_num(0.0, posinf=0.0, neginf=0.0), b.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    inf_same = bool(torch.equal(a.isinf() & (a > 0), b.isinf() & (b > 0))) and \
        bool(torch.equal(a.isinf() & (a < 0), b.isinf() & (b < 0)))
    diff = an != bn
    n = int(diff.sum())
    max_abs = float((an.double() - bn.double()).abs().max()) if a.numel() else 0.0
    return nan_same and inf_same and n == 0, max_abs, n + int(not nan_same) + int(not inf_same)


# ---- inputs ------------------------------------------------------------------------------

def random_inputs(entries: int, shape: tuple, model_dtype: torch.dtype, seed: int = 0, device: str = "cuda",
                  nan_fraction: float = 0.0, coefs=None, stochastic=None):
    """Random slots/rows: uncond rows for most entries, noise rows for some, finite clips
    for some, keep_history on and off; unused model/noise rows NaN (reading one shows);
    slots outside the index hold sentinels. `coefs` (entries × NUM_COEFS) overrides the
    random coefficients (a sampler's pattern); `stochastic` which entries get noise."""
    from engine.core.solvers import CLIP, G, HC, KEEP_HIST, KS, NUM_COEFS

    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    slots = entries + max(1, entries // 4)
    entry_slots = torch.randperm(slots, generator=g)[:entries]
    has_uncond = torch.rand(entries, generator=g) < 0.75
    has_noise = (torch.rand(entries, generator=g) < 0.3) if stochastic is None else torch.as_tensor(stochastic)
    used = entries + int(has_uncond.sum())
    rows = used + 8
    perm = torch.randperm(rows, generator=g)
    rc = perm[:entries]
    ru = torch.full((entries,), -1, dtype=torch.int64)
    ru[has_uncond] = perm[entries:used]
    n_noise = int(has_noise.sum()) + 2
    rn = torch.full((entries,), -1, dtype=torch.int64)
    rn[has_noise] = torch.randperm(n_noise, generator=g)[: int(has_noise.sum())]
    index = torch.stack([entry_slots, rc, ru, rn], 1).to(torch.int32)
    if coefs is None:
        coefs = torch.randn(entries, NUM_COEFS, generator=g)
        coefs[:, G] = torch.rand(entries, generator=g) * 10
        finite = torch.rand(entries, generator=g) < 0.3
        coefs[:, CLIP] = torch.where(finite, torch.rand(entries, generator=g) * 2 + 0.25, torch.tensor(math.inf))
        coefs[:, KS] = torch.where(torch.rand(entries, generator=g) < 0.5, torch.tensor(1.0),
                                   torch.rand(entries, generator=g) * 3 + 0.1)
        coefs[:, HC] = torch.where(torch.rand(entries, generator=g) < 0.4, torch.tensor(0.0), coefs[:, HC])
        coefs[:, KEEP_HIST] = (torch.rand(entries, generator=g) < 0.5).float()
    coefs = torch.as_tensor(coefs, dtype=torch.float32)
    dev = torch.device(device)
    gd = torch.Generator(dev).manual_seed(seed)
    model_out = torch.full((rows, numel), math.nan, device=dev)
    read_rows = torch.cat([rc, ru[ru >= 0]]).to(dev)
    model_out[read_rows] = torch.randn(len(read_rows), numel, device=dev, generator=gd) * 2
    if nan_fraction:
        hit = torch.rand(len(read_rows), numel, device=dev, generator=gd) < nan_fraction
        block = model_out[read_rows]
        block[hit] = math.nan
        model_out[read_rows] = block
    noise = torch.full((n_noise, numel), math.nan, device=dev)
    noise_rows = rn[rn >= 0].to(dev)
    noise[noise_rows] = torch.randn(len(noise_rows), numel, device=dev, generator=gd)
    latents = torch.full((slots, numel), 7777.0, device=dev)
    history = torch.full((slots, numel), -5555.0, device=dev)
    es = entry_slots.to(dev)
    latents[es] = torch.randn(entries, numel, device=dev, generator=gd) * 3
    history[es] = torch.randn(entries, numel, device=dev, generator=gd)
    return dict(model_out=model_out.to(model_dtype), latents=latents, history=history, noise=noise,
                index=index.to(dev), coefs=coefs.to(dev))


def compare_kernel(part: str, case: str, t: dict, view=None) -> bool:
    """Run the reference and the kernel on copies of `t`; check bit equality of both outputs,
    and that slots outside the index are untouched. `view`: name → callable making the
    argument the kernel sees from its copy (a strided view)."""
    from engine.core.kernels import update_slots_reference, update_slots_triton

    ref = {k: v.clone() for k, v in t.items()}
    tri = {k: v.clone() for k, v in t.items()}
    update_slots_reference(**ref)
    args = dict(tri)
    for name, make in (view or {}).items():
        args[name] = make(tri[name])
    update_slots_triton(**args)
    if t["latents"].is_cuda:
        torch.cuda.synchronize(t["latents"].device)
    ok_all = True
    slots = t["index"][:, 0].long()
    others = torch.ones(t["latents"].shape[0], dtype=torch.bool, device=t["latents"].device)
    others[slots] = False
    for name in ("latents", "history"):
        got = tri[name] if view is None or name not in view else tri[name]
        same, max_abs, n = same_bits(got, ref[name])
        ok_all &= check(part, case, f"{name} bitwise = reference", same, same,
                        f"max|Δ| {max_abs:.3g}, {n} elements differ" if not same else
                        f"{got[slots].isnan().sum().item()} NaN kept")
        untouched = bool(torch.equal(got[others], t[name][others]))
        if not untouched:
            ok_all &= check(part, case, f"{name} outside the index untouched", untouched, untouched)
    return ok_all


# ---- part: ptx (no GPU needed) -----------------------------------------------------------------

def ptx_checks(case: str, ptx: str, note: str = "") -> None:
    n = ptx.count
    check("ptx", case, "div.rn.f32 (IEEE division)", n("div.rn.f32"), n("div.rn.f32") > 0)
    check("ptx", case, "div.approx / div.full", n("div.approx") + n("div.full"), n("div.approx") + n("div.full") == 0)
    check("ptx", case, "fma.rn.f32 (contracted)", n("fma.rn.f32"), n("fma.rn.f32") == 0)
    nan_tests = n("setp.nan.f32") + n("setp.neu.f32") + n("max.NaN.f32")
    check("ptx", case, "NaN test before the clamp", nan_tests, nan_tests > 0, note)


def launched_kernels(fn) -> list:
    """The compiled variants a Triton JIT function holds after its launches in this process
    (`device_caches[device][0]` is the kernel cache from Triton 3.2 on; `cache` before)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return [k for entry in caches.values() for k in entry[0].values()]
    return [k for per_device in getattr(fn, "cache", {}).values() for k in per_device.values()]


def part_ptx(args) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.core import kernels
    from engine.core.solvers import NUM_COEFS

    fn = kernels._update_slots_kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        row("ptx", "sm_90", "compile", "interpreter", "skipped", "TRITON_INTERPRET is set")
        return
    if CUDA:  # the PTX of the kernels the update actually launched here, with its own options
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            kernels.update_slots_triton(**random_inputs(8, (4, 8, 8), dtype, seed=11))
        torch.cuda.synchronize()
        launched = [k for k in launched_kernels(fn) if "ptx" in getattr(k, "asm", {})]
        major, minor = torch.cuda.get_device_capability()
        check("ptx", f"launched on sm_{major}{minor}", "compiled variants", len(launched), len(launched) > 0,
              "from the JIT function's kernel cache")
        for k, compiled in enumerate(launched):
            ptx_checks(f"launched variant {k}, sm_{major}{minor}", compiled.asm["ptx"])
        return
    sig = {"out_ptr": "*fp16", "x_ptr": "*fp32", "h_ptr": "*fp32", "noise_ptr": "*fp32", "index_ptr": "*i32",
           "coef_ptr": "*fp32", "numel": "i32", "out_stride": "i64", "x_stride": "i64", "h_stride": "i64",
           "noise_stride": "i64", "NUM_COEFS": "constexpr", "BLOCK": "constexpr"}
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs={"NUM_COEFS": NUM_COEFS, "BLOCK": 1024}),
                              target=GPUTarget("cuda", 90, 32), options=dict(kernels.LAUNCH_OPTIONS))
    ptx_checks(f"sm_90, {kernels.LAUNCH_OPTIONS}", compiled.asm["ptx"], f"compiled in {time.perf_counter() - t0:.1f} s")


# ---- part: interpreter (no GPU needed) --------------------------------------------------------------

def interpreter_worker() -> int:
    """Child process (TRITON_INTERPRET=1): CPU cases, one JSON row per line on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    global row

    def emit(part, case, metric, value, status="info", note=""):
        print("ROW " + json.dumps(dict(part=part, case=case, metric=metric, value=value, status=status,
                                       note=note)), flush=True)

    row = emit  # noqa: F811 - compare_kernel's checks go to stdout as JSON
    cases = [("random fp32", dict(entries=6, shape=(4, 8, 8), model_dtype=torch.float32, seed=1)),
             ("random bf16", dict(entries=5, shape=(4, 6, 6), model_dtype=torch.bfloat16, seed=2)),
             ("NaN model output", dict(entries=6, shape=(4, 8, 8), model_dtype=torch.float32, seed=3,
                                       nan_fraction=0.1))]
    for name, kw in cases:
        compare_kernel("interpreter", name, random_inputs(device="cpu", **kw))
    t = random_inputs(6, (4, 8, 8), torch.float32, seed=4, device="cpu")
    wide = torch.full((t["model_out"].shape[0], 2 * t["model_out"].shape[1]), 31337.0)
    wide[:, : t["model_out"].shape[1]] = t["model_out"]
    t["model_out"] = wide[:, : t["model_out"].shape[1]]  # out[:, :C]: row stride 2 × numel
    compare_kernel("interpreter", "learned-sigma out[:, :C] view", t)
    return 0


def part_interpreter(args) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--interpreter-worker"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    for r in rows:
        row(**r)
    ok = proc.returncode == 0 and rows and all(r["status"] != "FAIL" for r in rows)
    check("interpreter", "TRITON_INTERPRET=1 child", "cases passed", len(rows), bool(ok),
          f"{time.perf_counter() - t0:.1f} s" + ("" if proc.returncode == 0 else f"; rc {proc.returncode}: "
                                                 + proc.stderr[-400:].replace("\n", " | ")))


# ---- part: kernel (CUDA) -----------------------------------------------------------------------------

SAMPLER_CASES = [  # (sampler, prediction type) pairs the kernel runs
    ("euler", "epsilon"), ("euler", "v_prediction"), ("euler", "sample"),
    ("euler_ancestral", "epsilon"), ("euler_ancestral", "v_prediction"),
    ("ddim", "epsilon"), ("ddim", "v_prediction"), ("ddim", "sample"),
    ("dpmpp_2m", "epsilon"), ("dpmpp_2m", "v_prediction"), ("dpmpp_2m", "sample"), ("dpmpp_2m", "flow"),
    ("flow_euler", "flow"),
]


def part_kernel(args) -> None:
    from engine.core.fences import CudaFences
    from engine.core.solvers import build_schedule
    from engine.testing.tiny_pipelines import SCHEDULER_CONFIGS

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for entries, shape, seed in ((64, (4, 64, 64), 1), (37, (4, 24, 40), 2)):
            compare_kernel("kernel", f"random {entries}x{'x'.join(map(str, shape))} {str(dtype)[6:]}",
                           random_inputs(entries, shape, dtype, seed=seed))
    steps = 20
    for sampler, prediction in SAMPLER_CASES:
        schedule = build_schedule(sampler, dict(SCHEDULER_CONFIGS[prediction]), steps, 7.5)
        at = [0, 1, steps // 2, steps - 2, steps - 1] * 4
        coefs = torch.from_numpy(schedule.coefs[at]).clone()
        stochastic = [schedule.stochastic] * len(at)
        compare_kernel("kernel", f"{sampler}/{prediction} steps 0,1,{steps // 2},-2,-1",
                       random_inputs(len(at), (4, 32, 32), torch.float16, seed=3, coefs=coefs, stochastic=stochastic))
    compare_kernel("kernel", "NaN model outputs (10%)", random_inputs(32, (4, 32, 32), torch.float32, seed=5,
                                                                       nan_fraction=0.1))
    t = random_inputs(16, (4, 32, 32), torch.float16, seed=6)
    rows_, numel = t["model_out"].shape
    wide = torch.full((rows_, 2 * numel), 31337.0, dtype=t["model_out"].dtype, device="cuda")
    wide[:, :numel] = t["model_out"]
    t["model_out"] = wide[:, :numel]  # a learned-sigma model's out[:, :C]
    compare_kernel("kernel", "learned-sigma out[:, :C] view", t)
    if torch.cuda.device_count() > 1:  # device guards: every launch on its tensors' device, not the current one
        from engine.testing.reference import rel_l2

        current = torch.cuda.current_device()
        other = next(d for d in range(torch.cuda.device_count()) if d != current)
        case = f"cuda:{other} while cuda:{current} is current"
        t = random_inputs(16, (4, 32, 32), torch.float32, seed=7, device=f"cuda:{other}")
        compare_kernel("kernel", case, t)
        fence = CudaFences(torch.device(f"cuda:{other}")).record()
        check("kernel", case, f"fence on cuda:{other}", str(fence.device),
              fence.device == torch.device(f"cuda:{other}"))
        torch.backends.cuda.matmul.allow_tf32 = False  # as part_reaper: fp32 convs without TF32 match the CPU
        torch.backends.cudnn.allow_tf32 = False
        on_other, _, _, _ = run_plan(f"cuda:{other}", hold_at_cancel=False)  # a whole EngineCore on cuda:N
        on_cpu, _, _, _ = run_plan("cpu", hold_at_cancel=False)
        worst = max((rel_l2(on_other[k], on_cpu[k]) for k in on_cpu if k in on_other), default=float("inf"))
        check("kernel", f"EngineCore on {case}", "max rel L2 vs cpu", worst,
              sorted(on_other) == sorted(on_cpu) and worst <= 1e-4, f"{len(on_other)} requests finished")
    else:
        row("kernel", "cuda:N while another device is current", "second device", torch.cuda.device_count(), "skipped",
            "one device")


# ---- part: bandwidth (CUDA) ------------------------------------------------------------------------------

def launch_bytes(t: dict) -> int:
    """What one launch must read and write (the index and coefficients aside)."""
    from engine.core.solvers import HC, KEEP_HIST

    idx, c = t["index"].cpu(), t["coefs"].cpu()
    numel = t["latents"].shape[1]
    mb = t["model_out"].element_size()
    rows = idx.shape[0] + int((idx[:, 2] >= 0).sum())
    reads = rows * numel * mb + idx.shape[0] * numel * 4
    reads += int((c[:, HC] != 0).sum()) * numel * 4 + int((idx[:, 3] >= 0).sum()) * numel * 4
    writes = idx.shape[0] * numel * 4 + int((c[:, KEEP_HIST] != 0).sum()) * numel * 4
    return reads + writes


def bounded_inputs(entries: int, shape: tuple, model_dtype, device="cuda"):
    """A full group with guidance, multistep history on, a quarter with noise; coefficients
    that keep repeated in-place updates finite (timing on real, non-zero data)."""
    from engine.core.solvers import A, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q

    numel = math.prod(shape)
    noisy = torch.arange(entries) % 4 == 0
    rn = torch.full((entries,), -1, dtype=torch.int64)
    rn[noisy] = torch.arange(int(noisy.sum()))
    index = torch.stack([torch.randperm(entries), 2 * torch.arange(entries), 2 * torch.arange(entries) + 1, rn],
                        1).to(torch.int32)
    coefs = torch.zeros(entries, NUM_COEFS)
    coefs[:, [G, P, Q, A, E, M, KS, KT, HC, KEEP_HIST]] = torch.tensor(
        [3.0, 1.0, -0.5, 0.9, 0.05, 1.0, 1.3, 0.01, -0.1, 1.0])
    coefs[:, CLIP] = math.inf
    coefs[:, D] = 0.1
    dev = torch.device(device)
    return dict(model_out=torch.randn(2 * entries, numel, device=dev).to(model_dtype),
                latents=torch.randn(entries, numel, device=dev), history=torch.randn(entries, numel, device=dev),
                noise=torch.randn(int(noisy.sum()), numel, device=dev), index=index.to(dev), coefs=coefs.to(dev))


def part_bandwidth(args) -> None:
    import triton.testing

    from engine.core.kernels import update_slots_reference, update_slots_triton

    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 60 << 20)
    rep = 100 if args.quick else 400  # ms of back-to-back launches per measurement
    for entries, shape, dtype in ((1024, (4, 64, 64), torch.float16), (256, (4, 128, 128), torch.float32),
                                  (2048, (4, 64, 64), torch.float32)):
        case = f"{entries}x{'x'.join(map(str, shape))} {str(dtype)[6:]}"
        t = bounded_inputs(entries, shape, dtype)
        nbytes = launch_bytes(t)
        update_slots_triton(**t)  # compile
        torch.cuda.synchronize()
        ms_k = triton.testing.do_bench(lambda t=t: update_slots_triton(**t), warmup=50, rep=rep, return_mode="median")
        n = nbytes // 8  # float32 elements: the copy reads 4n and writes 4n = nbytes
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        ms_c = triton.testing.do_bench(lambda src=src, dst=dst: dst.copy_(src), warmup=50, rep=rep,
                                       return_mode="median")
        bw_k, bw_c = nbytes / ms_k / 1e6, 8 * n / ms_c / 1e6
        ok = bool(torch.isfinite(t["latents"]).all())
        row("bandwidth", case, "bytes per launch (MB)", nbytes / 1e6, "info", f"{nbytes / l2:.1f}× the L2")
        row("bandwidth", case, "kernel median ms", ms_k, "info", f"{bw_k:.0f} GB/s")
        row("bandwidth", case, "d2d copy median ms (same bytes)", ms_c, "info", f"{bw_c:.0f} GB/s")
        check("bandwidth", case, "kernel / copy bandwidth", bw_k / bw_c, ok, "" if ok else "latents went non-finite")
        if entries == 1024:
            ms_r = triton.testing.do_bench(lambda t=t: update_slots_reference(**t), warmup=10, rep=rep // 2,
                                           return_mode="median")
            row("bandwidth", case, "torch reference median ms", ms_r, "info", f"kernel {ms_r / ms_k:.1f}× faster")
        del t, src, dst
        torch.cuda.empty_cache()


# ---- part: reaper (CUDA) --------------------------------------------------------------------------------

PLAN = [  # id, sampler, steps, guidance, seed, join at batch, cancel at batch
    ("euler", "euler", 12, 3.0, 1, 0, None),
    ("victim", "dpmpp_2m", 30, 3.0, 9, 0, 5),
    ("dpm", "dpmpp_2m", 15, 7.5, 3, 0, None),
    ("ancestral", "euler_ancestral", 10, 7.5, 2, 2, None),
    ("ddim", "ddim", 8, 1.0, 4, 3, None),
    ("late", "dpmpp_2m", 9, 1.0, 5, 6, None),
]


def sleep_cycles_per_s() -> float:
    """torch.cuda._sleep's cycles per second on this device (measured with events): the
    fastest of three, so that a hold planned from it lasts at least as long as planned
    once the SM clock has risen. Only a plan: the checks time each hold with events."""
    rates = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        rates.append(20_000_000 / (a.elapsed_time(b) / 1e3))
    return max(rates)


def run_plan(device: str, hold_at_cancel: bool, hold_s: float = 0.2):
    from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled
    from engine.protocol import GenerateParams
    from engine.testing.reference import TEST_CONDITIONS, tiny_model

    model = tiny_model("epsilon")
    model.unet.to(device)
    model.device = torch.device(device)
    hold = {"on": False}
    run = model.run
    cycles = sleep_cycles_per_s() * hold_s if device == "cuda" else 0

    holds = []  # (begin, end) CUDA events around each hold: its real length (SM clocks change)

    def held_run(inputs):
        if hold["on"]:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(int(cycles))  # about hold_s of GPU time queued before this launch
            end.record()
            holds.append((begin, end))
            hold["on"] = False
        return run(inputs)

    model.run = held_run
    core = EngineCore(model, CoreConfig(slots=4, max_steps=64, device=device, output_budget_bytes=1 << 30))
    fences = []
    record = core.fences.record
    core.fences.record = lambda *a, **k: fences.append(record(*a, **k)) or fences[-1]
    results, canceled, checks = {}, set(), {}

    def collect(outputs):
        for o in outputs:
            if isinstance(o, DenoiseFinished):
                results[o.request_id] = o.latents.clone()
                core.decode_done(o.request_id)
            elif isinstance(o, RequestCanceled):
                canceled.add(o.request_id)

    waiting = list(PLAN)
    guard = 0
    while waiting or core.has_unfinished_requests():
        for item in list(waiting):
            rid, sampler, steps, g, seed, join, _ = item
            if core.batches >= join:
                core.add_request(rid, GenerateParams(prompt=TEST_CONDITIONS[seed % 3], steps=steps, sampler=sampler,
                                                     guidance=g, seed=seed, output="latent"))
                waiting.remove(item)
        for rid, *_, cancel in PLAN:
            if cancel is not None and core.batches == cancel and rid in core.requests \
                    and not core.requests[rid].stopping:
                req = core.requests[rid]
                if hold_at_cancel:
                    torch.cuda.synchronize()
                    collect(core.step())  # every earlier launch reaped now
                    hold["on"] = True
                    collect(core.step())  # this launch, which includes the victim, waits behind the sleep
                    group, slot = req.group, req.slot
                    fence, epoch = group.last_fence[slot], int(group.epoch[slot])
                    checks["fence pending after launch"] = not fence.done()
                    core.abort_requests([rid])
                    collect_now = core.step()  # the reaper must not release the slot yet
                    checks["slot kept while fence pending"] = (group.requests[slot] is req
                                                               and int(group.epoch[slot]) == epoch)
                    checks["no Canceled before fence done"] = not any(
                        isinstance(o, RequestCanceled) and o.request_id == rid for o in collect_now)
                    collect(collect_now)
                    fence.synchronize()
                    checks["fence done after its event"] = fence.done()
                    outs = core.step()
                    checks["released after fence (epoch+1)"] = int(group.epoch[slot]) == epoch + 1
                    checks["Canceled delivered after fence"] = any(
                        isinstance(o, RequestCanceled) and o.request_id == rid for o in outs)
                    collect(outs)
                else:
                    core.abort_requests([rid])
        collect(core.step())
        guard += 1
        if guard > 5000:
            raise RuntimeError("engine did not finish the plan")
    if device == "cuda":
        torch.cuda.synchronize()
        checks["fences are CUDA events"] = all(type(f).__name__ == "CudaFence" for f in fences)
        checks[f"all {len(fences)} fences done"] = all(f.done() for f in fences)
    run_plan.holds_ms = [begin.elapsed_time(end) for begin, end in holds]  # read by part_reaper
    return results, canceled, checks, model


def part_reaper(args) -> None:
    from engine.testing.reference import rel_l2

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    gpu, gpu_canceled, checks, _ = run_plan("cuda", hold_at_cancel=True)
    holds_ms = run_plan.holds_ms
    cpu, cpu_canceled, _, _ = run_plan("cpu", hold_at_cancel=False)
    check("reaper", "held launch + cancel", "hold ms (CUDA events)", holds_ms[0] if holds_ms else 0.0,
          len(holds_ms) == 1 and holds_ms[0] >= 50, "planned 200 ms by the cycle calibration; the fence "
          "checks need the launch still pending when they look")
    for name, ok in checks.items():
        check("reaper", "held launch + cancel", name, ok, bool(ok))
    both = sorted(gpu_canceled) == sorted(cpu_canceled) == ["victim"]
    check("reaper", "cancel", "victim canceled on cuda and cpu", both, both)
    for rid, sampler, steps, g, seed, _, cancel in PLAN:
        if cancel is not None:
            continue
        if rid not in gpu or rid not in cpu:
            check("reaper", rid, "finished", False, False)
            continue
        err = rel_l2(gpu[rid], cpu[rid])
        check("reaper", f"{rid} ({sampler}, {steps} steps, g={g:g})", "rel L2 cuda vs cpu", err, err <= 1e-4)
    row("reaper", "cuda + cpu runs", "wall s", time.perf_counter() - t0)


# ---- part: nosync (CUDA) ---------------------------------------------------------------------------------

def part_nosync(args) -> None:
    from engine.core import CoreConfig, DenoiseFinished, EngineCore
    from engine.protocol import GenerateParams
    from engine.testing.reference import TEST_CONDITIONS, tiny_model

    model = tiny_model("epsilon")
    model.unet.to("cuda")
    model.device = torch.device("cuda")
    core = EngineCore(model, CoreConfig(slots=8, max_steps=64, device="cuda", output_budget_bytes=1 << 30))
    plan = [("anc", "euler_ancestral", 40, 7.5), ("dpm", "dpmpp_2m", 40, 3.0), ("ddim", "ddim", 40, 1.0),
            ("short", "euler", 4, 3.0)]
    for k, (rid, sampler, steps, g) in enumerate(plan):
        core.add_request(rid, GenerateParams(prompt=TEST_CONDITIONS[k % 3], steps=steps, sampler=sampler,
                                             guidance=g, seed=k, output="latent"))

    def step():
        for o in core.step():
            if isinstance(o, DenoiseFinished):
                core.decode_done(o.request_id)

    for _ in range(2):  # admission, encode, kernel compile, allocator warm-up
        step()
    torch.cuda.synchronize()
    step()
    torch.cuda.synchronize()

    # (a) the sync debug mode sees .item(), .cpu(), pageable blocking copies, nonzero, ...
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    check("nosync", "middle step (noise, 3 samplers)", "sync-debug warnings", len(syncs), not syncs,
          "; ".join(sorted(set(syncs)))[:160])

    # (b) the stream held: a step must come back long before the hold ends. Each hold is
    # timed by CUDA events around it: `_sleep` counts SM cycles, and the SM clock moves
    # (345 MHz idle to 1980 MHz under load on an H200), so the calibration only plans it.
    torch.cuda.synchronize()
    hold_s = 0.5
    cycles = int(sleep_cycles_per_s() * hold_s)

    def held_step() -> tuple[float, float]:
        """(host s in step(), the hold's device s as its events measured it)."""
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        t0 = time.perf_counter()
        step()
        host = time.perf_counter() - t0
        end.synchronize()
        return host, begin.elapsed_time(end) / 1e3

    def held_check(case: str, host: float, held: float, ok: bool = True, note: str = "") -> None:
        check("nosync", case, "host s in step() / hold s", host / held, ok and held >= 0.1 and host < 0.25 * held,
              f"host {host * 1e3:.1f} ms, hold {held * 1e3:.0f} ms by events (planned {hold_s * 1e3:.0f}); {note}")

    host, held = held_step()
    held_check("middle step, stream held", host, held, note="a synchronising call waits out the hold")
    torch.cuda.synchronize()
    while "short" in core.requests and core.requests["short"].status.value == "running":
        step()  # up to the short request's final launch
    torch.cuda.synchronize()  # its final fence is done: the next step reaps it and publishes
    host, held = held_step()
    published = "short" not in core.requests or core.requests["short"].status.value != "finishing"
    held_check("step that publishes a finished request", host, held, published,
               "publish must not drain the stream (.to('cpu'))")
    torch.cuda.synchronize()


# ---- the SD-1.5-architecture UNet ----------------------------------------------------------------------------

SD15_UNET_CONFIG = dict(  # runwayml/stable-diffusion-v1-5 unet/config.json, written out (no hub)
    sample_size=64, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    only_cross_attention=False, block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, downsample_padding=1,
    mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=768,
    attention_head_dim=8, use_linear_projection=False,
)
SD15_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json (PNDM; the engine's samplers build from it)
    _class_name="PNDMScheduler", num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
    beta_schedule="scaled_linear", trained_betas=None, skip_prk_steps=True, set_alpha_to_one=False,
    prediction_type="epsilon", steps_offset=1, clip_sample=False,
)
TEXT_TOKENS, TEXT_WIDTH = 77, 768


def sd15_model():
    """The UNet in a DiffusionModel: prompts map to fixed random 77×768 fp16 rows (a
    stand-in for the CLIP text encoder, which is off the denoiser's path)."""
    import hashlib

    from diffusers import UNet2DConditionModel

    from engine.models.geometry import Geometry
    from engine.models.loading import Conditioning, DiffusionModel

    class Sd15(DiffusionModel):
        pipeline_class = "StableDiffusionPipeline"

        def __init__(self):
            self.path = pathlib.Path("sd15-architecture-random")
            self.device, self.dtype = torch.device("cuda"), torch.float16
            torch.manual_seed(0)
            with torch.device("cuda"):
                self.denoiser = UNet2DConditionModel(**SD15_UNET_CONFIG)
            self.denoiser = self.denoiser.to(torch.float16).eval().requires_grad_(False)
            self.scheduler_config = dict(SD15_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:
            return Geometry(latent_channels=4, vae_scale=8, size_multiple=64, native_size=512)

        def encode(self, prompts):
            out = []
            for p in prompts:
                seed = int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "little")
                g = torch.Generator("cuda").manual_seed(seed)
                out.append(Conditioning(torch.randn(TEXT_TOKENS, TEXT_WIDTH, device="cuda", generator=g,
                                                    dtype=torch.float16)))
            return out

        def forward(self, inputs):
            return self.denoiser(inputs.sample, inputs.timestep, encoder_hidden_states=inputs.hidden).sample

    return Sd15()


_SD15 = {}


def get_sd15():
    if "model" not in _SD15:
        t0 = time.perf_counter()
        _SD15["model"] = sd15_model()
        torch.cuda.synchronize()
        params = sum(p.numel() for p in _SD15["model"].denoiser.parameters())
        row("unet", "SD-1.5 UNet2DConditionModel", "built (s)", time.perf_counter() - t0, "info",
            f"{params / 1e6:.0f} M parameters, fp16, random weights")
    return _SD15["model"]


def denoiser_peak_ms(model, rows: int, **request_inputs) -> float:
    """The model's denoiser alone (`model.denoise`, the core's `run` with its inputs), `rows`
    rows at the native size: median ms over back-to-back calls (triton.testing.do_bench)."""
    import triton.testing

    shape = model.latent_shape(model.native_size, model.native_size)
    x = torch.randn(rows, *shape, device=model.device, dtype=model.dtype)
    t = torch.randint(0, 1000, (rows,), device=model.device).float()
    conds = model.encode([f"p{k}" for k in range(rows)])
    with torch.no_grad():
        return triton.testing.do_bench(lambda: model.denoise(x, t, conds, **request_inputs), warmup=100, rep=600,
                                       return_mode="median")


def unet_peak_ms(model, rows: int) -> float:
    return denoiser_peak_ms(model, rows)


def time_fence_waits(core) -> dict:
    """Count the seconds the core sleeps on fences (the run-ahead window's wait for room,
    the idle reaper's wait): host time per step is a step's time less these."""
    spent = {"s": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - t0
        return wrapper

    if core.window is not None:
        core.window.wait_for_room = timed(core.window.wait_for_room)
    core.reaper.wait = timed(core.reaper.wait)
    return spent


def run_engine_steps(model, slots: int, active: int, layout: str, steps_each: int, measure: int | None,
                     guidance: float = 7.5, sampler: str = "euler", device: str = "cuda", prompts=None,
                     cuda_graphs: bool = True, latents: dict | None = None, params=None):
    """An EngineCore on the model with `active` requests; returns (wall s, steps, useful rows,
    total rows, host s per step list, finished, failed). Host time per step is `step()`'s
    time less its fence waits (`time_fence_waits`; their total over the timed steps in
    `run_engine_steps.waited_s`). `measure`: time only that many steps after two warm-up
    steps (requests stay active); None: run every request to the end. `params(k)`: extra
    GenerateParams fields of request k (they override the defaults here)."""
    from engine.core import CoreConfig, DenoiseFinished, EngineCore

    try:
        from engine.core import RequestFailed
    except Exception:  # noqa: BLE001
        RequestFailed = ()  # noqa: N806
    from engine.protocol import GenerateParams

    core = EngineCore(model, CoreConfig(slots=slots, layout=layout, max_steps=max(64, steps_each), device=device,
                                        trajectory_budget_bytes=1 << 36, output_budget_bytes=1 << 36,
                                        cuda_graphs=cuda_graphs))
    prompts = prompts or [f"prompt {k}" for k in range(5)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for k in range(active):
        fields = dict(prompt=prompts[k % len(prompts)], negative_prompt="", steps=steps_each, sampler=sampler,
                      guidance=guidance, seed=k, output="latent")
        fields.update(params(k) if params is not None else {})
        core.add_request(f"r{k}", GenerateParams(**fields))
    finished = failed = 0
    spent = time_fence_waits(core)

    def step():
        nonlocal finished, failed
        waited = spent["s"]
        t0 = time.perf_counter()
        outs = core.step()
        host = time.perf_counter() - t0 - (spent["s"] - waited)
        for o in outs:
            if isinstance(o, DenoiseFinished):
                finished += 1
                if latents is not None:
                    latents[o.request_id] = o.latents.clone()
                core.decode_done(o.request_id)
            elif RequestFailed and isinstance(o, RequestFailed):
                failed += 1
        return host

    with torch.no_grad():
        for _ in range(2):
            step()
        sync()
        s0 = core.stats()
        b0 = core.batches
        hosts = []
        waited0 = spent["s"]
        t0 = time.perf_counter()
        if measure is None:
            while core.has_unfinished_requests():
                hosts.append(step())
        else:
            for _ in range(measure):
                hosts.append(step())
        sync()
        wall = time.perf_counter() - t0
        run_engine_steps.waited_s = spent["s"] - waited0
        if measure is None:
            while core.has_unfinished_requests():
                step()
    s1 = core.stats()
    useful = s1["useful_evals"] - s0["useful_evals"]
    total = useful + s1["padded_evals"] - s0["padded_evals"]
    graphs = 0 if core.graphed is None else len(core.graphed.graphs)
    run_engine_steps.replays = 0 if core.graphed is None else core.graphed.replays
    run_engine_steps.graphs = graphs  # read by part_layouts
    return wall, core.batches - b0, useful, total, hosts, finished, failed


def finite_output_check(part: str, model, label: str, **request_inputs) -> bool:
    """One call of two rows at the native size (prompt "a" at t=500, "" at t=20): the
    random-weight denoiser's output is finite and latent-shaped (the engine fails a request
    whose latents turn non-finite, so a run on such weights would measure nothing)."""
    shape = model.latent_shape(model.native_size, model.native_size)
    x = torch.randn(2, *shape, device=model.device, dtype=model.dtype)
    with torch.no_grad():
        out = model.denoise(x, torch.tensor([500.0, 20.0], device=model.device), model.encode(["a", ""]),
                            **request_inputs)
    finite = bool(torch.isfinite(out).all())
    shaped = tuple(out.shape) == tuple(x.shape)
    return check(part, f"random-weight {label} output", "finite, latent-shaped", finite and shaped, finite and shaped,
                 f"std {float(out.float().std()):.3g}, shape {tuple(out.shape)}")


def engine_vs_peak(part: str, model, label: str, slots: int, rows_per_request: int, steps: int, params=None,
                   sampler: str = "euler", guidance: float = 7.5, peak_inputs: dict | None = None) -> None:
    """The denoiser's peak batched rate at the engine's full batch (slots × rows per request)
    against an EngineCore serving `slots` requests to the end (compact layout): useful
    rows/s over peak rows/s, and host time per step() less its fence waits."""
    rows = slots * rows_per_request
    ms = denoiser_peak_ms(model, rows, **(peak_inputs or {}))
    peak = rows / (ms / 1e3)
    row(part, f"{label} alone, batch {rows}", "median ms / rows/s", ms, "info", f"{peak:.2f} rows/s")
    wall, batches, useful, total, hosts, finished, failed = run_engine_steps(
        model, slots, slots, "compact", steps, None, guidance=guidance, sampler=sampler, params=params)
    rate = useful / wall
    check(part, f"engine {slots} requests x {steps} steps, compact", f"useful rows/s / {label} peak", rate / peak,
          finished == slots and failed == 0 and useful > 0,
          f"{rate:.2f} rows/s, {batches} batches, {useful / max(1, batches):.1f} useful rows per call, "
          f"{finished} finished, {failed} failed")
    hosts_ms = sorted(h * 1e3 for h in hosts)
    row(part, "engine, host time per step() less fence waits", "median ms", statistics.median(hosts_ms), "info",
        f"p90 {hosts_ms[int(0.9 * (len(hosts_ms) - 1))]:.2f} ms vs {wall / max(1, batches) * 1e3:.1f} ms per step; "
        f"fence waits {run_engine_steps.waited_s:.2f} of {wall:.2f} s (host ≪ device: the host runs ahead)")


def part_unet(args) -> None:
    model = get_sd15()
    finite_output_check("unet", model, "SD-1.5 UNet")
    engine_vs_peak("unet", model, "UNet", 16, 2, 10 if args.quick else 20)  # guidance 7.5: cond + uncond rows


def part_layouts(args) -> None:
    model = get_sd15()
    slots = 16
    fractions = (0.125, 0.25, 0.5, 1.0)
    measure = 4 if args.quick else 8
    for fraction in fractions:
        active = max(1, round(slots * fraction))
        base = None
        for layout, graphs in (("padded", False), ("compact", False), ("bucketed", False), ("bucketed", True)):
            wall, batches, useful, total, hosts, _, failed = run_engine_steps(model, slots, active, layout, 60, measure,
                                                                              cuda_graphs=graphs)
            per_step = wall / max(1, batches) * 1e3
            per_row = wall / max(1, useful) * 1e3
            base = base or per_step
            name = layout + ("+graphs" if graphs else "")
            row("layouts", f"{name} {active}/{slots} active", "ms per step / per useful row", per_step,
                "info" if failed == 0 else "FAIL",
                f"{per_row:.2f} ms/useful row, {total // max(1, batches)} rows/step "
                f"({useful // max(1, batches)} useful), {base / per_step:.2f}x padded's speed, "
                f"host {statistics.median(hosts) * 1e3:.2f} ms/step less fence waits"
                + (f", {run_engine_steps.graphs} graphs" if graphs else ""))


def part_graphs(args) -> None:
    """CUDA graphs change no result: the same requests, bucketed, replayed vs eager."""
    model = get_sd15()
    results = []
    for graphs in (False, True):
        latents = {}
        _, _, _, _, _, finished, failed = run_engine_steps(model, 8, 5, "bucketed", 6, None, sampler="dpmpp_2m",
                                                           cuda_graphs=graphs, latents=latents)
        results.append((latents, finished, failed))
    (eager, n0, f0), (graphed, n1, f1) = results
    worst = max((float((graphed[k].float() - eager[k].float()).norm() / eager[k].float().norm())
                 for k in eager if k in graphed), default=float("inf"))
    # a capture that failed runs eagerly and would compare equal: the check needs real replays
    check("graphs", "bucketed: CUDA graphs captured and replayed", "graphs", run_engine_steps.graphs,
          run_engine_steps.graphs > 0 and run_engine_steps.replays > 0, f"{run_engine_steps.replays} replays")
    check("graphs", "bucketed: CUDA graphs vs eager, 5 requests x 6 steps", "max rel L2", worst,
          n0 == n1 == 5 and f0 == f1 == 0 and worst < 1e-3,
          f"{run_engine_steps.graphs} graphs captured; same kernels, so only capture-order rounding may differ")


# ---- shared by the model parts: random rows, the engine served in-process -------------------------------------

def random_rows(text: str, shape: tuple, device, dtype) -> torch.Tensor:
    """Fixed random rows per text: a stand-in for a text encoder (off the denoiser's path)."""
    import hashlib

    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
    g = torch.Generator(device).manual_seed(seed)
    return torch.randn(*shape, device=device, generator=g, dtype=dtype)


def serve_in_process(model, stage, requests: list, config, timeout_s: float = 300.0) -> dict:
    """The engine process's busy loop without its sockets (`engine.serve.proc`): step the
    core while it has work, hand finished latents to the decode stage, return each decoded
    output's reservation (`decode_done`). All requests are queued at the start; goodput is
    completed outputs over the wall time from the first `add_request` to the last output."""
    from engine.core import DenoiseFinished, EngineCore
    from engine.core.outputs import RequestCanceled, RequestFailed

    core = EngineCore(model, config)
    spent = time_fence_waits(core)
    completed, errors, decode_s, hosts = 0, [], [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for rid, params in requests:
            core.add_request(rid, params)
        while completed + len(errors) < len(requests):
            outputs = []
            if core.has_work():
                waited, s0 = spent["s"], time.perf_counter()
                outputs = core.step()
                hosts.append(time.perf_counter() - s0 - (spent["s"] - waited))
            else:
                time.sleep(0.0005)  # only decodes in flight: their outputs come at a poll
            for o in outputs:
                if isinstance(o, DenoiseFinished):
                    stage.submit(o.request_id, o.latents, o.params, o.timings, o.finished_at)
                elif isinstance(o, (RequestFailed, RequestCanceled)):
                    errors.append(f"{o.request_id}: {getattr(o, 'error', 'canceled')}")
            for decoded in stage.poll():
                core.decode_done(decoded.request_id)
                if decoded.error is None:
                    completed += 1
                    decode_s.append(decoded.timings.decode_s)
                else:
                    errors.append(f"{decoded.request_id}: {decoded.error}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"served {completed} of {len(requests)} in {timeout_s:g} s")
    wall = time.perf_counter() - t0
    stats = core.stats()
    return dict(completed=completed, errors=errors, wall=wall, goodput=completed / wall,
                rows_per_call=stats["useful_evals"] / max(1, core.batches),
                decode_ms=statistics.median(decode_s) * 1e3 if decode_s else float("nan"),
                host_ms=statistics.median(hosts) * 1e3 if hosts else float("nan"),
                denoiser_s=stats["denoiser_s"])


def served_row(part: str, case: str, r: dict, n: int) -> bool:
    ok = r["completed"] == n and not r["errors"]
    return check(part, case, "goodput (images/s)", r["goodput"], ok,
                 f"{r['completed']}/{n} in {r['wall']:.2f} s, {r['rows_per_call']:.1f} rows/call, decode p50 "
                 f"{r['decode_ms']:.1f} ms, host {r['host_ms']:.2f} ms/step less fence waits"
                 + (f"; {len(r['errors'])} errors: {r['errors'][0][:120]}" if r["errors"] else ""))


def generate_requests(tag: str, n: int, output: str, steps: int, prompts=None, guidance: float = 7.5) -> list:
    from engine.protocol import GenerateParams

    prompts = prompts or [f"prompt {k}" for k in range(5)]
    return [(f"{tag}{k}", GenerateParams(prompt=prompts[k % len(prompts)], negative_prompt="", steps=steps,
                                         sampler="euler", guidance=guidance, seed=k, output=output))
            for k in range(n)]


# ---- part: png (CUDA): png vs latent outputs on the SD-1.5-architecture UNet ----------------------------------

SD15_VAE_CONFIG = dict(  # runwayml/stable-diffusion-v1-5 vae/config.json, written out (no hub)
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=4, norm_num_groups=32, sample_size=512, scaling_factor=0.18215,
)


def sd15_vae(device="cuda", dtype=torch.float16, config=SD15_VAE_CONFIG):
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    with torch.device(device):
        vae = AutoencoderKL(**config)
    return vae.to(dtype).eval().requires_grad_(False)


def part_png(args) -> None:
    """Goodput with `png` outputs through the in-process decode stage (`--decode-workers 0`:
    the VAE on its own CUDA stream in a thread of the engine process, PNG encoding on the
    host) against `latent` outputs through the same stage, same requests."""
    from engine.core import CoreConfig
    from engine.decode.factory import make_decode_stage

    model = get_sd15()
    if model.vae is None:
        model.vae = sd15_vae()  # random weights: the decode's cost, not its pictures
    slots, n, steps = 16, (32 if args.quick else 64), (10 if args.quick else 20)
    config = CoreConfig(slots=slots, max_steps=64, device="cuda")
    stage = make_decode_stage(model, 0)
    try:
        serve_in_process(model, stage, generate_requests("warm", 2, "png", 2), config)  # VAE kernels, PNG path
        results = {kind: serve_in_process(model, stage, generate_requests(kind, n, kind, steps), config)
                   for kind in ("latent", "png")}
    finally:
        stage.close()
    ok = all([served_row("png", f"SD-1.5 {n} requests x {steps} steps, {kind}, in-process decode", r, n)
              for kind, r in results.items()])
    ratio = results["png"]["goodput"] / results["latent"]["goodput"]
    check("png", "png / latent goodput, in-process decode", "ratio", ratio, ok and ratio >= 0.9,
          f"target ≥ 0.9; {slots} slots, guidance 7.5, 512×512, fp16 UNet and VAE")


# ---- part: shapes (CUDA): the embedded model in fp16, one decode worker vs the in-process decode ---------------

def ensure_c_extension() -> str:
    """`engine._C` (the decode arena's atomics) for this Python: compiled here with the C
    compiler when missing (the lent machine's Python is not the checkout's)."""
    import importlib
    import shutil
    import sysconfig

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


def part_shapes(args) -> None:
    """The embedded `shapes` text-to-image folder (its own CLIP encoder, UNet, VAE) in fp16
    on CUDA: `latent`, `png` with the in-process decode, and `png` with one decode worker
    process (the page-locked shared arena: `engine._C`), same requests each."""
    from engine.core import CoreConfig
    from engine.decode.factory import make_decode_stage
    from engine.decode.stage import DecodeConfig
    from engine.models.loading import load_model
    from engine.models.shapes.draw import PROMPTS

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


# ---- part: sdxl (CUDA): an SDXL-architecture UNet under the engine --------------------------------------------

SDXL_UNET_CONFIG = dict(  # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json, written out (no hub)
    sample_size=128, in_channels=4, out_channels=4, center_input_sample=False, flip_sin_to_cos=True, freq_shift=0,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    only_cross_attention=False, block_out_channels=(320, 640, 1280), layers_per_block=2, downsample_padding=1,
    mid_block_scale_factor=1, act_fn="silu", norm_num_groups=32, norm_eps=1e-5, cross_attention_dim=2048,
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    upcast_attention=False,
)  # 2,567,463,684 parameters, as the released UNet
SDXL_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json
    _class_name="EulerDiscreteScheduler", num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
    beta_schedule="scaled_linear", trained_betas=None, prediction_type="epsilon", interpolation_type="linear",
    use_karras_sigmas=False, timestep_spacing="leading", steps_offset=1, clip_sample=False, sample_max_value=1.0,
    set_alpha_to_one=False, skip_prk_steps=True,
)


def sdxl_model(config: dict = SDXL_UNET_CONFIG, device="cuda", dtype=torch.float16):
    """The engine's own `StableDiffusionXLModel` on a random-weight UNet. The pipeline
    object is reduced to what that class reads (the UNet, `force_zeros_for_empty_prompt`,
    the pipeline's `_get_add_time_ids`); prompts map to fixed random rows (77 × 2048
    hidden, 1280 pooled), as `sd15_model`'s."""
    import types

    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    from engine.models.geometry import Geometry
    from engine.models.loading import Conditioning
    from engine.models.sdxl import StableDiffusionXLModel

    hidden_width = int(config["cross_attention_dim"])
    pooled_width = int(config["projection_class_embeddings_input_dim"]) - 6 * int(config["addition_time_embed_dim"])

    class Sdxl(StableDiffusionXLModel):
        def __init__(self):
            self.path = pathlib.Path("sdxl-architecture-random")
            self.device, self.dtype = torch.device(device), dtype
            torch.manual_seed(0)
            with torch.device(device):
                unet = UNet2DConditionModel(**config)
            unet = unet.to(dtype).eval().requires_grad_(False)
            pipe = types.SimpleNamespace(unet=unet, vae=None, text_encoder_2=None,
                                         config={"force_zeros_for_empty_prompt": True})
            pipe._get_add_time_ids = functools.partial(StableDiffusionXLPipeline._get_add_time_ids, pipe)
            self.pipe, self.vae = pipe, None
            self.scheduler_config = dict(SDXL_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:  # the released VAE's: 8 pixels per cell, 2 halvings in the UNet
            return Geometry(latent_channels=4, vae_scale=8, size_multiple=32, native_size=8 * config["sample_size"])

        def _encode_texts(self, prompts):
            return [Conditioning(random_rows(p, (TEXT_TOKENS, hidden_width), self.device, dtype),
                                 random_rows(p + "\0pooled", (pooled_width,), self.device, dtype)) for p in prompts]

    return Sdxl()


def sdxl_request(k: int) -> dict:
    """Mixed micro-conditioning in one batch: original sizes, crops and targets per request;
    no negative prompt for every other one (zero rows: `force_zeros_for_empty_prompt`)."""
    sizes = ((1024, 1024), (768, 1344), (1344, 768), (2048, 2048))
    return dict(original_size=sizes[k % 4], crops_coords_top_left=((0, 0), (64, 32), (128, 0))[k % 3],
                target_size=sizes[(k + 1) % 4], negative_prompt=None if k % 2 else "", guidance=5.0 + k % 3)


def part_sdxl(args) -> None:
    t0 = time.perf_counter()
    model = sdxl_model()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.denoiser.parameters())
    row("sdxl", "SDXL UNet2DConditionModel", "built (s)", time.perf_counter() - t0, "info",
        f"{params / 1e6:.0f} M parameters, fp16, random weights, 1024×1024 → 4×128×128")
    time_ids = torch.tensor([[1024, 1024, 0, 0, 1024, 1024], [768, 1344, 64, 32, 1024, 1024]],
                            dtype=torch.float32, device="cuda")
    finite_output_check("sdxl", model, "SDXL UNet", time_ids=time_ids)
    slots = 8 if args.quick else 16
    rows = 2 * slots  # guidance > 1: cond + uncond rows
    engine_vs_peak("sdxl", model, "SDXL UNet", slots, 2, 8 if args.quick else 16, params=sdxl_request,
                   guidance=5.0, peak_inputs=dict(time_ids=time_ids.repeat(slots, 1)[:rows]))


# ---- part: flux (CUDA): a FLUX-architecture transformer under the engine --------------------------------------

FLUX_TRANSFORMER_CONFIG = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json, written out (no hub)
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # 11,901,408,320 parameters, as the released transformer
FLUX_SCHEDULER_CONFIG = dict(  # its scheduler/scheduler_config.json
    _class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
    base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
)
FLUX_TEXT_TOKENS = 512  # the pipeline's max_sequence_length


def flux_model(config: dict = FLUX_TRANSFORMER_CONFIG, device="cuda", dtype=torch.bfloat16, native_size: int = 1024):
    """The engine's own `FluxModel` on a random-weight transformer (its packing, position
    ids, timestep scaling, per-row embedded guidance and schedule shift are the class's).
    The pipeline object is reduced to what the class reads; prompts map to fixed random
    rows (512 × 4096 T5 hidden, 768 CLIP pooled)."""
    import types

    from diffusers import FluxTransformer2DModel
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    from engine.models.flux import FluxModel
    from engine.models.geometry import Geometry
    from engine.models.loading import Conditioning

    class Flux(FluxModel):
        def __init__(self):
            self.path = pathlib.Path("flux-architecture-random")
            self.device, self.dtype = torch.device(device), dtype
            torch.manual_seed(0)
            with torch.device(device):
                transformer = FluxTransformer2DModel(**config)
            transformer = transformer.to(dtype).eval().requires_grad_(False)
            self.pipe = types.SimpleNamespace(
                transformer=transformer, vae=None, text_encoder=None,
                scheduler=types.SimpleNamespace(config=dict(FLUX_SCHEDULER_CONFIG)),
                _pack_latents=FluxPipeline._pack_latents, _unpack_latents=FluxPipeline._unpack_latents,
                _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids)
            self.vae = None
            self.scheduler_config = dict(FLUX_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:  # the released VAE's: 16 channels, 8 pixels per cell; 2×2 packing
            return Geometry(latent_channels=16, vae_scale=8, size_multiple=16, native_size=native_size)

        def _encode_texts(self, prompts):
            return [Conditioning(random_rows(p, (FLUX_TEXT_TOKENS, config["joint_attention_dim"]), self.device, dtype),
                                 random_rows(p + "\0pooled", (config["pooled_projection_dim"],), self.device, dtype))
                    for p in prompts]

    return Flux()


def part_flux(args) -> None:
    config = dict(FLUX_TRANSFORMER_CONFIG)  # all blocks (about 24 GB in bf16): cut num_layers here if need be
    depth = f"{config['num_layers']}/19 double + {config['num_single_layers']}/38 single blocks"
    t0 = time.perf_counter()
    model = flux_model(config)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.denoiser.parameters())
    row("flux", "FLUX FluxTransformer2DModel", "built (s)", time.perf_counter() - t0, "info",
        f"{params / 1e6:.0f} M parameters ({depth}; real widths), bf16, random weights, "
        "1024×1024 → 16×128×128 (4096 tokens + 512 text)")
    finite_output_check("flux", model, "FLUX transformer", guidance=torch.tensor([3.5, 1.0], device="cuda"))
    slots = 4 if args.quick else 8
    guidance = torch.tensor([2.0 + 0.5 * k for k in range(slots)], device="cuda")
    engine_vs_peak("flux", model, "FLUX", slots, 1, 6 if args.quick else 12, sampler="flow_euler",
                   params=lambda k: dict(guidance=2.0 + 0.5 * k, negative_prompt=None),
                   peak_inputs=dict(guidance=guidance))


# ---- part: lora (CUDA): the gathered LoRA kernel on SD-sized layers -------------------------------------------

LORA_CASES = [  # features (in = out), adapter ranks (cycled over slots), adapters, rows, adapters per row
    (320, (8,), 8, 32, 1),
    (640, (16,), 16, 32, 1),
    (1280, (64,), 8, 32, 1),
    (1280, (8, 16, 64), 16, 32, 2),  # ragged ranks, two adapters a row
]
LORA_TOKENS = 4096  # SD 1.5's first block at 512×512 (64×64 latent cells)


def lora_case(features: int, ranks: tuple, adapters: int, rows: int, width: int, tokens: int, device, seed: int = 0,
              dtype=torch.float16):
    """One layer's adapters in a SlotWeights (A ~ N(0, 1/in), B ~ N(0, 1/r), scaling 2) and a
    call's rows: adapters drawn by Zipf popularity (ragged groups), a quarter of the
    entries with none (-1), scales in [0.5, 1.5)."""
    from engine.lora.kernel import SlotWeights

    g = torch.Generator().manual_seed(seed)
    weights = SlotWeights(adapters, features, features, device, dtype)
    for slot in range(adapters):
        r = ranks[slot % len(ranks)]
        weights.put(slot, torch.randn(r, features, generator=g) / math.sqrt(features),
                    torch.randn(features, r, generator=g) / math.sqrt(r), 2.0)
    popularity = 1.0 / torch.arange(1, adapters + 1, dtype=torch.float64)
    index = torch.multinomial(popularity, rows * width, replacement=True, generator=g).view(rows, width).to(torch.int32)
    index[torch.rand(rows, width, generator=g) < 0.25] = -1
    scale = torch.rand(rows, width, generator=g) + 0.5
    gd = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, tokens, features, device=device, generator=gd, dtype=dtype)
    out = torch.randn(rows, tokens, features, device=device, generator=gd, dtype=dtype)
    return weights, index, scale, x, out


def lora_loop(weights, index: torch.Tensor, scale: torch.Tensor, x: torch.Tensor):
    """The natural baseline: one gather, two matmuls and an index_add per adapter in the call
    (its rows grouped on the host beforehand, so the loop itself never syncs)."""
    groups = []
    for slot in sorted(set(index[index >= 0].tolist())):
        r_of, k_of = (index == slot).nonzero(as_tuple=True)
        s = (scale[r_of, k_of] * weights.scaling[slot]).to(x.device, x.dtype)[:, None, None]
        groups.append((r_of.to(x.device), s, weights.A[slot].t(), weights.B[slot].t()))

    def run(out: torch.Tensor) -> None:
        for rows, s, At, Bt in groups:
            out.index_add_(0, rows, ((x.index_select(0, rows) @ At) * s) @ Bt)
    return run


def lora_compare(case: str, weights, index, scale, x, out0, tol: float) -> tuple[bool, float]:
    """add_lora_triton vs add_lora_reference on copies of out0: rel L2 of the difference over
    the delta's norm; rows with no adapter bit-for-bit untouched."""
    from engine.lora.kernel import RowGroups, add_lora_reference, add_lora_triton

    dev_index, dev_scale = index.to(x.device), scale.to(x.device)
    got, ref = out0.clone(), out0.clone()
    add_lora_triton(got, x, weights, RowGroups.build(dev_index, dev_scale, for_kernel=True))
    add_lora_reference(ref, x, weights, RowGroups.build(dev_index, dev_scale, for_kernel=False))
    delta = float((ref.float() - out0.float()).norm())
    err = float((got.float() - ref.float()).norm()) / max(delta, 1e-6)
    idle = (index < 0).all(1).to(x.device)
    untouched = bool(torch.equal(got[idle], out0[idle]))
    finite = bool(torch.isfinite(got).all())
    ok = err <= tol and untouched and finite
    check("lora", case, "kernel vs add_lora_reference (rel L2)", err, ok,
          f"tol {tol:g}; {int(idle.sum())} rows without adapter untouched: {untouched}; finite: {finite}")
    return ok, err


def part_lora(args) -> None:
    import triton.testing

    from engine.lora.kernel import RowGroups, add_lora_triton

    rep = 100 if args.quick else 300
    for n, (features, ranks, adapters, rows, width) in enumerate(LORA_CASES):
        case = f"{rows}x{LORA_TOKENS}x{features} r{'/'.join(map(str, ranks))} {adapters} ad. K={width}"
        weights, index, scale, x, out0 = lora_case(features, ranks, adapters, rows, width, LORA_TOKENS, "cuda", seed=n)
        lora_compare(case, weights, index, scale, x, out0, 2e-3)
        groups = RowGroups.build(index.cuda(), scale.cuda())
        loop = lora_loop(weights, index, scale, x)
        check_loop = out0.clone()
        loop(check_loop)
        buf = out0.clone()
        add_lora_triton(buf, x, weights, groups)
        loop_err = float((check_loop.float() - buf.float()).norm() / (buf.float() - out0.float()).norm())
        ms_k = triton.testing.do_bench(lambda buf=buf: add_lora_triton(buf, x, weights, groups), warmup=25,
                                       rep=rep, return_mode="median")
        ms_l = triton.testing.do_bench(lambda buf=buf: loop(buf), warmup=25, rep=rep, return_mode="median")
        base_w = torch.randn(features, features, device="cuda", dtype=x.dtype) / math.sqrt(features)
        ms_b = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, base_w), warmup=25, rep=rep,
                                       return_mode="median")
        # what the kernel must move at least: x and out (read + write) of the rows with an
        # adapter, and each used adapter's factors once
        used_rows = int((index >= 0).any(1).sum())
        used = sorted(set(index[index >= 0].tolist()))
        element = x.element_size()
        nbytes = used_rows * LORA_TOKENS * 3 * features * element + sum(
            2 * weights.rank[s] * features * element for s in used)
        n_copy = nbytes // 8  # float32: the copy reads 4n and writes 4n bytes
        src, dst = torch.randn(n_copy, device="cuda"), torch.empty(n_copy, device="cuda")
        ms_c = triton.testing.do_bench(lambda src=src, dst=dst: dst.copy_(src), warmup=25, rep=rep,
                                       return_mode="median")
        row("lora", case, "kernel median ms", ms_k, "info",
            f"{nbytes / ms_k / 1e6:.0f} GB/s of the {nbytes / 1e6:.0f} MB it must move; {len(used)} adapters used, "
            f"{used_rows}/{rows} rows")
        row("lora", case, "per-adapter loop median ms", ms_l, "info",
            f"kernel {ms_l / ms_k:.2f}× faster; loop vs kernel rel L2 {loop_err:.2g}")
        row("lora", case, "d2d copy, same bytes (bound) ms", ms_c, "info",
            f"kernel at {ms_c / ms_k:.2f} of the bandwidth bound; {8 * n_copy / ms_c / 1e6:.0f} GB/s copy")
        row("lora", case, "kernel / base linear time", ms_k / ms_b, "info",
            f"base F.linear {features}→{features} {ms_b:.3f} ms (the layer the adapter rides on)")
        del weights, x, out0, buf, check_loop, src, dst
        torch.cuda.empty_cache()
    # fp32: the kernel runs IEEE dots (no TF32), so it meets the reference closely
    weights, index, scale, x, out0 = lora_case(320, (8, 16), 6, 8, 2, 1024, "cuda", seed=9, dtype=torch.float32)
    lora_compare("8x1024x320 r8/16 6 ad. K=2 fp32", weights, index, scale, x, out0, 1e-5)
    if torch.cuda.device_count() > 1:  # the launch's device guard: tensors on another device than the current one
        current = torch.cuda.current_device()
        other = next(d for d in range(torch.cuda.device_count()) if d != current)
        weights, index, scale, x, out0 = lora_case(320, (8, 16), 6, 8, 2, 1024, f"cuda:{other}", seed=10)
        lora_compare(f"cuda:{other} while cuda:{current} is current", weights, index, scale, x, out0, 2e-3)
    else:
        row("lora", "tensors on another device than the current one", "second device", torch.cuda.device_count(),
            "skipped", "one device")


# ---- driver ---------------------------------------------------------------------------------------------------

PARTS = [  # name, function, needs CUDA; run in this order
    ("ptx", part_ptx, False),
    ("interpreter", part_interpreter, False),
    ("kernel", part_kernel, True),
    ("bandwidth", part_bandwidth, True),
    ("reaper", part_reaper, True),
    ("nosync", part_nosync, True),
    ("unet", part_unet, True),
    ("graphs", part_graphs, True),
    ("layouts", part_layouts, True),
    ("png", part_png, True),
    ("shapes", part_shapes, True),
    ("lora", part_lora, True),
    ("sdxl", part_sdxl, True),
    ("flux", part_flux, True),
]


def write_json(path: pathlib.Path | None, device: str, args, ok: bool, finished: bool) -> None:
    """The rows so far (after every part, so a run stopped at its time limit still leaves them)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(device=device, torch=torch.__version__, quick=args.quick, ok=ok, finished=finished,
                                    rows=ROWS), indent=1, default=str))


def main() -> int:
    import gc

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all): "
                        + ",".join(name for name, _, _ in PARTS))
    parser.add_argument("--quick", action="store_true", help="shorter timings, smaller runs (FLUX: fewer blocks)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="also write the rows as JSON here (rewritten after every part)")
    parser.add_argument("--device", default=None, help="cuda:N to run on (default: the current CUDA device)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no part after this many seconds: the parts left get a FAIL row 'not run'")
    parser.add_argument("--interpreter-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interpreter_worker:
        return interpreter_worker()
    only = {p for p in args.only.split(",") if p}
    unknown = only - {name for name, _, _ in PARTS}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if args.device is not None and CUDA:
        chosen = torch.device(args.device)
        if chosen.type != "cuda" or chosen.index is None or chosen.index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: one of cuda:0 … cuda:{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(chosen)  # every "cuda" tensor below goes there; engines get it explicitly
    started = time.perf_counter()
    device = f"{torch.cuda.get_device_name()} (cuda:{torch.cuda.current_device()})" if CUDA else "no CUDA device"
    import triton

    print(f"gpu_check on {device}: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"triton {triton.__version__}, quick={args.quick}", flush=True)
    for name, fn, needs_cuda in PARTS:
        if only and name not in only:
            continue
        if needs_cuda and not CUDA:
            row(name, "-", "run", "-", "skipped", SKIP_NOTE)
            continue
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            row(name, "-", "run", "not run", "FAIL", f"--budget-s {args.budget_s:g} spent before it started")
            continue
        t = time.perf_counter()
        print(f"[{name}]", flush=True)
        try:
            fn(args)
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
        write_json(args.json, device, args, all(r["status"] != "FAIL" for r in ROWS), False)
    ok = all(r["status"] != "FAIL" for r in ROWS)
    row("total", "-", "wall s", time.perf_counter() - started, "ok" if ok else "FAIL")
    print()
    print_table()
    write_json(args.json, device, args, ok, True)
    if args.json:
        print(f"wrote {args.json}")
    print("gpu_check: ALL OK" if ok else "gpu_check: SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
