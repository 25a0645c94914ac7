"""Part `step_cache`: per-request step caches on the device, on a FLUX.1-architecture
transformer at 1024² (random weights, real widths, bf16; the blocks cut as said in its rows),
through the engine's own loop (`EngineCore` on CUDA; compact layout and eager calls unless
said).

Random weights make a data-dependent hit pattern meaningless, so the skip pattern is set:
MagCache with flat ratios (1.0), no retention and `max_skip_steps=1` skips every other step
of every request, whatever its step — requests that joined at different steps skip on
different calls, so the rows that skip leave calls that others still compute. Checked:

- `mag, every other step`: goodput over the same trace uncached, against the ideal
  1 / (1 − share of row-steps skipped) (`judge.step_cache_goodput`);
- `first_block, never hits` (threshold 0): what deciding per request costs when nothing is
  skipped (the first block apart, one host read per call; `judge.step_cache_decision`);
- `taylorseer lite, every other step`, bucketed layout with CUDA graphs, against the same
  trace uncached through the same graphs: a lite call is an uncached call of the rows that
  compute, padded to a bucket, so it keeps replaying graphs (`judge.step_cache_goodput`).
"""
from __future__ import annotations

import time

import torch

from engine.core import CoreConfig, EngineCore
from engine.protocol import GenerateParams, StepCache

from .flux import FLUX_TRANSFORMER_CONFIG, flux_model
from . import judge
from .report import check, row

def trace(requests: int, steps: int, cache: StepCache | None) -> list[tuple[str, GenerateParams]]:
    return [(f"r{k}", GenerateParams(prompt=f"prompt {k % 3}", steps=steps + 2 * (k % 3), seed=k, output="latent",
                                     sampler="flow_euler", guidance=3.5, cache=cache)) for k in range(requests)]


def timed_run(model, jobs, slots: int, layout: str = "compact") -> tuple[float, dict]:
    core = EngineCore(model, CoreConfig(slots=slots, device="cuda", max_queue=len(jobs) + 1, layout=layout))
    for rid, p in jobs[:slots // 2]:  # half join now, the rest as slots free up: mixed steps
        core.add_request(rid, p)
    pending = list(jobs[slots // 2:])
    torch.cuda.synchronize()
    started = time.perf_counter()
    while core.has_unfinished_requests() or pending:
        if pending and len(core.requests) < slots:
            core.add_request(*pending.pop(0))
        for out in core.step():
            if getattr(out, "latents", None) is not None:
                core.decode_done(out.request_id)
    torch.cuda.synchronize()
    return time.perf_counter() - started, core.stats()


def run(args) -> None:
    blocks = (4, 8) if args.quick else (8, 16)
    config = dict(FLUX_TRANSFORMER_CONFIG, num_layers=blocks[0], num_single_layers=blocks[1])
    depth = f"{config['num_layers']}/19 double + {config['num_single_layers']}/38 single blocks"
    model = flux_model(config)
    slots, requests, steps = (4, 8, 6) if args.quick else (8, 16, 10)
    row("step_cache", "FLUX-architecture transformer", "blocks", depth, "info",
        f"bf16, random weights, 1024², {requests} requests of {steps}–{steps + 4} steps, {slots} slots")
    timed_run(model, trace(2, 2, None), 2)  # warm-up: kernels, allocator
    plain_s, _ = timed_run(model, trace(requests, steps, None), slots)
    skip = StepCache("mag", threshold=1.0, max_skip_steps=1, retention_ratio=0.0, mag_ratios=(1.0,))
    skip_s, stats = timed_run(model, trace(requests, steps, skip), slots)
    share = stats["cache_hits"] / max(1, stats["cache_decisions"])
    verdict = judge.step_cache_goodput(plain_s / skip_s, share)
    check("step_cache", "mag, every other step", "goodput × uncached", plain_s / skip_s, verdict.ok, verdict.note)
    never = StepCache("first_block", threshold=0.0)
    never_s, stats = timed_run(model, trace(requests, steps, never), slots)
    verdict = judge.step_cache_decision(never_s, plain_s, stats["cache_hits"])
    check("step_cache", "first_block, never hits", "time × uncached", never_s / plain_s, verdict.ok, verdict.note)
    timed_run(model, trace(2, 2, None), 2, layout="bucketed")  # the graphs' warm-up and first captures
    graphed_s, _ = timed_run(model, trace(requests, steps, None), slots, layout="bucketed")
    lite = StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1, use_lite_mode=True)
    lite_s, stats = timed_run(model, trace(requests, steps, lite), slots, layout="bucketed")
    share = stats["cache_hits"] / max(1, stats["cache_decisions"])
    verdict = judge.step_cache_goodput(graphed_s / lite_s, share)
    check("step_cache", "taylorseer lite, every other step, CUDA graphs", "goodput × uncached (graphs)",
          graphed_s / lite_s, verdict.ok, verdict.note)
