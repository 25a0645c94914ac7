"""Queue instrument (requirement R12): the fluid model of admission pressure, and a
measured backlog beside it.

Usage (``python -m engine queue-instrument``; ``python -m engine.queue_instrument``
runs the same thing)::

    queue-instrument --arrival 4 --service 3 --steps 4
        Reset (t = 0, backlog 4), set lambda and mu, print the prediction at
        t = steps * 0.5 (or --predict-t) and each step's (t, backlog).
    queue-instrument --serve [--host 127.0.0.1] [--port 0] [--from-run RESULTS.json]
        Serve the instrument page (Reset, lambda and mu inputs, Predict, Step, a plot
        of backlog over time) on loopback and print its URL. Port 0 picks a free port.
    queue-instrument --from-run RESULTS.json [--tolerance 1] [--plot OUT.png]
        Print, per configuration of a workload-benchmark run, the backlog the engine
        measured beside the fluid prediction at that run's measured arrival and
        service rates, the largest deviation, and the first time the deviation
        exceeds the tolerance. With --serve the page overlays them; with --plot the
        overlay is written as a PNG.

The page and the CLI share one exact implementation, :class:`engine.fluid.FluidQueue`;
the page talks to it through a small JSON API on the same server:

    GET  /                 the page (self-contained: inline script and SVG, nothing external)
    GET  /api/state        the instrument's state (below)
    POST /api/reset        reset; returns the state
    POST /api/rates        body {"arrival": "4", "service": "3"} (numbers or decimal
                           strings); returns the state, or 400 {"error": ...}
    GET  /api/predict?t=2  predict; returns the state (with "prediction")
    POST /api/step         advance t by 0.5; returns the state
    GET  /api/run          the --from-run comparison ({"configs": []} without one)

The state is ``{"t", "backlog", "arrival", "service", "anchor_t", "anchor_backlog",
"steps", "drain_time", "history": [[t, q], ...] (visited since reset),
"prediction": {"t", "backlog", "drain_time"} | null, "curve": [[t, q], ...]
(breakpoints of the predicted backlog from the time the rates took effect to
"horizon"), "horizon", "limits"}``; times and backlogs are floats rounded once from
exact values, ``drain_time`` is null when the backlog never drains.

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

import argparse
import ipaddress
import json
import math
import signal
import socket
import sys
import textwrap
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence
from urllib.parse import parse_qs, urlsplit

from engine.fluid import LIMITS, STEP, FluidQueue, to_fraction

PROG = "python -m engine queue-instrument"
_MAX_BODY = 64 * 1024
_MAX_HISTORY = 20_000


# --------------------------------------------------------------------------------------
# number formatting (exact where the value has a finite decimal expansion)
# --------------------------------------------------------------------------------------
def fmt(x: Fraction | float | int | None, never: str = "never") -> str:
    """Format an exact value: integers plainly, finite decimals exactly, else 12 digits."""
    if x is None:
        return never
    if not isinstance(x, Fraction):
        if isinstance(x, float) and not math.isfinite(x):
            return repr(x)
        x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    twos = fives = 0
    while d % 2 == 0:
        d //= 2
        twos += 1
    while d % 5 == 0:
        d //= 5
        fives += 1
    if d == 1 and max(twos, fives) <= 12:
        digits = max(twos, fives)
        scaled = x * 10**digits
        sign = "-" if scaled < 0 else ""
        n = abs(scaled.numerator)
        s = str(n).rjust(digits + 1, "0")
        return f"{sign}{s[:-digits]}.{s[-digits:]}".rstrip("0").rstrip(".")
    return f"{float(x):.12g}"


# --------------------------------------------------------------------------------------
# --from-run: load, compare
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# PNG plot (matplotlib, Agg)
# --------------------------------------------------------------------------------------
def write_plot(path: str, *, queue: FluidQueue | None = None, history=None, prediction=None,
               run: list[RunConfig] | None = None, tolerance: Fraction = Fraction(1)) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    if run:
        n = len(run)
        fig, axes = plt.subplots(n, 1, figsize=(8, 3.2 * n), squeeze=False)
        for ax, rc in zip(axes[:, 0], run):
            ts = [float(t) for t, _ in rc.samples]
            ax.plot(ts, [float(q) for _, q in rc.samples], "o-", color="#d95f02", ms=3,
                    label="measured backlog")
            t_end = rc.samples[-1][0]
            if rc.drain_time is not None and rc.drain_time > t_end:
                t_end = rc.drain_time
            curve = rc.curve(t_end)
            ax.plot([float(t) for t, _ in curve], [float(q) for _, q in curve], "--",
                    color="#1b6ac9", lw=2, label="fluid model", zorder=3)
            first = rc.first_exceeding(tolerance)
            if first is not None:
                ax.axvline(float(first), color="#b00020", ls=":", lw=1.5,
                           label=f"|deviation| > {fmt(tolerance)} from t = {fmt(first)} s")
            dmax, tmax = rc.max_deviation()
            ax.set_title(f"{rc.name}: arrival {fmt(rc.arrival)}/s, service {fmt(rc.service)}/s, "
                         f"max |deviation| {fmt(dmax)} at t = {fmt(tmax)} s", fontsize=10)
            ax.set_xlabel("t (s)")
            ax.set_ylabel("queued requests")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
    else:
        assert queue is not None
        fig, ax = plt.subplots(figsize=(8, 4))
        horizon = max([4.0, queue.t] + ([prediction[0]] if prediction else [])
                      + ([prediction[2]] if prediction and prediction[2] is not None else []))
        horizon = math.ceil(horizon * 1.1 * 2) / 2
        curve = queue.curve(horizon)
        ax.plot([t for t, _ in curve], [q for _, q in curve], "--", color="#1b6ac9", lw=2,
                label="fluid prediction", zorder=3)
        if history:
            ax.plot([t for t, _ in history], [q for _, q in history], "o-", color="#d95f02",
                    ms=4, label="steps")
        if prediction:
            ax.plot([prediction[0]], [prediction[1]], "x", color="black", ms=10, mew=2,
                    clip_on=False, zorder=4,
                    label=f"predict t = {fmt(prediction[0])}: backlog {fmt(prediction[1])}")
            if prediction[2] is not None:
                ax.axvline(prediction[2], color="#1a9850", ls=":", lw=1.5,
                           label=f"drains at t = {fmt(prediction[2])}")
        ax.set_title(f"fluid queue: arrival {fmt(queue.arrival)}, service {fmt(queue.service)}",
                     fontsize=10)
        ax.set_xlabel("t")
        ax.set_ylabel("backlog q")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.text(0.01, 0.005, "Fluid model only: no batch slots, solver coordinates, cancellation "
             "events, GPU completion or decode memory.", fontsize=7, color="#444")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------
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


_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower()
    if h in _LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    server: "InstrumentServer"
    server_version = "diffslot-queue-instrument"
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        if self.server.verbose:
            super().log_message(format, *args)

    # -- helpers
    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:",
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, msg: str) -> None:
        self._json({"error": msg}, status)

    def _host_ok(self) -> bool:
        if self.server.allow_remote:
            return True
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if is_loopback(name):
            return True
        self._error(HTTPStatus.FORBIDDEN, "the instrument answers loopback host names only")
        return False

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        if n > _MAX_BODY:
            raise ValueError("request body too large")
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        return json.loads(raw)

    # -- verbs
    def do_HEAD(self):  # noqa: N802
        self.do_GET()

    def do_GET(self):  # noqa: N802
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        inst = self.server.instrument
        if url.path in ("/", "/index.html"):
            self._send(200, self.server.page, "text/html; charset=utf-8")
        elif url.path == "/api/state":
            self._json(inst.state())
        elif url.path == "/api/predict":
            qs = parse_qs(url.query)
            if "t" not in qs:
                self._error(400, "predict needs ?t=")
                return
            try:
                self._json(inst.predict(qs["t"][0]))
            except ValueError as e:
                self._error(400, str(e))
        elif url.path == "/api/run":
            self._json(inst.run_json)
        elif url.path == "/favicon.ico":
            self._send(204, b"", "image/x-icon")
        else:
            self._error(404, f"no such resource: {url.path}")

    def do_POST(self):  # noqa: N802
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        inst = self.server.instrument
        try:
            body = self._body()
        except (ValueError, json.JSONDecodeError) as e:
            self._error(400, f"bad request body: {e}")
            return
        try:
            if url.path == "/api/reset":
                self._json(inst.reset())
            elif url.path == "/api/rates":
                if not isinstance(body, dict) or "arrival" not in body or "service" not in body:
                    self._error(400, 'rates need {"arrival": ..., "service": ...}')
                    return
                self._json(inst.set_rates(body["arrival"], body["service"]))
            elif url.path == "/api/step":
                self._json(inst.step())
            else:
                self._error(404, f"no such resource: {url.path}")
        except ValueError as e:
            self._error(400, str(e))


class InstrumentServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, instrument: Instrument, *, allow_remote=False, verbose=False):
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.instrument = instrument
        self.allow_remote = allow_remote
        self.verbose = verbose
        q = instrument.queue
        self.page = (
            PAGE.replace("__LIMITS__", _html_escape(LIMITS))
            .replace("__ARRIVAL__", fmt(q.arrival))
            .replace("__SERVICE__", fmt(q.service))
            .encode("utf-8")
        )
        super().__init__(addr, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/"


def _html_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def make_server(host="127.0.0.1", port=0, *, arrival=0, service=0, run=None,
                tolerance=Fraction(1), allow_remote=False, verbose=False) -> InstrumentServer:
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing to serve on non-loopback host {host!r} (pass --allow-remote)")
    return InstrumentServer((host, port), Instrument(arrival, service, run, tolerance),
                            allow_remote=allow_remote, verbose=verbose)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Queue instrument: the fluid model of admission pressure.\n"
            "Backlog q(t) with arrival rate lambda and service rate mu follows\n"
            "dq/dt = lambda - mu while q > 0 and never goes below 0. Reset gives t = 0,\n"
            "backlog 4; each step advances t by 0.5; predict(t) gives q(t) and the drain time.\n\n"
            + textwrap.fill(LIMITS, width=78)
        ),
        epilog=(
            "examples:\n"
            f"  {PROG} --arrival 4 --service 3 --steps 4\n"
            f"  {PROG} --arrival 2 --service 3 --steps 8\n"
            f"  {PROG} --serve            (open the printed URL)\n"
            f"  {PROG} --from-run RESULTS.json --plot overlay.png\n\n"
            "RESULTS.json: {\"configs\": {NAME: {\"arrival_rate\": r, \"service_rate\": r,\n"
            "  \"initial_backlog\": q (optional), \"backlog\": [[t_seconds, queued], ...]}}}"
        ),
    )
    p.add_argument("--arrival", metavar="LAMBDA", help="offered arrival rate lambda (>= 0)")
    p.add_argument("--service", metavar="MU", help="service rate mu (>= 0)")
    p.add_argument("--steps", type=int, default=4, metavar="N",
                   help="steps of 0.5 to take after reset (default 4)")
    p.add_argument("--predict-t", metavar="T",
                   help="time to predict the backlog at (default: steps * 0.5)")
    p.add_argument("--from-run", metavar="RESULTS.json",
                   help="overlay the backlog a real engine run measured on the fluid prediction "
                        "at that run's measured rates")
    p.add_argument("--tolerance", default="1", metavar="Q",
                   help="deviation (requests) beyond which the fluid model is said to stop "
                        "holding, for --from-run (default 1)")
    p.add_argument("--plot", metavar="OUT.png", help="write the plot as a PNG (matplotlib)")
    p.add_argument("--serve", action="store_true", help="serve the instrument page")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to serve on (default 0: a free port)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow serving on a non-loopback address (the page has no authentication)")
    p.add_argument("--verbose", action="store_true", help="log HTTP requests")
    return p


def _err(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)

    try:
        tolerance = to_fraction(args.tolerance, "tolerance")
        if tolerance < 0:
            raise ValueError("tolerance must be >= 0")
        arrival = to_fraction(args.arrival, "arrival rate") if args.arrival is not None else None
        service = to_fraction(args.service, "service rate") if args.service is not None else None
        for v, n in ((arrival, "arrival rate"), (service, "service rate")):
            if v is not None and v < 0:
                raise ValueError(f"{n} must be >= 0, got {fmt(v)}")
    except ValueError as e:
        return _err(str(e))
    if args.steps < 0:
        return _err("--steps must be >= 0")
    if not (0 <= args.port <= 65535):
        return _err("--port must be in 0..65535")

    run = None
    if args.from_run:
        try:
            run = load_run(args.from_run)
        except RunFormatError as e:
            return _err(str(e))

    if args.serve:
        if not args.allow_remote and not is_loopback(args.host):
            return _err(f"refusing to serve on non-loopback host {args.host!r}; "
                        "the page has no authentication (pass --allow-remote to insist)")
        if args.plot:
            rc = _plot_cli(args, run, tolerance, arrival, service)
            if rc:
                return rc
        return _serve(args, run, tolerance, arrival or 0, service or 0)

    if run is not None:
        print(format_run(run, tolerance))
        print()
        print("note: " + LIMITS)
        if args.plot:
            return _plot_cli(args, run, tolerance, arrival, service)
        return 0

    if arrival is None or service is None:
        return _err("--arrival and --service are required (or --serve, or --from-run)")
    q = FluidQueue(arrival, service)
    q.reset()
    t_pred = (args.steps * STEP) if args.predict_t is None else None
    try:
        if t_pred is None:
            t_pred = to_fraction(args.predict_t, "--predict-t")
        backlog, drain = q.predict_exact(t_pred)
    except ValueError as e:
        return _err(str(e))
    net = arrival - service
    print("fluid queue model: dq/dt = lambda - mu while q > 0; q never below 0")
    print(f"reset: t = {fmt(q.t_exact)}, backlog = {fmt(q.backlog_exact)}")
    print(f"rates: arrival lambda = {fmt(arrival)}, service mu = {fmt(service)} "
          f"(dq/dt = {'+' if net > 0 else ''}{fmt(net)})")
    why = ""
    if drain is None:
        why = " (lambda > mu: the backlog grows)" if net > 0 else " (lambda = mu: the backlog stays)"
    print(f"predict t = {fmt(t_pred)}: backlog = {fmt(backlog)}, drain time = {fmt(drain)}{why}")
    history = [(q.t, q.backlog)]
    for k in range(1, args.steps + 1):
        q.step()
        history.append((q.t, q.backlog))
        print(f"step {k}: (t, backlog) = ({fmt(q.t_exact)}, {fmt(q.backlog_exact)})")
    print("note: " + LIMITS)
    if args.plot:
        try:
            write_plot(args.plot, queue=q, history=history,
                       prediction=(float(t_pred), float(backlog), None if drain is None else float(drain)))
        except OSError as e:
            return _err(f"cannot write {args.plot}: {e.strerror or e}")
        print(f"wrote {args.plot}")
    return 0


def _plot_cli(args, run, tolerance, arrival, service) -> int:
    try:
        if run is not None:
            write_plot(args.plot, run=run, tolerance=tolerance)
        else:
            q = FluidQueue(arrival or 0, service or 0)
            write_plot(args.plot, queue=q, history=[(q.t, q.backlog)])
    except OSError as e:
        return _err(f"cannot write {args.plot}: {e.strerror or e}")
    print(f"wrote {args.plot}")
    return 0


def _serve(args, run, tolerance, arrival, service) -> int:
    try:
        server = make_server(args.host, args.port, arrival=arrival, service=service, run=run,
                             tolerance=tolerance, allow_remote=args.allow_remote,
                             verbose=args.verbose)
    except (OSError, ValueError) as e:
        return _err(f"cannot serve on {args.host}:{args.port}: {e}")

    def _stop(signum, frame):
        raise KeyboardInterrupt

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _stop)
    print(f"queue instrument at {server.url}", flush=True)
    print("note: " + LIMITS, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 0


# --------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------
PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>diffslot queue instrument</title>
<style>
  :root { --fg:#1d2330; --muted:#5b6472; --line:#d5dae1; --pred:#1b6ac9; --step:#d95f02;
          --drain:#1a9850; --meas:#7b3294; --bad:#b00020; }
  * { box-sizing: border-box; }
  body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
         color: var(--fg); margin: 0; background: #f5f6f8; }
  main { max-width: 980px; margin: 0 auto; padding: 18px 22px 30px; }
  h1 { font-size: 22px; margin: 0 0 4px; }
  h2 { font-size: 17px; margin: 22px 0 8px; }
  .sub { color: var(--muted); margin: 0 0 12px; }
  .card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px; }
  .limits { border-left: 4px solid #e0a100; background: #fff8e1; padding: 8px 12px;
            border-radius: 4px; margin: 10px 0 14px; }
  .controls { display: flex; flex-wrap: wrap; gap: 10px 14px; align-items: end; }
  label { display: flex; flex-direction: column; font-size: 13px; color: var(--muted); }
  input { font: inherit; width: 96px; padding: 5px 7px; border: 1px solid #b8bfc9; border-radius: 5px; }
  button { font: inherit; padding: 6px 14px; border-radius: 5px; border: 1px solid #8a94a3;
           background: #fff; cursor: pointer; }
  button.primary { background: var(--pred); border-color: var(--pred); color: #fff; }
  button:hover { filter: brightness(0.95); }
  .readout { display: grid; grid-template-columns: repeat(6, auto); gap: 4px 18px;
             margin-top: 12px; align-items: baseline; justify-content: start; }
  .readout dt { color: var(--muted); font-size: 13px; }
  .readout dd { margin: 0; font-size: 20px; font-variant-numeric: tabular-nums; font-weight: 600; }
  #error { color: var(--bad); min-height: 1.4em; margin: 8px 0 0; }
  svg { width: 100%; height: auto; display: block; background: #fff; }
  svg text { font: 12px system-ui, "DejaVu Sans", sans-serif; fill: var(--fg); }
  .axis { stroke: #333; stroke-width: 1; }
  .grid { stroke: #e8ebef; stroke-width: 1; }
  table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
  td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #eef0f3; }
  .formula { font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
</style>
</head>
<body data-pending="0" data-seq="0">
<main>
  <h1>Queue instrument</h1>
  <p class="sub">Fluid model of admission pressure: backlog <span class="formula">q(t)</span> with
    offered rate λ and service rate μ, <span class="formula">dq/dt = λ − μ</span> while
    <span class="formula">q &gt; 0</span>, and <span class="formula">q</span> never below 0.
    Reset gives <span class="formula">t = 0, q = 4</span>; Step advances t by 0.5.</p>
  <p class="limits" id="limits">__LIMITS__</p>

  <section class="card">
    <div class="controls">
      <button id="reset" type="button">Reset</button>
      <label for="arrival">arrival λ<input id="arrival" type="text" inputmode="decimal" value="__ARRIVAL__" autocomplete="off"></label>
      <label for="service">service μ<input id="service" type="text" inputmode="decimal" value="__SERVICE__" autocomplete="off"></label>
      <label for="predict-t">predict at t<input id="predict-t" type="text" inputmode="decimal" value="2" autocomplete="off"></label>
      <button id="predict" type="button" class="primary">Predict</button>
      <button id="step" type="button">Step (+0.5)</button>
    </div>
    <dl class="readout">
      <dt>t</dt><dt>backlog q(t)</dt><dt>predicted at t</dt><dt>predicted backlog</dt><dt>drain time</dt><dt>rates λ / μ</dt>
      <dd id="t">–</dd><dd id="backlog">–</dd><dd id="predicted-t">–</dd><dd id="predicted-backlog">–</dd><dd id="drain">–</dd><dd id="rates">–</dd>
    </dl>
    <p id="error" role="alert"></p>
    <svg id="plot" viewBox="0 0 900 400" role="img" aria-label="backlog over time"></svg>
  </section>

  <section id="run" hidden>
    <h2>Measured run against the fluid model</h2>
    <div class="card">
      <p class="sub" id="run-note">The backlog the real engine measured (--from-run), beside the fluid
        prediction at that run's measured arrival and service rates. Where they part, the fluid model
        stops holding.</p>
      <label for="run-config" style="flex-direction:row;gap:8px;align-items:center">configuration
        <select id="run-config"></select></label>
      <p id="run-summary"></p>
      <svg id="run-plot" viewBox="0 0 900 360" role="img" aria-label="measured backlog vs fluid model"></svg>
    </div>
  </section>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
let chain = Promise.resolve();
let runData = null;

function fmt(x) {
  if (x === null || x === undefined) return "never";
  if (Number.isInteger(x)) return String(x);
  return String(Number(x.toPrecision(12)));
}

function enqueue(task) {
  const body = document.body;
  body.dataset.pending = String(Number(body.dataset.pending) + 1);
  chain = chain.then(task).catch((e) => { $("error").textContent = String(e.message || e); })
    .finally(() => {
      body.dataset.pending = String(Number(body.dataset.pending) - 1);
      body.dataset.seq = String(Number(body.dataset.seq) + 1);
    });
  return chain;
}

async function api(method, path, payload) {
  const opts = { method, headers: {} };
  if (payload !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(payload);
  }
  const r = await fetch(path, opts);
  const data = await r.json();
  if (!r.ok) throw new Error(data.error || ("HTTP " + r.status));
  return data;
}

async function applyRates() {
  const st = await api("POST", "/api/rates", { arrival: $("arrival").value, service: $("service").value });
  render(st);
  return st;
}

function render(st) {
  $("error").textContent = "";
  $("t").textContent = fmt(st.t);
  $("backlog").textContent = fmt(st.backlog);
  $("rates").textContent = fmt(st.arrival) + " / " + fmt(st.service);
  const p = st.prediction;
  $("predicted-t").textContent = p ? fmt(p.t) : "–";
  $("predicted-backlog").textContent = p ? fmt(p.backlog) : "–";
  $("drain").textContent = p ? fmt(p.drain_time) : "–";
  drawInstrument(st);
}

function el(name, attrs, parent, text) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

function niceStep(range, n) {
  const raw = range / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

function axes(svg, W, H, m, tMin, tMax, qMax, xlabel, ylabel) {
  const x = (t) => m.l + (t - tMin) / (tMax - tMin) * (W - m.l - m.r);
  const y = (q) => H - m.b - q / qMax * (H - m.t - m.b);
  const xs = niceStep(tMax - tMin, 10), ys = niceStep(qMax, 6);
  for (let v = Math.ceil(tMin / xs) * xs; v <= tMax + 1e-9; v += xs) {
    el("line", { x1: x(v), x2: x(v), y1: m.t, y2: H - m.b, class: "grid" }, svg);
    el("text", { x: x(v), y: H - m.b + 16, "text-anchor": "middle" }, svg, fmt(Number(v.toFixed(6))));
  }
  for (let v = 0; v <= qMax + 1e-9; v += ys) {
    el("line", { x1: m.l, x2: W - m.r, y1: y(v), y2: y(v), class: "grid" }, svg);
    el("text", { x: m.l - 7, y: y(v) + 4, "text-anchor": "end" }, svg, fmt(Number(v.toFixed(6))));
  }
  el("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis" }, svg);
  el("line", { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis" }, svg);
  el("text", { x: (m.l + W - m.r) / 2, y: H - m.b + 34, "text-anchor": "middle" }, svg, xlabel);
  el("text", { x: 16, y: (m.t + H - m.b) / 2, "text-anchor": "middle",
               transform: `rotate(-90 16 ${(m.t + H - m.b) / 2})` }, svg, ylabel);
  return { x, y };
}

// One row of legend items under the plot: [label, color, dash, marker ("dot" | "cross" | "")].
function legend(svg, x0, y, items) {
  let x = x0;
  const g = el("g", { class: "legend" }, svg);
  for (const [label, color, dash, marker] of items) {
    if (marker === "cross") {
      el("path", { d: `M${x + 8},${y - 5}L${x + 18},${y + 5}M${x + 8},${y + 5}L${x + 18},${y - 5}`,
                   stroke: color, "stroke-width": 2.5 }, g);
    } else {
      el("line", { x1: x, x2: x + 26, y1: y, y2: y, stroke: color, "stroke-width": 2.5,
                   "stroke-dasharray": dash || "" }, g);
      if (marker === "dot") el("circle", { cx: x + 13, cy: y, r: 3.5, fill: color }, g);
    }
    const t = el("text", { x: x + 32, y: y + 4 }, g, label);
    let w = label.length * 6.8;
    try { w = t.getComputedTextLength() || w; } catch (e) { /* not laid out yet */ }
    x += 32 + w + 26;
  }
}

function drawInstrument(st) {
  const svg = $("plot");
  svg.replaceChildren();
  const W = 900, H = 400, m = { l: 56, r: 20, t: 16, b: 66 };
  const tMax = Math.max(st.horizon, 0.5);
  let qMax = 1;
  for (const [, q] of st.curve) qMax = Math.max(qMax, q);
  for (const [, q] of st.history) qMax = Math.max(qMax, q);
  if (st.prediction) qMax = Math.max(qMax, st.prediction.backlog);
  qMax = Math.ceil(qMax * 1.15);
  const { x, y } = axes(svg, W, H, m, 0, tMax, qMax, "t", "backlog q");
  const line = (pts) => pts.map(([t, q]) => `${x(t).toFixed(2)},${y(q).toFixed(2)}`).join(" ");
  const items = [["fluid prediction (current rates)", "var(--pred)", "7 5", ""],
                 ["steps taken", "var(--step)", "", "dot"]];
  if (st.drain_time !== null && st.drain_time <= tMax) {
    const dx = x(st.drain_time), right = dx > (m.l + W - m.r) * 0.7;
    el("line", { x1: dx, x2: dx, y1: m.t, y2: H - m.b, stroke: "var(--drain)",
                 "stroke-width": 1.5, "stroke-dasharray": "2 4", class: "drain" }, svg);
    el("text", { x: right ? dx - 6 : dx + 6, y: m.t + 14, fill: "var(--drain)",
                 "text-anchor": right ? "end" : "start" }, svg, "drains at t = " + fmt(st.drain_time));
    items.push(["drain time", "var(--drain)", "2 4", ""]);
  }
  el("polyline", { points: line(st.history), fill: "none", stroke: "var(--step)", "stroke-width": 2,
                   class: "stepped" }, svg);
  for (const [t, q] of st.history)
    el("circle", { cx: x(t), cy: y(q), r: 4, fill: "var(--step)", class: "step-point" }, svg);
  el("polyline", { points: line(st.curve), fill: "none", stroke: "var(--pred)", "stroke-width": 2.5,
                   "stroke-dasharray": "7 5", class: "predicted" }, svg);
  if (st.prediction) {
    const px = x(st.prediction.t), py = y(st.prediction.backlog);
    el("path", { d: `M${px - 7},${py - 7}L${px + 7},${py + 7}M${px - 7},${py + 7}L${px + 7},${py - 7}`,
                 stroke: "#111", "stroke-width": 2.5, class: "prediction-mark" }, svg);
    el("text", { x: px + 10, y: py - 10 }, svg,
       `q(${fmt(st.prediction.t)}) = ${fmt(st.prediction.backlog)}`);
    items.push(["prediction", "#111", "", "cross"]);
  }
  legend(svg, m.l, H - 12, items);
}

function drawRun() {
  if (!runData || !runData.configs.length) return;
  const c = runData.configs[Number($("run-config").value) || 0];
  const svg = $("run-plot");
  svg.replaceChildren();
  const W = 900, H = 360, m = { l: 56, r: 20, t: 16, b: 66 };
  const tMin = c.samples[0][0];
  let tMax = tMin + 1e-9;
  for (const [t] of c.samples.concat(c.curve)) tMax = Math.max(tMax, t);
  let qMax = 1;
  for (const [, q] of c.samples.concat(c.curve)) qMax = Math.max(qMax, q);
  qMax = Math.ceil(qMax * 1.15);
  const { x, y } = axes(svg, W, H, m, tMin, tMax, qMax, "t (s)", "queued requests");
  const line = (pts) => pts.map(([t, q]) => `${x(t).toFixed(2)},${y(q).toFixed(2)}`).join(" ");
  el("polyline", { points: line(c.samples), fill: "none", stroke: "var(--meas)", "stroke-width": 2,
                   class: "run-measured" }, svg);
  for (const [t, q] of c.samples) el("circle", { cx: x(t), cy: y(q), r: 3, fill: "var(--meas)" }, svg);
  el("polyline", { points: line(c.curve), fill: "none", stroke: "var(--pred)", "stroke-width": 2.5,
                   "stroke-dasharray": "7 5", class: "run-fluid" }, svg);
  const items = [["fluid model at measured rates", "var(--pred)", "7 5", ""],
                 ["measured backlog", "var(--meas)", "", "dot"]];
  if (c.first_exceeding_t !== null) {
    const fx = x(c.first_exceeding_t);
    el("line", { x1: fx, x2: fx, y1: m.t, y2: H - m.b, stroke: "var(--bad)", "stroke-width": 1.5,
                 "stroke-dasharray": "3 3", class: "run-diverge" }, svg);
    items.push([`|deviation| > ${fmt(runData.tolerance)} from t = ${fmt(c.first_exceeding_t)} s`, "var(--bad)", "3 3", ""]);
  }
  legend(svg, m.l, H - 12, items);
  $("run-summary").textContent =
    `arrival ${fmt(c.arrival_rate)}/s, service ${fmt(c.service_rate)}/s, initial backlog ` +
    `${fmt(c.initial_backlog)}; max |deviation| ${fmt(c.max_deviation)} requests at t = ` +
    `${fmt(c.max_deviation_t)} s; ` + (c.first_exceeding_t === null
      ? `the fluid model holds within ${fmt(runData.tolerance)} requests throughout.`
      : `the fluid model stops holding at t = ${fmt(c.first_exceeding_t)} s.`);
}

$("reset").addEventListener("click", () => enqueue(async () => render(await api("POST", "/api/reset"))));
$("predict").addEventListener("click", () => enqueue(async () => {
  await applyRates();
  render(await api("GET", "/api/predict?t=" + encodeURIComponent($("predict-t").value.trim())));
}));
$("step").addEventListener("click", () => enqueue(async () => {
  await applyRates();
  render(await api("POST", "/api/step"));
}));
for (const id of ["arrival", "service"])
  $(id).addEventListener("change", () => enqueue(applyRates));
$("run-config").addEventListener("change", drawRun);

enqueue(async () => {
  render(await api("GET", "/api/state"));
  runData = await api("GET", "/api/run");
  if (runData.configs.length) {
    const sel = $("run-config");
    runData.configs.forEach((c, i) => {
      const o = document.createElement("option");
      o.value = String(i); o.textContent = c.name; sel.appendChild(o);
    });
    $("run").hidden = false;
    drawRun();
  }
});
</script>
</body>
</html>
"""


if __name__ == "__main__":
    sys.exit(main())
