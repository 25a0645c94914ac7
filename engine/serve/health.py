"""`python -m engine health`: a liveness / readiness probe for supervisors.

It does what a client does — the handshake (token included), then a Stats round trip
answered by the engine's busy loop — so it fails when the engine is gone, when its IO
thread is stuck, and when the busy loop is stuck between steps. A hung step is the
watchdog's (--step-timeout), which ends the process. Exit codes: 0 healthy; 1 not
ready (`--ready` and the engine is draining after SIGTERM); 2 unreachable, refused
or no answer in time.
"""
from __future__ import annotations

import json
import sys


def main(address: str | None, timeout: float, ready: bool, token_file: str | None) -> int:
    from frontend.client import Client

    token = None
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    try:
        with Client(address, connect_timeout=timeout, token=token, name="health") as client:
            stats = client.stats(timeout=timeout)
    except Exception as exc:  # ConnectionError, TimeoutError, AuthenticationError, EngineDeadError
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 2
    summary = {key: stats.get(key) for key in ("pid", "uptime_s", "clients", "requests_in_flight", "queue_depth",
                                               "slot_occupancy", "draining", "longest_step_s", "step_timeout_s")}
    print(json.dumps(summary))
    if ready and stats.get("draining"):
        print("not ready: draining (SIGTERM received)", file=sys.stderr)
        return 1
    return 0
