"""The busy loop's heartbeat: what it stamps as it goes, read by the step watchdog and by
the IO thread, which answers health probes from it while the busy loop is busy.

Only the busy loop writes (plain attribute stores: no lock, no syscall); readers see
each value whole. `verdict` is the health probe's answer: the engine is alive while
the busy loop beats, and while the step it runs has run less than the stall limit (the
engine's --step-timeout), so a long legitimate step is not mistaken for a dead engine;
it is dead once the loop has been stuck, in a step or anywhere else, past the limit.
"""
from __future__ import annotations

import dataclasses
import time

DEFAULT_STALL_LIMIT_S = 120.0  # the health limit when the engine runs without a step watchdog


@dataclasses.dataclass(frozen=True)
class Verdict:
    alive: bool
    reason: str
    step_running_s: float
    loop_silent_s: float


class LoopHeartbeat:
    def __init__(self, stall_limit_s: float) -> None:
        self.stall_limit_s = stall_limit_s if stall_limit_s > 0 else DEFAULT_STALL_LIMIT_S
        self.started_at = time.monotonic()
        self.last_beat = self.started_at
        self.step_started: float | None = None
        self.longest_step_s = 0.0
        self.draining = False
        self.stats: dict = {}  # the busy loop's latest stats snapshot, for health answers
        self.stats_at = 0.0

    # -------------------------------------------------- busy loop side
    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def step_begin(self) -> None:
        self.step_started = self.last_beat = time.monotonic()

    def step_end(self) -> None:
        started, self.step_started = self.step_started, None
        self.last_beat = now = time.monotonic()
        if started is not None and now - started > self.longest_step_s:
            self.longest_step_s = now - started

    def publish_stats(self, stats: dict) -> None:
        self.stats, self.stats_at = stats, time.monotonic()

    def step_running_s(self) -> float:
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    # -------------------------------------------------- readers (IO thread, watchdog, metrics)
    def verdict(self, now: float | None = None) -> Verdict:
        now = time.monotonic() if now is None else now
        started, last = self.step_started, self.last_beat
        running = 0.0 if started is None else now - started
        silent = now - last
        limit = self.stall_limit_s
        if started is not None and running > limit:
            return Verdict(False, f"a denoising step has run {running:.1f}s, past the stall limit of {limit:g}s "
                                  f"(--step-timeout)", running, silent)
        if started is None and silent > limit:
            return Verdict(False, f"the busy loop has been stuck outside a step for {silent:.1f}s, past the stall "
                                  f"limit of {limit:g}s (--step-timeout)", running, silent)
        return Verdict(True, "", running, silent)
