"""Replaying a trace through an in-process engine core, as the engine process would drive
it: each request added at its arrival time (`add_request` with that arrival), `step()`
until every request has ended, each finished request's output acknowledged at once."""
from __future__ import annotations

import time

from engine.core import DenoiseFinished


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
