"""Replaying a trace through an in-process engine core, as the engine process would drive
it: each request added at its arrival time (`add_request` with that arrival), `step()`
until every request has ended, each finished request's output acknowledged at once."""
from __future__ import annotations

import collections
import time
from typing import Callable

from engine.core import DenoiseFinished
from engine.core.outputs import RequestCanceled, RequestFailed, StepProgress


def replay(core, work: list) -> dict[str, tuple[float, DenoiseFinished]]:
    """`work`: (arrival s, request id, params) sorted by arrival. Returns request id →
    (time to usable output in seconds, its DenoiseFinished) for every finished request."""
    arrival_of = {rid: arrival for arrival, rid, _ in work}
    pending = list(work)
    finished = {}
    start = time.monotonic()
    while pending or core.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            arrival, rid, params = pending.pop(0)
            core.add_request(rid, params, arrival_time=start + arrival)
        if not core.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, pending[0][0] - now)))
            continue
        for out in core.step():  # `finished_at` is on the core's clock, time.monotonic
            if isinstance(out, DenoiseFinished):
                finished[out.request_id] = (out.finished_at - (start + arrival_of[out.request_id]), out)
                core.decode_done(out.request_id)
    return finished


def replay_records(core, trace: list[dict], params_of: Callable[[dict], object], limit_s: float) -> dict:
    """`trace`: entries with "id", "at" (arrival s) and optionally "cancel_at" (the step
    after which the request is aborted); `params_of(entry)` its GenerateParams. Returns
    request id → record: state "done" (with `ttuo`, the time to usable output, `done_at`
    and its final `latents`), "canceled" or "failed" (with `error`). RuntimeError past
    `limit_s`."""
    clock = time.monotonic
    pending = collections.deque(sorted(trace, key=lambda r: r["at"]))
    by_id = {r["id"]: r for r in trace}
    records = {}
    t0 = clock() + 0.05
    deadline = t0 + limit_s
    while True:
        now = clock()
        while pending and t0 + pending[0]["at"] <= now:
            entry = pending.popleft()
            core.add_request(entry["id"], params_of(entry), arrival_time=t0 + entry["at"])
        for out in core.step():
            rid = out.request_id
            if isinstance(out, StepProgress):
                cancel = by_id[rid].get("cancel_at")
                if cancel is not None and out.step >= cancel:
                    core.abort_requests([rid])
            elif isinstance(out, DenoiseFinished):
                done = clock()
                core.decode_done(rid)
                records[rid] = dict(state="done", ttuo=done - (t0 + by_id[rid]["at"]), done_at=done - t0,
                                    latents=out.latents.float().clone())
            elif isinstance(out, RequestCanceled):
                records[rid] = dict(state="canceled")
                core.decode_done(rid)
            elif isinstance(out, RequestFailed):
                records[rid] = dict(state="failed", error=out.error)
        if not pending and not core.has_unfinished_requests():
            break
        if clock() > deadline:
            raise RuntimeError(f"the run did not end within {limit_s:.0f} s")
        if pending and not core.has_work():
            time.sleep(max(0.0, min(0.005, t0 + pending[0]["at"] - clock())))
    return records
