"""The tiny random-weight model folders of engine.testing.tiny_pipelines, loaded and run
by diffusers alone: shapes, finiteness, text conditioning actually wired, tokenizers
that round-trip through save/load with one token per vocabulary word."""
from __future__ import annotations

import json
import time

import diffusers
import numpy as np
import pytest
import torch
import transformers

from engine.models.vocab import write_clip_tokenizer, write_t5_tokenizer
from engine.testing.tiny_pipelines import (
    SCHEDULER_CONFIGS, TEST_CONDITIONS, VOCAB, build_class_conditional, build_sd, build_sd3, tiny_class_vae,
    tiny_unet)

PROMPT, OTHER, NEG = "a red circle", "a big blue cat", "blurry"


@pytest.fixture(scope="module", autouse=True)
def _quiet_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def sd_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-sd")
    return {pred: build_sd(root / pred, prediction_type=pred, seed=0)
            for pred in ("epsilon", "v_prediction", "sample")}


@pytest.fixture(scope="session")
def sd3_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-sd3")
    return {True: build_sd3(root / "t5", with_t5=True), False: build_sd3(root / "no-t5", with_t5=False)}


def _sd3_pipe(folder, with_t5):
    from diffusers import StableDiffusion3Pipeline

    # a folder saved without T5 has null text_encoder_3/tokenizer_3, which diffusers
    # only loads when they are passed as None explicitly
    extra = {} if with_t5 else dict(text_encoder_3=None, tokenizer_3=None)
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe, prompt=PROMPT, neg=NEG, g=7.5, seed=0, output_type="latent", **kw):
    return pipe(prompt, negative_prompt=neg, num_inference_steps=3, guidance_scale=g,
                generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kw).images


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


# --- tokenizers ---

