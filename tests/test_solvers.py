"""Per-request solver equivalence with diffusers as the oracle (DESIGN.md section 3, R1, R3).

Every sampler × prediction type that diffusers supports (`engine.solvers.SUPPORTED`),
step counts 1, 2, 7 and 25, guidance 1.0 and 7.5: the result of a request must equal
`tests.reference.reference_latents` (one request, one diffusers scheduler) to a relative
L2 error ≤ 1e-5 in float32 on CPU, while the request shares batches in an `EngineCore`
with trajectories at other steps that join late and with neighbours that are canceled.

The denoiser and batch invariance. The tiny UNet's float32 CPU kernels are not batch
invariant: one row's output depends on how many rows share the call (the time-embedding
GEMM takes a different path for M=1 than for M>1), by ~5e-7 relative, which guidance 7.5
and a sample-predicting model amplify to ~2e-5 in the final latents. That is a property
of the model, not of the solver, so the shared-batch tests run the UNet internally in
float64 and round its output to float32 (`BatchInvariant`): every row's float32 output
is then the same in any batch (checked in `test_denoiser_is_batch_invariant`), and the
engine's batching, row map, coefficients, history, noise and clamp are compared with
diffusers exactly as the contract states. `test_alone_float32_model` runs the real
float32 model with a request alone in the engine (the same 1- or 2-row batches as the
reference) against the same bound.
"""
from __future__ import annotations

import dataclasses
import functools
import random

import msgspec
import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)


from engine.testing.reference import SCHEDULER_CONFIGS, TEST_CONDITIONS, reference_latents, rel_l2, tiny_model  # noqa: E402

from engine.core import CoreConfig, EngineCore, RequestRejected  # noqa: E402
from engine.core.kernels import update_slots_reference  # noqa: E402
from engine.models.stable_diffusion import ClassConditionalModel  # noqa: E402
from engine.protocol import GenerateParams  # noqa: E402
from engine.core.solvers import (  # noqa: E402
    CLIP, HC, KEEP_HIST, P, Q, SAMPLERS, SUPPORTED, Trajectory, UnsupportedSampler, build_schedule, make_scheduler,
)

from core_driver import run_to_end  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")]  # diffusers + numpy 2

TOL = 1e-5
PREDICTIONS = ("epsilon", "v_prediction", "sample", "flow")
STEPS = (1, 2, 7, 25)
GUIDANCES = (1.0, 7.5)
PAIRS = [(s, p) for s in SAMPLERS for p in PREDICTIONS if p in SUPPORTED[s]]
UNSUPPORTED = [(s, p) for s in SAMPLERS for p in PREDICTIONS if p not in SUPPORTED[s]]


@dataclasses.dataclass(frozen=True)
class Case:
    sampler: str
    prediction: str
    steps: int
    guidance: float
    seed: int
    prompt: str

    @property
    def id(self) -> str:
        return f"{self.sampler}-{self.prediction}-{self.steps}-g{self.guidance:g}"

    def params(self) -> GenerateParams:
        return GenerateParams(prompt=self.prompt, steps=self.steps, sampler=self.sampler,
                              guidance=self.guidance, seed=self.seed, output="latent")


def _cases(pairs, steps, guidances) -> list[Case]:
    out = []
    for sampler, pred in pairs:
        for n in steps:
            for g in guidances:
                k = len(out)
                out.append(Case(sampler, pred, n, g, seed=1000 + 17 * k, prompt=TEST_CONDITIONS[k % 3]))
    return out


CASES = _cases(PAIRS, STEPS, GUIDANCES)
CASE_BY_KEY = {(c.sampler, c.prediction, c.steps, c.guidance): c for c in CASES}


# ---- the denoiser ----------------------------------------------------------------------

class BatchInvariant(ClassConditionalModel):
    """The tiny model, its UNet run in float64, outputs rounded to float32: the float32
    output of a row no longer depends on its neighbours in the call (see module docstring)."""

    def forward(self, inputs):
        return self.unet(inputs.sample.double(), inputs.timestep, class_labels=inputs.hidden).sample.float()


@functools.lru_cache(maxsize=None)
def invariant_model(prediction: str, **overrides) -> BatchInvariant:
    base = tiny_model(prediction)
    base.unet.double()
    config = dict(base.scheduler_config, **overrides)
    return BatchInvariant(path=base.path, unet=base.unet, vae=None, scheduler_config=config,
                          conditions=base.conditions, device=base.device)


