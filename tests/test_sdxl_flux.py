"""SDXL and FLUX (dev and schnell) folders against diffusers' own pipelines (R19, DESIGN.md
section 3): first the model classes alone (their denoiser call on gathered rows, and a
loop written out over them), then the engine (a request alone, and requests that share
calls with mixed prompts, negative prompts, sizes, samplers, steps, guidance, FLUX's
embedded guidance and true CFG, seeds, late joins and cancels)."""
from __future__ import annotations

import dataclasses
import math
import random

import msgspec
import numpy as np
import pytest
import torch

from engine.core.outputs import RequestRejected
from engine.core.solvers import build_schedule, init_noise_sigma, make_scheduler
from engine.core.validation import checked_size
from engine.models.flux import FluxModel
from engine.models.geometry import geometry_of
from engine.models.loading import load_model
from engine.models.model import model_inputs
from engine.models.sdxl import StableDiffusionXLModel
from engine.protocol import GenerateParams
from engine.testing.pipeline_oracle import load_pipeline, model_of, pipeline_output_of, rel_l2
from engine.testing.tiny_pipelines import build_flux, build_sdxl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PROMPTS = ["a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross", ""]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdxl-flux")
    return {
        "sdxl": build_sdxl(root / "sdxl", seed=1),
        "sdxl-no-zeros": build_sdxl(root / "sdxl-no-zeros", seed=2, force_zeros_for_empty_prompt=False),
        "flux-dev": build_flux(root / "flux-dev", guidance_embeds=True, seed=3),
        "flux-schnell": build_flux(root / "flux-schnell", guidance_embeds=False, seed=4),
    }




def params(**fields) -> GenerateParams:
    return GenerateParams(**{"output": "latent", **fields})


# --- the model classes, no core --------------------------------------------------------

def test_folders_load_as_their_model_classes(folders):
    sdxl, dev, schnell = (model_of(folders[k]) for k in ("sdxl", "flux-dev", "flux-schnell"))
    assert isinstance(sdxl, StableDiffusionXLModel) and isinstance(dev, FluxModel) and isinstance(schnell, FluxModel)
    # SDXL: CLIP 32 + 48 per token, the second encoder's projection (40) pooled
    assert sdxl.conditioning_layout[:2] == ((16, 80), (40,))
    assert (sdxl.latent_channels, sdxl.vae_scale, sdxl.size_multiple, sdxl.native_size) == (4, 2, 4, 16)
    # FLUX: T5 at the pipeline's default 512 tokens, CLIP pooled; 16 unpacked latent channels,
    # sizes in multiples of VAE scale × 2 (packing), native size the pipeline's 128 cells
    for flux in (dev, schnell):
        assert flux.conditioning_layout[:2] == ((512, 32), (32,))
        assert flux.encoder_settings == ("max_sequence_length", 512)
        assert (flux.latent_channels, flux.vae_scale, flux.size_multiple, flux.native_size) == (16, 2, 4, 256)
        assert flux.latent_shape(32, 48) == (16, 16, 24)
    assert dev.guidance_embedded and not schnell.guidance_embedded
    for model in (sdxl, dev):  # the decode workers' geometry, read from the folder's configs alone
        assert geometry_of(model.path) == model.geometry


def test_fields_each_model_cannot_use_are_named(folders):
    sdxl, dev = model_of(folders["sdxl"]), model_of(folders["flux-dev"])
    base = params(prompt="a red circle")
    assert sdxl.check_params(base) is None and dev.check_params(base) is None
    replace = msgspec.structs.replace
    assert sdxl.check_params(replace(base, true_cfg=2.0))[0] == "true_cfg"
    assert sdxl.check_params(replace(base, original_size=(32, 32), crops_coords_top_left=(0, 4))) is None
    assert dev.check_params(replace(base, original_size=(32, 32)))[0] == "original_size"
    assert dev.check_params(replace(base, true_cfg=4.0, sampler="flow_euler")) is None
    # the values' own rules live once, for every model, in the core's validation
    for model, bad in ((sdxl, {"crops_coords_top_left": (-1, 0)}), (sdxl, {"target_size": (0, 16)}),
                       (dev, {"true_cfg": math.nan})):
        with pytest.raises(RequestRejected) as info:
            checked_size(model, model.geometry, replace(base, **bad), 50)
        assert info.value.field == next(iter(bad))
    for sampler in ("dpmpp_2m", "euler", "ddim"):
        assert dev.check_params(replace(base, sampler=sampler))[0] == "sampler"


