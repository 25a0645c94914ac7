"""The fused per-slot update (R3): the Triton kernel, run through Triton's interpreter on
CPU, against the torch reference on random inputs; and the reference against a
hand-written per-element formula, so the reference itself is pinned down.

The kernel runs in the suite's one Triton-interpreter worker (the `triton_interpreter`
fixture, tests/triton_interpreter.py says why a worker process with TRITON_INTERPRET=1
from its start); inputs are built and the reference runs here, in the test process.
"""
from __future__ import annotations

import math
import pathlib

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]

from engine.core import kernels as engine_kernels  # noqa: E402
from engine.core.solvers import A, B, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q  # noqa: E402
from triton_interpreter import assert_interpreted  # noqa: E402

pytest.importorskip("triton")

TENSORS = ("model_out", "latents", "history", "noise", "index", "coefs")


def _worker_run_triton(arrays: dict, dtype: str, block: int) -> tuple:
    """In the interpreter worker: run update_slots_triton on numpy copies of the inputs."""
    assert_interpreted(engine_kernels._update_slots_kernel)
    t = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    t["model_out"] = t["model_out"].to(getattr(torch, dtype))
    engine_kernels.update_slots_triton(**t, block=block)
    return t["latents"].numpy(), t["history"].numpy(), type(engine_kernels._update_slots_kernel).__name__


@pytest.fixture(scope="module")
def interpreter(triton_interpreter):
    """The kernel through the module's interpreter worker: inputs in, outputs out."""
    pool = triton_interpreter

    def run(inputs: dict, block: int):
        arrays = {k: (v.float() if k == "model_out" else v).numpy() for k, v in inputs.items()}
        dtype = str(inputs["model_out"].dtype).removeprefix("torch.")
        lat, hist, kind = pool.submit(_worker_run_triton, arrays, dtype, block).result(timeout=600)
        assert kind == "InterpretedFunction"
        out = {k: v.clone() for k, v in inputs.items()}
        out["latents"], out["history"] = torch.from_numpy(lat), torch.from_numpy(hist)
        return out

    run.pool = pool  # for tests that run other functions in the same worker
    return run


LATENT_SENTINEL = 7777.0  # slots outside the index: must come back untouched
HISTORY_SENTINEL = -5555.0


# ---- random inputs -------------------------------------------------------------------------

