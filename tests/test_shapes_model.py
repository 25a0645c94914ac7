"""The embedded `shapes` model is real: its samples are recognisably their prompt, as read
by a classifier that says "unknown" to look-alikes.

Two models: the class-conditional one the engine serves as `shapes` today
(`weights/`), and its text-to-image successor (`weights_t2i/`, a plain diffusers
`StableDiffusionPipeline`), whose tests run once `python -m engine.models.shapes.train`
has written it."""
import json

import numpy as np
import pytest
import torch

from engine.models.shapes.classify import UNKNOWN, classify
from engine.models.shapes.draw import CONDITIONS, DISTRACTORS, draw, draw_distractors
from engine.models.shapes.sample import (
    PROMPTS,
    T2I_DIR,
    load_pipeline,
    prompt_condition,
    sample,
)

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


requires_t2i = pytest.mark.skipif(
    not (T2I_DIR / "model_index.json").exists(),
    reason="the text-to-image shapes model is not trained yet: python -m engine.models.shapes.train")


@torch.no_grad()
def _sample_class_conditional(model, prompts, steps: int, guidance: float, seed: int) -> np.ndarray:
    """DESIGN.md section 3's class-conditional loop, batched, with diffusers' own
    DPMSolverMultistepScheduler (dpmpp_2m), as a pipeline call would run it."""
    from engine.core.solvers import init_noise_sigma, make_scheduler

    sched = make_scheduler("dpmpp_2m", model.scheduler_config)
    sched.set_timesteps(steps)
    gen = torch.Generator("cpu").manual_seed(seed)
    size = model.native_size
    x = torch.randn((len(prompts), *model.latent_shape(size, size)), generator=gen) * init_noise_sigma(sched)
    rows = model.encode(list(prompts) + [""] * len(prompts))
    for t in sched.timesteps:
        x_in = sched.scale_model_input(torch.cat([x, x]), t)
        cond, uncond = model.denoise(x_in, t, rows).chunk(2)
        x = sched.step(uncond + guidance * (cond - uncond), t, x, generator=gen).prev_sample
    return model.decode(x)


def test_served_class_conditional_model_samples_are_their_prompt():
    """The model `python -m engine serve` loads as `shapes`: diffusers' DPMSolverMultistep,
    20 steps, guidance 3, 16 samples per prompt from a fresh seed."""
    from engine.models.loading import load_model

    torch.set_num_threads(2)
    model = load_model("shapes")
    assert list(model.prompts[:-1]) == list(CONDITIONS) and model.prompts[-1] == ""
    prompts = [c for c in CONDITIONS for _ in range(16)]
    seed = int(np.random.default_rng().integers(2**31))
    readings = classify(_sample_class_conditional(model, prompts, steps=20, guidance=3.0, seed=seed))
    misses = [f"{p} -> {r}" for p, r in zip(prompts, readings) if r != p]
    accuracy = 1 - len(misses) / len(prompts)
    print(f"class-conditional shapes model: {accuracy:.3f} of {len(prompts)} samples read as their prompt "
          f"(seed {seed}); missed: {misses}")
    assert accuracy >= 0.95, misses


@requires_t2i
def test_model_folder_is_a_stable_diffusion_pipeline():
    index = json.loads((T2I_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    for part in ("tokenizer", "text_encoder", "unet", "vae", "scheduler"):
        assert (T2I_DIR / part).is_dir(), part
    total = sum(f.stat().st_size for f in T2I_DIR.rglob("*") if f.is_file())
    assert total <= 30 * 2**20, f"weights are {total / 2**20:.1f} MiB"
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(T2I_DIR / "tokenizer")
    assert tok.model_max_length == 16
    for word in {w for p in PROMPTS for w in p.split()}:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    for prompt in PROMPTS + ("",):
        ids = tok(prompt, padding="max_length", max_length=tok.model_max_length).input_ids
        assert len(ids) == 16 and ids[0] == tok.bos_token_id, prompt


@requires_t2i
def test_samples_are_their_prompt():
    """diffusers' DPMSolverMultistep, 20 steps, guidance 3, from a fresh seed.

    16 per prompt: with 192 samples, a model that is really 98% right fails the 95% bar by
    chance well under 1% of the time, while a model that is really below it fails."""
    torch.set_num_threads(2)
    pipe = load_pipeline(T2I_DIR, "dpm")
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
