"""The fused per-slot update (R3): the Triton kernel, run through Triton's interpreter on
CPU, against the torch reference on random inputs; and the reference against a
hand-written per-element formula, so the reference itself is pinned down.

How the interpreter is switched on. `TRITON_INTERPRET` (`triton.knobs.runtime.interpret`)
is looked up in os.environ at every access, and triton consults it at several moments:
when `@triton.jit` decorates a function (triton's own standard library at `import
triton`, our kernel when engine/kernels.py is executed) and again at launch (e.g. the
gluon import asserts that interpreted functions only exist in interpret mode). It must
therefore be set before triton is imported and stay set for the process. In a pytest
session triton is usually imported already (any module importing engine.core imports it),
and the suite may run on a CUDA machine where other tests want the compiled kernel, so
the kernel runs in one spawned worker process whose environment has TRITON_INTERPRET=1
from the start; inputs are built and the reference runs here, in the test process.
"""
from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import pathlib
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import kernels as engine_kernels  # noqa: E402
from engine.solvers import A, B, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q  # noqa: E402

pytest.importorskip("triton")

TENSORS = ("model_out", "latents", "history", "noise", "index", "coefs")


def _worker_run_triton(arrays: dict, dtype: str, block: int) -> tuple:
    """In the interpreter worker: run update_slots_triton on numpy copies of the inputs."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(engine_kernels._update_slots_kernel, InterpretedFunction)
    t = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    t["model_out"] = t["model_out"].to(getattr(torch, dtype))
    engine_kernels.update_slots_triton(**t, block=block)
    return t["latents"].numpy(), t["history"].numpy(), type(engine_kernels._update_slots_kernel).__name__


@pytest.fixture(scope="module")
def interpreter():
    """One spawned worker with TRITON_INTERPRET=1 in its environment from the start."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(int, 0).result(timeout=120)  # start it now, inside the environment above
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before

    def run(inputs: dict, block: int):
        arrays = {k: (v.float() if k == "model_out" else v).numpy() for k, v in inputs.items()}
        dtype = str(inputs["model_out"].dtype).removeprefix("torch.")
        lat, hist, kind = pool.submit(_worker_run_triton, arrays, dtype, block).result(timeout=600)
        assert kind == "InterpretedFunction"
        out = {k: v.clone() for k, v in inputs.items()}
        out["latents"], out["history"] = torch.from_numpy(lat), torch.from_numpy(hist)
        return out

    yield run
    pool.shutdown(wait=True, cancel_futures=True)


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
