"""The instrument's state: one fluid queue, the points visited since reset, the last
prediction and the --from-run comparison, behind a lock for the server's threads.

The state (what every ``/api`` call but ``/api/run`` returns) is ``{"t", "backlog",
"arrival", "service", "anchor_t", "anchor_backlog", "steps", "drain_time",
"history": [[t, q], ...] (visited since reset), "prediction": {"t", "backlog",
"drain_time"} | null, "curve": [[t, q], ...] (breakpoints of the predicted backlog
from the time the rates took effect to "horizon"), "horizon", "limits"}``; times and
backlogs are floats rounded once from exact values, ``drain_time`` is null when the
backlog never drains.
"""
from __future__ import annotations

import math
import threading
from fractions import Fraction

from engine.instrument.fluid import LIMITS, FluidQueue, to_fraction
from engine.instrument.runs import RunConfig, run_to_json

__all__ = ["Instrument"]

_MAX_HISTORY = 20_000


class Instrument:
    """One FluidQueue behind a lock, with the visited points and the last prediction."""

    def __init__(self, arrival=0, service=0, run: list[RunConfig] | None = None,
                 tolerance: Fraction = Fraction(1)):
        self.lock = threading.Lock()
        self.queue = FluidQueue(arrival, service)
        self.history: list[tuple[float, float]] = [(self.queue.t, self.queue.backlog)]
        self.prediction: dict | None = None
        self.run_json = run_to_json(run, tolerance) if run else {"configs": [], "limits": LIMITS}

    def reset(self) -> dict:
        with self.lock:
            self.queue.reset()
            self.history = [(self.queue.t, self.queue.backlog)]
            self.prediction = None
            return self._state()

    def set_rates(self, arrival, service) -> dict:
        with self.lock:
            before = (self.queue.arrival, self.queue.service)
            self.queue.set_rates(arrival, service)
            if (self.queue.arrival, self.queue.service) != before:
                self.prediction = None  # made under other rates
            return self._state()

    def predict(self, t) -> dict:
        with self.lock:
            backlog, drain = self.queue.predict(t)
            self.prediction = {"t": float(to_fraction(t, "t")), "backlog": backlog,
                               "drain_time": drain}
            return self._state()

    def step(self) -> dict:
        with self.lock:
            self.history.append(self.queue.step())
            del self.history[:-_MAX_HISTORY]
            return self._state()

    def state(self) -> dict:
        with self.lock:
            return self._state()

    def _state(self) -> dict:
        q = self.queue
        drain = q.drain_time_exact()
        horizon = max(Fraction(4), q.t_exact)
        if self.prediction:
            horizon = max(horizon, to_fraction(self.prediction["t"], "t"))
        if drain is not None:
            horizon = max(horizon, drain)
        horizon = Fraction(math.ceil(horizon * Fraction(11, 10) * 2), 2)  # margin, a multiple of 1/2
        return {
            "t": q.t,
            "backlog": q.backlog,
            "arrival": q.arrival,
            "service": q.service,
            "anchor_t": q.anchor_t,
            "anchor_backlog": q.anchor_backlog,
            "steps": q.steps,
            "drain_time": None if drain is None else float(drain),
            "history": [list(p) for p in self.history],
            "prediction": self.prediction,
            "curve": [list(p) for p in q.curve(horizon)],
            "horizon": float(horizon),
            "limits": LIMITS,
        }
