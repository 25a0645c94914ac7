"""Holding the CUDA stream for a planned time with `torch.cuda._sleep`, which counts SM
cycles: the cycles per second measured here only plan a hold; a check times its hold
with CUDA events around it, since the SM clock moves."""
from __future__ import annotations

import torch


def sleep_cycles_per_s() -> float:
    """torch.cuda._sleep's cycles per second on this device (measured with events): the
    fastest of three, so that a hold planned from it lasts at least as long as planned
    once the SM clock has risen. Only a plan: the checks time each hold with events."""
    rates = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        rates.append(20_000_000 / (a.elapsed_time(b) / 1e3))
    return max(rates)