def test_negative_branch_and_true_cfg_as_the_pipelines_decide(folders):
    sdxl, no_zeros, dev = (model_of(folders[k]) for k in ("sdxl", "sdxl-no-zeros", "flux-dev"))
    absent, empty = params(prompt="a cat", guidance=5.0), params(prompt="a cat", negative_prompt="", guidance=5.0)
    # SDXL: an absent negative prompt is zeros (force_zeros_for_empty_prompt), "" is encoded
    assert sdxl.negative_text(absent) is None and sdxl.negative_text(empty) == ""
    assert no_zeros.negative_text(absent) == ""
    zeros, encoded = sdxl.encode([None, ""])
    assert torch.count_nonzero(zeros.hidden) == 0 and torch.count_nonzero(zeros.pooled) == 0
    assert zeros.hidden.shape == encoded.hidden.shape and zeros.pooled.shape == encoded.pooled.shape
    assert torch.count_nonzero(encoded.hidden) > 0
    assert sdxl.cfg_scale(absent) == 5.0 and sdxl.cfg_scale(params(prompt="a cat", guidance=1.0)) is None
    # FLUX: guidance never makes two rows; true CFG does, above 1 with a negative prompt ("" counts)
    assert dev.cfg_scale(absent) is None and dev.cfg_scale(empty) is None
    assert dev.cfg_scale(msgspec.structs.replace(absent, true_cfg=4.0)) is None
    assert dev.cfg_scale(msgspec.structs.replace(empty, true_cfg=4.0)) == 4.0
    assert dev.negative_text(empty) == ""


