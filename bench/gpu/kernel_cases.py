"""Inputs of the fused per-slot update kernel and the bitwise comparison of the kernel
(compiled, or through the interpreter) against its torch reference: shared by the ptx,
interpreter and kernel parts."""
from __future__ import annotations

import math

import torch

from .engine_internals import CLIP, G, HC, KEEP_HIST, KS, NUM_COEFS, update_slots_reference, update_slots_triton
from .report import check


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


def random_inputs(entries: int, shape: tuple, model_dtype: torch.dtype, seed: int = 0, device: str = "cuda",
                  nan_fraction: float = 0.0, coefs=None, stochastic=None):
    """Random slots/rows: uncond rows for most entries, noise rows for some, finite clips
    for some, keep_history on and off; unused model/noise rows NaN (reading one shows);
    slots outside the index hold sentinels. `coefs` (entries × NUM_COEFS) overrides the
    random coefficients (a sampler's pattern); `stochastic` which entries get noise."""
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
        got = tri[name]  # a view's writes land in its base
        same, max_abs, n = same_bits(got, ref[name])
        ok_all &= check(part, case, f"{name} bitwise = reference", same, same,
                        f"max|Δ| {max_abs:.3g}, {n} elements differ" if not same else
                        f"{got[slots].isnan().sum().item()} NaN kept")
        untouched = bool(torch.equal(got[others], t[name][others]))
        if not untouched:
            ok_all &= check(part, case, f"{name} outside the index untouched", untouched, untouched)
    return ok_all
