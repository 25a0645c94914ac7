"""Text-to-image pipeline folders (SD, SD3) against diffusers' own pipeline call (DESIGN.md,
"Reference semantics"; R13, R14): a request alone, requests sharing batches with late joins and
cancellations, uint8 output, the encode phase and its cache, conditioning references."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core import CoreConfig, EngineCore, RequestCanceled, RequestRejected
from engine.core.fences import DeferredFences
from engine.decode.stage import postprocess
from engine.models.stable_diffusion import StableDiffusion3Model, StableDiffusionModel
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.pipeline_oracle import model_of, pipeline_output, rel_l2
from engine.testing.tiny_pipelines import build_sd, build_sd3

from core_driver import run_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PROMPTS = ["a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross", ""]
NEGATIVES = ["", "blurry", "ugly photo"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {
        "sd-ddim": build_sd(root / "sd-ddim", scheduler="ddim", seed=1),
        "sd-pndm": build_sd(root / "sd-pndm", scheduler="pndm", seed=2),  # SD 1.5's default: the generic path
        "sd-v": build_sd(root / "sd-v", scheduler="euler", prediction_type="v_prediction", seed=3),
        "sd3": build_sd3(root / "sd3", seed=4),
        "sd3-no-t5": build_sd3(root / "sd3-no-t5", with_t5=False, seed=5),
    }




SAMPLERS_OF = {
    "sd-ddim": ["default", "euler", "euler_ancestral", "ddim", "dpmpp_2m"],
    "sd-pndm": ["default", "dpmpp_2m"],
    "sd-v": ["default", "euler_ancestral", "ddim", "dpmpp_2m"],
    "sd3": ["default", "flow_euler", "dpmpp_2m"],
    "sd3-no-t5": ["default", "flow_euler"],
}
ALONE = [(name, sampler) for name, samplers in SAMPLERS_OF.items() for sampler in samplers]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, sampler", ALONE, ids=[f"{n}-{s}" for n, s in ALONE])
def test_request_alone_equals_the_pipeline(folders, name, sampler):
    folder = folders[name]
    model = model_of(folder)
    rng = random.Random(f"{name}-{sampler}")
    for guidance, negative in ((rng.choice([3.0, 7.5]), rng.choice(NEGATIVES)), (1.0, "")):
        prompt, seed, steps = rng.choice(PROMPTS[:4]), rng.randrange(10_000), rng.choice([4, 7])
        core = EngineCore(model, CoreConfig(slots=2))
        got = run_to_end(core, {"r": GenerateParams(prompt=prompt, negative_prompt=negative, steps=steps,
                                                    sampler=sampler, guidance=guidance, seed=seed,
                                                    output="latent")}).results["r"]
        want = pipeline_output(folder, sampler, prompt, steps, guidance, seed, negative_prompt=negative)
        assert got.shape == want.shape
        err = rel_l2(got, want)
        print(f"alone {name} {sampler} g={guidance}: relative L2 {err:.2e}")
        assert err <= ALONE_TOL, f"{name} {sampler} g={guidance}: relative L2 {err:.3g}"
        # guidance 1: one row a step, as the pipeline runs it (PNDM's schedule has one step more)
        evaluations = steps + (name == "sd-pndm" and sampler == "default")
        assert core.stats()["useful_evals"] == evaluations * (2 if guidance > 1 else 1)


@pytest.mark.timeout(300)
def test_pndm_at_guidance_1_under_graphs_equals_the_pipeline(folders):
    """SD 1.5's own PNDM keeps the model outputs it is given (`ets`) and the sample it
    started from; under a graph every replay rewrites one output buffer, so a kept view
    would silently turn into the next step's output. At guidance 1 the single row goes to
    the scheduler unguided — the case where nothing else makes a copy. `EagerCapture`
    has the graph's contract: one static output buffer, rewritten by every replay."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser

    folder = folders["sd-pndm"]
    model = model_of(folder)
    rng = random.Random()
    cases = {f"r{k}": GenerateParams(prompt=rng.choice(PROMPTS[:4]), steps=rng.choice([5, 7]), guidance=1.0,
                                     seed=rng.randrange(10_000), output="latent") for k in range(3)}
    core = EngineCore(model, CoreConfig(slots=2, layout="bucketed", max_queue=8))
    capture = EagerCapture()
    core.graphed = GraphedDenoiser(model, capture)
    results = run_to_end(core, cases).results
    assert capture.captures >= 1 and core.graphed.replays == core.batches  # every call went through a graph
    for rid, p in cases.items():
        want = pipeline_output(folder, "default", p.prompt, p.steps, 1.0, p.seed)
        err = rel_l2(results[rid], want)
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["sd-ddim", "sd-pndm", "sd3"])
def test_shared_batches_with_late_joins_and_cancels_equal_the_pipeline(folders, name):
    folder = folders[name]
    model = model_of(folder)
    rng = random.Random(name)
    samplers = SAMPLERS_OF[name]
    cases = {}
    for k in range(10):
        cases[f"r{k}"] = GenerateParams(
            prompt=rng.choice(PROMPTS), negative_prompt=rng.choice(NEGATIVES), steps=rng.choice([3, 5, 8]),
            sampler=samplers[k % len(samplers)], guidance=rng.choice([1.0, 2.5, 7.0]), seed=rng.randrange(10_000),
            output="latent")
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    pending = list(cases.items())
    victims = [f"v{k}" for k in range(3)]
    for k, vid in enumerate(victims):  # long requests canceled mid-way: their slots are reused
        pending.insert(2 + 3 * k, (vid, GenerateParams(prompt=PROMPTS[k], steps=20, sampler=samplers[k % len(samplers)],
                                                       guidance=5.0, seed=k, output="latent")))
    seen = {"shared": 0, "steps": 0}

    def join_cancel_and_count(d):
        for _ in range(rng.choice((0, 1, 1, 2))):  # late joins
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            request = core.requests.get(vid)
            if request is not None and request.step >= 3 and not request.stopping:
                core.abort_requests([vid])
        running = [r for g in core.groups.values() for r in g.requests if r is not None and g.runnable[r.slot]]
        seen["steps"] = max(seen["steps"], len({r.step for r in running}))
        seen["shared"] += len(running) > 1

    d = run_to_end(core, before_step=join_cancel_and_count, waiting=lambda: bool(pending), limit=2000)
    results, canceled, shared, steps_seen = d.results, set(d.canceled), seen["shared"], seen["steps"]
    assert canceled == set(victims) and set(results) == set(cases)
    assert shared > 10 and steps_seen >= 3, "requests did not really share batches at different steps"
    for rid, p in cases.items():
        want = pipeline_output(folder, p.sampler, p.prompt, p.steps, p.guidance, p.seed,
                               negative_prompt=p.negative_prompt)
        err = rel_l2(results[rid], want)
        print(f"shared {name} {rid} {p.sampler} g={p.guidance}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid} {p}: relative L2 {err:.3g}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sd-ddim", "sd3"])
