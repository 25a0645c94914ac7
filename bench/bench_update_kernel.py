"""The fused per-slot update (R3): the torch reference on CPU (the CPU path), and, only
when CUDA is available, the Triton kernel and the torch reference on CUDA, side by side
in one pytest-benchmark group per (entries, latent shape).

    .venv/bin/python -m pytest bench/bench_update_kernel.py --benchmark-enable --benchmark-only

(pytest.ini disables benchmarks by default, so the suite runs each once as a smoke test.)
Entries 8 / 64 / 256 × latents 4×8×8 and 4×64×64; every entry has two rows (guidance),
multistep history on, a quarter of the entries draw noise.
"""
from __future__ import annotations

import pathlib
import sys

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]

from engine.core.kernels import update_slots_reference, update_slots_triton  # noqa: E402
from engine.core.solvers import A, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q  # noqa: E402

ENTRIES = (8, 64, 256)
SHAPES = ((4, 8, 8), (4, 64, 64))
CUDA = torch.cuda.is_available()


def make_inputs(entries: int, shape: tuple, device: str, model_dtype=torch.float32, seed: int = 0):
    """A full group (slots == entries), cond/uncond rows per entry, bounded coefficients
    (so repeated in-place updates stay finite)."""
    numel = int(torch.tensor(shape).prod())
    g = torch.Generator().manual_seed(seed)
    noisy = torch.arange(entries) % 4 == 0
    rn = torch.full((entries,), -1, dtype=torch.int64)
    rn[noisy] = torch.arange(int(noisy.sum()))
    index = torch.stack([torch.randperm(entries, generator=g), 2 * torch.arange(entries),
                         2 * torch.arange(entries) + 1, rn], 1).to(torch.int32)
    coefs = torch.zeros(entries, NUM_COEFS)
    coefs[:, [G, P, Q, A, E, M, KS, KT, HC, KEEP_HIST]] = torch.tensor(
        [3.0, 1.0, -0.5, 0.9, 0.05, 1.0, 1.0, 0.01, -0.1, 1.0])
    coefs[:, CLIP] = float("inf")
    coefs[:, D] = 0.1
    t = dict(model_out=torch.randn(2 * entries, numel, generator=g).to(model_dtype),
             latents=torch.randn(entries, numel, generator=g), history=torch.randn(entries, numel, generator=g),
             noise=torch.randn(int(noisy.sum()), numel, generator=g), index=index, coefs=coefs)
    return {k: v.to(device) for k, v in t.items()}


def _label(entries, shape):
    return f"update {entries} entries x {'x'.join(map(str, shape))}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("entries", ENTRIES)
def test_reference_cpu(benchmark, entries, shape):
    t = make_inputs(entries, shape, "cpu")
    benchmark.group = _label(entries, shape)
    benchmark.extra_info.update(entries=entries, numel=t["latents"].shape[1], impl="reference", device="cpu")
    benchmark(update_slots_reference, **t)
    assert torch.isfinite(t["latents"]).all()


def _cuda_timed(fn, t):
    def run():
        fn(**t)
        torch.cuda.synchronize()
    return run


@pytest.mark.skipif(not CUDA, reason="CUDA not available")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("entries", ENTRIES)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_cuda(benchmark, impl, entries, shape):
    t = make_inputs(entries, shape, "cuda")
    fn = update_slots_triton if impl == "triton" else update_slots_reference
    fn(**t)  # compile / warm up
    torch.cuda.synchronize()
    benchmark.group = _label(entries, shape)
    benchmark.extra_info.update(entries=entries, numel=t["latents"].shape[1], impl=impl, device="cuda")
    benchmark(_cuda_timed(fn, t))
    assert torch.isfinite(t["latents"]).all()
