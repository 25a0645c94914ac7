"""The step-cache input kind: `cache`, a request's own step cache (`StepCache`), or the
server's default (`--cache`).

Intake resolves it against diffusers' own configs (`FirstBlockCacheConfig`,
`MagCacheConfig`, `TaylorSeerCacheConfig`: their defaults, MagCache's interpolated
ratios) and the model (a denoiser the hooks cannot cache is `Rejected` naming `cache`),
and reserves the bytes the request's cache state can reach. At preparation each request
gets one `UnitState` per unit: a request's rows that its pipeline's call holds together
(FLUX's true-CFG branches are two calls, so two units; a pipeline that batches its CFG
rows, one unit of both). The slot state holds them on the device, parks them with the
slot and drops them after the fence."""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from engine.core.input_kinds.base import InputKind
from engine.core.outputs import RequestRejected
from engine.protocol import STEP_CACHE_KINDS, StepCache

#: the `StepCache` fields each kind takes
KIND_FIELDS = {
    "first_block": ("threshold",),
    "mag": ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios"),
    "taylorseer": ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order",
                   "factors_dtype", "use_lite_mode"),
    "off": (),
}
log = logging.getLogger("diffslot.core")

FACTOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_MAG_RATIOS = 1000


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """A request's resolved cache: its kind and every parameter, diffusers' defaults filled in."""

    kind: str
    threshold: float = 0.0
    max_skip_steps: int = 0
    retention_ratio: float = 0.0
    num_inference_steps: int = 0
    mag_ratios: object = None  # float32 tensor, one ratio per step (MagCacheConfig's own interpolation)
    cache_interval: int = 1
    disable_cache_before_step: int = 0
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: torch.dtype = torch.bfloat16
    lite: bool = False  # TaylorSeer Lite: whole blocks skipped, the output projection predicted


