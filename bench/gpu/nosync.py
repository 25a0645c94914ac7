"""Part `nosync`: no hidden synchronisation on the busy loop. (a) A whole request's life
under `torch.cuda.set_sync_debug_mode("error")` around every step(): a tiny SD model on
CUDA with an adapter pool, the bucketed layout with CUDA graphs (captured before serving,
with and without adapter rows), and requests of every kind at the native size: plain,
img2img, inpainting, one and two plain-LoRA adapters, one of them loaded by the pool's
loader thread while the others run, prompts encoded at admission (LoCon is left out: loading it changes the graphs'
layout, and a recapture synchronises by design). Warm-up requests first compile the
kernels. Any synchronising call inside a step raises, and the check fails naming it.
(b) With the stream held by a long `_sleep`, `step()` returns in a fraction of the hold,
for a middle step (noise, copies) and for the step that reaps a finished request (its
publish must not drain the stream). Each hold is timed by CUDA events around it: `_sleep`
counts SM cycles and the SM clock moves (345 → 1980 MHz)."""
from __future__ import annotations

import time

import torch

from engine.protocol import GenerateParams
from engine.testing.reference import TEST_CONDITIONS, tiny_model

from . import judge
from .engine_internals import CoreConfig, DenoiseFinished, EngineCore, RequestFailed
from .report import check
from .stream_hold import sleep_cycles_per_s
from .tiny_lora import mixed_requests, model_with_pool


FRESH_PROMPTS = ("a big yellow square", "the small blue triangle", "a photo of a green cross")


def whole_life(device: str = "cuda", set_mode=None, synchronize=None) -> dict:
    """(a): warm-up requests, then the requests' whole lives with every step() through
    `judge.first_sync` (`set_mode`: `torch.cuda.set_sync_debug_mode`; a CPU test passes a
    fake). Returns the syncs found, the steps run, the requests and those that ended."""
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    synchronize = synchronize or torch.cuda.synchronize
    model, pool = model_with_pool(device, pairs=False)
    core = EngineCore(model, CoreConfig(slots=4, layout="bucketed", device=device, cuda_graphs=True), adapters=pool)
    native = model.geometry.native_size
    # prompts of their own (encoded during the guarded lives, not served from the cache)
    kinds = [(rid, p) for rid, p in mixed_requests("life", native, seed=1, prompts=FRESH_PROMPTS)
             if "L" not in (p.loras or {})]
    warm = [(rid, p) for rid, p in mixed_requests("warm", native, seed=2)
            if "L" not in (p.loras or {}) and "B" not in (p.loras or {})]  # B is loaded during the lives
    ended, failed = set(), {}

    def step():
        for o in core.step():
            if isinstance(o, DenoiseFinished):
                core.decode_done(o.request_id)
                ended.add(o.request_id)
            elif isinstance(o, RequestFailed):
                failed[o.request_id] = o.error
                ended.add(o.request_id)

    try:
        with torch.no_grad():
            for rid, params in warm:  # kernels compiled, A loaded, allocator warm: unguarded
                core.add_request(rid, params)
            while core.has_unfinished_requests():
                step()
            synchronize()
            loads = pool.stats()["loads"]
            for rid, params in kinds:
                core.add_request(rid, params)
            syncs, steps, t0 = [], 0, time.perf_counter()
            while core.has_unfinished_requests() and not syncs and time.perf_counter() - t0 < 120:
                found = judge.first_sync(step, set_mode)
                steps += 1
                if found is not None:
                    syncs.append(found)
            synchronize()
    finally:
        pool.close()
    return dict(syncs=syncs, steps=steps, requests={rid for rid, _ in kinds}, ended=ended, failed=failed,
                loads_during=pool.stats()["loads"] - loads)


def whole_life_without_syncs() -> None:
    life = whole_life()
    verdict = judge.sync_free(life["syncs"], life["steps"])
    check("nosync", f"{len(life['requests'])} requests' lives: images, adapters, graphs", "synchronising calls",
          len(life["syncs"]), verdict.ok, f"{verdict.note}; {life['loads_during']} adapter loaded meanwhile")
    failed = life["failed"]
    everyone = life["requests"] <= life["ended"] and not failed
    check("nosync", "those requests", "finished", len(life["ended"] & life["requests"]),
          everyone or bool(life["syncs"]),
          f"{len(failed)} failed" + (f": {next(iter(failed.values()))[:120]}" if failed else ""))


def run(args) -> None:
    whole_life_without_syncs()
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
        verdict = judge.held_step(host, held, ok)
        check("nosync", case, "host s in step() / hold s", host / held, verdict.ok,
              f"{verdict.note} (planned {hold_s * 1e3:.0f} ms); {note}")

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
