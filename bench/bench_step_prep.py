"""Per-step preparation: `Runner.build_batch` on one group's step plan (row map, per-row scale,
timestep and class, per-slot coefficient rows, the noise of stochastic slots, and the
host→device copies of index and coefficients).

    .venv/bin/python -m pytest bench/bench_step_prep.py --benchmark-only
    .venv/bin/python bench/bench_step_prep.py --profile 64     # cProfile of 2000 calls, top entries

Groups of 8, 64 and 256 active slots on the tiny test model (4×8×8 latents), mixed
samplers (euler, euler_ancestral, ddim, dpmpp_2m: a quarter of the slots draw noise),
guidance 1.0 / 3.0 / 7.5 (two thirds of the slots have two rows), each slot at its own
step. Target: ≤ 150 µs for 64 slots on a CPU. The denoiser is not called.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np
import pytest

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]

from engine.core import CoreConfig, EngineCore  # noqa: E402
from engine.protocol import GenerateParams  # noqa: E402
from engine.testing.reference import TEST_CONDITIONS, tiny_model  # noqa: E402

MIXED_SAMPLERS = ("euler", "euler_ancestral", "ddim", "dpmpp_2m")
GUIDANCES = (1.0, 3.0, 7.5)
STEPS = (10, 20, 30, 50)
TARGET_US_64 = 150.0

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),  # diffusers + numpy 2
]


def prepared_core(slots: int, layout: str = "compact", seed: int = 0):
    """An EngineCore with `slots` admitted, mixed requests, each at its own step."""
    core = EngineCore(tiny_model("epsilon"), CoreConfig(slots=slots, layout=layout, max_steps=max(STEPS),
                                                         max_queue=slots, decode_buffers=slots,
                                                         output_budget_bytes=1 << 30,
                                                         trajectory_budget_bytes=1 << 30))
    for k in range(slots):
        core.add_request(f"r{k}", GenerateParams(
            prompt=TEST_CONDITIONS[k % 3], steps=STEPS[k % len(STEPS)], sampler=MIXED_SAMPLERS[k % len(MIXED_SAMPLERS)],
            guidance=GUIDANCES[k % len(GUIDANCES)], seed=k, output="latent"))
    core.admit()
    (group,) = core.groups.values()
    assert group.active == slots and group.runnable.sum() == slots
    rng = np.random.default_rng(seed)
    group.step_index[:] = rng.integers(0, [r.total_steps for r in group.requests])  # every slot mid-way, at its own step
    return core, core.scheduler.next_step()


@pytest.mark.parametrize("slots", [8, 64, 256])
def test_build_batch_compact(benchmark, slots):
    core, plan = prepared_core(slots)
    storage = core.storage[plan.key]
    benchmark.group = "step prep: build_batch (compact)"
    benchmark.extra_info.update(slots=slots, rows=int(slots + storage.two_rows.sum()),
                                stochastic=int(storage.stochastic.sum()), target_us_64=TARGET_US_64)
    batch = benchmark(core.runner.build_batch, plan)
    assert len(batch.slots) == slots and batch.useful_rows == slots + int(storage.two_rows.sum())


@pytest.mark.parametrize("layout", ["compact", "padded", "bucketed"])
def test_build_batch_layouts_64(benchmark, layout):
    core, group = prepared_core(64, layout)
    benchmark.group = "step prep: build_batch, 64 slots, by layout"
    benchmark.extra_info.update(slots=64, layout=layout)
    benchmark(core.runner.build_batch, group)


def test_build_batch_64_deterministic_only(benchmark):
    """Same 64 slots with no stochastic sampler: what the per-slot noise draws cost."""
    core, plan = prepared_core(64)
    core.storage[plan.key].stochastic[:] = False
    benchmark.group = "step prep: build_batch, 64 slots, noise share"
    benchmark(core.runner.build_batch, plan)


def main() -> None:
    import cProfile
    import pstats
    import timeit

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=int, default=64, metavar="SLOTS")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    core, plan = prepared_core(args.profile)
    runs = timeit.repeat(lambda: core.runner.build_batch(plan), number=200, repeat=5)
    print(f"build_batch, {args.profile} slots: best {min(runs) / 200 * 1e6:.1f} µs/call "
          f"(median of 5×200: {sorted(runs)[2] / 200 * 1e6:.1f} µs)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        core.runner.build_batch(plan)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
