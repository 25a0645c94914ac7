"""The GPU story of diffslot in one command: one CUDA device, < 8 minutes.

    python3 bench/gpu_check.py [--only PART,...] [--quick] [--json OUT.json]

Parts (each prints table rows; a failure in one is reported and the others still run;
exit status 1 if any check failed):

  ptx          (CPU too) the update kernel compiled for sm_90 with the launch's options:
               IEEE division (div.rn.f32, no div.approx/div.full), no FMA contraction, a
               NaN test before the clamp.
  interpreter  (CPU too) the kernel through TRITON_INTERPRET=1 (a child process) against
               the torch reference, bit for bit: random cases, NaN outputs, strided views.
  kernel       the compiled kernel against the torch reference on CUDA, bit for bit (NaN
               where NaN): random cases in fp32/bf16/fp16 model outputs, every sampler's
               coefficient pattern (each kernel sampler × prediction type, first/middle/
               last steps), NaN model outputs, a learned-sigma `out[:, :C]` view, and a
               second device (cuda:1 while cuda:0 is current) where there is one.
  bandwidth    the kernel's achieved bandwidth (bytes it must move / median time over
               many back-to-back launches, triton.testing.do_bench) against a
               device-to-device copy of the same bytes in the same run, at sizes several
               times the 60 MB L2.
  reaper       an EngineCore on CUDA (tiny model, mixed samplers, a cancel): a launch held
               behind `torch.cuda._sleep` keeps the canceled request's slot and epoch until
               its CUDA event completes; every fence completes; results equal the CPU run.
  nosync       no hidden synchronisation in a step: (a) steps under
               `torch.cuda.set_sync_debug_mode("warn")` raise no warning; (b) with the stream
               held by a long `_sleep`, `step()` returns in a fraction of the hold, for a
               middle step (noise, copies) and for the step that reaps a finished request
               (its publish must not drain the stream).
  unet         an SD-1.5-architecture UNet2DConditionModel (random weights, 512×512 → 4×64×64
               latents, fp16; SD 1.5's config written out below) under the engine at full
               batch vs the same UNet's peak batched rate: useful rows/s ratio, host time per step.
  graphs       the bucketed layout with CUDA graphs (one captured denoiser call per bucket,
               replayed) against the same requests launched eagerly: equal final latents.
  layouts      compact vs padded vs bucketed (eager, and with CUDA graphs) at active
               fractions 1/8 … 1 on that UNet: time per step and per useful row, host time.

The lent machine has no diffusers and no msgspec and an older torch than setup.py pins:
`bash bench/device_wheels.sh` (here) downloads the wheels into bench/.wheels; this script
unpacks them into bench/.wheels/site and puts that on sys.path (the project itself is
never installed there: it runs from this checkout). On a machine without CUDA the CUDA
parts print "no CUDA device: skipped" and the script exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
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
    sig = {"out_ptr": "*fp16", "x_ptr": "*fp32", "h_ptr": "*fp32", "noise_ptr": "*fp32", "index_ptr": "*i32",
           "coef_ptr": "*fp32", "numel": "i32", "out_stride": "i64", "x_stride": "i64", "h_stride": "i64",
           "noise_stride": "i64", "NUM_COEFS": "constexpr", "BLOCK": "constexpr"}
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs={"NUM_COEFS": NUM_COEFS, "BLOCK": 1024}),
                              target=GPUTarget("cuda", 90, 32), options=dict(kernels.LAUNCH_OPTIONS))
    ptx = compiled.asm["ptx"]
    n = lambda s: ptx.count(s)  # noqa: E731
    case = f"sm_90, {kernels.LAUNCH_OPTIONS}"
    check("ptx", case, "div.rn.f32 (IEEE division)", n("div.rn.f32"), n("div.rn.f32") > 0)
    check("ptx", case, "div.approx / div.full", n("div.approx") + n("div.full"), n("div.approx") + n("div.full") == 0)
    check("ptx", case, "fma.rn.f32 (contracted)", n("fma.rn.f32"), n("fma.rn.f32") == 0)
    nan_tests = n("setp.nan.f32") + n("setp.neu.f32") + n("max.NaN.f32")
    check("ptx", case, "NaN test before the clamp", nan_tests, nan_tests > 0,
          f"compiled in {time.perf_counter() - t0:.1f} s")


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
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(0):
            t = random_inputs(16, (4, 32, 32), torch.float32, seed=7, device="cuda:1")
            compare_kernel("kernel", "cuda:1 while cuda:0 is current", t)
            fence = CudaFences(torch.device("cuda:1")).record()
            check("kernel", "cuda:1 while cuda:0 is current", "fence on cuda:1",
                  str(fence.device), fence.device == torch.device("cuda:1"))
    else:
        row("kernel", "cuda:1 while cuda:0 is current", "second device", torch.cuda.device_count(), "skipped",
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

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    rep = 100 if args.quick else 400  # ms of back-to-back launches per measurement
    for entries, shape, dtype in ((1024, (4, 64, 64), torch.float16), (256, (4, 128, 128), torch.float32),
                                  (2048, (4, 64, 64), torch.float32)):
        case = f"{entries}x{'x'.join(map(str, shape))} {str(dtype)[6:]}"
        t = bounded_inputs(entries, shape, dtype)
        nbytes = launch_bytes(t)
        update_slots_triton(**t)  # compile
        torch.cuda.synchronize()
        ms_k = triton.testing.do_bench(lambda: update_slots_triton(**t), warmup=50, rep=rep, return_mode="median")
        n = nbytes // 8  # float32 elements: the copy reads 4n and writes 4n = nbytes
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        ms_c = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=rep, return_mode="median")
        bw_k, bw_c = nbytes / ms_k / 1e6, 8 * n / ms_c / 1e6
        ok = bool(torch.isfinite(t["latents"]).all())
        row("bandwidth", case, "bytes per launch (MB)", nbytes / 1e6, "info", f"{nbytes / l2:.1f}× the L2")
        row("bandwidth", case, "kernel median ms", ms_k, "info", f"{bw_k:.0f} GB/s")
        row("bandwidth", case, "d2d copy median ms (same bytes)", ms_c, "info", f"{bw_c:.0f} GB/s")
        check("bandwidth", case, "kernel / copy bandwidth", bw_k / bw_c, ok, "" if ok else "latents went non-finite")
        if entries == 1024:
            ms_r = triton.testing.do_bench(lambda: update_slots_reference(**t), warmup=10, rep=rep // 2,
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
    """torch.cuda._sleep's cycles per second on this device (measured with events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(50_000_000)
    b.record()
    b.synchronize()
    return 50_000_000 / (a.elapsed_time(b) / 1e3)


