"""Part `bandwidth`: the update kernel's achieved bandwidth (bytes it must move / median
time over many back-to-back launches, triton.testing.do_bench) against a
device-to-device copy of the same bytes in the same run, at sizes several times the
60 MB L2: at least `judge.BANDWIDTH_TARGET` of the copy's."""
from __future__ import annotations

import math

import torch
import triton.testing

from .engine_internals import (A, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q, update_slots_reference,
                               update_slots_triton)
from . import judge
from .report import check, row


def launch_bytes(t: dict) -> int:
    """What one launch must read and write (the index and coefficients aside)."""
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


def run(args) -> None:
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
        finite = bool(torch.isfinite(t["latents"]).all())
        row("bandwidth", case, "bytes per launch (MB)", nbytes / 1e6, "info", f"{nbytes / l2:.1f}× the L2")
        row("bandwidth", case, "kernel median ms", ms_k, "info", f"{bw_k:.0f} GB/s")
        row("bandwidth", case, "d2d copy median ms (same bytes)", ms_c, "info", f"{bw_c:.0f} GB/s")
        verdict = judge.bandwidth(bw_k, bw_c, finite)
        check("bandwidth", case, "kernel / copy bandwidth", bw_k / bw_c, verdict.ok, verdict.note)
        if entries == 1024:
            ms_r = triton.testing.do_bench(lambda t=t: update_slots_reference(**t), warmup=10, rep=rep // 2,
                                           return_mode="median")
            row("bandwidth", case, "torch reference median ms", ms_r, "info", f"kernel {ms_r / ms_k:.1f}× faster")
        del t, src, dst
        torch.cuda.empty_cache()