def random_case(seed: int, dtype: torch.dtype = torch.float32):
    """Random slots / rows / entries: some entries without an uncond row, some with noise
    rows, some with a finite clip, keep_history on and off; unused model and noise rows
    are NaN (reading one would show), outputs outside the update are sentinels."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    coin = lambda p=0.5: bool(torch.rand((), generator=g) < p)  # noqa: E731
    numel = ri(1, 400)
    block = [b for b in (16, 32, 64, 128, 256) if b < numel] or [16]
    block = block[ri(0, len(block) - 1)]
    slots = ri(1, 10)
    entries = ri(1, min(slots, 6))
    entry_slots = torch.randperm(slots, generator=g)[:entries]
    has_uncond = [coin(0.6) for _ in range(entries)]
    has_noise = [coin(0.5) for _ in range(entries)] if coin(0.8) else [False] * entries
    # model rows: the ones the entries use, in random order, plus unused (padded) rows
    used = entries + sum(has_uncond)
    rows = used + ri(0, 3)
    perm = torch.randperm(rows, generator=g).tolist()
    noise_rows = sum(has_noise) + (ri(0, 2) if any(has_noise) else 0)
    nperm = torch.randperm(noise_rows, generator=g).tolist()
    index = []
    for j in range(entries):
        rc = perm.pop()
        ru = perm.pop() if has_uncond[j] else -1
        rn = nperm.pop() if has_noise[j] else -1
        index.append([int(entry_slots[j]), rc, ru, rn])
    index = torch.tensor(index, dtype=torch.int32).reshape(entries, 4)

    model_out = torch.full((rows, numel), float("nan"))
    used_rows = [r for r in index[:, 1:3].flatten().tolist() if r >= 0]
    model_out[used_rows] = torch.randn(len(used_rows), numel, generator=g) * 2
    model_out = model_out.to(dtype)
    noise = torch.full((noise_rows, numel), float("nan"))
    used_noise = [r for r in index[:, 3].tolist() if r >= 0]
    noise[used_noise] = torch.randn(len(used_noise), numel, generator=g)

    latents = torch.full((slots, numel), LATENT_SENTINEL)
    history = torch.full((slots, numel), HISTORY_SENTINEL)
    latents[entry_slots] = torch.randn(entries, numel, generator=g) * 3
    history[entry_slots] = torch.randn(entries, numel, generator=g)

    coefs = torch.randn(entries, NUM_COEFS, generator=g)
    coefs[:, G] = torch.rand(entries, generator=g) * 10
    clip = torch.rand(entries, generator=g) * 2 + 0.25
    finite = torch.rand(entries, generator=g) < 0.5
    coefs[:, CLIP] = torch.where(finite, clip, torch.full_like(clip, math.inf))
    coefs[:, KS] = torch.where(torch.rand(entries, generator=g) < 0.5, torch.ones(entries),
                               torch.rand(entries, generator=g) * 3 + 0.1)
    coefs[:, HC] = torch.where(torch.rand(entries, generator=g) < 0.4, torch.zeros(entries), coefs[:, HC])
    coefs[:, KEEP_HIST] = (torch.rand(entries, generator=g) < 0.5).float()
    return dict(model_out=model_out, latents=latents, history=history, noise=noise, index=index,
                coefs=coefs), block


def _clone(inputs):
    return {k: v.clone() for k, v in inputs.items()}


def _check(interpreter, inputs, block):
    ref = _clone(inputs)
    engine_kernels.update_slots_reference(**ref)
    tri = interpreter(inputs, block)
    index = inputs["index"].long()
    slots = index[:, 0]
    keep = inputs["coefs"][:, KEEP_HIST] != 0
    others = torch.ones(inputs["latents"].shape[0], dtype=torch.bool)
    others[slots] = False
    # every element, both outputs
    torch.testing.assert_close(tri["latents"], ref["latents"], rtol=1e-6, atol=1e-6, equal_nan=False)
    torch.testing.assert_close(tri["history"], ref["history"], rtol=1e-6, atol=1e-6, equal_nan=False)
    for out in (ref, tri):
        # slots outside the index untouched, in both tensors
        assert torch.equal(out["latents"][others], inputs["latents"][others])
        assert torch.equal(out["history"][others], inputs["history"][others])
        # keep_history == 0: history untouched; == 1: rewritten (x0 is never the old value here)
        assert torch.equal(out["history"][slots[~keep]], inputs["history"][slots[~keep]])
        if keep.any():
            assert not torch.equal(out["history"][slots[keep]], inputs["history"][slots[keep]])
        assert torch.isfinite(out["latents"][slots]).all()
        # inputs are read only
        for name in ("model_out", "noise", "index", "coefs"):
            assert torch.equal(out[name], inputs[name]) or (
                torch.equal(out[name].isnan(), inputs[name].isnan())
                and torch.equal(out[name].nan_to_num(), inputs[name].nan_to_num()))
    return ref, tri


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_triton_matches_reference_random(interpreter, seed):
    inputs, block = random_case(seed)
    _check(interpreter, inputs, block)


def test_random_cases_cover_the_features():
    """The seeds above really cover what they are meant to."""
    cases = [random_case(s) for s in SEEDS]
    covered = [c for c, _ in cases]
    assert any((c["index"][:, 2] < 0).any() and (c["index"][:, 2] >= 0).any() for c in covered)
    assert any((c["index"][:, 3] >= 0).any() and (c["index"][:, 3] < 0).any() for c in covered)
    assert any(c["noise"].numel() == 0 for c in covered)
    assert any(torch.isfinite(c["coefs"][:, CLIP]).any() and torch.isinf(c["coefs"][:, CLIP]).any() for c in covered)
    assert any((c["coefs"][:, KEEP_HIST] == 0).any() and (c["coefs"][:, KEEP_HIST] == 1).any() for c in covered)
    assert any((c["coefs"][:, HC] == 0).any() and (c["coefs"][:, HC] != 0).any() for c in covered)
    assert any(c["model_out"].isnan().any() for c in covered)  # unused (padded) rows present
    numel_block = [(c["latents"].shape[1], b) for c, b in cases]
    assert any(n % b and n > 2 * b for n, b in numel_block)  # several programs, a ragged last block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_matches_reference_low_precision_model_output(interpreter, dtype):
    for seed in (100, 101):
        inputs, block = random_case(seed, dtype)
        _check(interpreter, inputs, block)


def test_triton_one_block_and_tiny_rows(interpreter):
    """numel 1 and numel below the block (one program per entry, most lanes masked)."""
    for seed, numel in ((200, 1), (201, 5), (202, 100)):
        inputs, _ = random_case(seed)
        inputs = {k: (v[:, :numel].contiguous() if k in ("model_out", "latents", "history", "noise") else v)
                  for k, v in inputs.items()}
        _check(interpreter, inputs, block=1024)


def test_clamp_is_active_in_random_cases():
    """Finite clips clamp something, so the clamp path is really compared."""
    clamped = 0
    for seed in range(12):
        inputs, _ = random_case(seed)
        ref = _clone(inputs)
        engine_kernels.update_slots_reference(**ref)
        c = inputs["coefs"]
        for j, (slot, rc, ru, rn) in enumerate(inputs["index"].tolist()):
            if math.isfinite(c[j, CLIP]) and c[j, KEEP_HIST]:
                clamped += int((ref["history"][slot].abs() >= c[j, CLIP] * (1 - 1e-6)).sum())
    assert clamped > 0


def test_empty_index_is_a_no_op(interpreter):
    inputs, block = random_case(3)
    inputs["index"] = inputs["index"][:0]
    inputs["coefs"] = inputs["coefs"][:0]
    ref, tri = _check(interpreter, inputs, block)
    assert torch.equal(tri["latents"], inputs["latents"]) and torch.equal(ref["history"], inputs["history"])


def test_dispatch_on_cpu_uses_reference():
    inputs, _ = random_case(4)
    a, b = _clone(inputs), _clone(inputs)
    engine_kernels.update_slots(**a)
    engine_kernels.update_slots_reference(**b)
    assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["history"], b["history"])


# ---- the reference, pinned to the per-element formula ------------------------------------------

def test_reference_equals_hand_written_formula():
    """Two entries written out element by element in float64 Python arithmetic:
    one with guidance combine, finite clip, history, noise and keep_history; one with
    the cond row only, no clip, no noise and keep_history off."""
    numel = 7
    g = torch.Generator().manual_seed(42)
    model_out = torch.randn(3, numel, generator=g) * 2
    latents = torch.randn(4, numel, generator=g) * 3
    history = torch.randn(4, numel, generator=g)
    noise = torch.randn(2, numel, generator=g)
    index = torch.tensor([[2, 1, 0, 1], [0, 2, -1, -1]], dtype=torch.int32)
    coefs = torch.zeros(2, NUM_COEFS)
    coefs[0, [G, P, Q, CLIP, A, E, B, M, KS, KT, HC, D, KEEP_HIST]] = torch.tensor(
        [7.5, 0.9, -0.3, 1.0, 0.5, 0.25, 0.7, 0.6, 1.3, -0.4, -0.2, 0.35, 1.0])
    coefs[1, [G, P, Q, CLIP, A, E, B, M, KS, KT, HC, D, KEEP_HIST]] = torch.tensor(
        [3.0, 1.1, 0.4, math.inf, -0.5, 0.75, 0.0, 1.0, 0.8, 0.3, 0.0, 0.9, 0.0])
    x_before, h_before = latents.clone(), history.clone()

    expected_x, expected_h = latents.clone().double(), history.clone().double()
    for j, (slot, rc, ru, rn) in enumerate(index.tolist()):
        c = [float(v) for v in coefs[j]]
        for i in range(numel):
            cond = float(model_out[rc, i])
            out = cond if ru < 0 else float(model_out[ru, i]) + c[G] * (cond - float(model_out[ru, i]))
            x = float(x_before[slot, i])
            x0u = c[P] * x + c[Q] * out
            x0 = min(max(x0u, -c[CLIP]), c[CLIP])
            new = c[A] * x + c[E] * out + c[B] * x0 + ((x - c[M] * x0u) / c[KS]) * c[KT] \
                + c[HC] * float(h_before[slot, i])
            if rn >= 0:
                new += c[D] * float(noise[rn, i])
            expected_x[slot, i] = new
            if c[KEEP_HIST]:
                expected_h[slot, i] = x0

    engine_kernels.update_slots_reference(model_out, latents, history, noise, index, coefs)
    torch.testing.assert_close(latents.double(), expected_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(history.double(), expected_h, rtol=1e-6, atol=1e-6)
    assert torch.equal(history[0], h_before[0])  # keep_history off
    assert torch.equal(latents[[1, 3]], x_before[[1, 3]]) and torch.equal(history[[1, 3]], h_before[[1, 3]])
    assert (history[2].abs() <= 1.0).all() and (history[2].abs() == 1.0).any()  # clamped x0 kept, not x0u


# ---- arithmetic equal to the reference, NaN, strides ---------------------------

def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal as float32 values, NaN where NaN (torch.equal alone treats NaN as unequal)."""
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN in different places"
    diff = (a.nan_to_num(0.0) != b.nan_to_num(0.0))
    assert not diff.any(), f"{what}: {int(diff.sum())} elements differ, max |Δ| " \
                           f"{float((a.nan_to_num(0.0) - b.nan_to_num(0.0)).abs().max()):.3g}"