def run_plan(device: str, hold_at_cancel: bool, hold_s: float = 0.2):
    from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled
    from engine.protocol import GenerateParams
    from engine.testing.reference import TEST_CONDITIONS, tiny_model

    model = tiny_model("epsilon")
    model.unet.to(device)
    model.device = torch.device(device)
    hold = {"on": False}
    denoise = model.denoise
    cycles = sleep_cycles_per_s() * hold_s if device == "cuda" else 0

    def held_denoise(x, t, c):
        if hold["on"]:
            torch.cuda._sleep(int(cycles))  # hold_s of GPU time queued before this launch
            hold["on"] = False
        return denoise(x, t, c)

    model.denoise = held_denoise
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
    return results, canceled, checks, model


def part_reaper(args) -> None:
    from engine.testing.reference import rel_l2

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    gpu, gpu_canceled, checks, _ = run_plan("cuda", hold_at_cancel=True)
    cpu, cpu_canceled, _, _ = run_plan("cpu", hold_at_cancel=False)
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

    # (b) the stream held: a step must come back long before the hold ends
    torch.cuda.synchronize()
    hold_s = 0.5
    cycles = int(sleep_cycles_per_s() * hold_s)

    def held_step_host_s() -> float:
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    host = held_step_host_s()
    check("nosync", "middle step, stream held 0.5 s", "host s in step()", host, host < 0.25 * hold_s,
          "a synchronising call waits out the hold")
    torch.cuda.synchronize()
    while "short" in core.requests and core.requests["short"].status.value == "running":
        step()  # up to the short request's final launch
    torch.cuda.synchronize()  # its final fence is done: the next step reaps it and publishes
    host = held_step_host_s()
    published = "short" not in core.requests or core.requests["short"].status.value != "finishing"
    check("nosync", "step that publishes a finished request", "host s in step()", host,
          host < 0.25 * hold_s and published, "publish must not drain the stream (.to('cpu'))")
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

        @property
        def vae_scale(self) -> int:
            return 8

        def encode(self, prompts):
            out = []
            for p in prompts:
                seed = int.from_bytes(hashlib.blake2b(p.encode(), digest_size=4).digest(), "little")
                g = torch.Generator("cuda").manual_seed(seed)
                out.append(Conditioning(torch.randn(TEXT_TOKENS, TEXT_WIDTH, device="cuda", generator=g,
                                                    dtype=torch.float16)))
            return out

        def stack_conditioning(self, rows):
            return (torch.stack([c.hidden for c in rows]),)

        def denoise_stacked(self, x, t, hidden):
            return self.denoiser(x, t, encoder_hidden_states=hidden).sample

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


def unet_peak_ms(model, rows: int) -> float:
    import triton.testing

    x = torch.randn(rows, 4, 64, 64, device="cuda", dtype=torch.float16)
    t = torch.randint(0, 1000, (rows,), device="cuda").float()
    conds = model.encode([f"p{k}" for k in range(rows)])
    with torch.no_grad():
        return triton.testing.do_bench(lambda: model.denoise(x, t, conds), warmup=100, rep=600, return_mode="median")


