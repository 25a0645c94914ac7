"""Part `nosync`: no hidden synchronisation in a step: (a) steps under
`torch.cuda.set_sync_debug_mode("warn")` raise no warning; (b) with the stream held by a
long `_sleep`, `step()` returns in a fraction of the hold, for a middle step (noise,
copies) and for the step that reaps a finished request (its publish must not drain the
stream). Each hold is timed by CUDA events around it: `_sleep` counts SM cycles and the
SM clock moves (345 → 1980 MHz)."""
from __future__ import annotations

import time
import warnings

import torch

from engine.protocol import GenerateParams
from engine.testing.reference import TEST_CONDITIONS, tiny_model

from .engine_internals import CoreConfig, DenoiseFinished, EngineCore
from .report import check
from .stream_hold import sleep_cycles_per_s


def run(args) -> None:
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
