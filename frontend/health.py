"""`python -m engine health`: a liveness / readiness probe for supervisors.

It does what a client does — the handshake (token and CURVE keys included) — then asks
`Health`, which the engine's IO thread answers from the busy loop's heartbeat, so the
answer comes while a long denoising step runs. Exit codes:

- 0: alive (the busy loop beats, or its step has run less than --step-timeout);
- 1: not ready (`--ready` and the engine is draining after SIGTERM);
- 2: dead or unreachable: no answer within `--timeout`, refused, or the busy loop has
  been stuck (in a step or elsewhere) past the engine's --step-timeout.
"""
from __future__ import annotations

import json
import sys

SUMMARY_KEYS = ("pid", "uptime_s", "clients", "requests_in_flight", "queue_depth", "slot_occupancy",
                "longest_step_s", "step_timeout_s")


def main(address: str | None, timeout: float, ready: bool, token_file: str | None,
         curve_server_key: str | None = None, curve_client_key: str | None = None) -> int:
    from frontend.client import Client
    from engine.serve.transport import load_curve_keys

    token = None
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    curve = load_curve_keys(curve_server_key, curve_client_key) if curve_server_key else None
    try:
        with Client(address, connect_timeout=timeout, token=token, name="health", curve=curve) as client:
            reply = client.health(timeout=timeout)
    except Exception as exc:  # ConnectionError, TimeoutError, AuthenticationError, EngineDeadError
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 2
    summary = {"alive": reply.alive, "draining": reply.draining, "step_running_s": round(reply.step_running_s, 3),
               "loop_silent_s": round(reply.loop_silent_s, 3), "stall_limit_s": reply.stall_limit_s,
               **{key: reply.stats[key] for key in SUMMARY_KEYS if key in reply.stats}}
    print(json.dumps(summary))
    if not reply.alive:
        print(f"unhealthy: {reply.reason}", file=sys.stderr)
        return 2
    if ready and reply.draining:
        print("not ready: draining (SIGTERM received)", file=sys.stderr)
        return 1
    return 0
