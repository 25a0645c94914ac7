"""Per-request solver state: each step of each sampler as coefficients of one linear update.

diffusers' schedulers keep one step index and one multistep history for a whole batch,
so a batch of independent trajectories cannot share a scheduler object. Here every
request builds its own diffusers scheduler once, at admission (`set_timesteps`), and
keeps only the arrays (timesteps, sigmas, alphas). Each step then reduces to per-slot
coefficients of one update that the fused kernel (`engine.core.kernels`) applies in place:

    out  = u + g * (c - u)              guidance combine of the two branch rows (c only when g == 1)
    x0u  = p * x + q * out               conversion to the data prediction
    x0   = clamp(x0u, -clip, clip)       (clip_sample only)
    x'   = a * x + e * out + b * x0 + ((x - m * x0u) / ks) * kt + hc * h + d * noise
    h'   = x0                            multistep history (DPM-Solver++), when `keep_history`

and the model input of the step is `x / s_in` at timestep `t` (scale_model_input). Every coefficient is
derived in float64 from diffusers' own float32 schedule arrays; the formulas follow
each scheduler's `step()`. The `((x - m * x0u) / ks) * kt` term repeats diffusers' own
order of operations where float32 cancellation would otherwise show: Euler's
`(x - x0) / sigma * dt`, and DDIM's noise direction from a sample prediction.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import math

import numpy as np
import torch
import diffusers
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)

from engine.models.model import prediction_type_of
from engine.protocol import SAMPLERS

# Columns of a coefficient row (see the module docstring).
G, P, Q, CLIP, A, E, B, M, KS, KT, HC, D, KEEP_HIST = range(13)
NUM_COEFS = 13


# The folder's scheduler class → the kernel sampler that runs it exactly (when its config
# is the one `make_scheduler` builds); any other scheduler runs on the generic path.
_KERNEL_SAMPLER_OF = {
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler_ancestral",
    "DDIMScheduler": "ddim",
    "DPMSolverMultistepScheduler": "dpmpp_2m",
    "FlowMatchEulerDiscreteScheduler": "flow_euler",
}

# Which (sampler, prediction type) pairs diffusers supports.
SUPPORTED = {
    "default": {"epsilon", "v_prediction", "sample", "flow"},
    "euler": {"epsilon", "v_prediction", "sample"},
    "euler_ancestral": {"epsilon", "v_prediction"},
    "ddim": {"epsilon", "v_prediction", "sample"},
    "dpmpp_2m": {"epsilon", "v_prediction", "sample", "flow"},
    "flow_euler": {"flow"},
}

_DIFFUSERS_PREDICTION = {"flow": "flow_prediction"}
NOISE_BLOCK = 16  # steps of noise a stochastic request draws at once


class UnsupportedSampler(ValueError):
    """The sampler cannot run on this model (unknown, or an unsupported pair)."""


def make_scheduler(sampler: str, scheduler_config: dict):
    """The diffusers scheduler object for `sampler` on a model with this scheduler config.

    This is also the oracle the tests compare against, so the engine and the reference
    loop build their schedules in exactly the same way.
    """
    if sampler == "default":
        return folder_scheduler(scheduler_config)
    if sampler not in SAMPLERS:
        raise UnsupportedSampler(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    prediction = prediction_type_of(scheduler_config)
    if prediction not in SUPPORTED[sampler]:
        raise UnsupportedSampler(f"sampler {sampler!r} does not support this model's prediction type {prediction!r}")
    config = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    if sampler == "flow_euler":
        sched = _from_config(FlowMatchEulerDiscreteScheduler, config)
        # dynamic shifting (FLUX) is supported: its `mu` comes with the schedule options
        if sched.config.stochastic_sampling:
            raise UnsupportedSampler("flow_euler: stochastic sampling is not supported")
        return sched
    config["prediction_type"] = _DIFFUSERS_PREDICTION.get(prediction, prediction)
    if sampler == "euler":
        sched = _from_config(EulerDiscreteScheduler, config)
        if sched.config.timestep_type != "discrete":
            raise UnsupportedSampler("euler: only discrete timesteps are supported")
    elif sampler == "euler_ancestral":
        sched = _from_config(EulerAncestralDiscreteScheduler, config)
    elif sampler == "ddim":
        sched = _from_config(DDIMScheduler, config)
        if sched.config.thresholding:
            raise UnsupportedSampler("ddim: dynamic thresholding is not supported")
    else:
        if prediction == "flow":
            config.setdefault("use_flow_sigmas", True)
            config.setdefault("flow_shift", scheduler_config.get("shift", 1.0))
        config.update(algorithm_type="dpmsolver++", solver_order=2)
        sched = _from_config(DPMSolverMultistepScheduler, config)
        if sched.config.thresholding:
            raise UnsupportedSampler("dpmpp_2m: dynamic thresholding is not supported")
    return sched


def folder_scheduler(scheduler_config: dict):
    """The model folder's own scheduler, as its pipeline runs it (sampler `default`)."""
    cls = getattr(diffusers, scheduler_config.get("_class_name", ""), None)
    if cls is None or not hasattr(cls, "step"):
        raise UnsupportedSampler(f"the model's scheduler {scheduler_config.get('_class_name')!r} is not a "
                                 "diffusers scheduler")
    return cls.from_config({k: v for k, v in scheduler_config.items() if not k.startswith("_")})


