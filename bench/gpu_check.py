"""One prepared check for a CUDA machine (written for a lent H200; a few minutes).

    python bench/gpu_check.py [--quick] [--json OUT.json] [--iters N]

(a) accuracy  the Triton update kernel vs the torch reference on CUDA, random inputs
              (entries without an uncond row, noise rows, finite clips, keep_history on
              and off, unused model/noise rows NaN, slots outside the index sentinel):
              64 entries × 4×64×64 and 256 × 4×128×128, fp32 and bf16 model outputs;
              max abs error, max error relative to max|ref|, rel L2, untouched slots.
(b) speed     the kernel timed with CUDA events (warmup, median of N), its achieved
              bandwidth (bytes the launch must read + write / time) against a
              device-to-device copy (`dst.copy_(src)`) moving the same bytes, measured in
              the same run → ratio; the torch reference on CUDA for comparison; without
              --quick also a BLOCK sweep on the largest case.
(c) engine    an EngineCore on cuda with the tiny test model, mixed requests (samplers,
              guidance, late joiners) and one cancel, against the same plan on CPU
              (rel L2 ≤ 1e-4, TF32 off); every CudaFence turns done; a fence held
              pending (torch.cuda._sleep before the launch) keeps the canceled request's
              slot and epoch until it completes, then the reaper releases it.

Prints one table; --json writes the same rows as JSON. Exit status 1 if a check fails.
Without CUDA it prints a message and exits 0 (a CPU smoke for CI).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

ROWS: list[dict] = []
DEVICE = "cuda"  # the kernel checks' device (a CPU dry run of this script's own logic sets "cpu")


def row(section: str, case: str, metric: str, value, ok: bool | None = None, note: str = "") -> None:
    ROWS.append(dict(section=section, case=case, metric=metric, value=value, ok=ok, note=note))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_table() -> None:
    cols = ("section", "case", "metric", "value", "ok", "note")
    cells = [[r["section"], r["case"], r["metric"], fmt(r["value"]),
              "" if r["ok"] is None else ("ok" if r["ok"] else "FAIL"), r["note"]] for r in ROWS]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for x in cells:
        print("  ".join(c.ljust(w) for c, w in zip(x, widths)))


# ---- inputs ------------------------------------------------------------------------------

def random_inputs(entries: int, shape: tuple, model_dtype: torch.dtype, seed: int = 0):
    from engine.solvers import CLIP, G, HC, KEEP_HIST, KS, NUM_COEFS

    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    slots = entries + max(1, entries // 4)  # some slots outside the index
    entry_slots = torch.randperm(slots, generator=g)[:entries]
    has_uncond = torch.rand(entries, generator=g) < 0.75
    has_noise = torch.rand(entries, generator=g) < 0.3
    used = entries + int(has_uncond.sum())
    rows = used + 8  # padded rows, never read
    perm = torch.randperm(rows, generator=g)
    rc = perm[:entries]
    ru = torch.full((entries,), -1, dtype=torch.int64)
    ru[has_uncond] = perm[entries:used]
    n_noise = int(has_noise.sum()) + 2
    rn = torch.full((entries,), -1, dtype=torch.int64)
    rn[has_noise] = torch.randperm(n_noise, generator=g)[: int(has_noise.sum())]
    index = torch.stack([entry_slots, rc, ru, rn], 1).to(torch.int32)

    coefs = torch.randn(entries, NUM_COEFS, generator=g)
    coefs[:, G] = torch.rand(entries, generator=g) * 10
    finite = torch.rand(entries, generator=g) < 0.3
    coefs[:, CLIP] = torch.where(finite, torch.rand(entries, generator=g) * 2 + 0.25, torch.tensor(math.inf))
    coefs[:, KS] = torch.where(torch.rand(entries, generator=g) < 0.5, torch.tensor(1.0),
                               torch.rand(entries, generator=g) * 3 + 0.1)
    coefs[:, HC] = torch.where(torch.rand(entries, generator=g) < 0.4, torch.tensor(0.0), coefs[:, HC])
    coefs[:, KEEP_HIST] = (torch.rand(entries, generator=g) < 0.5).float()

    dev = torch.device(DEVICE)
    gd = torch.Generator(dev).manual_seed(seed)
    model_out = torch.full((rows, numel), math.nan, device=dev)
    read_rows = torch.cat([rc, ru[ru >= 0]]).to(dev)
    model_out[read_rows] = torch.randn(len(read_rows), numel, device=dev, generator=gd) * 2
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


def launch_bytes(t: dict) -> int:
    """What one launch must read and write (the index and coefficients aside)."""
    from engine.solvers import HC, KEEP_HIST

    idx, c = t["index"].cpu(), t["coefs"].cpu()
    numel = t["latents"].shape[1]
    mb = t["model_out"].element_size()
    rows = idx.shape[0] + int((idx[:, 2] >= 0).sum())
    reads = rows * numel * mb + idx.shape[0] * numel * 4  # model rows + x
    reads += int((c[:, HC] != 0).sum()) * numel * 4 + int((idx[:, 3] >= 0).sum()) * numel * 4
    writes = idx.shape[0] * numel * 4 + int((c[:, KEEP_HIST] != 0).sum()) * numel * 4
    return reads + writes


def cuda_time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# ---- (a) accuracy and (b) speed --------------------------------------------------------------

CASES = [(64, (4, 64, 64)), (256, (4, 128, 128))]


def check_kernel(quick: bool, iters: int) -> None:
    from engine.kernels import update_slots_reference, update_slots_triton
    from engine.solvers import KEEP_HIST

    for entries, shape in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            case = f"{entries}x{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
            t = random_inputs(entries, shape, dtype, seed=entries)
            ref = {k: v.clone() for k, v in t.items()}
            tri = {k: v.clone() for k, v in t.items()}
            update_slots_reference(**ref)
            update_slots_triton(**tri)
            torch.cuda.synchronize()
            slots = t["index"][:, 0].long()
            others = torch.ones(t["latents"].shape[0], dtype=torch.bool, device=DEVICE)
            others[slots] = False
            for name in ("latents", "history"):
                r, k = ref[name][slots].double(), tri[name][slots].double()
                err = (k - r).abs()
                finite = bool(torch.isfinite(k).all())
                max_abs = float(err.max())
                scale = float(r.abs().max())
                rel_l2 = float(err.norm() / r.norm())
                close = finite and bool((err <= 1e-5 + 1e-5 * r.abs()).all())
                row("a accuracy", case, f"{name} max abs err", max_abs, close,
                    f"max|ref| {scale:.3g}, rel-to-max {max_abs / scale:.2e}, rel L2 {rel_l2:.2e}")
                untouched = bool(torch.equal(tri[name][others], t[name][others]))
                row("a accuracy", case, f"{name} slots outside index untouched", untouched, untouched)
            keep0 = slots[t["coefs"][:, KEEP_HIST] == 0]
            same = bool(torch.equal(tri["history"][keep0], t["history"][keep0]))
            row("a accuracy", case, "history untouched where keep_history=0", same, same)

            # (b) speed, on fresh inputs of the same layout
            work = {k: v.clone() for k, v in t.items()}
            nbytes = launch_bytes(work)
            ms_k = cuda_time_ms(lambda: update_slots_triton(**work), warmup=10, iters=iters)
            ms_r = cuda_time_ms(lambda: update_slots_reference(**work), warmup=3, iters=max(5, iters // 4))
            n = nbytes // 8  # float32 elements: a copy of n reads 4n and writes 4n bytes = nbytes
            src, dst = torch.randn(n, device=DEVICE), torch.empty(n, device=DEVICE)
            ms_c = cuda_time_ms(lambda: dst.copy_(src), warmup=10, iters=iters)
            bw_k, bw_c = nbytes / ms_k / 1e6, 8 * n / ms_c / 1e6  # GB/s
            row("b speed", case, "kernel median ms", ms_k, None, f"{nbytes / 1e6:.1f} MB moved per launch")
            row("b speed", case, "kernel GB/s", bw_k, None)
            row("b speed", case, "d2d copy GB/s (same bytes)", bw_c, None, f"{ms_c:.4f} ms")
            row("b speed", case, "kernel / copy bandwidth", bw_k / bw_c, None)
            row("b speed", case, "torch reference median ms", ms_r, None, f"kernel speed-up {ms_r / ms_k:.1f}x")
            del work, src, dst, t, ref, tri
            torch.cuda.empty_cache()

    if not quick:
        entries, shape = CASES[-1]
        t = random_inputs(entries, shape, torch.float32, seed=1)
        nbytes = launch_bytes(t)
        for block in (256, 512, 1024, 2048, 4096):
            ms = cuda_time_ms(lambda: update_slots_triton(**t, block=block), warmup=5, iters=iters)
            row("b speed", f"{entries}x{'x'.join(map(str, shape))} float32", f"BLOCK={block} median ms", ms, None,
                f"{nbytes / ms / 1e6:.0f} GB/s")


# ---- (c) the engine on cuda: fences, reaper, results ------------------------------------------

PLAN = [  # id, sampler, steps, guidance, seed, join at batch, cancel at batch
    ("euler", "euler", 12, 3.0, 1, 0, None),
    ("victim", "dpmpp_2m", 30, 3.0, 9, 0, 5),
    ("dpm", "dpmpp_2m", 15, 7.5, 3, 0, None),
    ("ancestral", "euler_ancestral", 10, 7.5, 2, 2, None),
    ("ddim", "ddim", 8, 1.0, 4, 3, None),
    ("late", "dpmpp_2m", 9, 1.0, 5, 6, None),
]


def run_plan(device: str, hold_at_cancel: bool):
    from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled
    from engine.protocol import GenerateParams
    from reference import TEST_CONDITIONS, tiny_model

    model = tiny_model("epsilon")
    model.unet.to(device)
    model.device = torch.device(device)
    hold = {"on": False}
    denoise = model.denoise

    def held_denoise(x, t, c):
        if hold["on"]:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before this launch
            hold["on"] = False
        return denoise(x, t, c)

    model.denoise = held_denoise
    core = EngineCore(model, CoreConfig(slots=4, max_steps=64, device=device, output_budget_bytes=1 << 30))
    fences = []
    record = core.fences.record
    core.fences.record = lambda: fences.append(record()) or fences[-1]
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
                core.add_request(rid, GenerateParams(condition=TEST_CONDITIONS[seed % 3], steps=steps, sampler=sampler,
                                                     guidance=g, seed=seed, output="latent"))
                waiting.remove(item)
        for rid, *_, cancel in PLAN:
            if cancel is not None and core.batches == cancel and rid in core.requests \
                    and not core.requests[rid].canceled:
                req = core.requests[rid]
                if hold_at_cancel:
                    torch.cuda.synchronize()
                    core._reap()  # every earlier launch reaped now: no publish (a blocking copy) below
                    hold["on"] = True
                    collect(core.step())  # this launch, which includes the victim, waits behind the sleep
                    group, slot = req.group, req.slot
                    fence, epoch = group.last_fence[slot], int(group.epoch[slot])
                    checks["fence pending after launch (no hidden sync)"] = not fence.done()
                    core.abort_requests([rid])
                    core._reap()  # the reaper must not release the slot yet
                    checks["slot kept while fence pending"] = (group.requests[slot] is req
                                                               and int(group.epoch[slot]) == epoch)
                    checks["no Canceled before fence done"] = not any(
                        isinstance(o, RequestCanceled) and o.request_id == rid for o in core.outputs)
                    torch.cuda.synchronize()
                    checks["fence done after synchronize"] = fence.done()
                    outs = core.step()
                    checks["released after fence (epoch+1)"] = int(group.epoch[slot]) == epoch + 1
                    checks["Canceled delivered"] = any(
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
        checks["fences are CudaFence"] = all(type(f).__name__ == "CudaFence" for f in fences)
        checks[f"all {len(fences)} fences done"] = all(f.done() for f in fences)
    return results, canceled, checks, model


def check_engine() -> None:
    from reference import TEST_CONDITIONS, reference_latents, rel_l2

    t0 = time.perf_counter()
    gpu, gpu_canceled, checks, _ = run_plan("cuda", hold_at_cancel=True)
    cpu, cpu_canceled, _, cpu_model = run_plan("cpu", hold_at_cancel=False)
    row("c engine", "cuda run", "wall s (cuda + cpu runs)", time.perf_counter() - t0)
    for name, ok in checks.items():
        row("c engine", "fences/reaper", name, ok, bool(ok))
    row("c engine", "cancel", "victim canceled on both", sorted(gpu_canceled) == sorted(cpu_canceled) == ["victim"],
        sorted(gpu_canceled) == sorted(cpu_canceled) == ["victim"])
    for rid, sampler, steps, g, seed, _, cancel in PLAN:
        if cancel is not None:
            continue
        if rid not in gpu or rid not in cpu:
            row("c engine", rid, "finished", False, False)
            continue
        err = rel_l2(gpu[rid], cpu[rid])
        ref = reference_latents(cpu_model, sampler, TEST_CONDITIONS[seed % 3], steps, g, seed)
        row("c engine", f"{rid} ({sampler}, {steps} steps, g={g:g})", "rel L2 cuda vs cpu", err, err <= 1e-4,
            f"cpu vs diffusers {rel_l2(cpu[rid], ref):.1e}, cuda vs diffusers {rel_l2(gpu[rid], ref):.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timing iterations, no BLOCK sweep")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check (exit 0).")
        return 0
    iters = args.iters or (20 if args.quick else 100)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    device = torch.cuda.get_device_name()
    print(f"gpu_check on {device}, torch {torch.__version__}, quick={args.quick}, iters={iters}", flush=True)
    for name, fn in (("kernel", lambda: check_kernel(args.quick, iters)), ("engine", check_engine)):
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # report and go on: one failure should not hide the other checks
            traceback.print_exc()
            row(name, "-", "exception", f"{type(exc).__name__}: {exc}", False)
        print(f"[{name} done in {time.perf_counter() - t:.1f} s]", flush=True)
    ok = all(r["ok"] is not False for r in ROWS)
    row("total", "-", "wall s", time.perf_counter() - started, ok)
    print_table()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(device=device, torch=torch.__version__, quick=args.quick,
                                             iters=iters, ok=ok, rows=ROWS), indent=1, default=str))
        print(f"wrote {args.json}")
    print("gpu_check: ALL OK" if ok else "gpu_check: SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
