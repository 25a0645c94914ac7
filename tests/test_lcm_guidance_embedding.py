"""UNets with a guidance embedding (`time_cond_proj_dim`, LCM-distilled): the pipeline runs
one row a step and feeds `timestep_cond`, an embedding of `guidance − 1`, to the UNet; the
engine passes it per row as a request input, so requests with different guidance share a
call and each equals the pipeline."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core import CoreConfig, EngineCore
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.pipeline_oracle import pipeline_output
from engine.testing.tiny_pipelines import build_sd

from core_driver import run_to_end

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import UNet2DConditionModel

    path = build_sd(tmp_path_factory.mktemp("lcm") / "sd", scheduler="ddim", seed=4)
    config = dict(UNet2DConditionModel.load_config(path / "unet"), time_cond_proj_dim=16)
    torch.manual_seed(21)
    UNet2DConditionModel.from_config(config).save_pretrained(path / "unet")
    return path


def test_requests_with_different_guidance_share_a_call_and_equal_the_pipeline(folder):
    model = load_model(folder)
    core = EngineCore(model, CoreConfig(slots=3))
    params = {f"g{g}": GenerateParams(prompt="a red circle", steps=4, sampler="ddim", guidance=g, seed=3,
                                      output="latent") for g in (1.0, 4.0, 8.5)}
    conds = []
    real_run = model.run

    def spying(inputs):
        conds.append(inputs.timestep_cond)
        return real_run(inputs)

    model.run = spying
    done = run_to_end(core, params).results
    del model.run
    first = conds[0]
    assert first is not None and first.shape[0] == 3 and not torch.equal(first[0], first[2])  # one row each
    for rid, p in params.items():
        want = pipeline_output(folder, "ddim", p.prompt, p.steps, p.guidance, p.seed)
        err = float(np.linalg.norm(done[rid].astype(np.float64) - want) / np.linalg.norm(want))
        assert err <= 1e-4, (rid, err)
    # the guidance changes the result through the embedding alone
    assert float(np.abs(done["g1.0"] - done["g8.5"]).max()) > 1e-3