def kernel_sampler_of_default(scheduler_config: dict) -> str | None:
    """The kernel sampler that equals the folder's own scheduler, or None: then `default`
    runs the scheduler object itself, per request (`Schedule.scheduler`)."""
    name = _KERNEL_SAMPLER_OF.get(scheduler_config.get("_class_name", ""))
    if name is None:
        return None
    try:
        ours = make_scheduler(name, scheduler_config)
    except UnsupportedSampler:
        return None
    theirs = folder_scheduler(scheduler_config)
    accepted = inspect.signature(type(theirs).__init__).parameters
    settings = lambda sched: {k: v for k, v in sched.config.items() if k in accepted}  # noqa: E731
    return name if type(ours) is type(theirs) and settings(ours) == settings(theirs) else None


def _from_config(cls, config: dict):
    """`cls.from_config` with only the keys `cls` takes: a model's config written for
    another scheduler class is normal, and not worth a warning per request."""
    accepted = inspect.signature(cls.__init__).parameters
    return cls.from_config({k: v for k, v in config.items() if k in accepted})


def init_noise_sigma(sched) -> float:
    """Flow-matching schedulers have no `init_noise_sigma`; their pipelines start at 1."""
    return float(getattr(sched, "init_noise_sigma", 1.0))


@dataclasses.dataclass
class Schedule:
    """One request's whole trajectory as arrays, built once at admission."""

    coefs: np.ndarray  # steps × NUM_COEFS, float32
    timesteps: np.ndarray  # steps, float32: the denoiser's timestep input per step
    input_divisor: np.ndarray  # steps, float32: model input = x / input_divisor, as scale_model_input
    init_noise_sigma: float
    stochastic: bool  # draws noise at every step (euler_ancestral)
    scheduler: object | None = None  # generic path: a diffusers scheduler after set_timesteps (a template)
    # image inputs: the trajectory is the full schedule's tail from index `begin` (the
    # pipelines' `t_start * scheduler.order`); the arrays above hold only that tail
    begin: int = 0
    # add_noise(x, noise, t) = a * x + b * noise, as (a, b) float32: at the first timestep
    # (the initial latents), and per step k at the timestep after it (inpainting keeps the
    # known region noised to where the trajectory is next; the last row (1, 0): unnoised)
    start_noising: np.ndarray | None = None  # 2
    step_noising: np.ndarray | None = None  # steps × 2

    @property
    def steps(self) -> int:
        return len(self.timesteps)