def test_uint8_output_equals_the_pipelines_np_image(folders, name):
    folder = folders[name]
    model = model_of(folder)
    p = GenerateParams(prompt="a red circle", steps=5, sampler="default", guidance=4.0, seed=11, output="uint8")
    latents = run_to_end(EngineCore(model, CoreConfig(slots=2)), {"r": p}).results["r"]
    image, shape, dtype = postprocess(model, torch.from_numpy(latents), "uint8")
    want = pipeline_output(folder, "default", p.prompt, p.steps, p.guidance, p.seed, output_type="np")
    assert dtype == "uint8" and image.shape == want.shape
    diff = np.abs(image.astype(np.int64) - np.round(want * 255).astype(np.int64))
    assert diff.max() <= 1, f"max difference {diff.max()} levels"
    assert image.std() > 0  # a real image, not a constant


def test_pipeline_classes_and_conditioning_layouts(folders):
    sd, sd3, sd3_no_t5 = (model_of(folders[k]) for k in ("sd-ddim", "sd3", "sd3-no-t5"))
    assert isinstance(sd, StableDiffusionModel) and isinstance(sd3, StableDiffusion3Model)
    hidden, pooled, _ = sd.conditioning_layout
    assert pooled is None and hidden == (16, 32)  # the tokenizer's 16 tokens × the CLIP width
    hidden3, pooled3, _ = sd3.conditioning_layout
    assert pooled3 == (80,) and hidden3[1] == 128
    assert sd3_no_t5.conditioning_layout[0][1] == 128
    assert sd.conditioning_nbytes == 16 * 32 * 4


def test_encode_phase_batches_caches_and_times(folders):
    model = model_of(folders["sd-ddim"])
    calls = []
    original = model.encode

    def counting(prompts):
        calls.append(list(prompts))
        return original(prompts)

    model.encode = counting
    try:
        core = EngineCore(model, CoreConfig(slots=4, max_queue=16, embedding_cache_entries=3))
        params = [GenerateParams(prompt=PROMPTS[k % 2], negative_prompt="blurry", steps=2, guidance=3.0, seed=k,
                                 output="latent") for k in range(4)]
        run_to_end(core, {f"r{k}": p for k, p in enumerate(params)})
        # one batched pass for the four admitted together: the two prompts and the negative, once each
        assert len(calls) == 1 and sorted(calls[0]) == sorted([PROMPTS[0], PROMPTS[1], "blurry"])
        stats = core.stats()
        assert stats["embedding_cache_hits"] == 8 - 3 and stats["embedding_cache_misses"] == 3
        run_to_end(core, {"again": params[0]})
        assert len(calls) == 1 and core.stats()["embedding_cache_hits"] == 5 + 2
        run_to_end(core, {"new": GenerateParams(prompt=PROMPTS[2], steps=2, guidance=1.0, output="latent")})
        assert calls[-1] == [PROMPTS[2]] and core.stats()["embedding_cache_entries"] == 3  # bounded: LRU out
    finally:
        del model.encode