@pytest.mark.parametrize("seed", SEEDS)
def test_triton_equals_reference_exactly(interpreter, seed):
    """Same float32 operations in the same order: the interpreter's kernel (numpy float32,
    one rounding per operation, as the compiled kernel with div_rn and without FMA
    contraction) equals the torch reference bit for bit, not just within a tolerance."""
    inputs, block = random_case(seed)
    ref = _clone(inputs)
    engine_kernels.update_slots_reference(**ref)
    tri = interpreter(inputs, block)
    _assert_same_bits(tri["latents"], ref["latents"], "latents")
    _assert_same_bits(tri["history"], ref["history"], "history")


def _with_nans(seed: int, dtype=torch.float32):
    """A random case whose used model rows (and one history and noise row) hold NaN and
    ±inf in some elements; clips finite for most entries, so a clamp that drops NaN shows."""
    inputs, block = random_case(seed, dtype)
    g = torch.Generator().manual_seed(1000 + seed)
    index = inputs["index"].long()
    numel = inputs["latents"].shape[1]
    out = inputs["model_out"].float()
    for r in index[:, 1:3].flatten().tolist():
        if r >= 0:
            hit = torch.rand(numel, generator=g) < 0.2
            out[r, hit] = float("nan")
            out[r, torch.rand(numel, generator=g) < 0.05] = float("inf")
    inputs["model_out"] = out.to(dtype)
    inputs["coefs"][:, CLIP] = torch.rand(len(index), generator=g) + 0.5
    inputs["coefs"][0, HC] = 0.7  # entry 0 reads its history: NaN there propagates
    slot0 = int(index[0, 0])
    inputs["history"][slot0, : max(1, numel // 3)] = float("nan")
    return inputs, block


@pytest.mark.parametrize("seed", [0, 5, 7])
def test_nan_model_output_propagates_like_the_reference(interpreter, seed):
    """A NaN model output stays NaN in the latents and in the kept history (x0), in the
    kernel as in the reference: never turned into ±clip by the clamp."""
    inputs, block = _with_nans(seed)
    ref = _clone(inputs)
    engine_kernels.update_slots_reference(**ref)
    tri = interpreter(inputs, block)
    slots = inputs["index"][:, 0].long()
    keep = inputs["coefs"][:, KEEP_HIST] != 0
    assert ref["latents"][slots].isnan().any()
    if keep.any():
        assert ref["history"][slots[keep]].isnan().any(), "the case must put NaN into a kept history row"
    _assert_same_bits(tri["latents"], ref["latents"], "latents")
    _assert_same_bits(tri["history"], ref["history"], "history")


def test_nan_clamp_case_is_covered():
    """At least one NaN case keeps history with a finite clip (the clamp's NaN path)."""
    covered = False
    for seed in (0, 5, 7):
        inputs, _ = _with_nans(seed)
        keep = inputs["coefs"][:, KEEP_HIST] != 0
        covered |= bool(keep.any()) and bool(torch.isfinite(inputs["coefs"][keep, CLIP]).all())
    assert covered


def test_reference_skips_history_term_where_hc_is_zero():
    """No history term where hc == 0 (diffusers' first-order steps have none): a NaN in
    an unused history row does not leak into the latents — the kernel's `if hc != 0`."""
    inputs, _ = random_case(6)
    inputs["coefs"][:, HC] = 0.0
    inputs["history"][:] = float("nan")
    inputs["coefs"][:, KEEP_HIST] = 0.0
    ref = _clone(inputs)
    engine_kernels.update_slots_reference(**ref)
    assert torch.isfinite(ref["latents"][inputs["index"][:, 0].long()]).all()


def _worker_run_views(arrays: dict, dtype: str, views: dict, block: int) -> tuple:
    """In the interpreter worker: build the strided views described by `views` over the
    wide arrays, run the kernel on the views, return the wide latents and history."""
    assert_interpreted(engine_kernels._update_slots_kernel)
    wide = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    wide["model_out"] = wide["model_out"].to(getattr(torch, dtype))
    args = {}
    for name, t in wide.items():
        how = views.get(name)
        if how is None:
            args[name] = t
        elif how[0] == "cols":  # first `numel` columns of a wider row: row stride > numel
            args[name] = t[:, : how[1]]
        elif how[0] == "every2":  # every other element: element stride 2
            args[name] = t[:, ::2]
        elif how[0] == "transposed":  # numel × rows storage, viewed as rows × numel
            args[name] = t.t()
    engine_kernels.update_slots_triton(**args, block=block)
    return wide["latents"].numpy(), wide["history"].numpy()


@pytest.fixture(scope="module")
def interpreter_views(interpreter):
    pool = interpreter.pool  # the module's one interpreter worker

    def run(wide: dict, views: dict, block: int):
        arrays = {k: (v.float() if k == "model_out" else v).numpy() for k, v in wide.items()}
        dtype = str(wide["model_out"].dtype).removeprefix("torch.")
        lat, hist = pool.submit(_worker_run_views, arrays, dtype, views, block).result(timeout=600)
        return torch.from_numpy(lat), torch.from_numpy(hist)

    return run


def _widen(t: torch.Tensor, how: str, g: torch.Generator) -> torch.Tensor:
    """Storage that `how` views back as `t` (the rest filled with poison)."""
    rows, numel = t.shape
    if how == "cols":
        wide = torch.full((rows, numel + 5), 31337.0, dtype=t.dtype)
        wide[:, :numel] = t
    elif how == "every2":
        wide = torch.full((rows, 2 * numel), 31337.0, dtype=t.dtype)
        wide[:, ::2] = t
    else:  # transposed
        wide = t.t().contiguous()
    return wide


@pytest.mark.parametrize("model_how,slots_how", [("cols", None), ("every2", None), ("transposed", None),
                                                  ("cols", "cols"), (None, "every2"), ("cols", "transposed")])
def test_non_contiguous_views(interpreter_views, model_how, slots_how):
    """A learned-sigma model's `out[:, :C]` (row stride > numel), element-strided and
    transposed views, for the model output and noise, and for the slot storage updated in
    place: the kernel reads and writes exactly the viewed elements, as the reference does."""
    inputs, block = random_case(11 if model_how != "transposed" else 9)
    g = torch.Generator().manual_seed(5)
    ref = _clone(inputs)
    engine_kernels.update_slots_reference(**ref)
    wide, views = dict(inputs), {}
    if model_how:
        for name in ("model_out", "noise"):
            if inputs[name].numel():
                wide[name], views[name] = _widen(inputs[name], model_how, g), (model_how, inputs[name].shape[1])
    if slots_how:
        for name in ("latents", "history"):
            wide[name], views[name] = _widen(inputs[name], slots_how, g), (slots_how, inputs[name].shape[1])
    lat, hist = interpreter_views(wide, views, block)
    for name, got in (("latents", lat), ("history", hist)):
        how = views.get(name, (None,))[0]
        if how == "cols":
            viewed, rest = got[:, : inputs[name].shape[1]], got[:, inputs[name].shape[1]:]
            assert (rest == 31337.0).all(), f"{name}: written outside the view"
        elif how == "every2":
            viewed, rest = got[:, ::2], got[:, 1::2]
            assert (rest == 31337.0).all(), f"{name}: written outside the view"
        elif how == "transposed":
            viewed = got.t()
        else:
            viewed = got
        _assert_same_bits(viewed, ref[name], name)


def test_launcher_rejects_wrong_shapes_devices_and_dtypes():
    inputs, _ = random_case(2)
    bad = [
        dict(model_out=inputs["model_out"][:, :-1]),  # rows of another size
        dict(index=inputs["index"].long()),  # int64 index
        dict(coefs=inputs["coefs"].double()),
        dict(coefs=inputs["coefs"][:, :-1]),
        dict(history=inputs["history"][:-1]),
        dict(latents=inputs["latents"].double(), history=inputs["history"].double()),
        dict(index=inputs["index"].to("meta")),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            engine_kernels.update_slots_triton(**{**_clone(inputs), **change})


# ---- the compiled kernel for sm_90, read on this CPU ---------------------------------------------

def _compile_for_sm90(fp_fusion: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = engine_kernels._update_slots_kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile")
    sig = {"out_ptr": "*fp32", "x_ptr": "*fp32", "h_ptr": "*fp32", "noise_ptr": "*fp32", "index_ptr": "*i32",
           "coef_ptr": "*fp32", "numel": "i32", "out_stride": "i64", "x_stride": "i64", "h_stride": "i64",
           "noise_stride": "i64", "NUM_COEFS": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn, sig, constexprs={"NUM_COEFS": NUM_COEFS, "BLOCK": 1024})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={**engine_kernels.LAUNCH_OPTIONS, "enable_fp_fusion": fp_fusion})
    except Exception as exc:  # no LLVM / ptxas for this target in the installed triton
        pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
    return compiled.asm["ptx"]


@pytest.mark.timeout(300)
def test_sm90_ptx_has_ieee_division_no_fma_and_nan_aware_clamp():
    """What the defects were found in, checked without a GPU: the kernel compiled for sm_90
    with the launch's options divides with div.rn.f32 (no div.approx / div.full), has no
    fma (every product rounded, as in torch), and tests for NaN before the clamp. The same
    kernel compiled with fp fusion on does contain FMAs, so the check can see them."""
    assert engine_kernels.LAUNCH_OPTIONS == {"enable_fp_fusion": False}
    ptx = _compile_for_sm90(fp_fusion=False)
    assert "div.rn.f32" in ptx
    assert "div.approx" not in ptx and "div.full" not in ptx
    assert "fma.rn.f32" not in ptx
    assert "setp.nan.f32" in ptx or "setp.neu.f32" in ptx or "max.NaN.f32" in ptx
    fused = _compile_for_sm90(fp_fusion=True)
    assert "fma.rn.f32" in fused


def test_installed_triton_takes_enable_fp_fusion_as_launch_option():
    """`enable_fp_fusion` is a field of the NVIDIA backend's options in the installed triton
    (a launch keyword goes to parse_options), so the launch really passes it."""
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions

    assert "enable_fp_fusion" in {f.name for f in dataclasses.fields(CUDAOptions)}
