"""Part `lora`: the gathered LoRA kernel (`engine.lora.kernel.add_lora_triton`) on SD-sized
layers (32 rows × 4096 tokens × 320/640/1280 features, ranks 8/16/64 and mixed, 8–16
adapters by Zipf popularity, a quarter of the entries without one, one and two adapters
a row): equal to `add_lora_reference` (fp16 and fp32, rows without adapters untouched);
median time against a per-adapter loop of matmuls, against a device-to-device copy of the
bytes it must move (the bandwidth bound), and against the base layer's F.linear. High
ranks (up to the limit, ragged, in one call; a graph captured at a low rank replayed with
a rank-256 adapter) and bf16 against an fp32 reference."""
from __future__ import annotations

import math

import torch
import triton.testing

from engine.lora.kernel import RowGroups, SlotWeights, add_lora_reference, add_lora_triton

from .report import check, row


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


def run(args) -> None:
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
    high_ranks(args)
    bf16_against_fp32()
    if torch.cuda.device_count() > 1:  # the launch's device guard: tensors on another device than the current one
        current = torch.cuda.current_device()
        other = next(d for d in range(torch.cuda.device_count()) if d != current)
        weights, index, scale, x, out0 = lora_case(320, (8, 16), 6, 8, 2, 1024, f"cuda:{other}", seed=10)
        lora_compare(f"cuda:{other} while cuda:{current} is current", weights, index, scale, x, out0, 2e-3)
    else:
        row("lora", "tensors on another device than the current one", "second device", torch.cuda.device_count(),
            "skipped", "one device")


HIGH_RANKS = (64, 128, 200, 256)  # up to the pool's default limit (`DEFAULT_RANK_LIMIT`)


def high_ranks(args) -> None:
    """Ranks up to the limit, ragged in one call (the kernels walk the rank in tiles of
    `RANK_BLOCK`: one compiled kernel for every rank), fp16 and fp32, against the
    reference; and inside a CUDA-graph capture (scratch sized for the limit), replayed
    after a higher-rank adapter is put in a slot the graph never saw."""
    for dtype, tol in ((torch.float16, 2e-3), (torch.float32, 1e-5)):
        weights, index, scale, x, out0 = lora_case(640, HIGH_RANKS, 8, 8, 2, 1024, "cuda", seed=21, dtype=dtype)
        lora_compare(f"8x1024x640 r{'/'.join(map(str, HIGH_RANKS))} K=2 {str(dtype)[6:]}", weights, index, scale, x,
                     out0, tol)
    weights, index, scale, x, out0 = lora_case(640, (8,), 4, 8, 1, 1024, "cuda", seed=22, dtype=torch.float16)
    groups = RowGroups.build(index.cuda(), scale.cuda(), for_kernel=True)
    out = out0.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        add_lora_triton(out, x, weights, groups)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        add_lora_triton(out, x, weights, groups)
    g = torch.Generator().manual_seed(23)
    top = max(HIGH_RANKS)
    weights.put(0, torch.randn(top, 640, generator=g) / 640 ** 0.5, torch.randn(640, top, generator=g) / top ** 0.5,
                1.5)  # slot 0 now holds a rank-256 adapter: the graph reads it through the device tables
    out.copy_(out0)
    graph.replay()
    ref = out0.clone()
    add_lora_reference(ref, x, weights, RowGroups.build(index.cuda(), scale.cuda(), for_kernel=False))
    err = float((out.float() - ref.float()).norm() / max(float((ref.float() - out0.float()).norm()), 1e-6))
    check("lora", "graph captured at rank 8, replayed with a rank-256 adapter", "rel L2 vs reference", err,
          err <= 2e-3 and bool(torch.isfinite(out).all()), "the scratch is sized for the rank limit at capture")


def bf16_against_fp32() -> None:
    """bf16 adapters and activations through the kernel against the fp32 reference on
    fp32 copies of the same values: the error is bf16's rounding (a few 1e-3 of the
    delta), not a wrong adapter, scale or row."""
    weights, index, scale, x, out0 = lora_case(1280, (8, 16, 64), 12, 16, 2, 1024, "cuda", seed=31,
                                               dtype=torch.bfloat16)
    got = out0.clone()
    add_lora_triton(got, x, weights, RowGroups.build(index.cuda(), scale.cuda(), for_kernel=True))
    wide = SlotWeights(weights.capacity, 1280, 1280, "cuda", torch.float32)
    for slot in range(weights.capacity):
        if weights.A[slot] is not None:
            wide.put(slot, weights.A[slot].float(), weights.B[slot].float(), weights.scaling[slot])
    ref = out0.float().clone()
    add_lora_reference(ref, x.float(), wide, RowGroups.build(index.cuda(), scale.cuda(), for_kernel=False))
    delta = float((ref - out0.float()).norm())
    err = float((got.float() - ref).norm()) / max(delta, 1e-6)
    check("lora", "16x1024x1280 r8/16/64 K=2 bf16", "kernel vs fp32 reference (rel L2 of the delta)", err,
          err <= 2e-2 and bool(torch.isfinite(got).all()), "tol 2e-2: bf16 keeps 8 bits of mantissa")