@functools.lru_cache(maxsize=None)
def float32_model(prediction: str) -> ClassConditionalModel:
    return tiny_model(prediction)


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> torch.Tensor:
    return reference_latents(invariant_model(case.prediction), case.sampler, case.prompt, case.steps,
                             case.guidance, case.seed)


def test_denoiser_is_batch_invariant():
    model = invariant_model("sample")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, 8, 8, generator=g)
    t = torch.linspace(1, 999, 12)
    prompts = model.encode(TEST_CONDITIONS)
    c = [prompts[i % len(TEST_CONDITIONS)] for i in range(12)]
    with torch.no_grad():
        full = model.denoise(x, t, c)
        for rows in ([0], [3, 1], [5, 0, 11], list(range(7))):
            sel = torch.tensor(rows)
            assert torch.equal(model.denoise(x[sel], t[sel], [c[i] for i in rows]), full[sel])


# ---- the batch runner: an EngineCore with late joiners and canceled neighbours ---------------

class RecordingCore(EngineCore):
    """EngineCore that records the composition of every batch it builds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_log: list[dict] = []
        self._build_batch = self.runner.build_batch
        self.runner.build_batch = self.recorded_batch

    def recorded_batch(self, plan):
        batch = self._build_batch(plan)
        reqs = [plan.request_at(s) for s in batch.slots]
        self.batch_log.append({
            "steps": sorted({plan.step_at(s) for s in batch.slots}),
            "samplers": sorted({r.params.sampler for r in reqs}),
            "two_rows": sorted({r.cfg_scale is not None for r in reqs}),
        })
        return batch


@dataclasses.dataclass
class SharedRun:
    results: dict  # request id → C×H×W latents
    canceled: set
    core: RecordingCore
    admitted_late: set  # ids admitted while other trajectories were mid-way
    victims: set  # ids submitted to be canceled mid-trajectory


def run_shared(model: ClassConditionalModel, cases: list[Case], layout: str = "compact", slots: int = 6,
               victims: int = 3, shuffle_seed: int = 0) -> SharedRun:
    """Submit `cases` a few at a time into one engine with fewer slots than requests, so
    trajectories join late at every step boundary; some victims (stochastic and multistep)
    are canceled mid-trajectory, and their slots are reused."""
    core = RecordingCore(model, CoreConfig(slots=slots, layout=layout, max_steps=32,
                                           max_queue=len(cases) + victims + 1, output_budget_bytes=1 << 30,
                                           decode_buffers=len(cases) + victims + 1))
    rng = random.Random(shuffle_seed)
    pending = list(cases)
    rng.shuffle(pending)
    victim_params = [GenerateParams(prompt=TEST_CONDITIONS[k % 3], steps=25, guidance=3.0, seed=7 + k,
                                    sampler=("euler_ancestral", "dpmpp_2m", "ddim")[k % 3], output="latent")
                     for k in range(victims)]
    victim_params = [p for p in victim_params if model.prediction_type in SUPPORTED[p.sampler]]
    admitted_late, victim_ids = set(), set()
    to_cancel = {}  # victim id → batch count at which to cancel
    busy_before = set()

    def join_and_cancel(d):
        nonlocal busy_before
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                case = pending.pop()
                core.add_request(case.id, case.params())
        if victim_params and d.calls % 5 == 2:
            vid = f"victim-{len(victim_params)}"
            core.add_request(vid, victim_params.pop())
            to_cancel[vid] = core.batches + 3
            victim_ids.add(vid)
        for vid, at in list(to_cancel.items()):
            if core.batches >= at and vid in core.requests and core.requests[vid].step > 0:
                core.abort_requests([vid])
                del to_cancel[vid]
        busy_before = {r.request_id for g in core.groups.values() for r in g.requests
                       if r is not None and r.step > 0}

    def note_late_admissions(d, outputs):
        if busy_before:
            for g in core.groups.values():
                admitted_late.update(r.request_id for r in g.requests if r is not None and r.step == 1
                                     and r.request_id not in busy_before)

    d = run_to_end(core, keep="torch", before_step=join_and_cancel, after_step=note_late_admissions,
                   waiting=lambda: bool(pending or victim_params))
    results, canceled = d.results, set(d.canceled)
    return SharedRun(results, canceled, core, admitted_late, victim_ids)


@functools.lru_cache(maxsize=None)
def shared_run(prediction: str, layout: str = "compact", subset: bool = False) -> SharedRun:
    cases = [c for c in CASES if c.prediction == prediction]
    if subset:
        cases = [c for c in cases if c.steps in (2, 7)]
    return run_shared(invariant_model(prediction), cases, layout=layout)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_engine_shared_batch_matches_diffusers(case):
    run = shared_run(case.prediction)
    err = rel_l2(run.results[case.id], reference(case))
    assert err <= TOL, f"{case.id}: relative L2 {err:.3g}"


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_shared_run_really_shares(prediction):
    """The equivalence above was reached in mixed, late-joined, canceled-around batches."""
    run = shared_run(prediction)
    log = run.core.batch_log
    assert max(len(b["steps"]) for b in log) >= 3, "never had trajectories at 3 different steps in one batch"
    if sum(p == prediction for _, p in PAIRS) > 1:
        assert any(len(b["samplers"]) > 1 for b in log), "samplers never shared a batch"
    assert any(b["two_rows"] == [False, True] for b in log), "guidance 1 and 7.5 never shared a batch"
    assert len(run.admitted_late) >= 5, "too few requests joined while others were mid-trajectory"
    assert run.victims and run.canceled == run.victims
    assert set(run.results) == {c.id for c in CASES if c.prediction == prediction}
    assert not run.core.requests and run.core.ledger.used.trajectory_bytes == 0


@pytest.mark.parametrize("layout", ["padded", "bucketed"])
@pytest.mark.parametrize("prediction", ["epsilon", "sample"])
def test_other_layouts_match_diffusers(layout, prediction):
    run = shared_run(prediction, layout, subset=True)
    assert run.results
    errs = {cid: rel_l2(x, reference(next(c for c in CASES if c.id == cid))) for cid, x in run.results.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, f"{layout}: {worst} relative L2 {errs[worst]:.3g}"


# ---- the unit level: one trajectory through update_slots_reference -------------------------

@torch.no_grad()
def run_unit(model: ClassConditionalModel, case: Case, clip_override: float | None = None, stats: dict | None = None):
    """One request's trajectory from its Schedule, one update_slots_reference call per step."""
    schedule = build_schedule(case.sampler, model.scheduler_config, case.steps, case.guidance)
    if clip_override is not None:
        schedule.coefs[:, CLIP] = clip_override
    shape = model.latent_shape(model.native_size, model.native_size)
    traj = Trajectory(schedule, case.seed, shape)
    x = traj.initial_latents().reshape(1, -1)
    h = torch.zeros_like(x)
    two = case.guidance != 1.0
    conditioning = model.encode([case.prompt, ""][: 1 + two])
    for i in range(schedule.steps):
        rows = len(conditioning)
        xin = (x / torch.tensor(schedule.input_divisor[i])).expand(rows, -1).reshape(rows, *shape)
        out = model.denoise(xin, torch.full((rows,), float(schedule.timesteps[i])), conditioning).reshape(rows, -1)
        noise = traj.step_noise(i).reshape(1, -1) if schedule.stochastic else torch.empty(0)
        index = torch.tensor([[0, 0, 1 if two else -1, 0 if schedule.stochastic else -1]], dtype=torch.int32)
        coefs = torch.from_numpy(schedule.coefs[i: i + 1].copy())
        if stats is not None:
            o = out[1] + float(coefs[0, 0]) * (out[0] - out[1]) if two else out[0]
            x0u = coefs[0, P] * x[0] + coefs[0, Q] * o
            stats["clamped"] = stats.get("clamped", 0) + int((x0u.abs() > coefs[0, CLIP]).sum())
        update_slots_reference(out, x, h, noise, index, coefs)
    return x.reshape(shape)