def test_flux_schedule_is_the_pipelines(folders):
    """sigmas = linspace(1, 1/steps, steps) and mu from the packed token count; dev's
    `default` runs on the kernel's flow Euler with the same timesteps as the pipeline's."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    for name in ("flux-dev", "flux-schnell"):
        model, pipe = model_of(folders[name]), load_pipeline(str(folders[name]))
        for (height, width), steps in (((32, 32), 4), ((64, 32), 7)):
            options = dict(model.schedule_options(height, width, steps))
            tokens = (height // 4) * (width // 4)
            assert options["mu"] == calculate_shift(tokens, 256, 4096, 0.5, 1.15)
            assert np.array_equal(options["sigmas"], np.linspace(1.0, 1 / steps, steps))
            sched = type(pipe.scheduler).from_config(pipe.scheduler.config)
            want, _ = retrieve_timesteps(sched, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                                         mu=options["mu"])
            schedule = build_schedule("default", model.scheduler_config, steps, 1.0,
                                      model.schedule_options(height, width, steps))
            assert schedule.scheduler is None, "FLUX's own scheduler is the kernel's flow Euler"
            assert np.array_equal(schedule.timesteps, want.numpy())
        # dev: the shift depends on the size; schnell: a fixed shift (mu is ignored)
        a = build_schedule("flow_euler", model.scheduler_config, 4, 1.0, model.schedule_options(32, 32, 4))
        b = build_schedule("flow_euler", model.scheduler_config, 4, 1.0, model.schedule_options(64, 64, 4))
        assert (not np.array_equal(a.timesteps, b.timesteps)) == (name == "flux-dev")


def _sdxl_pipeline_rows(pipe, p: GenerateParams, height: int, width: int):
    """(cond, uncond) hidden, pooled and time ids exactly as StableDiffusionXLPipeline builds them."""
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(p.prompt, device="cpu", num_images_per_prompt=1,
                                                         do_classifier_free_guidance=True,
                                                         negative_prompt=p.negative_prompt)
    time_ids = pipe._get_add_time_ids(p.original_size or (height, width), p.crops_coords_top_left or (0, 0),
                                      p.target_size or (height, width), dtype=embeds.dtype,
                                      text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
    return [(embeds, pooled, time_ids), (neg, neg_pooled, time_ids)]


@torch.no_grad()
def test_sdxl_forward_on_gathered_rows_equals_the_unet_call(folders):
    model, pipe = model_of(folders["sdxl"]), load_pipeline(str(folders["sdxl"]))
    requests = [params(prompt="a red circle", guidance=5.0),  # absent negative: zero rows
                params(prompt="a big blue cat", negative_prompt="", guidance=3.0, original_size=(64, 48),
                       crops_coords_top_left=(8, 0)),
                params(prompt="the small green dog", negative_prompt="blurry", guidance=7.0, target_size=(24, 16))]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * len(requests), 4, 8, 8, generator=gen)
    t = torch.tensor([999.0, 999.0, 500.0, 500.0, 21.0, 21.0])
    rows, extra = [], []
    for p in requests:
        rows += model.encode([p.prompt, model.negative_text(p)])
        extra.append(model.request_inputs(p, 16, 16)["time_ids"])
    got = model.forward(model_inputs(x, t, rows, time_ids=torch.cat(extra)))
    for k, p in enumerate(requests):
        for branch, (hidden, pooled, time_ids) in enumerate(_sdxl_pipeline_rows(pipe, p, 16, 16)):
            r = 2 * k + branch
            want = pipe.unet(x[r:r + 1], t[r], encoder_hidden_states=hidden,
                             added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)[0]
            assert rel_l2(got[r:r + 1], want) < 1e-5, (k, branch)
    # the micro-conditioning reaches the UNet
    plain = model.forward(model_inputs(x[2:4], t[2:4], rows[2:4], time_ids=model.request_inputs(
        params(prompt="a big blue cat"), 16, 16)["time_ids"]))
    assert (plain - got[2:4]).abs().max() > 1e-3


@torch.no_grad()
def test_flux_forward_on_gathered_rows_equals_the_transformer_call(folders):
    """Rows of three requests in one call (different prompts, embedded guidance, timesteps,
    a true-CFG pair), each equal to the pipeline's own transformer call on packed latents."""
    for name in ("flux-dev", "flux-schnell"):
        model, pipe = model_of(folders[name]), load_pipeline(str(folders[name]))
        requests = [params(prompt="a red circle", guidance=3.5),
                    params(prompt="a big blue cat", negative_prompt="blurry", guidance=1.0, true_cfg=4.0),
                    params(prompt="", guidance=6.0)]
        height, width = 16, 24
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4, *model.latent_shape(height, width), generator=gen)
        t = torch.tensor([1000.0, 640.0, 640.0, 250.0])
        guidance, texts = [], []
        for p in requests:
            branches = 1 if model.cfg_scale(p) is None else 2
            texts += [p.prompt, model.negative_text(p)][:branches]
            guidance += [model.request_inputs(p, height, width).get("guidance", torch.zeros(2))[:branches]]
        rows = model.encode(texts)
        inputs = model_inputs(x, t, rows, **({"guidance": torch.cat(guidance)} if model.guidance_embedded else {}))
        got = model.forward(inputs)
        assert got.shape == x.shape
        for r, text in enumerate(texts):
            embeds, pooled, text_ids = pipe.encode_prompt(prompt=text, prompt_2=None, device="cpu")
            packed, image_ids = pipe.prepare_latents(1, 16, height, width, torch.float32, "cpu", None,
                                                     latents=pipe._pack_latents(x[r:r + 1], 1, 16, 8, 12))
            g = torch.full([1], float(inputs.guidance[r]), dtype=torch.float32) if model.guidance_embedded else None
            want = pipe.transformer(hidden_states=packed, timestep=t[r:r + 1] / 1000, guidance=g,
                                    pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids,
                                    img_ids=image_ids, return_dict=False)[0]
            want = pipe._unpack_latents(want, height, width, pipe.vae_scale_factor)
            assert rel_l2(got[r:r + 1], want) < 1e-5, (name, r)
        if model.guidance_embedded:  # the embedded guidance reaches the transformer, per row
            other = model.forward(dataclasses.replace(inputs, guidance=inputs.guidance + 2.0))
            assert (other - got).flatten(1).abs().amax(1).min() > 1e-4


