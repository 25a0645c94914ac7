"""The tiny model's plan of six requests (mixed samplers, late joins, one canceled) run on
an EngineCore on any device, optionally holding the launch that carries the cancel
behind a `torch.cuda._sleep`: used by the reaper part (CUDA against CPU, the reaper's
checks at the held cancel) and the kernel part (an EngineCore on a second device)."""
from __future__ import annotations

import statistics
import time

import torch

from engine.protocol import GenerateParams
from engine.testing.reference import TEST_CONDITIONS, tiny_model

from . import judge
from .engine_internals import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled, record_fences
from .stream_hold import sleep_cycles_per_s


PLAN = [  # id, sampler, steps, guidance, seed, join at batch, cancel at batch
    ("euler", "euler", 12, 3.0, 1, 0, None),
    ("victim", "dpmpp_2m", 30, 3.0, 9, 0, 5),
    ("dpm", "dpmpp_2m", 15, 7.5, 3, 0, None),
    ("ancestral", "euler_ancestral", 10, 7.5, 2, 2, None),
    ("ddim", "ddim", 8, 1.0, 4, 3, None),
    ("late", "dpmpp_2m", 9, 1.0, 5, 6, None),
]


def run_plan(device: str, hold_at_cancel: bool):
    """The plan on `device`. With `hold_at_cancel`, the launch that carries the cancel waits
    behind a hold of `judge.hold_seconds(the median step() time measured before it)`;
    `run_plan.holds_ms` (CUDA events) and `run_plan.step_s` say what it was."""
    model = tiny_model("epsilon")
    model.unet.to(device)
    model.device = torch.device(device)
    hold = {"on": False, "s": 0.0}
    run = model.run
    cycles_per_s = sleep_cycles_per_s() if device == "cuda" else 0
    step_times = []

    holds = []  # (begin, end) CUDA events around each hold: its real length (SM clocks change)

    def held_run(inputs):
        if hold["on"]:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(int(cycles_per_s * hold["s"]))  # about hold["s"] of GPU time before this launch
            end.record()
            holds.append((begin, end))
            hold["on"] = False
        return run(inputs)

    model.run = held_run
    core = EngineCore(model, CoreConfig(slots=4, max_steps=64, device=device, output_budget_bytes=1 << 30))
    fences = record_fences(core)
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
                    run_plan.step_s = statistics.median(step_times)
                    hold["on"], hold["s"] = True, judge.hold_seconds(run_plan.step_s)
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
        t0 = time.perf_counter()
        collect(core.step())
        step_times.append(time.perf_counter() - t0)
        guard += 1
        if guard > 5000:
            raise RuntimeError("engine did not finish the plan")
    if device == "cuda":
        torch.cuda.synchronize()
        checks["fences are CUDA events"] = all(type(f).__name__ == "CudaFence" for f in fences)
        checks[f"all {len(fences)} fences done"] = all(f.done() for f in fences)
    run_plan.holds_ms = [begin.elapsed_time(end) for begin, end in holds]  # read by the reaper part
    return results, canceled, checks, model