UNIT_CASES = [c for c in CASES if c.steps in (1, 2, 7) and c.sampler != "default"]  # the kernel path alone


@pytest.mark.parametrize("case", UNIT_CASES, ids=lambda c: c.id)
def test_unit_trajectory_matches_diffusers(case):
    err = rel_l2(run_unit(invariant_model(case.prediction), case), reference(case))
    assert err <= TOL, f"{case.id}: relative L2 {err:.3g}"


def test_ddim_clamp_is_exercised():
    """The sample config has clip_sample=True: the clamp is active, and it matters."""
    case = CASE_BY_KEY[("ddim", "sample", 7, 7.5)]
    model = invariant_model("sample")
    schedule = build_schedule("ddim", model.scheduler_config, 7, 7.5)
    assert np.all(schedule.coefs[:, CLIP] == 1.0)
    stats = {}
    x = run_unit(model, case, stats=stats)
    assert stats["clamped"] > 0
    assert rel_l2(x, reference(case)) <= TOL
    unclamped = run_unit(model, case, clip_override=float("inf"))
    assert rel_l2(unclamped, reference(case)) > 1e-3


@pytest.mark.parametrize("pair", PAIRS, ids="-".join)
def test_alone_float32_model(pair):
    """The real float32 model, a request alone in the engine: the batches are the
    reference's own (1 row, or cond+uncond), so the bound holds without batch invariance."""
    sampler, pred = pair
    model = float32_model(pred)
    for steps, g in ((2, 7.5), (7, 1.0)):
        case = CASE_BY_KEY[(sampler, pred, steps, g)]
        core = EngineCore(model, CoreConfig(slots=4, max_steps=32, output_budget_bytes=1 << 30))
        result = run_to_end(core, {"r": case.params()}, keep="torch").results["r"]
        ref = reference_latents(model, sampler, case.prompt, steps, g, case.seed)
        err = rel_l2(result, ref)
        assert err <= TOL, f"{case.id}: relative L2 {err:.3g}"