@torch.no_grad()
def model_loop(model, p: GenerateParams) -> np.ndarray:
    """DESIGN.md section 3's loop over the model class (no core): the model's own
    encode, negative branch, guidance scale, request inputs and schedule options, with
    one diffusers scheduler stepping the request."""
    height, width = p.height or model.native_size, p.width or model.native_size
    sched = make_scheduler(p.sampler, model.scheduler_config)
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in model.schedule_options(height, width, p.steps)}
    if "sigmas" in options:  # as the pipeline's retrieve_timesteps
        sched.set_timesteps(**options)
    else:
        sched.set_timesteps(p.steps, **options)
    gen = torch.Generator("cpu").manual_seed(p.seed)
    x = torch.randn((1, *model.latent_shape(height, width)), generator=gen) * init_noise_sigma(sched)
    scale = model.cfg_scale(p)
    texts = [p.prompt] if scale is None else [p.prompt, model.negative_text(p)]
    rows = model.encode(texts)
    extra = {k: v[:len(texts)] for k, v in model.request_inputs(p, height, width).items()}
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(0)
    for t in sched.timesteps:
        xin = torch.cat([x] * len(texts))
        xin = sched.scale_model_input(xin, t) if hasattr(sched, "scale_model_input") else xin
        out = model.run(model_inputs(xin, t, rows, **extra)).float()
        if scale is not None:
            cond, uncond = out.chunk(2)
            out = uncond + scale * (cond - uncond)
        x = sched.step(out, t, x, generator=gen).prev_sample
    return x[0].numpy()


