"""A workload-benchmark run (RESULTS.json) set beside the fluid model: load, compare, report.

RESULTS.json schema (written by the workload benchmark; extra keys are ignored)::

    {
      "configs": {
        "<name>": {
          "arrival_rate": float,      # measured offered rate, requests per second
          "service_rate": float,      # measured service rate, requests per second
          "initial_backlog": float,   # optional; default: the first sample's backlog
          "backlog": [[t_seconds, queued_requests], ...]   # t non-decreasing
        },
        ...
      }
    }

The fluid prediction for a configuration starts at the first sample's time ``t0``
with the initial backlog and runs at the measured rates:
``q(t) = max(0, q0 + (arrival_rate - service_rate) * (t - t0))``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from engine.instrument.fluid import LIMITS, FluidQueue, to_fraction
from engine.instrument.formatting import fmt

__all__ = ["RunConfig", "RunFormatError", "load_run", "parse_run", "format_run", "run_to_json"]


@dataclass
class RunConfig:
    name: str
    arrival: Fraction
    service: Fraction
    initial_backlog: Fraction
    samples: list[tuple[Fraction, Fraction]]
    predicted: list[Fraction] = field(default_factory=list)
    deviation: list[Fraction] = field(default_factory=list)
    drain_time: Fraction | None = None

    @property
    def t0(self) -> Fraction:
        return self.samples[0][0]

    def max_deviation(self) -> tuple[Fraction, Fraction]:
        """(largest |measured - fluid|, the time it occurs)."""
        i = max(range(len(self.deviation)), key=lambda k: abs(self.deviation[k]))
        return abs(self.deviation[i]), self.samples[i][0]

    def first_exceeding(self, tolerance: Fraction) -> Fraction | None:
        for (t, _), d in zip(self.samples, self.deviation):
            if abs(d) > tolerance:
                return t
        return None

    def curve(self, t_end: Fraction) -> list[tuple[Fraction, Fraction]]:
        fq = FluidQueue(self.arrival, self.service, initial_backlog=self.initial_backlog)
        return [(t + self.t0, q) for t, q in fq.curve_exact(max(t_end - self.t0, Fraction(0)))]


class RunFormatError(ValueError):
    pass


def load_run(path: str) -> list[RunConfig]:
    """Read and validate a RESULTS.json (schema in the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise RunFormatError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise RunFormatError(f"{path} is not valid JSON: {e}") from None
    return parse_run(data, source=path)


def parse_run(data: Any, source: str = "RESULTS.json") -> list[RunConfig]:
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise RunFormatError(f'{source}: expected an object with a "configs" object')
    if not data["configs"]:
        raise RunFormatError(f'{source}: "configs" is empty')
    out = []
    for name, cfg in data["configs"].items():
        where = f"{source}: configs[{name!r}]"
        if not isinstance(cfg, dict):
            raise RunFormatError(f"{where} must be an object")
        for key in ("arrival_rate", "service_rate", "backlog"):
            if key not in cfg:
                raise RunFormatError(f'{where} lacks "{key}"')
        try:
            lam = _json_number(cfg["arrival_rate"], f"{where}.arrival_rate")
            mu = _json_number(cfg["service_rate"], f"{where}.service_rate")
            for v, n in ((lam, "arrival_rate"), (mu, "service_rate")):
                if v < 0:
                    raise ValueError(f"{where}.{n} must be >= 0, got {float(v)!r}")
            raw = cfg["backlog"]
            if not isinstance(raw, list) or not raw:
                raise ValueError(f"{where}.backlog must be a non-empty list of [t, q] pairs")
            samples = []
            for i, pair in enumerate(raw):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError(f"{where}.backlog[{i}] must be a [t_seconds, queued] pair")
                t = _json_number(pair[0], f"{where}.backlog[{i}][0]")
                q = _json_number(pair[1], f"{where}.backlog[{i}][1]")
                if q < 0:
                    raise ValueError(f"{where}.backlog[{i}]: backlog must be >= 0")
                if samples and t < samples[-1][0]:
                    raise ValueError(f"{where}.backlog[{i}]: times must not decrease")
                samples.append((t, q))
            q0_raw = cfg.get("initial_backlog")
            q0 = samples[0][1] if q0_raw is None else _json_number(q0_raw, f"{where}.initial_backlog")
            if q0 < 0:
                raise ValueError(f"{where}.initial_backlog must be >= 0")
        except ValueError as e:
            raise RunFormatError(str(e)) from None
        rc = RunConfig(str(name), lam, mu, q0, samples)
        fq = FluidQueue(lam, mu, initial_backlog=q0)
        for t, q in samples:
            pred, _ = fq.predict_exact(t - rc.t0)
            rc.predicted.append(pred)
            rc.deviation.append(q - pred)
        d = fq.drain_time_exact()
        rc.drain_time = None if d is None else d + rc.t0
        out.append(rc)
    return out


def _json_number(v: Any, name: str) -> Fraction:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    return to_fraction(v, name)


def format_run(configs: list[RunConfig], tolerance: Fraction) -> str:
    lines = [
        "measured backlog vs the fluid model at the run's measured rates",
        f"(fluid: q(t) = max(0, q0 + (arrival - service) * (t - t0)); tolerance {fmt(tolerance)} requests)",
    ]
    for rc in configs:
        lines.append("")
        lines.append(
            f"config {rc.name}: arrival {fmt(rc.arrival)}/s, service {fmt(rc.service)}/s, "
            f"initial backlog {fmt(rc.initial_backlog)} at t0 = {fmt(rc.t0)} s, "
            f"fluid drain time {fmt(rc.drain_time)}{'' if rc.drain_time is None else ' s'}"
        )
        lines.append(f"{'t_s':>12} {'measured':>12} {'fluid':>12} {'deviation':>12}")
        for (t, q), p, d in zip(rc.samples, rc.predicted, rc.deviation):
            mark = "  <-- beyond tolerance" if abs(d) > tolerance else ""
            lines.append(f"{fmt(t):>12} {fmt(q):>12} {fmt(p):>12} {fmt(d):>12}{mark}")
        dmax, tmax = rc.max_deviation()
        first = rc.first_exceeding(tolerance)
        lines.append(f"max |deviation| = {fmt(dmax)} requests at t = {fmt(tmax)} s")
        if first is None:
            lines.append(f"the fluid model holds within {fmt(tolerance)} requests over the whole run")
        else:
            lines.append(
                f"the fluid model stops holding at t = {fmt(first)} s "
                f"(first |deviation| > {fmt(tolerance)} requests)"
            )
    return "\n".join(lines)


def run_to_json(configs: list[RunConfig], tolerance: Fraction) -> dict:
    out = []
    for rc in configs:
        dmax, tmax = rc.max_deviation()
        first = rc.first_exceeding(tolerance)
        t_end = rc.samples[-1][0]
        if rc.drain_time is not None and rc.drain_time > t_end:
            t_end = rc.drain_time
        out.append(
            {
                "name": rc.name,
                "arrival_rate": float(rc.arrival),
                "service_rate": float(rc.service),
                "initial_backlog": float(rc.initial_backlog),
                "t0": float(rc.t0),
                "samples": [[float(t), float(q)] for t, q in rc.samples],
                "fluid": [float(p) for p in rc.predicted],
                "curve": [[float(t), float(q)] for t, q in rc.curve(t_end)],
                "drain_time": None if rc.drain_time is None else float(rc.drain_time),
                "max_deviation": float(dmax),
                "max_deviation_t": float(tmax),
                "first_exceeding_t": None if first is None else float(first),
            }
        )
    return {"configs": out, "tolerance": float(tolerance), "limits": LIMITS}