def test_slot_holds_its_rows_until_the_fence(folders):
    model = model_of(folders["sd-ddim"])
    fences = DeferredFences()
    core = EngineCore(model, CoreConfig(slots=2), fences=fences)
    core.add_request("r", GenerateParams(prompt="a red circle", negative_prompt="ugly", steps=3, guidance=3.0,
                                         output="latent"))
    core.step()
    group = next(iter(core.groups.values()))
    slot = core.requests["r"].slot
    storage = core.storage[group.key]
    positive, negative = storage.conditioning[slot]
    assert positive.hidden.shape == (16, 32) and negative is not None
    core.abort_requests(["r"])
    core.step()
    assert storage.conditioning[slot, 0] is not None, "rows released while a launch may still read them"
    fences.release_all()
    outputs = core.step() + core.step()  # the storage learns of the release with the next plan
    assert any(isinstance(o, RequestCanceled) for o in outputs)
    assert storage.conditioning[slot, 0] is None and group.epoch[slot] == 1


def test_admission_counts_embedding_bytes(folders):
    model = model_of(folders["sd-ddim"])
    core = EngineCore(model, CoreConfig(slots=4))
    core.add_request("g", GenerateParams(prompt="a red circle", steps=2, guidance=3.0, output="latent"))
    core.add_request("one", GenerateParams(prompt="a red circle", steps=2, guidance=1.0, output="latent"))
    guided, single = core.requests["g"].reservation, core.requests["one"].reservation
    assert guided.trajectory_bytes - single.trajectory_bytes == model.conditioning_nbytes


@pytest.mark.parametrize("field, value", [("prompt", 7), ("prompt", "x" * 5000), ("negative_prompt", 7),
                                          ("prompt", "nul\x00byte")])
def test_bad_prompts_are_rejected_naming_the_field(folders, field, value):
    core = EngineCore(model_of(folders["sd-ddim"]), CoreConfig(slots=2))
    params = GenerateParams(prompt="a red circle", steps=2)
    import msgspec

    bad = msgspec.structs.replace(params, **{field: value})
    with pytest.raises(RequestRejected) as info:
        core.add_request("r", bad)
    assert info.value.field == field
    core.add_request("ok", params)  # nothing else lost
    assert run_to_end(core).results["ok"].shape == (4, 8, 8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sd-ddim", "sd3"])
def test_half_precision_weights_keep_float32_latents(folders, name):
    """`--dtype bfloat16`: the weights (denoiser, encoders, VAE) in bf16, the engine's latents
    and solver state in fp32; the result stays near the fp32 pipeline's (bf16 keeps 8 bits
    of mantissa, so not within the fp32 tolerance), and a bad dtype names the field."""
    folder = folders[name]
    model = load_model(folder, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.denoiser.parameters()} >= {torch.bfloat16}
    assert model.conditioning_layout[2] == "torch.bfloat16" and model.vae.dtype == torch.bfloat16
    params = GenerateParams(prompt="a red circle", negative_prompt="blurry", steps=5, sampler="dpmpp_2m",
                            guidance=3.0, seed=3, output="latent")
    got = run_to_end(EngineCore(model, CoreConfig(slots=2)), {"r": params}).results["r"]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    want = pipeline_output(folder, "dpmpp_2m", "a red circle", 5, 3.0, 3, negative_prompt="blurry")
    err = rel_l2(got, want)
    print(f"{name} bf16 weights vs fp32 pipeline: relative L2 {err:.2e}")
    assert 0 < err < 0.05, err
    image, shape, dtype = postprocess(model, torch.from_numpy(got), "uint8")  # the bf16 VAE decodes it
    assert dtype == "uint8" and image.shape == shape and shape[2] == 3
    with pytest.raises(ValueError, match="dtype"):
        load_model(folder, dtype="float8")


@pytest.mark.timeout(300)
def test_the_oracle_builds_its_schedulers_itself(folders, monkeypatch):
    """A break in the engine's scheduler construction (here: the timestep spacing flipped)
    must show against the oracle; before, the oracle swapped schedulers with the engine's
    own `make_scheduler`, so the engine and the oracle broke together and agreed."""
    from engine.core import solvers
    from engine.testing import pipeline_oracle

    real = solvers.make_scheduler

    def broken(sampler, config):
        flipped = "leading" if config.get("timestep_spacing") == "trailing" else "trailing"
        return real(sampler, {**config, "timestep_spacing": flipped})

    monkeypatch.setattr(solvers, "make_scheduler", broken)
    monkeypatch.setattr(pipeline_oracle, "make_scheduler", broken, raising=False)
    folder = folders["sd-ddim"]
    for sampler in ("euler", "dpmpp_2m"):
        params = GenerateParams(prompt="a red circle", steps=5, sampler=sampler, guidance=3.0, seed=7,
                                output="latent")
        got = run_to_end(EngineCore(model_of(folder), CoreConfig(slots=2)), {"r": params}).results["r"]
        want = pipeline_output(folder, sampler, params.prompt, params.steps, params.guidance, params.seed)
        assert rel_l2(got, want) > 100 * ALONE_TOL, sampler