def run_engine_steps(model, slots: int, active: int, layout: str, steps_each: int, measure: int | None,
                     guidance: float = 7.5, sampler: str = "euler", device: str = "cuda", prompts=None,
                     cuda_graphs: bool = True, latents: dict | None = None):
    """An EngineCore on the UNet with `active` requests; returns (wall s, steps, useful rows,
    total rows, host s per step list, finished, failed). `measure`: time only that many
    steps after two warm-up steps (requests stay active); None: run every request to the end."""
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
        core.add_request(f"r{k}", GenerateParams(prompt=prompts[k % len(prompts)], negative_prompt="", steps=steps_each,
                                                 sampler=sampler, guidance=guidance, seed=k, output="latent"))
    finished = failed = 0

    def step():
        nonlocal finished, failed
        t0 = time.perf_counter()
        outs = core.step()
        host = time.perf_counter() - t0
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
        t0 = time.perf_counter()
        if measure is None:
            while core.has_unfinished_requests():
                hosts.append(step())
        else:
            for _ in range(measure):
                hosts.append(step())
        sync()
        wall = time.perf_counter() - t0
        if measure is None:
            while core.has_unfinished_requests():
                step()
    s1 = core.stats()
    useful = s1["useful_evals"] - s0["useful_evals"]
    total = useful + s1["padded_evals"] - s0["padded_evals"]
    graphs = 0 if core.graphed is None else len(core.graphed.graphs)
    run_engine_steps.graphs = graphs  # read by part_layouts
    return wall, core.batches - b0, useful, total, hosts, finished, failed


def part_unet(args) -> None:
    model = get_sd15()
    x = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        out = model.denoise(x, torch.tensor([500.0, 20.0], device="cuda"), model.encode(["a", ""]))
    finite = bool(torch.isfinite(out).all())
    row("unet", "random-weight UNet output", "finite", finite, "info" if finite else "FAIL",
        f"std {float(out.float().std()):.3g}")
    slots = 16
    rows = 2 * slots  # guidance 7.5: cond + uncond row per slot
    ms = unet_peak_ms(model, rows)
    peak = rows / (ms / 1e3)
    row("unet", f"UNet alone, batch {rows} fp16", "median ms / rows/s", ms, "info", f"{peak:.1f} rows/s")
    steps = 10 if args.quick else 20
    wall, batches, useful, total, hosts, finished, failed = run_engine_steps(model, slots, slots, "compact", steps,
                                                                             None)
    rate = useful / wall
    check("unet", f"engine {slots} requests x {steps} steps, compact", "useful rows/s / UNet peak", rate / peak,
          finished == slots and failed == 0,
          f"{rate:.1f} rows/s, {batches} batches, {finished} finished, {failed} failed")
    hosts_ms = sorted(h * 1e3 for h in hosts)
    row("unet", "engine, host time per step()", "median ms", statistics.median(hosts_ms), "info",
        f"p90 {hosts_ms[int(0.9 * (len(hosts_ms) - 1))]:.2f} ms vs {wall / max(1, batches) * 1e3:.1f} ms per step "
        "(host ≪ device: the host runs ahead)")


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
                f"host {statistics.median(hosts) * 1e3:.2f} ms/step"
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
    check("graphs", "bucketed: CUDA graphs vs eager, 5 requests x 6 steps", "max rel L2", worst,
          n0 == n1 == 5 and f0 == f1 == 0 and worst < 1e-3,
          f"{run_engine_steps.graphs} graphs captured; same kernels, so only capture-order rounding may differ")


# ---- driver ---------------------------------------------------------------------------------------------------

PARTS = [  # name, function, needs CUDA
    ("ptx", part_ptx, False),
    ("interpreter", part_interpreter, False),
    ("kernel", part_kernel, True),
    ("bandwidth", part_bandwidth, True),
    ("reaper", part_reaper, True),
    ("nosync", part_nosync, True),
    ("unet", part_unet, True),
    ("graphs", part_graphs, True),
    ("layouts", part_layouts, True),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--interpreter-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interpreter_worker:
        return interpreter_worker()
    only = {p for p in args.only.split(",") if p}
    unknown = only - {name for name, _, _ in PARTS}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if CUDA else "no CUDA device"
    import triton

    print(f"gpu_check on {device}: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"triton {triton.__version__}, quick={args.quick}", flush=True)
    for name, fn, needs_cuda in PARTS:
        if only and name not in only:
            continue
        if needs_cuda and not CUDA:
            row(name, "-", "run", "-", "skipped", SKIP_NOTE)
            continue
        t = time.perf_counter()
        print(f"[{name}]", flush=True)
        try:
            fn(args)
        except Exception as exc:  # report and go on: one failure must not hide the other parts
            traceback.print_exc()
            row(name, "-", "exception", f"{type(exc).__name__}: {str(exc)[:200]}", "FAIL")
        finally:
            if CUDA:
                with contextlib.suppress(Exception):
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        print(f"[{name} done in {time.perf_counter() - t:.1f} s]", flush=True)
    ok = all(r["status"] != "FAIL" for r in ROWS)
    row("total", "-", "wall s", time.perf_counter() - started, "ok" if ok else "FAIL")
    print()
    print_table()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(device=device, torch=torch.__version__, quick=args.quick, ok=ok,
                                             rows=ROWS), indent=1, default=str))
        print(f"wrote {args.json}")
    print("gpu_check: ALL OK" if ok else "gpu_check: SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