# ---- random streams ----------------------------------------------------------------------

def test_trajectory_draws_only_from_its_own_seed():
    sched = build_schedule("euler_ancestral", SCHEDULER_CONFIGS["epsilon"], 5, 3.0)
    shape = (4, 8, 8)
    a, b = Trajectory(sched, 11, shape), Trajectory(sched, 12, shape)
    draws_a = [a.initial_latents()]
    b.initial_latents()
    for step in range(5):  # interleaved with a neighbour's draws, some repeated (a re-run step)
        draws_a.append(a.step_noise(step))
        b.step_noise(step)
        b.step_noise(step)
    g = torch.Generator().manual_seed(11)
    expected = [torch.randn((1, *shape), generator=g) * sched.init_noise_sigma]
    expected += [torch.randn((1, *shape), generator=g) for _ in range(5)]
    for got, want in zip(draws_a, expected):
        assert torch.equal(got.reshape(want.shape), want)


def test_noise_blocks_equal_step_by_step_draws():
    """Noise drawn ahead in blocks (NOISE_BLOCK steps a call) equals one draw per step, bit
    for bit, across block boundaries; a size that is not a multiple of 16 draws per step."""
    from engine.core.solvers import NOISE_BLOCK

    steps = 2 * NOISE_BLOCK + 3
    sched = build_schedule("euler_ancestral", SCHEDULER_CONFIGS["epsilon"], steps, 3.0)
    for shape in ((4, 8, 8), (4, 5, 5)):
        t = Trajectory(sched, 5, shape)
        t.initial_latents()
        got = []
        for step in range(steps):
            got.append(t.step_noise(step).reshape(1, *shape))
        g = torch.Generator().manual_seed(5)
        torch.randn((1, *shape), generator=g)
        for k, row in enumerate(got):
            assert torch.equal(row, torch.randn((1, *shape), generator=g)), (shape, k)


def _run_requests(model, requests: list[tuple[str, GenerateParams]], cancel: dict | None = None,
                  join_at: dict | None = None, slots: int = 4):
    """Run requests to completion; `join_at[id]`: batch count before which it is not submitted;
    `cancel[id]`: batch count at which it is canceled. Returns (results, Request objects)."""
    cancel, join_at = cancel or {}, join_at or {}
    core = EngineCore(model, CoreConfig(slots=slots, max_steps=32, output_budget_bytes=1 << 30))
    waiting = list(requests)
    objects = {}

    def join_and_cancel(d):
        for rid, params in list(waiting):
            if core.batches >= join_at.get(rid, 0):
                core.add_request(rid, params)
                objects[rid] = core.requests[rid]
                waiting.remove((rid, params))
        for rid, at in cancel.items():
            if core.batches == at:
                core.abort_requests([rid])

    d = run_to_end(core, keep="torch", before_step=join_and_cancel, waiting=lambda: bool(waiting))
    return d.results, objects


