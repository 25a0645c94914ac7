"""The engine process's busy loop without its sockets, in this process: an EngineCore and a
decode stage serving a list of requests queued at once, for goodput by output kind.
Shared by the png and shapes parts."""
from __future__ import annotations

import statistics
import time

import torch

from engine.protocol import GenerateParams

from .engine_internals import DenoiseFinished, EngineCore, RequestCanceled, RequestFailed, time_fence_waits
from .report import check


def serve_in_process(model, stage, requests: list, config, timeout_s: float = 300.0) -> dict:
    """The engine process's busy loop without its sockets (`engine.serve.proc`): step the
    core while it has work, hand finished latents to the decode stage, return each decoded
    output's reservation (`decode_done`). All requests are queued at the start; goodput is
    completed outputs over the wall time from the first `add_request` to the last output."""
    core = EngineCore(model, config)
    spent = time_fence_waits(core)
    completed, errors, decode_s, hosts, completed_at = 0, [], [], [], []
    t0 = time.perf_counter()
    with torch.no_grad():
        for rid, params in requests:
            core.add_request(rid, params)
        while completed + len(errors) < len(requests):
            outputs = []
            if core.has_work():
                waited, s0 = spent["s"], time.perf_counter()
                outputs = core.step()
                hosts.append(time.perf_counter() - s0 - (spent["s"] - waited))
            else:
                time.sleep(0.0005)  # only decodes in flight: their outputs come at a poll
            for o in outputs:
                if isinstance(o, DenoiseFinished):
                    stage.submit(o.request_id, o.latents, o.params, o.timings, o.finished_at)
                elif isinstance(o, (RequestFailed, RequestCanceled)):
                    errors.append(f"{o.request_id}: {getattr(o, 'error', 'canceled')}")
            for decoded in stage.poll():
                core.decode_done(decoded.request_id)
                if decoded.error is None:
                    completed += 1
                    completed_at.append(time.perf_counter() - t0)
                    decode_s.append(decoded.timings.decode_s)
                else:
                    errors.append(f"{decoded.request_id}: {decoded.error}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"served {completed} of {len(requests)} in {timeout_s:g} s")
    wall = time.perf_counter() - t0
    stats = core.stats()
    return dict(completed=completed, errors=errors, wall=wall, goodput=completed / wall, completed_at=completed_at,
                rows_per_call=stats["useful_evals"] / max(1, core.batches),
                decode_ms=statistics.median(decode_s) * 1e3 if decode_s else float("nan"),
                host_ms=statistics.median(hosts) * 1e3 if hosts else float("nan"),
                denoiser_s=stats["denoiser_s"])


def served_row(part: str, case: str, r: dict, n: int) -> bool:
    ok = r["completed"] == n and not r["errors"]
    return check(part, case, "goodput (images/s)", r["goodput"], ok,
                 f"{r['completed']}/{n} in {r['wall']:.2f} s, {r['rows_per_call']:.1f} rows/call, decode p50 "
                 f"{r['decode_ms']:.1f} ms, host {r['host_ms']:.2f} ms/step less fence waits"
                 + (f"; {len(r['errors'])} errors: {r['errors'][0][:120]}" if r["errors"] else ""))


def generate_requests(tag: str, n: int, output: str, steps: int, prompts=None, guidance: float = 7.5,
                      stagger: int = 0) -> list:
    """`n` requests of `steps` steps (`stagger`: request k takes `k % (stagger + 1)` more, so
    that completions spread out instead of arriving in waves of a full batch)."""
    prompts = prompts or [f"prompt {k}" for k in range(5)]
    return [(f"{tag}{k}", GenerateParams(prompt=prompts[k % len(prompts)], negative_prompt="",
                                         steps=steps + k % (stagger + 1), sampler="euler", guidance=guidance, seed=k,
                                         output=output))
            for k in range(n)]