def build_schedule(sampler: str, scheduler_config: dict, steps: int, guidance: float,
                   options: tuple = (), start: int | None = None) -> Schedule:
    """`options`: (name, value) pairs for `set_timesteps` beside the step count, as the
    pipeline passes them (FLUX's `sigmas` and resolution-dependent `mu`).

    `start` (image inputs): the pipeline's `t_start` from `get_timesteps(steps, strength)`;
    the trajectory then runs the schedule's tail from `t_start * scheduler.order`, every
    first-step special case (DPM-Solver++'s first-order start, the scheduler's
    `set_begin_index`) relative to that step, and the schedule carries the add_noise
    coefficients of its timesteps. None: text-to-image, the whole schedule."""
    if sampler == "default":
        sampler = kernel_sampler_of_default(scheduler_config) or "generic"
    if sampler == "generic":
        return _generic_schedule(folder_scheduler(scheduler_config), steps, guidance, options, start)
    sched = make_scheduler(sampler, scheduler_config)
    _set_timesteps(sched, steps, options)
    begin = _begin_index(sched, start)
    prediction = prediction_type_of(scheduler_config)
    timesteps = sched.timesteps.to(torch.float64).numpy()
    coefs = np.zeros((len(timesteps), NUM_COEFS), dtype=np.float64)
    coefs[:, G] = guidance
    coefs[:, CLIP] = np.inf
    coefs[:, KS] = 1.0
    if sampler in ("euler", "euler_ancestral"):
        sig32 = sched.sigmas[:-1].to(torch.float32)
        input_divisor = ((sig32**2 + 1) ** 0.5).double().numpy()  # float32, as scale_model_input
        _karras(coefs, sched.sigmas.to(torch.float32), prediction, ancestral=sampler == "euler_ancestral")
    elif sampler == "flow_euler":
        sigmas = sched.sigmas.to(torch.float64).numpy()
        input_divisor = np.ones(len(timesteps))
        dt = sigmas[1:] - sigmas[:-1]
        coefs[:, A], coefs[:, E] = 1.0, dt  # x' = x + dt * velocity, as FlowMatchEulerDiscrete does
    elif sampler == "ddim":
        input_divisor = np.ones(len(timesteps))
        _ddim(coefs, sched, timesteps.astype(np.int64), prediction)
    else:
        input_divisor = np.ones(len(timesteps))
        _dpmpp_2m(coefs, sched, prediction, begin)
    _fold(coefs)
    start_noising, step_noising = _noising(sched, begin) if start is not None else (None, None)
    return Schedule(
        coefs=coefs[begin:].astype(np.float32),
        timesteps=timesteps[begin:].astype(np.float32),
        input_divisor=input_divisor[begin:].astype(np.float32),
        init_noise_sigma=init_noise_sigma(sched),
        stochastic=sampler == "euler_ancestral",
        begin=begin, start_noising=start_noising, step_noising=step_noising,
    )


def _begin_index(sched, start: int | None) -> int:
    """Where a trajectory starting at the pipeline's `t_start` begins in the schedule's
    arrays, as `get_timesteps` slices them; the scheduler is told, as the pipeline tells it."""
    if start is None:
        return 0
    begin = start * int(getattr(sched, "order", 1))
    if not 0 <= begin < len(sched.timesteps):
        raise UnsupportedSampler(f"a trajectory cannot start at step {start} of {len(sched.timesteps)}")
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(begin)
    return begin