def test_ancestral_noise_isolated_from_neighbours():
    """A euler_ancestral request's noise depends only on its own seed: the same result
    (bit for bit, the denoiser being batch invariant) alone and among stochastic
    neighbours that join before and after it, one of them canceled."""
    model = invariant_model("epsilon")
    me = GenerateParams(prompt="a red circle", steps=7, sampler="euler_ancestral", guidance=7.5, seed=123,
                        output="latent")
    alone, objs = _run_requests(model, [("me", me)])
    neighbours = [(f"n{k}", GenerateParams(prompt=TEST_CONDITIONS[k % 3], steps=4 + 3 * k,
                                           sampler="euler_ancestral", guidance=(1.0, 3.0)[k % 2], seed=k,
                                           output="latent")) for k in range(4)]
    crowd, crowd_objs = _run_requests(model, neighbours[:2] + [("me", me)] + neighbours[2:],
                                      join_at={"me": 2, "n2": 3, "n3": 5}, cancel={"n1": 4})
    assert torch.equal(alone["me"], crowd["me"])
    assert "n1" not in crowd and {"n0", "n2", "n3"} <= set(crowd)
    # the request's own generator advanced by exactly its own draws: initial latents + one per step
    g = torch.Generator().manual_seed(123)
    for _ in range(1 + 7):
        torch.randn((1, 4, 8, 8), generator=g)
    for o in (objs, crowd_objs):
        assert torch.equal(o["me"].trajectory.generator.get_state(), g.get_state())
    # and the noise matters: another seed gives another image
    other, _ = _run_requests(model, [("me", msgspec.structs.replace(me, seed=124))])
    assert rel_l2(other["me"], alone["me"]) > 1e-2
    case = Case("euler_ancestral", "epsilon", 7, 7.5, 123, "a red circle")
    assert rel_l2(alone["me"], reference(case)) <= TOL


# ---- schedules, orders, supported pairs ------------------------------------------------------

def diffusers_scheduler(sampler: str, prediction: str, **overrides):
    """Built here from diffusers' classes directly (not through engine.solvers)."""
    config = {k: v for k, v in SCHEDULER_CONFIGS[prediction].items() if not k.startswith("_")}
    config.update(overrides)
    if sampler == "flow_euler":
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    config["prediction_type"] = "flow_prediction" if prediction == "flow" else prediction
    if sampler == "dpmpp_2m":
        extra = dict(use_flow_sigmas=True, flow_shift=config["shift"]) if prediction == "flow" else {}
        return DPMSolverMultistepScheduler.from_config(config, algorithm_type="dpmsolver++", solver_order=2, **extra)
    cls = {"euler": EulerDiscreteScheduler, "euler_ancestral": EulerAncestralDiscreteScheduler,
           "ddim": DDIMScheduler}[sampler]
    return cls.from_config(config)


@pytest.mark.parametrize("pair", [p for p in PAIRS if p[0] != "default"], ids="-".join)
def test_schedule_comes_from_diffusers(pair):
    sampler, pred = pair
    for steps in STEPS:
        sched = diffusers_scheduler(sampler, pred)
        sched.set_timesteps(steps)
        ours = build_schedule(sampler, SCHEDULER_CONFIGS[pred], steps, 7.5)
        assert type(make_scheduler(sampler, SCHEDULER_CONFIGS[pred])) is type(sched)
        assert ours.steps == steps == len(sched.timesteps)
        np.testing.assert_array_equal(ours.timesteps, sched.timesteps.to(torch.float32).numpy())
        assert ours.init_noise_sigma == pytest.approx(float(getattr(sched, "init_noise_sigma", 1.0)), rel=1e-7)
        if sampler in ("euler", "euler_ancestral"):
            sigmas = sched.sigmas[:-1].to(torch.float64).numpy()
            np.testing.assert_allclose(ours.input_divisor, np.sqrt(sigmas**2 + 1), rtol=1e-7)
        else:
            np.testing.assert_array_equal(ours.input_divisor, 1.0)
        assert ours.stochastic == (sampler == "euler_ancestral")
        assert np.all(ours.coefs[:, 0] == np.float32(7.5))
        assert np.all(np.isfinite(ours.coefs[:, [c for c in range(ours.coefs.shape[1]) if c != CLIP]]))


@pytest.mark.parametrize("prediction", [p for p in PREDICTIONS if p in SUPPORTED["dpmpp_2m"]])
def test_dpm_order_logic(prediction):
    """DPM-Solver++(2M): first step first-order; the last first-order with final_sigmas_type
    "zero" (the default); second order (history coefficient != 0) in between."""
    config = SCHEDULER_CONFIGS[prediction]
    for steps in (1, 2, 3, 7, 25):
        s = build_schedule("dpmpp_2m", config, steps, 3.0)
        hc = s.coefs[:, HC]
        assert hc[0] == 0 and hc[-1] == 0, steps
        assert np.all(hc[1:-1] != 0), steps
        assert np.all(s.coefs[:, KEEP_HIST] == 1)
    if prediction == "flow":
        return
    # sigma_min: lower_order_final applies only below 15 steps, as in diffusers
    sm = dict(config, final_sigmas_type="sigma_min")
    assert build_schedule("dpmpp_2m", sm, 7, 3.0).coefs[-1, HC] == 0
    assert build_schedule("dpmpp_2m", sm, 25, 3.0).coefs[-1, HC] != 0
    assert np.all(build_schedule("dpmpp_2m", sm, 25, 3.0).coefs[1:, HC] != 0)


