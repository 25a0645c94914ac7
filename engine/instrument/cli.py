"""The queue instrument's command line.

Usage (``python -m engine queue-instrument``; ``python -m engine.instrument``
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
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import textwrap
import threading
from typing import Sequence

from engine.flags import add_config_arguments, cli, config_from_args
from engine.instrument.fluid import INITIAL_BACKLOG, LIMITS, STEP, FluidQueue, to_fraction
from engine.instrument.formatting import fmt
from engine.instrument.plot import write_plot
from engine.instrument.runs import RunFormatError, format_run, load_run
from engine.instrument.server import is_loopback, make_server

__all__ = ["InstrumentOptions", "build_parser", "main"]

PROG = "python -m engine queue-instrument"


@dataclasses.dataclass
class InstrumentOptions:
    """The instrument's flags. Rates, times and the tolerance stay text here: `main` reads
    them as exact decimals (to_fraction), so 0.1 is one tenth, not a float near it."""

    arrival: str | None = dataclasses.field(default=None, metadata=cli(
        "--arrival", metavar="LAMBDA", help="offered arrival rate lambda (>= 0)"))
    service: str | None = dataclasses.field(default=None, metadata=cli(
        "--service", metavar="MU", help="service rate mu (>= 0)"))
    steps: int = dataclasses.field(default=4, metadata=cli(
        "--steps", metavar="N", help=f"steps of {fmt(STEP)} to take after reset"))
    predict_t: str | None = dataclasses.field(default=None, metadata=cli(
        "--predict-t", metavar="T", help=f"time to predict the backlog at (default: steps * {fmt(STEP)})"))
    from_run: str | None = dataclasses.field(default=None, metadata=cli(
        "--from-run", metavar="RESULTS.json",
        help="overlay the backlog a real engine run measured on the fluid prediction at that run's measured rates"))
    tolerance: str = dataclasses.field(default="1", metadata=cli(
        "--tolerance", metavar="Q",
        help="deviation (requests) beyond which the fluid model is said to stop holding, for --from-run"))
    plot: str | None = dataclasses.field(default=None, metadata=cli(
        "--plot", metavar="OUT.png", help="write the plot as a PNG (matplotlib)"))
    serve: bool = dataclasses.field(default=False, metadata=cli("--serve", help="serve the instrument page"))
    host: str = dataclasses.field(default="127.0.0.1", metadata=cli("--host", help="address to serve on"))
    port: int = dataclasses.field(default=0, metadata=cli("--port", help="port to serve on; 0 picks a free port"))
    allow_remote: bool = dataclasses.field(default=False, metadata=cli(
        "--allow-remote", help="allow serving on a non-loopback address (the page has no authentication)"))
    verbose: bool = dataclasses.field(default=False, metadata=cli("--verbose", help="log HTTP requests"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Queue instrument: the fluid model of admission pressure.\n"
            "Backlog q(t) with arrival rate lambda and service rate mu follows\n"
            "dq/dt = lambda - mu while q > 0 and never goes below 0. Reset gives t = 0,\n"
            f"backlog {fmt(INITIAL_BACKLOG)}; each step advances t by {fmt(STEP)}; predict(t) gives q(t) and the "
            "drain time.\n\n"
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
    add_config_arguments(p, InstrumentOptions)
    return p


def _err(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = config_from_args(InstrumentOptions, parser.parse_args(list(argv) if argv is not None else None))
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