@torch.no_grad()
def _noising(sched, begin: int) -> tuple[np.ndarray, np.ndarray]:
    """The add_noise coefficients (a, b) the pipeline's own calls use, read from the
    scheduler itself: its `add_noise` (flow matching: `scale_noise`) is a * x + b * noise
    elementwise with one float32 a and b per timestep, so probing it with ones and zeros
    gives exactly those two numbers, a * 1 + b * 0 = a. Index-based schedulers find their
    sigma by step index: at the start the begin index, after step k the index the
    scheduler's own `step` has advanced to (begin + k + 1), as in the inpainting loop."""
    probe = copy.deepcopy(sched)
    noise_at = getattr(probe, "add_noise", None)
    if noise_at is None:
        scale_noise = probe.scale_noise
        noise_at = lambda x, n, t: scale_noise(x, t, n)  # noqa: E731 - flow matching's argument order
    one, zero = torch.ones(1), torch.zeros(1)
    timesteps = probe.timesteps

    def at(index: int, step_index: int | None) -> tuple[float, float]:
        if hasattr(probe, "_step_index"):
            probe._step_index = step_index
        t = timesteps[index:index + 1]
        return float(noise_at(one, zero, t)), float(noise_at(zero, one, t))

    start = np.array(at(begin, None), dtype=np.float32)
    n = len(timesteps) - begin
    steps = np.zeros((n, 2), dtype=np.float32)
    for k in range(n - 1):
        steps[k] = at(begin + k + 1, begin + k + 1)
    steps[n - 1] = (1.0, 0.0)  # after the last step the known region is the image's latents themselves
    return start, steps


def _set_timesteps(sched, steps: int, options: tuple) -> None:
    kwargs = {name: list(value) if isinstance(value, tuple) else value for name, value in options}
    if getattr(sched.config, "use_dynamic_shifting", False) and kwargs.get("mu") is None:
        # the shift depends on the image size, which only the model's schedule options know
        raise UnsupportedSampler(f"{type(sched).__name__} with dynamic shifting needs the resolution-dependent "
                                 "`mu`, which this model does not give")
    if "sigmas" in kwargs:  # the pipeline passes sigmas instead of a step count
        sched.set_timesteps(sigmas=kwargs.pop("sigmas"), **kwargs)
    else:
        sched.set_timesteps(steps, **kwargs)


def _generic_schedule(sched, steps: int, guidance: float, options: tuple = (), start: int | None = None) -> Schedule:
    """A scheduler the kernel does not express (PNDM, LMS, UniPC, ...): each request steps
    its own copy of the diffusers object (told its begin index, as the pipeline tells it);
    the core only gathers its rows."""
    _set_timesteps(sched, steps, options)
    begin = _begin_index(sched, start)
    n = len(sched.timesteps) - begin
    coefs = np.zeros((n, NUM_COEFS), dtype=np.float32)
    coefs[:, G] = guidance
    start_noising, step_noising = _noising(sched, begin) if start is not None else (None, None)
    return Schedule(coefs=coefs, timesteps=sched.timesteps[begin:].to(torch.float32).numpy(),
                    input_divisor=np.ones(n, dtype=np.float32), init_noise_sigma=init_noise_sigma(sched),
                    stochastic=False, scheduler=sched, begin=begin, start_noising=start_noising,
                    step_noising=step_noising)


def _karras(coefs: np.ndarray, sigmas32: torch.Tensor, prediction: str, ancestral: bool) -> None:
    """Euler and Euler-ancestral on sigma-scaled samples (EulerDiscreteScheduler.step):
    x' = x + (x - x0) / sigma * dt (+ noise * sigma_up), dt and sigma_up in float32 as there."""
    sig, nxt = sigmas32[:-1], sigmas32[1:]
    sigma = sig.double().numpy()
    if prediction == "epsilon":
        coefs[:, P], coefs[:, Q] = 1.0, -sigma
    elif prediction == "v_prediction":
        coefs[:, P], coefs[:, Q] = 1.0 / (sigma**2 + 1.0), -sigma / np.sqrt(sigma**2 + 1.0)
    else:  # sample
        coefs[:, P], coefs[:, Q] = 0.0, 1.0
    if ancestral:
        sigma_up = (nxt**2 * (sig**2 - nxt**2) / sig**2) ** 0.5
        dt = (nxt**2 - sigma_up**2) ** 0.5 - sig  # sigma_down - sigma
        coefs[:, D] = sigma_up.double().numpy()
    else:
        dt = nxt - sig
    coefs[:, A], coefs[:, M], coefs[:, KS], coefs[:, KT] = 1.0, 1.0, sigma, dt.double().numpy()


