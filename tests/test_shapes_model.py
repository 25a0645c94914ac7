"""The embedded `shapes` model is real: a plain diffusers `StableDiffusionPipeline` folder
(`engine/models/shapes/weights/`) whose samples are recognisably their prompt, with
diffusers alone and served by the engine, as read by a classifier that says "unknown" to
look-alikes."""
import json

import numpy as np
import pytest
import torch

from engine.models import SHAPES_DIR, resolve
from engine.models.shapes.classify import UNKNOWN, classify
from engine.models.shapes.draw import CONDITIONS, DISTRACTORS, PROMPTS, draw, draw_distractors
from engine.models.shapes.sample import load_pipeline, prompt_condition, sample

pytestmark = pytest.mark.timeout(600)


def test_classifier_reads_fresh_drawings():
    images, labels = draw(600, np.random.default_rng())
    readings = classify(images)
    accuracy = np.mean([r == CONDITIONS[label] for r, label in zip(readings, labels)])
    print(f"classifier accuracy on fresh drawings: {accuracy:.3f}")
    assert accuracy >= 0.99


def test_classifier_rejects_distractors():
    """Ellipses, diamonds and blobs are none of the four shapes: not a circle, not a cross."""
    images, kinds = draw_distractors(600, np.random.default_rng())
    readings = classify(images)
    for kind in DISTRACTORS:
        got = [r for r, k in zip(readings, kinds) if k == kind]
        rejected = np.mean([r == UNKNOWN for r in got])
        print(f"{kind}: {rejected:.3f} of {len(got)} read as unknown; "
              f"misread: {sorted({r for r in got if r != UNKNOWN})}")
        assert rejected >= 0.99, kind


def test_classifier_rejects_blank_and_swapped_colours():
    blank = np.full((1, 32, 32, 3), 128, dtype=np.uint8)
    assert classify(blank) == [UNKNOWN]
    images, labels = draw(50, np.random.default_rng(1))
    swapped = images[..., ::-1]  # red <-> blue: the classifier must notice
    accuracy = np.mean([r == CONDITIONS[label] for r, label in zip(classify(swapped), labels)])
    assert accuracy < 0.5


def test_served_engine_samples_are_their_prompt():
    """What `python -m engine serve` serves as `shapes`: the engine core on the folder, 4
    samples per prompt sharing batches (dpmpp_2m, 20 steps, guidance 3, fresh seeds),
    decoded by the engine's decode path; and one request equals the pipeline call."""
    from core_driver import run_to_end
    from engine.core import CoreConfig, EngineCore
    from engine.decode.stage import postprocess
    from engine.models.stable_diffusion import StableDiffusionModel
    from engine.models.loading import load_model
    from engine.protocol import GenerateParams
    from engine.testing.pipeline_oracle import pipeline_output

    torch.set_num_threads(2)
    model = load_model("shapes")
    assert isinstance(model, StableDiffusionModel)
    base = int(np.random.default_rng().integers(2**31 - 1000))
    params = {f"r{i}": GenerateParams(prompt=p, steps=20, sampler="dpmpp_2m", guidance=3.0, seed=base + i,
                                      output="uint8")
              for i, p in enumerate(p for p in PROMPTS for _ in range(4))}
    core = EngineCore(model, CoreConfig(slots=16, max_queue=len(params)))
    latents = run_to_end(core, params, keep="torch").results  # in the order they finished
    images = {rid: postprocess(model, x, "uint8")[0] for rid, x in latents.items()}
    readings = dict(zip(images, classify(np.stack(list(images.values())))))
    misses = [f"{params[r].prompt} -> {look}" for r, look in readings.items()
              if look != prompt_condition(params[r].prompt)]
    accuracy = 1 - len(misses) / len(params)
    print(f"served shapes model: {accuracy:.3f} of {len(params)} samples read as their prompt (seeds from {base}); "
          f"missed: {misses}")
    assert accuracy >= 0.9, misses
    want = pipeline_output(SHAPES_DIR, "dpmpp_2m", params["r0"].prompt, 20, 3.0, base)
    err = float(np.linalg.norm(latents["r0"].numpy() - want) / np.linalg.norm(want))
    assert err <= 1e-4, err  # it shared its batches with 15 others


def test_model_folder_is_a_stable_diffusion_pipeline():
    assert resolve("shapes") == SHAPES_DIR
    index = json.loads((SHAPES_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    for part in ("tokenizer", "text_encoder", "unet", "vae", "scheduler"):
        assert (SHAPES_DIR / part).is_dir(), part
    total = sum(f.stat().st_size for f in SHAPES_DIR.rglob("*") if f.is_file())
    assert total <= 30 * 2**20, f"weights are {total / 2**20:.1f} MiB"
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(SHAPES_DIR / "tokenizer")
    assert tok.model_max_length == 16
    for word in {w for p in PROMPTS for w in p.split()}:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    for prompt in PROMPTS + ("",):
        ids = tok(prompt, padding="max_length", max_length=tok.model_max_length).input_ids
        assert len(ids) == 16 and ids[0] == tok.bos_token_id, prompt


def test_samples_are_their_prompt():
    """`StableDiffusionPipeline.from_pretrained(resolve("shapes"))` with diffusers'
    DPMSolverMultistep, 20 steps, guidance 3, from a fresh seed.

    16 per prompt: with 192 samples, a model that is really 98% right fails the 95% bar by
    chance well under 1% of the time, while a model that is really below it fails."""
    torch.set_num_threads(2)
    pipe = load_pipeline(SHAPES_DIR, "dpm")
    prompts = [p for p in PROMPTS for _ in range(16)]
    seed = int(np.random.default_rng().integers(2**31))
    print(f"seed {seed}")
    images = sample(pipe, prompts, steps=20, guidance=3.0, seed=seed)
    readings = classify(images)
    misses = [f"{p} -> {r}" for p, r in zip(prompts, readings) if r != prompt_condition(p)]
    accuracy = 1 - len(misses) / len(prompts)
    print(f"shapes model: {accuracy:.3f} of {len(prompts)} samples read as their prompt "
          f"(seed {seed}); missed: {misses}")
    assert accuracy >= 0.95, misses
