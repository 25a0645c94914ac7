"""The decode stage on the busy loop's thread: batched VAE calls give each request the
image a decode of its own latents gives (within one level), mixed shapes and kinds in
one queue, cancels dropped, a failing decode fails only the requests of that call."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.decode.inline import InlineDecodeStage
from engine.decode.stage import CANCELED, postprocess
from engine.models.loading import load_model
from engine.protocol import GenerateParams, Timings

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model():
    return load_model("shapes")


def test_batched_decodes_equal_one_decode_each_and_keep_their_order(model):
    stage = InlineDecodeStage(model, max_batch=3)
    g = torch.Generator().manual_seed(4)
    jobs = []
    for k in range(7):  # two shapes interleaved, three kinds
        side = 8 if k % 2 == 0 else 12
        latents = torch.randn(4, side, side, generator=g)
        kind = ("png", "uint8", "latent")[k % 3]
        jobs.append((f"r{k}", latents, GenerateParams(prompt="x", output=kind)))
        stage.submit(f"r{k}", latents, jobs[-1][2], Timings())
    stage.cancel("r5")
    out = {o.request_id: o for o in stage.poll()}
    assert set(out) == {f"r{k}" for k in range(7)} and out["r5"].error == CANCELED and out["r5"].payload is None
    for rid, latents, params in jobs:
        if rid == "r5":
            continue
        want, shape, dtype = postprocess(model, latents, params.output)
        got = out[rid]
        assert got.error is None and got.shape == tuple(shape) and got.dtype == dtype
        if params.output == "png":
            got_image = np.asarray(Image.open(io.BytesIO(got.payload)))
            want_image = np.asarray(Image.open(io.BytesIO(want)))
        else:
            got_image, want_image = np.asarray(got.payload), np.asarray(want)
        assert np.abs(got_image.astype(np.int64) - want_image.astype(np.int64)).max() <= 1, rid
    assert stage.batches >= 2 and stage.stats()["decode_dropped"] == 1


def test_a_failing_decode_fails_its_call_and_the_stage_goes_on(model):
    stage = InlineDecodeStage(model)
    stage.submit("bad", torch.randn(3, 8, 8), GenerateParams(prompt="x", output="png"), Timings())  # wrong channels
    (bad,) = stage.poll()
    assert bad.error is not None and "decode failed" in bad.error
    stage.submit("ok", torch.randn(4, 8, 8), GenerateParams(prompt="x", output="uint8"), Timings())
    (ok,) = stage.poll()
    assert ok.error is None and ok.shape == (32, 32, 3)
