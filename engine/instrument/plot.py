"""The instrument's plot as a PNG (matplotlib, Agg; imported only when a plot is written)."""
from __future__ import annotations

import math
from fractions import Fraction

from engine.instrument.fluid import FluidQueue
from engine.instrument.formatting import fmt
from engine.instrument.runs import RunConfig

__all__ = ["write_plot"]


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
