"""The shipped silhouette ControlNet of the `shapes` model (engine/models/shapes/controlnet,
trained by `engine.models.shapes.train_controlnet`, measured by `bench/shapes_controlnet.py`): served beside `shapes`, a request's
silhouette makes the model draw the prompt's shape there, in the prompt's colour, as the
`shapes` classifier reads it; without the control (scale 0) the drawn shapes do not
overlap the silhouettes."""
from __future__ import annotations

import pytest
import torch

from bench.shapes_controlnet import evaluate
from engine.models.shapes.train_controlnet import DEFAULT_OUT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(300)
def test_the_silhouette_controlnet_draws_the_shape_there_in_the_prompts_colour():
    with torch.no_grad():
        controlled = evaluate(DEFAULT_OUT, seeds=8, steps=10)
        alone = evaluate(DEFAULT_OUT, seeds=8, steps=10, scale=0.0)
    print(f"silhouette ControlNet: {controlled}; without it: {alone}")
    assert controlled["colour_right"] == 1.0
    assert controlled["iou_mean"] >= 0.7
    assert alone["iou_mean"] < 0.5  # the overlap is the control's doing