def resolve(cache: StepCache, steps: int, model_ratios) -> CacheSettings:
    """The settings of `cache` for a request of `steps` steps; ValueError says which parameter is wrong."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    given = {f: getattr(cache, f) for f in StepCache.__struct_fields__ if f != "kind" and getattr(cache, f) is not None}
    foreign = sorted(set(given) - set(KIND_FIELDS[cache.kind]))
    if foreign:
        raise ValueError(f"{cache.kind} takes no {', '.join(foreign)}")
    for name, value in given.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be finite")
    if cache.kind == "first_block":
        config = FirstBlockCacheConfig(**given)
        if config.threshold < 0:
            raise ValueError("threshold must be ≥ 0")
        return CacheSettings("first_block", threshold=float(config.threshold))
    if cache.kind == "mag":
        ratios = given.pop("mag_ratios", None)
        if ratios is None:
            ratios = model_ratios
        if ratios is None:
            raise ValueError("this model has no calibrated mag_ratios: give mag_ratios")
        if not 1 <= len(ratios) <= MAX_MAG_RATIOS or not all(math.isfinite(r) and r > 0 for r in ratios):
            raise ValueError(f"mag_ratios: 1 to {MAX_MAG_RATIOS} positive finite numbers")
        config = MagCacheConfig(num_inference_steps=steps, mag_ratios=list(ratios), **given)
        if config.threshold < 0 or config.max_skip_steps < 0 or not 0 <= config.retention_ratio <= 1:
            raise ValueError("threshold and max_skip_steps must be ≥ 0, retention_ratio in [0, 1]")
        return CacheSettings("mag", threshold=config.threshold, max_skip_steps=config.max_skip_steps,
                             retention_ratio=config.retention_ratio, num_inference_steps=steps,
                             mag_ratios=config.mag_ratios)
    dtype_name = given.pop("factors_dtype", None)
    if dtype_name is not None and dtype_name not in FACTOR_DTYPES:
        raise ValueError(f"factors_dtype: one of {', '.join(FACTOR_DTYPES)}")
    config = TaylorSeerCacheConfig(**given)
    if config.cache_interval < 1 or config.disable_cache_before_step < 0 or not 0 <= config.max_order <= 4 or \
            (config.disable_cache_after_step is not None and config.disable_cache_after_step < 0):
        raise ValueError("cache_interval ≥ 1, disable_cache_before/after_step ≥ 0, max_order in [0, 4]")
    return CacheSettings("taylorseer", cache_interval=config.cache_interval,
                         disable_cache_before_step=config.disable_cache_before_step,
                         disable_cache_after_step=config.disable_cache_after_step, max_order=config.max_order,
                         taylor_factors_dtype=FACTOR_DTYPES[dtype_name] if dtype_name else config.taylor_factors_dtype,
                         lite=bool(config.use_lite_mode))


@dataclasses.dataclass
class CacheValue:
    """A request's checked cache: its settings and its units (as branch lists: 0 the
    prompt's row, 1 the negative prompt's)."""

    settings: CacheSettings
    branches: tuple[tuple[int, ...], ...]


class StepCacheKind(InputKind):
    name = "cache"
    fields = ("cache",)

    def __init__(self, model, default: StepCache | None = None):
        self.model, self.default = model, default

    def check(self, p) -> CacheValue | None:
        cache = p.cache if p.cache is not None else self.default
        if cache is None or cache.kind == "off":
            return None
        if cache.kind not in STEP_CACHE_KINDS:
            raise RequestRejected(f"kind {cache.kind!r} is not one of {', '.join(STEP_CACHE_KINDS)}", "cache")
        support = getattr(self.model, "step_cache_support", None)
        why = "this model has no step cache" if support is None else support()
        if why:
            raise RequestRejected(why, "cache")
        try:
            settings = resolve(cache, p.steps, self.model.mag_ratios)
        except (ValueError, TypeError) as exc:
            raise RequestRejected(str(exc), "cache") from None
        two = self.model.cfg_scale(p) is not None
        if not two:
            branches = ((0,),)
        elif self.model.cfg_rows_share_cache:
            branches = ((1, 0),)  # the pipeline's batch order: negative prompt first
        else:
            branches = ((0,), (1,))
        return CacheValue(settings, branches)

    def nbytes(self, value: CacheValue, latent_shape) -> int:
        rows = sum(len(b) for b in value.branches)
        return rows * self.model.step_cache_row_bytes(value.settings, latent_shape)

    def prepare(self, requests: list) -> dict:
        from engine.models.cache_units import UnitState

        for request in requests:
            value = request.inputs.get(self.name)
            if value is not None:
                units = [UnitState(value.settings) for _ in value.branches]
                request.slot_inputs[self.name] = CacheSlot(units, value.branches,
                                                           self.nbytes(value, request.latent_shape),
                                                           request.request_id)
        return {}


@dataclasses.dataclass
class CacheSlot:
    """What a slot holds of its request's cache (also its parked form: the same, on the host)."""

    units: list
    branches: tuple[tuple[int, ...], ...]
    nbytes: int
    request_id: str = ""

    def pattern(self) -> str:
        """Each unit's calls, C computed and S skipped, units apart by "/" (the logs' form)."""
        return "/".join("".join("S" if hit else "C" for hit in unit.hits) for unit in self.units)

    def slot_state(self, storage) -> "StepCacheSlots":
        return StepCacheSlots(storage.device)

    def moved(self, move) -> "CacheSlot":
        return dataclasses.replace(self, units=[u.moved(move) for u in self.units])


class StepCacheSlots:
    """The cache units of every slot of one group's storage."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: dict[int, CacheSlot] = {}

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for value in self.slots.values() for u in value.units)

    def place(self, slot: int, value: CacheSlot) -> None:
        device = self.device
        self.slots[slot] = value.moved(lambda t: t.to(device, non_blocking=True))

    def holds(self, slot: int) -> bool:
        return slot in self.slots

    def after_update(self, latents, slots, steps) -> None:
        pass

    def release(self, slot: int) -> None:
        value = self.slots.pop(slot, None)
        if value is not None:
            log.debug("%s: step cache %s %s", value.request_id, value.units[0].settings.kind, value.pattern())

    def park(self, slot: int) -> CacheSlot:
        from engine.core.storage import to_host

        return self.slots[slot].moved(to_host)
