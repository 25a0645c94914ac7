"""Part `graphs`: the bucketed layout with CUDA graphs (one captured denoiser call per
bucket, replayed) against the same requests launched eagerly: equal final latents."""
from __future__ import annotations

from . import judge
from .engine_runs import run_engine_steps
from .report import check
from .sd15 import get_sd15


def run(args) -> None:
    """CUDA graphs change no result: the same requests, bucketed, replayed vs eager."""
    model = get_sd15()
    results = []
    for graphs in (False, True):
        latents = {}
        _, _, _, _, _, finished, failed = run_engine_steps(model, 8, 5, "bucketed", 6, None, sampler="dpmpp_2m",
                                                           cuda_graphs=graphs, latents=latents)
        results.append((latents, finished, failed))
    (eager, n0, f0), (graphed, n1, f1) = results
    worst = max((float((graphed[k].float() - eager[k].float()).norm() / eager[k].float().norm())
                 for k in eager if k in graphed), default=float("inf"))
    # a capture that failed runs eagerly and would compare equal: the check needs real
    # replays, while serving (each start-up capture replays once: those are not counted)
    verdict = judge.graph_replays(run_engine_steps.graphs, run_engine_steps.replays,
                                  run_engine_steps.replays_at_start, run_engine_steps.calls)
    check("graphs", "bucketed: every call while serving replayed", "graphs", run_engine_steps.graphs, verdict.ok,
          verdict.note)
    check("graphs", "bucketed: CUDA graphs vs eager, 5 requests x 6 steps", "max rel L2", worst,
          n0 == n1 == 5 and f0 == f1 == 0 and worst < 1e-3,
          f"{run_engine_steps.graphs} graphs captured; same kernels, so only capture-order rounding may differ")
