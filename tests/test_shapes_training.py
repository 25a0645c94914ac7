"""The trainers of the embedded models still run and write a folder that loads: two steps
each (what they produce at full length is the shipped weights, whose accuracy
tests/test_shapes.py and tests/test_shapes_dit.py check), and the schedule and EMA they share."""
import json
import math

import pytest
import torch

from engine.models.shapes.training import lr_scale, update_ema


def test_the_schedule_warms_up_then_falls_to_zero():
    assert lr_scale(0, warmup=100, total=1000) == pytest.approx(0.01 * 0.5 * (1 + 1.0))
    assert lr_scale(99, warmup=100, total=1000) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.099)))
    assert lr_scale(1000, warmup=100, total=1000) == pytest.approx(0.0, abs=1e-12)


def test_the_average_follows_the_weights():
    average, weight = torch.zeros(3), torch.ones(3)
    update_ema([(average, weight)], step=0)  # decay 0.1: mostly the weight at first
    assert torch.allclose(average, torch.full((3,), 0.9))
    update_ema([(average, weight)], step=10_000)  # decay 0.999 later
    assert torch.allclose(average, torch.full((3,), 0.9 + 0.1 * 0.001))


@pytest.mark.timeout(300)
def test_the_dit_trainer_writes_a_folder_the_engine_serves_at_32(tmp_path):
    from diffusers import FluxPipeline

    from engine.models.geometry import geometry_of
    from engine.models.shapes.train_dit import main

    out = tmp_path / "dit"
    main(["--out", str(out), "--steps", "2", "--images", "16", "--batch", "4", "--checkpoint-every", "1"])
    assert json.loads((out / "model_index.json").read_text())["_native_size"] == 32
    assert geometry_of(out).native_size == 32
    assert isinstance(FluxPipeline.from_pretrained(out), FluxPipeline)


@pytest.mark.timeout(300)
def test_the_unet_trainer_writes_a_folder_that_loads(tmp_path):
    from diffusers import StableDiffusionPipeline

    from engine.models.shapes.train import main

    out = tmp_path / "sd"
    main(["--out", str(out), "--steps", "2", "--images", "16", "--batch", "4", "--checkpoint-every", "0",
          "--threads", "1"])
    assert isinstance(StableDiffusionPipeline.from_pretrained(out), StableDiffusionPipeline)
