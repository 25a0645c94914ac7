"""Queue instrument: the fluid model of admission pressure, and a
measured backlog beside it.

One job per module, each importing only the ones above it:

    fluid.py       the model: FluidQueue, exact in Fractions (no dependencies)
    formatting.py  fmt: exact numbers as text, shared by the report, plot, page and CLI
    runs.py        a workload-benchmark RESULTS.json set beside the model (--from-run)
    plot.py        the plot as a PNG (matplotlib)
    state.py       Instrument: the state the page shows, behind a lock
    server.py      the page (page.html) and its JSON API on loopback
    cli.py         ``python -m engine queue-instrument`` / ``python -m engine.instrument``

The page and the CLI share one exact implementation, :class:`FluidQueue`.
"""
from engine.instrument.cli import build_parser, main
from engine.instrument.fluid import INITIAL_BACKLOG, LIMITS, STEP, FluidQueue, Prediction, to_fraction
from engine.instrument.formatting import fmt
from engine.instrument.runs import RunConfig, RunFormatError, format_run, load_run, parse_run, run_to_json
from engine.instrument.server import InstrumentServer, is_loopback, make_server
from engine.instrument.state import Instrument

__all__ = [
    "FluidQueue", "Prediction", "LIMITS", "STEP", "INITIAL_BACKLOG", "to_fraction", "fmt",
    "RunConfig", "RunFormatError", "load_run", "parse_run", "format_run", "run_to_json",
    "Instrument", "InstrumentServer", "make_server", "is_loopback", "build_parser", "main",
]
