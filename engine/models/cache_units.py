"""The per-request state of step caches and what one call decides for it.

A *unit* is a request's rows that its pipeline's call holds together (FLUX's true-CFG
branches are two calls, so two units; a pipeline that batches its CFG rows, one). Each
unit keeps its own `UnitState` (its settings, its call count, the tensors its kind keeps),
decides its mode for a call on the host where its kind allows it (MagCache and TaylorSeer
from the step alone; first_block inside the call, `engine.models.step_cache`), and records
the decision after the call. `CacheCall` is one call's units, by mode.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class UnitState:
    """One unit's cache state (a request's rows that its pipeline call holds together):
    its settings, how many calls it has made, and the tensors its kind keeps."""

    settings: object  # engine.core.input_kinds.step_cache.CacheSettings
    calls: int = 0
    off: bool = False  # a call of its rows did not run whole: it no longer follows its pipeline
    hits: list = dataclasses.field(default_factory=list)  # per call: True where it skipped work
    # first_block
    head_residual: torch.Tensor | None = None
    tail_hidden: torch.Tensor | None = None
    tail_encoder: torch.Tensor | None = None
    # mag
    mag_ratio: object = 1.0
    mag_err: object = 0.0
    mag_steps: int = 0
    mag_residual: torch.Tensor | None = None
    # taylorseer: attention module name → diffusers' own TaylorSeerState
    taylor: dict = dataclasses.field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        found = [t for t in (self.head_residual, self.tail_hidden, self.tail_encoder, self.mag_residual)
                 if t is not None]
        for state in self.taylor.values():
            found.extend(f for factors in state.taylor_factors.values() for f in factors.values())
        return found

    def taylor_state(self, name: str):
        """Diffusers' own `TaylorSeerState` of the module `name` (made on first use)."""
        if name not in self.taylor:
            from diffusers.hooks.taylorseer_cache import TaylorSeerState

            s = self.settings
            self.taylor[name] = TaylorSeerState(taylor_factors_dtype=s.taylor_factors_dtype, max_order=s.max_order)
        return self.taylor[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "UnitState":
        """A copy with every tensor moved (to the host to park, back to run)."""
        def opt(t):
            return None if t is None else move(t)

        taylor = {}
        for name, state in self.taylor.items():
            copy = type(state).__new__(type(state))
            copy.__dict__.update(state.__dict__)
            copy.taylor_factors = {i: {order: move(f) for order, f in factors.items()}
                                   for i, factors in state.taylor_factors.items()}
            taylor[name] = copy
        return dataclasses.replace(self, hits=list(self.hits), head_residual=opt(self.head_residual),
                                   tail_hidden=opt(self.tail_hidden), tail_encoder=opt(self.tail_encoder),
                                   mag_residual=opt(self.mag_residual), taylor=taylor)

    # ---- the decisions made on the host, before the call, from the step alone ----

    def mode(self) -> str:
        """This call's mode (MagCache and TaylorSeer decide from the step; first_block in the call)."""
        kind = self.settings.kind
        if kind == "first_block":
            return "first_block"
        if kind == "mag":
            return "mag_compute" if self.mag_computes() else "mag_skip"
        prefix = "lite" if self.settings.lite else "taylor"
        return f"{prefix}_compute" if self.taylor_computes() else f"{prefix}_predict"

    def mag_computes(self) -> bool:
        """MagCache's head-hook decision for this call (it updates the accumulators as the
        hook does, in the same float32 tensor arithmetic)."""
        s = self.settings
        step = self.calls
        scale = s.mag_ratios[step] if step < len(s.mag_ratios) else 1.0
        if step < int(s.retention_ratio * s.num_inference_steps + 0.5):
            return True
        self.mag_ratio = self.mag_ratio * scale
        self.mag_steps += 1
        self.mag_err = self.mag_err + abs(1.0 - self.mag_ratio)
        if self.mag_residual is not None and self.mag_err <= s.threshold and self.mag_steps <= s.max_skip_steps:
            return False
        self.mag_ratio, self.mag_steps, self.mag_err = 1.0, 0, 0.0
        return True

    def taylor_computes(self) -> bool:
        """TaylorSeer's decision for this call, as its hook measures it."""
        s, step = self.settings, self.calls
        warmup = step < s.disable_cache_before_step
        interval = (step - s.disable_cache_before_step - 1) % s.cache_interval == 0
        cooldown = s.disable_cache_after_step is not None and step >= s.disable_cache_after_step
        return warmup or interval or cooldown

    def advance_mag(self) -> None:
        """The tail hook's `_advance_step`: past the last step the state starts over."""
        if self.calls + 1 >= self.settings.num_inference_steps:
            self.mag_ratio, self.mag_steps, self.mag_err, self.mag_residual = 1.0, 0, 0.0, None


@dataclasses.dataclass
class UnitCall:
    """One unit in one call: its rows (indices into the call's rows) and its mode."""

    rows: list[int]
    state: UnitState
    mode: str  # first_block | mag_skip | mag_compute | taylor_compute | taylor_predict | lite_compute | lite_predict
    hit: bool = False
    slot: int = -1  # the slot whose request it belongs to
    # its prompt's own text length: a call pads its rows' texts to the longest (Qwen-Image),
    # and the state keeps the text part at the unit's own length, as its pipeline call alone
    text_length: int | None = None


#: the modes decided before the call that skip work (first_block decides inside it)
SKIPPING_MODES = ("mag_skip", "taylor_predict", "lite_predict")


class CacheCall:
    """What the runner binds around one denoiser call, and the hooks' working state."""

    def __init__(self, rows: int, units: list[UnitCall]):
        self.rows, self.units = rows, units
        self.by_mode: dict[str, list[UnitCall]] = {}
        for unit in units:
            self.by_mode.setdefault(unit.mode, []).append(unit)
            unit.hit = unit.mode in SKIPPING_MODES  # first_block decides in the call
        self.has_taylor = any(m.startswith("taylor") for m in self.by_mode)
        self.block_caching = any(m in ("first_block", "mag_skip", "mag_compute") for m in self.by_mode)
        self.rebind: Callable[[torch.Tensor | None], None] = lambda index: None
        self.current: list[int] = list(range(rows))  # the call's rows each block sees, in order
        self.skip_tail = False

    def units_of(self, *modes: str) -> list[UnitCall]:
        return [u for m in modes for u in self.by_mode.get(m, ())]

    def decided(self) -> None:
        """After the call: every unit's call counted and its decision recorded."""
        count_calls(self.units)

    @property
    def rows_skipped(self) -> int:
        """Rows that skipped the expensive part of the call."""
        return sum(len(u.rows) for u in self.units if u.hit)


def count_calls(units: list[UnitCall]) -> None:
    """Every unit's call counted and its decision recorded."""
    for unit in units:
        state = unit.state
        if unit.mode.startswith("mag"):
            state.advance_mag()
        state.hits.append(unit.hit)
        state.calls += 1
