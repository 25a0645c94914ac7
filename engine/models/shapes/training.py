"""What the shapes trainers share: the loop around their step (a step count or a time
budget, the learning rate's schedule, the EMA of the weights, progress and checkpoints)."""
from __future__ import annotations

import math
import time
from typing import Callable, Iterator

import torch
from tqdm import tqdm


def lr_scale(step: int, warmup: int, total: int) -> float:
    """The share of the base learning rate at `step`: a linear warm-up, then a cosine to zero."""
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))


@torch.no_grad()
def update_ema(pairs: list[tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
    """Each (average, weight) pair moved toward the weight after optimiser step `step`, with
    the warming-up decay min(0.999, (1 + step) / (10 + step))."""
    decay = min(0.999, (1 + step) / (10 + step))
    for average, weight in pairs:
        average.lerp_(weight, 1 - decay)


class TrainingSteps:
    """`for i in loop:` yields each step with every optimiser group's learning rate set (the
    base `lr` × `lr_scale` × the group's own "lr_scale", default 1); `loop.done(loss)` after
    the optimiser's step updates the EMA, the progress bar and, every `checkpoint_every`
    steps, calls `checkpoint(*averages, step)`. With `minutes` (and no `steps`) the cosine is
    laid over a step count measured from the speed of the first `timing` steps, so a run fits
    its time on any machine (then not bit-reproducible across machines; `steps` is)."""

    def __init__(self, opt: torch.optim.Optimizer, lr: float, steps: int | None, minutes: float | None, warmup: int,
                 ema_pairs: list, averages: tuple, desc: str, timing: int = 50,
                 checkpoint: Callable | None = None, checkpoint_every: int = 0):
        self.opt, self.lr, self.steps, self.warmup, self.timing = opt, lr, steps, warmup, timing
        self.ema_pairs, self.averages = ema_pairs, averages
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every
        self.total = steps if steps is not None else 10**9  # with `minutes`: decided after timing
        self.deadline = None if minutes is None else time.time() + 60 * minutes
        self.bar = tqdm(total=steps, desc=desc, mininterval=5)
        self.step = 0

    def __iter__(self) -> Iterator[int]:
        started = time.time()
        while self.step < self.total:
            i = self.step
            if self.steps is None and i == self.timing:  # measured speed → the step count that fits the time
                per_step = (time.time() - started) / self.timing
                self.total = max(i + 1, int(i + (self.deadline - time.time()) / per_step))
                self.bar.total = self.total
                self.bar.refresh()
            scale = lr_scale(i, self.warmup, self.total)
            for group in self.opt.param_groups:
                group["lr"] = self.lr * scale * group.get("lr_scale", 1.0)
            yield i
        self.bar.close()

    def done(self, loss: torch.Tensor) -> None:
        update_ema(self.ema_pairs, self.step)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        self.step += 1
        if self.checkpoint is not None and self.checkpoint_every and self.step % self.checkpoint_every == 0 \
                and self.step < self.total:
            self.checkpoint(*self.averages, self.step)
