"""Part `layouts`: compact vs padded vs bucketed (eager, and with CUDA graphs) at active
fractions 1/8 … 1 on the SD-1.5-architecture UNet: time per step and per useful row, host
time."""
from __future__ import annotations

import statistics

from .engine_runs import run_engine_steps
from .report import row
from .sd15 import get_sd15


def run(args) -> None:
    model = get_sd15()
    slots = 16
    fractions = (0.125, 0.25, 0.5, 1.0)
    measure = 4 if args.quick else 8
    for fraction in fractions:
        active = max(1, round(slots * fraction))
        base = None
        for layout, graphs in (("padded", False), ("compact", False), ("bucketed", False), ("bucketed", True)):
            wall, batches, useful, total, hosts, _, failed = run_engine_steps(model, slots, active, layout, 60, measure,
                                                                              cuda_graphs=graphs)
            per_step = wall / max(1, batches) * 1e3
            per_row = wall / max(1, useful) * 1e3
            base = base or per_step
            name = layout + ("+graphs" if graphs else "")
            row("layouts", f"{name} {active}/{slots} active", "ms per step / per useful row", per_step,
                "info" if failed == 0 else "FAIL",
                f"{per_row:.2f} ms/useful row, {total // max(1, batches)} rows/step "
                f"({useful // max(1, batches)} useful), {base / per_step:.2f}x padded's speed, "
                f"host {statistics.median(hosts) * 1e3:.2f} ms/step less fence waits"
                + (f", {run_engine_steps.graphs} graphs" if graphs else ""))