def _ddim(coefs: np.ndarray, sched: DDIMScheduler, timesteps: np.ndarray, prediction: str) -> None:
    """DDIM with eta = 0 (DDIMScheduler.step): x' = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps,
    each factor computed in float32 as there."""
    ac = sched.alphas_cumprod.to(torch.float32)
    prev = torch.from_numpy(timesteps - sched.config.num_train_timesteps // sched.num_inference_steps)
    alpha = ac[torch.from_numpy(timesteps)]
    final = torch.tensor(float(sched.final_alpha_cumprod), dtype=torch.float32)
    alpha_prev = torch.where(prev >= 0, ac[prev.clamp(min=0)], final)
    beta = 1 - alpha
    f64 = lambda t: t.double().numpy()  # noqa: E731
    sa, sb, direction = f64(alpha**0.5), f64(beta**0.5), f64((1 - alpha_prev) ** 0.5)
    coefs[:, B] = f64(alpha_prev**0.5)
    # x0 = p x + q out, and eps from the unclipped model output, as diffusers computes them
    if prediction == "epsilon":  # eps = out
        coefs[:, P], coefs[:, Q], coefs[:, E] = 1 / sa, -sb / sa, direction
    elif prediction == "sample":  # eps = (x - sqrt(alpha) x0u) / sqrt(beta)
        coefs[:, P], coefs[:, Q] = 0.0, 1.0
        coefs[:, M], coefs[:, KS], coefs[:, KT] = sa, sb, direction
    else:  # v_prediction: eps = sqrt(alpha) v + sqrt(beta) x
        coefs[:, P], coefs[:, Q] = sa, -sb
        coefs[:, A], coefs[:, E] = direction * sb, direction * sa
    if sched.config.clip_sample:
        coefs[:, CLIP] = sched.config.clip_sample_range


def _dpmpp_2m(coefs: np.ndarray, sched: DPMSolverMultistepScheduler, prediction: str, begin: int = 0) -> None:
    """DPM-Solver++(2M) (DPMSolverMultistepScheduler.step with dpmsolver++, order 2). The
    first step a trajectory takes (`begin`) is first order: the scheduler has no history
    yet (`lower_order_nums`); the final-step rules count the whole schedule, as there."""
    cfg = sched.config
    sigmas = sched.sigmas.to(torch.float64).numpy()
    if cfg.use_flow_sigmas:
        alphas, sig_t = 1.0 - sigmas, sigmas
    else:
        alphas = 1.0 / np.sqrt(sigmas**2 + 1.0)
        sig_t = sigmas * alphas
    with np.errstate(divide="ignore"):
        lam = np.log(alphas) - np.log(sig_t)
    n = len(sched.timesteps)
    for i in range(n):
        # convert_model_output (data prediction) at sigmas[i]
        if prediction == "epsilon":
            coefs[i, P], coefs[i, Q] = 1 / alphas[i], -sig_t[i] / alphas[i]
        elif prediction == "sample":
            coefs[i, P], coefs[i, Q] = 0.0, 1.0
        elif prediction == "v_prediction":
            coefs[i, P], coefs[i, Q] = alphas[i], -sig_t[i]
        else:  # flow
            coefs[i, P], coefs[i, Q] = 1.0, -sigmas[i]
        coefs[i, KEEP_HIST] = 1.0
        lower_order_final = i == n - 1 and (
            cfg.euler_at_final or (cfg.lower_order_final and n < 15) or cfg.final_sigmas_type == "zero"
        )
        if sig_t[i + 1] == 0.0:  # log(0) = -inf in diffusers gives exp(-h) = 0: x' = x0
            coefs[i, A], coefs[i, B] = 0.0, 1.0
            continue
        h = lam[i + 1] - lam[i]
        phi = alphas[i + 1] * math.expm1(-h)  # alpha_t * (exp(-h) - 1)
        coefs[i, A] = sig_t[i + 1] / sig_t[i]
        if i == begin or lower_order_final:
            coefs[i, B] = -phi
            continue
        r0 = (lam[i] - lam[i - 1]) / h
        # D0 = x0, D1 = (x0 - h_prev) / r0
        if cfg.solver_type == "midpoint":
            w1 = -0.5 * phi
        else:  # heun
            w1 = alphas[i + 1] * (math.expm1(-h) / h + 1.0)
        coefs[i, B] = -phi + w1 / r0
        coefs[i, HC] = -w1 / r0


def _fold(coefs: np.ndarray) -> None:
    """Without clipping, x0 enters x' linearly: fold b * x0 into a and e so that the kernel
    computes x' in as few roundings as diffusers does."""
    linear = np.isinf(coefs[:, CLIP])
    b = np.where(linear, coefs[:, B], 0.0)
    coefs[:, A] += b * coefs[:, P]
    coefs[:, E] += b * coefs[:, Q]
    coefs[:, B] -= b


class Trajectory:
    """A request's own solver coordinate: its schedule, step index and random stream.

    Noise is drawn from the request's own CPU generator, in diffusers' order (initial
    latents, then one draw per stochastic step), so a request's random stream never
    depends on its neighbours in the batch.
    """

    __slots__ = ("schedule", "generator", "latent_shape", "scheduler", "_step_kwargs", "_noise",
                 "_noise_from", "_numel")

    def __init__(self, schedule: Schedule, seed: int, latent_shape: tuple[int, ...]):
        self.schedule = schedule
        self.generator = torch.Generator("cpu").manual_seed(seed)
        self.latent_shape = (1, *latent_shape)
        # generic path: the request's own scheduler object (its step index and history)
        self.scheduler = copy.deepcopy(schedule.scheduler) if schedule.scheduler is not None else None
        self._step_kwargs = None
        self._noise: tuple[torch.Tensor, ...] = ()  # a block of steps' noise rows, drawn ahead (`step_noise`)
        self._noise_from = 0
        self._numel = math.prod(latent_shape)

    def scale_model_input(self, x: torch.Tensor, t) -> torch.Tensor:
        """Generic path: the model input of this step, as the pipeline computes it."""
        return self.scheduler.scale_model_input(x, t)

    def scheduler_step(self, out: torch.Tensor, t, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Generic path: one step of the request's own scheduler, with the pipeline's
        extra arguments (eta = 0 and the request's generator, where `step` takes them).
        Returns the next sample and the scheduler's x0 estimate, where it reports one."""
        if self._step_kwargs is None:
            accepted = inspect.signature(self.scheduler.step).parameters
            self._step_kwargs = {k: v for k, v in (("eta", 0.0), ("generator", self.generator)) if k in accepted}
        result = self.scheduler.step(out, t, x, **self._step_kwargs, return_dict=True)
        return result.prev_sample, getattr(result, "pred_original_sample", None)

    def initial_latents(self) -> torch.Tensor:
        x = torch.randn(self.latent_shape, generator=self.generator, dtype=torch.float32)
        return x * self.schedule.init_noise_sigma

    def step_noise(self, step: int) -> torch.Tensor:
        """The noise of step `step` (drawn in step order), from blocks of NOISE_BLOCK steps
        drawn ahead in one call each: fewer calls on the per-step path, at most one block of
        host memory per request. torch's CPU normal sampler fills 16 values at a time from the
        generator's stream, so for a multiple of 16 values one draw of k rows equals k draws
        of one row, bit for bit (tests compare with diffusers' own loop); other sizes keep
        drawing step by step."""
        k = step - self._noise_from
        if 0 <= k < len(self._noise):  # a tuple: no tensor op on the per-step path
            return self._noise[k]
        if self._numel % 16:
            return torch.randn(self._numel, generator=self.generator, dtype=torch.float32)
        rows = min(NOISE_BLOCK, self.schedule.steps - step)
        block = torch.randn((rows, self._numel), generator=self.generator, dtype=torch.float32)
        self._noise = block.unbind(0)  # row views in a tuple: indexing it costs no tensor op
        self._noise_from = step
        return self._noise[0]

    @property
    def total(self) -> int:
        return self.schedule.steps
