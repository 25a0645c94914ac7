"""Partial images (R16's `partial_images`): decoded previews of the clean-image estimate x0
at evenly spaced steps, decoded in the decode stage off the busy loop, all delivered before
the completed image; none for a canceled request; their decode cost counted."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.core import CoreConfig, EngineCore
from engine.protocol import GenerateParams
from engine.testing.tiny_pipelines import build_sd
from frontend import Client, Completed
from core_driver import run_to_end
from proc_helpers import fake_engine, real_engine


@pytest.mark.timeout(120)
def test_core_publishes_x0_estimates_at_evenly_spaced_steps(tmp_path):
    from engine.models.loading import load_model

    torch.set_num_threads(1)
    model = load_model(build_sd(tmp_path / "sd", scheduler="ddim"))
    core = EngineCore(model, CoreConfig(slots=2))
    core.add_request("r", GenerateParams(prompt="a red circle", steps=8, sampler="dpmpp_2m", guidance=3.0,
                                         output="latent"), partial_images=3)
    core.add_request("quiet", GenerateParams(prompt="a blue cat", steps=8, output="latent"))
    d = run_to_end(core, keep="torch")
    previews, final = d.previews, d.results["r"]
    assert [p.request_id for p in previews] == ["r"] * 3
    assert [p.step for p in previews] == [2, 4, 6] and [p.index for p in previews] == [0, 1, 2]
    # x0 estimates approach the final latents (the last one closest), and are not the noisy latents
    errs = [float((p.latents - final).norm() / final.norm()) for p in previews]
    assert errs[-1] < errs[0] and errs[-1] < 0.5, errs


@pytest.mark.timeout(120)
def test_previews_leave_by_fence_gated_copies_on_the_cuda_path(tmp_path):
    """The CUDA path (run on CPU tensors with deferred fences): a preview is copied to the
    host behind its step's fence, so nothing drains the stream, and published only after
    that fence; its values equal the synchronous path's."""
    from engine.core.fences import DeferredFences
    from engine.models.loading import load_model

    torch.set_num_threads(1)
    model = load_model(build_sd(tmp_path / "sd", scheduler="ddim"))
    params = GenerateParams(prompt="a red circle", steps=6, sampler="dpmpp_2m", guidance=3.0, output="latent")
    runs = {}
    for async_path in (False, True):
        fences = DeferredFences()
        core = EngineCore(model, CoreConfig(slots=1), fences=fences)
        core.async_copies = async_path
        copies = []
        copy_to_host = core.runner.copy_to_host
        core.runner.copy_to_host = lambda tensor: copies.append(tensor.shape) or copy_to_host(tensor)
        core.add_request("r", params, partial_images=2)
        d = run_to_end(core, after_step=lambda d, outputs: fences.release_all())
        runs[async_path] = d.previews, len(copies)
    (sync, sync_copies), (copied, async_copies) = runs[False], runs[True]
    assert sync_copies == 0 and async_copies == 3  # two previews and the final latents
    assert [p.step for p in sync] == [p.step for p in copied] == [2, 4]
    for a, b in zip(sync, copied):
        assert torch.equal(a.latents, b.latents)


@pytest.mark.timeout(60)
def test_partial_images_arrive_before_completed_over_the_wire():
    with fake_engine("--step-delay", "0.01") as engine, Client(engine.address) as client:
        handle = client.submit(GenerateParams(prompt="a red circle", steps=12), partial_images=2)
        seen = []
        handle.on_partial_image(lambda p: seen.append(("partial", p.index)))
        handle.add_done_callback(lambda h: seen.append(("done", None)))
        partials = list(handle.partial_images(timeout=30))
        result = handle.result(timeout=30)
        assert isinstance(result, Completed)
        assert [(p.index, p.step, p.total) for p in partials] == [(0, 4, 12), (1, 8, 12)]
        for p in partials:
            image = np.asarray(Image.open(io.BytesIO(p.image)))
            assert image.shape == (32, 32, 3)
        assert seen == [("partial", 0), ("partial", 1), ("done", None)]
        assert client.stats()["preview_decodes"] == 2
        bad = client.submit(GenerateParams(prompt="a red circle", steps=2), partial_images=4).result(timeout=30)
        assert bad.field == "partial_images"


@pytest.mark.timeout(300)
def test_real_engine_previews_decode_in_worker_processes(tmp_path):
    folder = build_sd(tmp_path / "sd", scheduler="pndm")  # the generic scheduler path, and decode workers
    with real_engine("--model", str(folder), "--decode-workers", "1", "--slots", "2") as engine, \
            Client(engine.address) as client:
        handle = client.submit(GenerateParams(prompt="a red circle", steps=6, guidance=3.0), partial_images=1)
        other = client.submit(GenerateParams(prompt="a green dog", steps=6), partial_images=0)
        partials = list(handle.partial_images(timeout=120))
        assert len(partials) == 1 and partials[0].step == 4  # PNDM runs 7 evaluations for 6 steps
        assert Image.open(io.BytesIO(partials[0].image)).size == (16, 16)
        assert isinstance(handle.result(timeout=120), Completed)
        assert isinstance(other.result(timeout=120), Completed)
        assert list(other.partial_images(timeout=1)) == []
        stats = client.stats()
        assert stats["preview_decodes"] == 1 and stats["preview_decode_s"] > 0