@pytest.mark.timeout(120)
@pytest.mark.parametrize("pad", ["<|endoftext|>", "!"])
def test_clip_tokenizer_one_token_per_word_and_round_trip(tmp_path, pad):
    from transformers import CLIPTokenizer

    tok = write_clip_tokenizer(tmp_path / "tok", VOCAB, 16, pad_token=pad)
    assert tok.model_max_length == 16 and tok.pad_token == pad
    assert tok.bos_token == "<|startoftext|>" and tok.eos_token == "<|endoftext|>"
    for w in VOCAB:
        assert tok.tokenize(w) == [w + "</w>"], w
    assert pad != "!" or tok.pad_token_id == 0  # as SD3's second (OpenCLIP) tokenizer
    ids = tok(f"{PROMPT} zebra, 7!", padding="max_length", max_length=16, truncation=True).input_ids
    assert len(ids) == 16 and ids[0] == tok.bos_token_id
    body = ids[1:ids.index(tok.eos_token_id)]
    assert tok.convert_ids_to_tokens(body[:3]) == ["a</w>", "red</w>", "circle</w>"]
    assert len(body) > 6  # "zebra" is spelt out byte by byte, nothing is unknown
    assert ids[ids.index(tok.eos_token_id) + 1:] == [tok.pad_token_id] * (15 - ids.index(tok.eos_token_id))
    # with "!" as the pad token (SD3's second tokenizer), transformers matches a "!" in
    # the text as that special token, so decoding without special tokens drops it
    assert tok.decode(ids, skip_special_tokens=True) == f"{PROMPT} zebra , 7" + (" !" if pad != "!" else "")

    again = CLIPTokenizer.from_pretrained(tmp_path / "tok")
    assert again(PROMPT, padding="max_length", max_length=16).input_ids == \
        tok(PROMPT, padding="max_length", max_length=16).input_ids
    assert (again.pad_token, again.model_max_length, len(again)) == (pad, 16, len(tok))
    # the hand-written vocab.json + merges.txt alone give the same tokenizer
    (tmp_path / "tok" / "tokenizer.json").unlink()
    bare = CLIPTokenizer.from_pretrained(tmp_path / "tok", pad_token=pad, model_max_length=16)
    assert bare(f"{PROMPT} zebra", padding="max_length", max_length=16).input_ids == \
        tok(f"{PROMPT} zebra", padding="max_length", max_length=16).input_ids
    merges = (tmp_path / "tok" / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and "r e" in merges and "re d</w>" in merges


@pytest.mark.timeout(120)
def test_clip_tokenizer_words_sharing_letters_stay_whole(tmp_path):
    words = ["re", "red", "are", "green", "tree", "ere", "e", "eee", "ab", "ba", "abc", "bca"]
    tok = write_clip_tokenizer(tmp_path / "tok", words)
    for w in words:
        assert len(tok.tokenize(w)) == 1, w


@pytest.mark.timeout(120)
def test_t5_tokenizer_one_piece_per_word_and_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = write_t5_tokenizer(tmp_path / "t5", VOCAB)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    for w in VOCAB:
        assert tok.tokenize(w) == ["▁" + w], w
    ids = tok(f"{PROMPT} zebra").input_ids
    assert ids[:3] == tok.convert_tokens_to_ids(["▁a", "▁red", "▁circle"]) and ids[-1] == tok.eos_token_id
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == f"{PROMPT} zebra"
    again = AutoTokenizer.from_pretrained(tmp_path / "t5")
    assert type(again) is type(tok) and len(again) == len(tok)
    padded = tok(PROMPT, padding="max_length", max_length=12).input_ids
    assert again(PROMPT, padding="max_length", max_length=12).input_ids == padded == ids[:3] + [1] + [0] * 8


# --- Stable Diffusion ---

@pytest.mark.timeout(120)
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction", "sample"])
def test_sd_folder_runs_in_diffusers(sd_folders, prediction):
    from diffusers import StableDiffusionPipeline

    folder = sd_folders[prediction]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["safety_checker"] == [None, None]
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.scheduler.config.prediction_type == prediction
    assert pipe.scheduler.config.beta_schedule == "scaled_linear" and pipe.scheduler.config.num_train_timesteps == 1000
    assert pipe.vae_scale_factor == 2 and pipe.unet.config.sample_size == 8

    emb, neg = pipe.encode_prompt(PROMPT, "cpu", 1, True, NEG)
    assert emb.shape == neg.shape == (1, 16, 32)

    lat = _call(pipe)
    assert lat.shape == (1, 4, 8, 8) and torch.isfinite(lat).all()
    assert 0.05 < float(lat.std()) < 5
    assert torch.equal(lat, _call(pipe))  # deterministic given the generator
    assert (lat - _call(pipe, OTHER)).abs().max() > 1e-2  # the prompt reaches the UNet
    assert (lat - _call(pipe, neg="ugly")).abs().max() > 1e-2  # and so does the negative prompt
    assert (lat - _call(pipe, g=1.0)).abs().max() > 1e-2

    img = _call(pipe, output_type="np")
    assert img.shape == (1, 16, 16, 3) and np.isfinite(img).all() and 0 <= img.min() and img.max() <= 1
    assert img.std() > 1e-3

    rect = _call(pipe, output_type="latent", height=24, width=16)
    assert rect.shape == (1, 4, 12, 8) and torch.isfinite(rect).all()


@pytest.mark.timeout(120)
def test_sd_latents_stay_order_one_over_50_steps(sd_folders):
    from diffusers import StableDiffusionPipeline

    for prediction, folder in sd_folders.items():
        pipe = StableDiffusionPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        lat = pipe(PROMPT, negative_prompt=NEG, num_inference_steps=50, guidance_scale=7.5,
                   generator=torch.Generator("cpu").manual_seed(0), output_type="latent").images
        assert torch.isfinite(lat).all() and 0.1 < float(lat.std()) < 3, (prediction, float(lat.std()))


# --- Stable Diffusion 3 ---

@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_t5", [True, False], ids=["t5", "no-t5"])
def test_sd3_folder_runs_in_diffusers(sd3_folders, with_t5):
    folder = sd3_folders[with_t5]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert (index["text_encoder_3"] == [None, None]) == (not with_t5)
    pipe = _sd3_pipe(folder, with_t5)
    assert (pipe.text_encoder_3 is None) == (not with_t5) and (pipe.tokenizer_3 is None) == (not with_t5)
    assert pipe.scheduler.config.shift == 3.0 and pipe.vae.config.shift_factor == pytest.approx(0.0609)
    assert pipe.vae.config.latent_channels == pipe.transformer.config.in_channels == 16
    assert pipe.tokenizer_2.pad_token == "!" and pipe.tokenizer.pad_token == "<|endoftext|>"

    # CLIP 32 + 48 wide, concatenated, zero-padded to joint_attention_dim 128, then the T5 tokens
    for seq in (16, 256):
        emb, neg, pooled, neg_pooled = pipe.encode_prompt(PROMPT, None, None, device="cpu", negative_prompt=NEG,
                                                          max_sequence_length=seq)
        assert emb.shape == neg.shape == (1, 16 + seq, 128)
        assert pooled.shape == neg_pooled.shape == (1, 80)
        assert torch.count_nonzero(emb[:, :16, 80:]) == 0
        assert (torch.count_nonzero(emb[:, 16:]) == 0) == (not with_t5)

    lat = _call(pipe, g=7.0, max_sequence_length=16)
    assert lat.shape == (1, 16, 8, 8) and torch.isfinite(lat).all() and 0.05 < float(lat.std()) < 5
    assert torch.equal(lat, _call(pipe, g=7.0, max_sequence_length=16))
    assert (lat - _call(pipe, OTHER, g=7.0, max_sequence_length=16)).abs().max() > 1e-2
    assert (lat - _call(pipe, neg="ugly", g=7.0, max_sequence_length=16)).abs().max() > 1e-2
    if with_t5:  # the T5 prompt alone reaches the transformer
        assert (lat - _call(pipe, g=7.0, max_sequence_length=16, prompt_3=OTHER)).abs().max() > 1e-2
    # each CLIP encoder alone reaches it too
    assert (lat - _call(pipe, g=7.0, max_sequence_length=16, prompt_2=OTHER)).abs().max() > 1e-2

    img = _call(pipe, g=7.0, output_type="np", max_sequence_length=16)
    assert img.shape == (1, 16, 16, 3) and np.isfinite(img).all() and 0 <= img.min() and img.max() <= 1
    assert img.std() > 1e-3
    rect = _call(pipe, g=7.0, height=32, width=16, max_sequence_length=16)
    assert rect.shape == (1, 16, 16, 8) and torch.isfinite(rect).all()


# --- the class-conditional layout ---

@pytest.mark.timeout(120)
@pytest.mark.parametrize("prediction", sorted(SCHEDULER_CONFIGS))
def test_class_conditional_folder(tmp_path, prediction):
    from diffusers import AutoencoderKL, UNet2DModel

    folder = build_class_conditional(tmp_path / "cc", seed=3, prediction_type=prediction)
    conditions = json.loads((folder / "conditions.json").read_text())
    assert conditions == TEST_CONDITIONS and conditions[-1] == ""
    sched = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert sched == SCHEDULER_CONFIGS[prediction]
    unet = UNet2DModel.from_pretrained(folder / "unet").eval()
    vae = AutoencoderKL.from_pretrained(folder / "vae").eval()
    assert unet.config.num_class_embeds == len(conditions)
    # the same weights as the in-memory helpers (the former tests/reference.py tiny_model)
    for got, want in ((unet, tiny_unet(3)), (vae, tiny_class_vae(4))):
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k
    with torch.no_grad():
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        out = unet(x, torch.tensor([999, 10]), class_labels=torch.tensor([0, len(conditions) - 1])).sample
        img = vae.decode(out / vae.config.scaling_factor).sample
    assert out.shape == (2, 4, 8, 8) and torch.isfinite(out).all()
    assert img.shape == (2, 3, 32, 32) and torch.isfinite(img).all()

    more = build_class_conditional(tmp_path / "more", conditions=["x", "y", ""])
    assert json.loads((more / "unet" / "config.json").read_text())["num_class_embeds"] == 3
    with pytest.raises(ValueError):
        build_class_conditional(tmp_path / "bad", conditions=["x", "y"])


# --- determinism, speed, size ---

@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sd", "sd3", "sd3-no-t5", "class"])
def test_builders_are_deterministic_fast_and_small(tmp_path, kind):
    build = {"sd": build_sd, "sd3": build_sd3, "sd3-no-t5": lambda f, seed: build_sd3(f, seed=seed, with_t5=False),
             "class": build_class_conditional}[kind]
    build(tmp_path / "warm", seed=0)  # imports and first-use costs out of the timing
    start = time.perf_counter()
    a = build(tmp_path / "a", seed=0)
    elapsed = time.perf_counter() - start
    b = build(tmp_path / "b", seed=0)
    c = build(tmp_path / "c", seed=1)
    assert elapsed < 20, elapsed  # ~0.1-0.5 s when the machine is idle; generous for a shared one
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert sum((a / f).stat().st_size for f in files) < 16 * 2 ** 20
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert weights
    from safetensors.torch import load_file

    differs = False
    for f in weights:
        ta, tb, tc = load_file(a / f), load_file(b / f), load_file(c / f)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f
        differs |= any(not torch.equal(ta[k], tc[k]) for k in ta)
    assert differs  # the seed matters
    for f in files:
        if f.suffix == ".json":
            assert (a / f).read_text() == (b / f).read_text(), f