LOOP_CASES = {
    "sdxl-default-zeros": ("sdxl", params(prompt="a red circle", steps=6, guidance=5.0, seed=3)),
    "sdxl-empty-negative": ("sdxl", params(prompt="a red circle", negative_prompt="", steps=6, guidance=5.0, seed=3)),
    "sdxl-micro-ancestral": ("sdxl", params(prompt="a big blue cat", negative_prompt="ugly", steps=5,
                                            sampler="euler_ancestral", guidance=3.0, seed=8, height=24, width=16,
                                            original_size=(96, 64), crops_coords_top_left=(4, 8))),
    "sdxl-no-zeros-dpmpp": ("sdxl-no-zeros", params(prompt="the small green dog", steps=5, sampler="dpmpp_2m",
                                                    guidance=4.0, seed=1)),
    "sdxl-one-row": ("sdxl", params(prompt="a photo of a yellow cross", steps=4, guidance=1.0, seed=5,
                                    target_size=(32, 32))),
    "flux-dev-embedded": ("flux-dev", params(prompt="a red circle", steps=5, guidance=3.5, seed=2,
                                             height=32, width=32)),
    "flux-dev-true-cfg": ("flux-dev", params(prompt="a big blue cat", negative_prompt="blurry", true_cfg=4.0, steps=4,
                                             sampler="flow_euler", guidance=2.0, seed=6, height=16, width=32)),
    "flux-schnell": ("flux-schnell", params(prompt="the small green dog", steps=4, guidance=0.0, seed=4,
                                            height=32, width=16)),
    "flux-schnell-true-cfg": ("flux-schnell", params(prompt="a red circle", negative_prompt="", true_cfg=3.0,
                                                     steps=3, seed=9, height=16, width=16)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(LOOP_CASES))
def test_loop_over_the_model_class_equals_the_pipeline(folders, case):
    name, p = LOOP_CASES[case]
    model = model_of(folders[name])
    got, want = model_loop(model, p), pipeline_output_of(folders[name], p)
    assert got.shape == want.shape == model.latent_shape(p.height or model.native_size, p.width or model.native_size)
    err = rel_l2(got, want)
    print(f"model loop {case}: relative L2 {err:.2e}")
    assert err <= ALONE_TOL, f"{case}: relative L2 {err:.3g}"
    assert np.isfinite(want).all() and 0.05 < want.std() < 5


def test_the_inputs_reach_the_result(folders):
    """The oracle cases above would pass with inputs that change nothing: they do change it."""
    def loop(name, **fields):
        return model_loop(model_of(folders[name]), params(**{"prompt": "a red circle", "steps": 3, "seed": 1,
                                                              "height": 16, "width": 16, **fields}))

    def differs(a, b):
        return np.abs(a - b).max() > 1e-3

    assert differs(loop("sdxl", guidance=5.0), loop("sdxl", guidance=5.0, negative_prompt=""))
    assert differs(loop("sdxl", guidance=5.0), loop("sdxl", guidance=5.0, crops_coords_top_left=(8, 8)))
    assert differs(loop("flux-dev", guidance=2.0), loop("flux-dev", guidance=5.0))
    assert not differs(loop("flux-schnell", guidance=2.0), loop("flux-schnell", guidance=5.0))
    assert differs(loop("flux-dev", negative_prompt="blurry"), loop("flux-dev", negative_prompt="blurry", true_cfg=3.0))
    assert differs(loop("flux-dev"), loop("flux-dev", prompt="a big blue cat"))


# --- the engine ---------------------------------------------------------------------

def run_core(core, requests: dict[str, GenerateParams]) -> dict:
    """The requests run to the end through the suite's core driver: {id: final latents}."""
    from core_driver import run_to_end

    return run_to_end(core, requests).results


ALONE_CASES = ["sdxl-default-zeros", "sdxl-micro-ancestral", "sdxl-one-row", "flux-dev-embedded",
               "flux-dev-true-cfg", "flux-schnell"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ALONE_CASES)
def test_request_alone_equals_the_pipeline(folders, case):
    from engine.core import CoreConfig, EngineCore

    name, p = LOOP_CASES[case]
    model = model_of(folders[name])
    core = EngineCore(model, CoreConfig(slots=2))
    got = run_core(core, {"r": p})["r"]
    want = pipeline_output_of(folders[name], p)
    assert got.shape == want.shape
    err = rel_l2(got, want)
    print(f"alone {case}: relative L2 {err:.2e}")
    assert err <= ALONE_TOL, f"{case}: relative L2 {err:.3g}"
    rows = 1 if model.cfg_scale(p) is None else 2
    assert core.stats()["useful_evals"] == p.steps * rows


def _mixed_requests(name: str, rng: random.Random, count: int) -> dict[str, GenerateParams]:
    sizes = [(16, 16), (16, 24), (24, 16)] if name == "sdxl" else [(16, 16), (16, 32), (32, 16)]
    samplers = (["default", "euler", "euler_ancestral", "ddim", "dpmpp_2m"] if name == "sdxl"
                else ["default", "flow_euler"])
    cases = {}
    for k in range(count):
        height, width = rng.choice(sizes)
        fields = dict(prompt=rng.choice(PROMPTS), steps=rng.choice([3, 4, 6]), sampler=samplers[k % len(samplers)],
                      seed=rng.randrange(10_000), height=height, width=width,
                      negative_prompt=rng.choice([None, "", "blurry", "ugly photo"]))
        if name == "sdxl":
            fields.update(guidance=rng.choice([1.0, 3.0, 7.0]))
            if rng.random() < 0.5:
                fields.update(original_size=rng.choice([(64, 64), (32, 48)]), crops_coords_top_left=(0, 4 * k))
        else:  # embedded guidance (ignored by schnell) and true CFG mixed in the same calls
            fields.update(guidance=rng.choice([1.0, 3.5, 5.0]), true_cfg=rng.choice([1.0, 1.0, 2.5, 4.0]))
        cases[f"r{k}"] = params(**fields)
    return cases


@pytest.mark.timeout(300)
def test_half_precision_flux_follows_its_embedded_guidance(folders):
    """bf16 FLUX-dev at two guidance values: each result near the fp32 pipeline's at its own
    guidance (a bound well under the ~0.04 that separates the two), and the change from one
    guidance to the other the pipeline's change: an embedded guidance forced to any
    constant makes no change at all and fails (the 0 < err < 0.05 above let it pass)."""
    from engine.core import CoreConfig, EngineCore

    model = load_model(folders["flux-dev"], dtype="bfloat16")
    got, want = {}, {}
    for guidance in (1.0, 4.0):
        p = params(prompt="a red circle", negative_prompt="blurry", steps=4, guidance=guidance, seed=3, height=16,
                   width=16, true_cfg=3.0)
        got[guidance] = run_core(EngineCore(model, CoreConfig(slots=2)), {"r": p})["r"]
        want[guidance] = pipeline_output_of(folders["flux-dev"], p)
        err = rel_l2(got[guidance], want[guidance])
        print(f"flux-dev bf16 at guidance {guidance:g}: relative L2 {err:.2e}")
        assert err <= 0.015, (guidance, err)
    change = rel_l2(got[1.0] - got[4.0], want[1.0] - want[4.0])
    print(f"flux-dev bf16: the guidance's effect off the pipeline's by {change:.2e}")
    assert change <= 0.4, change


def _per_row_inputs(name: str, p: GenerateParams) -> tuple:
    """What the shared calls must mix: for SDXL the time ids and whether the negative branch
    is zeros; for FLUX the embedded guidance and whether the request runs true CFG."""
    if name == "sdxl":
        return (p.original_size, p.crops_coords_top_left, p.height, p.width, p.negative_prompt is None)
    return (p.guidance, p.true_cfg > 1 and p.negative_prompt is not None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["sdxl", "flux-dev", "flux-schnell"])
def test_shared_calls_with_late_joins_and_cancels_equal_the_pipeline(folders, name):
    from core_driver import run_to_end
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders[name])
    rng = random.Random(name)
    cases = _mixed_requests(name, rng, 9)
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    pending = list(cases.items())
    victims = [f"v{k}" for k in range(2)]
    for k, vid in enumerate(victims):  # long requests canceled mid-way: their slots are reused
        extra = {} if name == "sdxl" else {"true_cfg": 3.0 * k}
        pending.insert(1 + 3 * k, (vid, params(prompt=PROMPTS[k], negative_prompt="blurry", steps=12, guidance=4.0,
                                               seed=k, height=16, width=16, **extra)))
    seen = {"shared": 0, "mixed_steps": 0, "mixed_inputs": 0, "before": {}}

    def join_and_cancel(d):
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            request = core.requests.get(vid)
            if request is not None and request.step >= 2 and vid not in d.canceled:
                core.abort_requests([vid])
        seen["before"] = {rid: r.step for rid, r in core.requests.items()}

    def count_shared(d, outputs):
        # the requests this call advanced: did they share it, at different steps, with
        # different per-row inputs?
        before = seen["before"]
        advanced = [rid for rid, step in before.items() if rid in core.requests and core.requests[rid].step > step]
        if len(advanced) > 1:
            seen["shared"] += 1
            seen["mixed_steps"] += len({before[rid] for rid in advanced}) > 1
            every = {**cases, **{rid: core.requests[rid].params for rid in advanced}}
            seen["mixed_inputs"] += len({_per_row_inputs(name, every[rid]) for rid in advanced}) > 1

    d = run_to_end(core, before_step=join_and_cancel, after_step=count_shared, waiting=lambda: bool(pending),
                   limit=2000)
    results, canceled = d.results, set(d.canceled)
    shared, mixed_steps, mixed_inputs = seen["shared"], seen["mixed_steps"], seen["mixed_inputs"]
    assert canceled == set(victims) and set(results) == set(cases)
    assert shared > 3 and mixed_steps > 0 and mixed_inputs > 0, (shared, mixed_steps, mixed_inputs)
    worst = 0.0
    for rid, p in cases.items():
        err = rel_l2(results[rid], pipeline_output_of(folders[name], p))
        worst = max(worst, err)
        assert err <= SHARED_TOL, f"{rid} {p}: relative L2 {err:.3g}"
    print(f"shared {name}: worst relative L2 {worst:.2e} over {len(cases)} requests, {shared} shared calls, "
          f"{mixed_steps} at mixed steps, {mixed_inputs} with mixed per-row inputs")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sdxl", "flux-dev"])