@pytest.mark.parametrize("steps", [7, 16])
def test_dpm_sigma_min_matches_diffusers(steps):
    """The branch where the last step's sigma is not zero (second order at the end for ≥ 15 steps)."""
    model = invariant_model("epsilon", final_sigmas_type="sigma_min")
    case = Case("dpmpp_2m", "epsilon", steps, 7.5, 5, "a blue triangle")
    ref = reference_latents(model, "dpmpp_2m", case.prompt, steps, 7.5, case.seed)
    assert rel_l2(run_unit(model, case), ref) <= TOL


@pytest.mark.parametrize("pair", UNSUPPORTED, ids="-".join)
def test_unsupported_pairs_raise(pair):
    sampler, pred = pair
    config = SCHEDULER_CONFIGS[pred]
    with pytest.raises(UnsupportedSampler):
        make_scheduler(sampler, config)
    with pytest.raises(UnsupportedSampler):
        build_schedule(sampler, config, 10, 3.0)
    core = EngineCore(float32_model(pred), CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as exc:
        core.add_request("r", GenerateParams(prompt="a red circle", steps=4, sampler=sampler))
    assert exc.value.field == "sampler"
    assert not core.requests and not core.queue


def test_unknown_sampler_raises():
    with pytest.raises(UnsupportedSampler):
        make_scheduler("heun", SCHEDULER_CONFIGS["epsilon"])


@pytest.mark.parametrize("pair", [("euler_ancestral", "sample"), ("euler", "flow"), ("euler_ancestral", "flow"),
                                  ("ddim", "flow")], ids="-".join)
def test_unsupported_pairs_are_unsupported_in_diffusers(pair):
    """SUPPORTED follows diffusers: its own step() refuses these pairs."""
    sampler, pred = pair
    sched = diffusers_scheduler(sampler, pred)
    sched.set_timesteps(4)
    x = torch.zeros(1, 4, 8, 8)
    with pytest.raises((ValueError, NotImplementedError)):
        sched.step(x, sched.timesteps[0], x)


def test_supported_pairs_cover_the_contract():
    assert set(SUPPORTED) == set(SAMPLERS)
    assert ("euler_ancestral", "sample") in UNSUPPORTED
    assert ("flow_euler", "epsilon") in UNSUPPORTED
    assert ("euler", "flow") in UNSUPPORTED
    assert len(PAIRS) == 17  # `default` (the folder's own scheduler) runs on every prediction type


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_default_is_the_folders_own_scheduler(prediction):
    """`default` runs the class the folder names: on the kernel where one of its updates is
    exactly that scheduler (FlowMatchEuler → flow_euler), else the diffusers object itself
    per request (these folders name DDPMScheduler, which the kernel does not express)."""
    config = SCHEDULER_CONFIGS[prediction]
    assert type(make_scheduler("default", config)).__name__ == config["_class_name"]
    schedule = build_schedule("default", config, 7, 3.0)
    if config["_class_name"] == "FlowMatchEulerDiscreteScheduler":
        assert schedule.scheduler is None
        np.testing.assert_array_equal(schedule.coefs, build_schedule("flow_euler", config, 7, 3.0).coefs)
    else:
        assert type(schedule.scheduler).__name__ == config["_class_name"]
        assert schedule.steps == len(schedule.scheduler.timesteps)


@pytest.mark.parametrize("folder_class, kernel", [("EulerDiscreteScheduler", "euler"), ("DDIMScheduler", "ddim"),
                                                  ("DPMSolverMultistepScheduler", "dpmpp_2m")])
def test_default_maps_to_the_kernel_only_when_configs_agree(folder_class, kernel):
    from engine.core.solvers import kernel_sampler_of_default

    config = dict(SCHEDULER_CONFIGS["epsilon"], _class_name=folder_class)
    assert kernel_sampler_of_default(config) == kernel
    if folder_class == "DPMSolverMultistepScheduler":  # a third-order folder is not dpmpp_2m: generic path
        assert kernel_sampler_of_default(dict(config, solver_order=3)) is None
