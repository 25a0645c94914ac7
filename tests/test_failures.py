"""Failure isolation in the core (R15): a batch whose denoiser raises fails only the requests
that cause it, non-finite latents fail their request, device out-of-memory shrinks the step;
every other request still equals diffusers' pipeline."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core import CoreConfig, EngineCore
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.faults import FaultyModel, parse_spec
from engine.testing.pipeline_oracle import pipeline_output
from engine.testing.tiny_pipelines import build_sd

from core_driver import run_to_end

TOL = 1e-4  # shared batches (the denoiser is not batch-invariant)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.set_num_threads(1)
    return build_sd(tmp_path_factory.mktemp("sd") / "sd", scheduler="ddim", seed=9)


@pytest.fixture(scope="module")
def base_model(folder):
    return load_model(folder)


GOOD = {
    "a": GenerateParams(prompt="a red circle", steps=6, sampler="euler_ancestral", guidance=3.0, seed=1, output="latent"),
    "b": GenerateParams(prompt="a blue cat", steps=4, sampler="dpmpp_2m", guidance=1.0, seed=2, output="latent"),
    "c": GenerateParams(prompt="the small dog", negative_prompt="blurry", steps=5, sampler="default", guidance=5.0,
                        seed=3, output="latent"),
}


def drive(core: EngineCore, params: dict) -> tuple[dict, dict, dict]:
    """Add `params` and run to the end: (final latents, errors, cancels) by request id."""
    d = run_to_end(core, params, limit=500)
    return d.results, d.failed, d.canceled


def assert_equal_the_pipeline(folder, done: dict) -> None:
    for rid, latents in done.items():
        p = GOOD[rid]
        want = pipeline_output(folder, p.sampler, p.prompt, p.steps, p.guidance, p.seed, negative_prompt=p.negative_prompt)
        err = float(np.linalg.norm(latents - want) / np.linalg.norm(want))
        assert err <= TOL, f"{rid}: relative L2 {err:.3g}"


@pytest.mark.timeout(300)
def test_a_request_that_breaks_the_denoiser_fails_alone(folder, base_model):
    model = FaultyModel(base_model, raise_on="poison pill")
    core = EngineCore(model, CoreConfig(slots=4))
    bad = GenerateParams(prompt="poison pill", steps=6, guidance=3.0, seed=4, output="latent")
    done, failed, _ = drive(core, {**GOOD, "bad": bad})
    assert set(failed) == {"bad"} and "ValueError" in failed["bad"] and "injected fault" in failed["bad"]
    assert set(done) == set(GOOD)
    assert_equal_the_pipeline(folder, done)  # the others continued at the same step, same random streams
    stats = core.stats()
    assert stats["failed_requests"] == 1 and not core.requests and core.ledger.used.trajectory_bytes == 0
    assert all(r is None for g in core.groups.values() for r in g.requests)


@pytest.mark.timeout(300)
def test_non_finite_latents_fail_their_request(folder, base_model):
    model = FaultyModel(base_model, nan_on="a nan maker")
    core = EngineCore(model, CoreConfig(slots=4))
    bad = GenerateParams(prompt="a nan maker", steps=6, guidance=1.0, seed=5, output="latent")
    done, failed, _ = drive(core, {**GOOD, "bad": bad})
    assert failed == {"bad": "non-finite latents at step 1"}
    assert set(done) == set(GOOD)
    assert_equal_the_pipeline(folder, done)


@pytest.mark.timeout(300)
def test_out_of_memory_shrinks_the_step_instead_of_dying(folder, base_model):
    model = FaultyModel(base_model, oom_above_rows=3)
    core = EngineCore(model, CoreConfig(slots=4))
    done, failed, _ = drive(core, dict(GOOD))
    assert not failed and set(done) == set(GOOD)
    assert_equal_the_pipeline(folder, done)
    assert core.row_limit is not None and core.row_limit <= 3
    assert max(model.calls[-5:]) <= 3 and core.stats()["oom_splits"] >= 1
    assert core.scheduler.slot_cap() < 4  # and admission now fills fewer slots


@pytest.mark.timeout(300)
def test_a_prompt_the_encoder_cannot_take_fails_alone(folder, base_model):
    model = FaultyModel(base_model, encode_raise_on="an unreadable prompt")
    core = EngineCore(model, CoreConfig(slots=4))
    bad = GenerateParams(prompt="an unreadable prompt", steps=3, guidance=3.0, output="latent")
    done, failed, _ = drive(core, {**GOOD, "bad": bad})  # admitted in the same batch as the others
    assert set(failed) == {"bad"} and "text encoder raised UnicodeError" in failed["bad"]
    assert set(done) == set(GOOD)
    assert_equal_the_pipeline(folder, done)


def test_fault_spec_parsing():
    assert parse_spec("raise=a b,nan=c,oom=4") == {"raise_on": "a b", "nan_on": "c", "oom_above_rows": 4}
    with pytest.raises(ValueError):
        parse_spec("explode=1")