def test_different_per_row_inputs_share_one_call(folders, name):
    """Requests of one size that differ only in per-row inputs run in one call: SDXL's time
    ids, guidance and zero negative rows; FLUX-dev's embedded guidance and true CFG (R2)."""
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders[name])
    if name == "sdxl":
        requests = [params(prompt="a red circle", guidance=5.0, seed=1, height=16, width=16),
                    params(prompt="a red circle", negative_prompt="", guidance=2.0, seed=2, height=16, width=16,
                           original_size=(64, 64), crops_coords_top_left=(8, 0)),
                    params(prompt="a big blue cat", guidance=1.0, seed=3, height=16, width=16, target_size=(8, 8))]
    else:
        requests = [params(prompt="a red circle", guidance=g, seed=k, height=16, width=16, steps=3)
                    for k, g in enumerate((1.0, 3.5, 6.0))]
        requests.append(params(prompt="a red circle", negative_prompt="ugly", true_cfg=4.0, guidance=2.0, seed=7,
                               height=16, width=16, steps=3))
    core = EngineCore(model, CoreConfig(slots=len(requests)))
    for k, p in enumerate(requests):
        core.add_request(f"r{k}", p)
    core.step()
    rows = sum(1 if model.cfg_scale(p) is None else 2 for p in requests)
    assert len(core.groups) == 1 and core.stats()["useful_evals"] == rows, "not one call"
    results = run_core(core, {})
    for k, p in enumerate(requests):
        err = rel_l2(results[f"r{k}"], pipeline_output_of(folders[name], p))
        assert err <= SHARED_TOL, (k, err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sdxl", "flux-dev"])
def test_uint8_output_equals_the_pipelines_np_image(folders, name):
    from engine.core import CoreConfig, EngineCore
    from engine.decode.stage import postprocess

    model = model_of(folders[name])
    p = params(prompt="a red circle", negative_prompt="blurry", steps=4, guidance=4.0, seed=11, height=16, width=16)
    latents = run_core(EngineCore(model, CoreConfig(slots=2)), {"r": p})["r"]
    image, shape, dtype = postprocess(model, torch.from_numpy(latents), "uint8")
    want = pipeline_output_of(folders[name], p, output_type="np")
    assert dtype == "uint8" and image.shape == want.shape == (16, 16, 3)
    diff = np.abs(image.astype(np.int64) - np.round(want * 255).astype(np.int64))
    print(f"{name} uint8 vs the pipeline's np image: max difference {diff.max()} levels")
    assert diff.max() <= 1, f"max difference {diff.max()} levels"
    assert image.std() > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sdxl", "flux-dev"])
def test_half_precision_weights_keep_float32_latents(folders, name):
    """`--dtype bfloat16`: weights in bf16, the engine's latents and solver state in fp32;
    the result stays near the fp32 pipeline's, as for SD and SD3."""
    from engine.core import CoreConfig, EngineCore

    model = load_model(folders[name], dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.conditioning_layout[2] == "torch.bfloat16"
    extra = {"true_cfg": 3.0} if name == "flux-dev" else {}
    p = params(prompt="a red circle", negative_prompt="blurry", steps=4, guidance=3.0, seed=3, height=16, width=16,
               **extra)
    got = run_core(EngineCore(model, CoreConfig(slots=2)), {"r": p})["r"]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    err = rel_l2(got, pipeline_output_of(folders[name], p))
    print(f"{name} bf16 weights vs fp32 pipeline: relative L2 {err:.2e}")
    assert 0 < err < 0.05, err


def test_request_inputs_are_host_tensors_whatever_the_device(folders):
    """Per-request inputs are made at intake on the busy loop: built on the host (the slot
    storage stages them), never copied to the model's device there, where a copy waits for
    every queued step. A device this machine lacks shows any such copy: it would raise."""
    for name in ("sdxl", "flux-dev"):
        model = model_of(folders[name])
        model.device = torch.device("cuda", 7)
        try:
            inputs = model.request_inputs(params(prompt="a red circle", guidance=3.5), 16, 16)
        finally:
            model.device = torch.device("cpu")
        assert inputs and all(t.device.type == "cpu" for t in inputs.values()), name
