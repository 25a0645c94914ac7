"""Qwen-Image folders against diffusers' own pipelines (QwenImagePipeline,
QwenImageImg2ImgPipeline, QwenImageInpaintPipeline): the model class alone (prompt rows
of their own length padded per call, the norm-preserving true-CFG combine), then the
engine: a request alone, and a shared batch mixing prompts of different lengths, steps,
true CFG on and off, img2img at two strengths and inpainting, with late joins and
cancels. The embedding cache's entries and bytes, the decoder, the geometry read from
the configs, and the fields the model cannot use."""
from __future__ import annotations

import dataclasses
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from engine.core import CoreConfig, EngineCore
from engine.models.geometry import geometry_of
from engine.models.model import VaeDecoder, model_inputs, prompt_rows
from engine.models.loading import load_model
from engine.models.qwen_image import QwenImageModel, QwenImageVaeDecoder, combine_norm_preserving
from engine.protocol import GenerateParams
from engine.testing.pipeline_oracle import load_pipeline, model_of, rel_l2
from engine.testing.tiny_qwen_image import build_qwen_image

from core_driver import run_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
#: prompts of different token counts (the template's 5 closing tokens plus one per word)
PROMPTS = ["a red circle", "a big blue cat with a small green dog on a yellow square", "dog", "",
           "a photo of a red cross over blue hills"]
NEGATIVES = ["bad quality", "blurry", "", "a blurry photo of a small green triangle"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen_image(tmp_path_factory.mktemp("qwen-image") / "qwen-image", seed=1)


def params(**fields) -> GenerateParams:
    return GenerateParams(**{"output": "latent", "height": 32, "width": 32, **fields})


def encoded(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def drawn_image(rng: random.Random, width: int, height: int) -> bytes:
    image = Image.new("RGB", (width, height), (rng.randrange(256),) * 3)
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.randrange(width - 4), rng.randrange(height - 4)
        box = [x0, y0, rng.randint(x0 + 4, width), rng.randint(y0 + 4, height)]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    return encoded(image)


def drawn_mask(rng: random.Random, width: int, height: int) -> bytes:
    mask = Image.new("L", (width, height), 0)
    x0, y0 = rng.randrange(width // 2), rng.randrange(height // 2)
    ImageDraw.Draw(mask).rectangle([x0, y0, x0 + width // 2, y0 + height // 2], fill=255)
    return encoded(mask)


def _pil(data: bytes | None):
    if data is None:
        return None
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@torch.no_grad()
def pipeline_output(folder, p: GenerateParams, output_type: str = "latent") -> np.ndarray:
    """The pipeline's own call for `p`: QwenImagePipeline, or its img2img / inpainting
    pipeline on the same components; latents come back C×h×w as its decode path unpacks them."""
    import diffusers

    pipe = load_pipeline(str(folder))
    image, mask = _pil(p.image), _pil(p.mask)
    extra = {}
    if image is not None:
        kind = diffusers.QwenImageInpaintPipeline if mask is not None else diffusers.QwenImageImg2ImgPipeline
        pipe = kind.from_pipe(pipe)
        pipe.set_progress_bar_config(disable=True)
        extra = {"image": image.convert("RGB"), **({"mask_image": mask} if mask is not None else {})}
        if p.strength is not None:
            extra["strength"] = p.strength
    if pipe.transformer.config.guidance_embeds:
        extra["guidance_scale"] = p.guidance
    out = pipe(p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.true_cfg, num_inference_steps=p.steps,
               height=p.height, width=p.width, generator=torch.Generator("cpu").manual_seed(p.seed),
               output_type=output_type, **extra).images
    if output_type == "latent":
        return pipe._unpack_latents(out, p.height, p.width, pipe.vae_scale_factor)[0, :, 0].float().numpy()
    return np.asarray(out[0], dtype=np.float32)


# --- the model class, no core ---------------------------------------------------------

def test_folders_load_as_the_model_class(folder, tmp_path):
    import diffusers

    model = model_of(folder)
    assert isinstance(model, QwenImageModel)
    # 4 latent channels (z_dim), 4 pixels per latent side, 2×2 packing; the pipeline's
    # default size: 128 latent cells
    assert (model.latent_channels, model.vae_scale, model.size_multiple, model.native_size) == (4, 4, 8, 512)
    assert geometry_of(folder) == model.geometry  # the engine process reads it from the configs alone
    assert model.conditioning_layout == ((None, 16), None, "torch.float32")
    assert model.conditioning_nbytes == 512 * 16 * 4
    # the same components saved as the img2img and inpainting pipelines load as the same model
    for kind in ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"):
        getattr(diffusers, kind).from_pipe(load_pipeline(str(folder))).save_pretrained(tmp_path / kind)
        other = load_model(tmp_path / kind)
        assert isinstance(other, QwenImageModel) and other.geometry == model.geometry
        assert other.image_support("image") is None and other.image_support("mask") is None
        assert other.default_strength("image") == other.default_strength("mask") == 0.6


@torch.no_grad()
def test_prompt_rows_keep_their_own_length(folder):
    """Each prompt's rows are its own tokens (the pipeline's mask), not the batch's longest,
    and equal the pipeline's own embedding of that prompt alone."""
    model = model_of(folder)
    pipe = load_pipeline(str(folder))
    rows = model.encode(PROMPTS)
    lengths = [c.hidden.shape[0] for c in rows]
    assert len(set(lengths)) == len(PROMPTS), lengths
    for prompt, c in zip(PROMPTS, rows):
        alone, mask = pipe.encode_prompt(prompt, device="cpu", max_sequence_length=512)
        assert mask is None and alone.shape[1] == c.hidden.shape[0]
        assert rel_l2(c.hidden.numpy(), alone[0].numpy()) < 1e-5
        assert c.nbytes == c.hidden.shape[0] * 16 * 4  # only its own bytes: no view of the batch
        assert c.hidden.untyped_storage().nbytes() == c.nbytes


@torch.no_grad()
def test_forward_on_rows_of_different_lengths_equals_each_alone(folder):
    """One call over prompts of different lengths (padded to the call's longest, with the
    mask) gives each row what the transformer gives that prompt alone, unpadded."""
    model = model_of(folder)
    rows = model.encode(PROMPTS[:4])
    gathered = prompt_rows(rows)
    mask = gathered["hidden_mask"]
    assert mask is not None and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [c.hidden.shape[0] for c in rows]
    assert prompt_rows([rows[0], rows[0]])["hidden_mask"] is None  # one length: no mask, as the pipeline
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(rows), 4, 8, 12, generator=gen)
    t = torch.tensor([900.0, 500.0, 250.0, 10.0])
    got = model.run(model_inputs(x, t, rows))
    for r, c in enumerate(rows):
        want = model.run(model_inputs(x[r:r + 1], t[r:r + 1], [c]))
        assert rel_l2(got[r:r + 1].numpy(), want.numpy()) < 1e-5, r
    # padded to a multiple (the runner's text buckets under CUDA graphs): the same results
    bucketed = prompt_rows(rows, 64)
    assert bucketed["hidden"].shape[1] == 64 and bucketed["hidden_mask"].sum(1).tolist() == mask.sum(1).tolist()
    assert prompt_rows(rows[:1], 64)["hidden_mask"] is not None
    padded = model.run(dataclasses.replace(model_inputs(x, t, rows), **bucketed))
    assert rel_l2(padded.numpy(), got.numpy()) < 1e-5
    # the padding is masked: other prompts' lengths change nothing, a row's own prompt does
    other = model.run(model_inputs(x[:1], t[:1], [rows[1]]))
    assert (other - got[:1]).abs().max() > 1e-3


def test_norm_preserving_combine_is_the_pipelines(folder):
    """`combine_guidance` writes the pipeline's combine of each pair into both its rows, so
    the fused update's `u + g (c − u)` is that combine exactly."""
    model = model_of(folder)
    gen = torch.Generator().manual_seed(3)
    shape = (4, 8, 12)
    out = torch.randn(5, int(np.prod(shape)), generator=gen)
    before = out.clone()
    model.combine_guidance(out, shape, [0, 3], [1, 4], [4.0, 2.5])
    for c, u, s in ((0, 1, 4.0), (3, 4, 2.5)):
        cond = before[c].view(1, *shape)
        neg = before[u].view(1, *shape)
        packed = lambda t: t.view(1, 4, 4, 2, 6, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 24, 16)  # noqa: E731
        comb = packed(neg) + s * (packed(cond) - packed(neg))  # the pipeline's lines, on packed tokens
        want = comb * (torch.norm(packed(cond), dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        want = want.view(1, 4, 6, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(-1)
        assert torch.equal(out[c], want) and torch.equal(out[u], want)
        assert torch.equal(out[u] + s * (out[c] - out[u]), want)  # the kernel's combine of the two rows
    assert torch.equal(out[2], before[2])
    # the rescale keeps each token's norm of the conditional prediction
    cond, neg = torch.randn(2, 1, 24, 16, generator=gen)
    combined = combine_norm_preserving(cond, neg, 3.0)
    assert torch.allclose(combined.norm(dim=-1), cond.norm(dim=-1), rtol=1e-5)


# --- the engine -----------------------------------------------------------------------

def _image_case(rng: random.Random, *, masked: bool, strength, size=(32, 32), **fields) -> GenerateParams:
    width, height = size
    return params(prompt=rng.choice(PROMPTS), image=drawn_image(rng, width, height),
                  mask=drawn_mask(rng, width, height) if masked else None, strength=strength, height=height,
                  width=width, seed=rng.randrange(10_000), **fields)


ALONE_CASES = {
    "text": params(prompt="a red circle", steps=4, seed=3),
    "text-true-cfg": params(prompt="a big blue cat with a small green dog on a yellow square",
                            negative_prompt="bad quality", true_cfg=4.0, steps=4, seed=5, height=32, width=48),
    "text-empty-negative": params(prompt="dog", negative_prompt="", true_cfg=2.5, steps=3, seed=7, height=48,
                                  width=32, sampler="flow_euler"),
    "img2img": ("image", 0.7),
    "img2img-default-strength": ("image", None),
    "inpaint-true-cfg": ("mask", 0.9),
}


def _alone_case(name: str) -> GenerateParams:
    case = ALONE_CASES[name]
    if isinstance(case, GenerateParams):
        return case
    field, strength = case
    rng = random.Random(name)
    extra = {"negative_prompt": "blurry", "true_cfg": 3.0} if field == "mask" else {}
    return _image_case(rng, masked=field == "mask", strength=strength, size=(40, 32), steps=5, **extra)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(ALONE_CASES))
def test_request_alone_equals_the_pipeline(folder, name):
    model = model_of(folder)
    p = _alone_case(name)
    core = EngineCore(model, CoreConfig(slots=2))
    for text in (p.prompt, model.negative_text(p) if model.cfg_scale(p) is not None else None):
        if text is not None:  # encoded one text at a time, as the pipeline encodes them
            core.embeddings.get_many([text])
    d = run_to_end(core, {"r": p})
    assert "r" in d.finished, d.failed
    got, want = d.results["r"], pipeline_output(folder, p)
    assert got.shape == want.shape == model.latent_shape(p.height, p.width)
    err = rel_l2(got, want)
    print(f"alone {name}: relative L2 {err:.2e}")
    assert err <= ALONE_TOL, f"{name}: relative L2 {err:.3g}"
    assert np.isfinite(want).all() and want.std() > 0.05


def test_the_inputs_reach_the_result(folder):
    """The cases above would pass with inputs that change nothing: they do change it."""
    model = model_of(folder)

    def run(**fields):
        p = params(**{"prompt": "a red circle", "steps": 3, "seed": 1, **fields})
        return run_to_end(EngineCore(model, CoreConfig(slots=2)), {"r": p}).results["r"]

    def differs(a, b):
        return np.abs(a - b).max() > 1e-3

    base = run()
    assert differs(base, run(prompt="a red circle on a blue square"))
    assert differs(run(negative_prompt="blurry", true_cfg=3.0), run(negative_prompt="blurry", true_cfg=5.0))
    assert not differs(base, run(negative_prompt="blurry"))  # true_cfg 1: one row, as the pipeline
    assert differs(base, run(height=64, width=64)[:, :8, :8])


def _mixed_cases(rng: random.Random, count: int) -> dict[str, GenerateParams]:
    """Text requests (prompts of different lengths, steps, sizes, true CFG on and off),
    img2img at two strengths and inpainting, all 32×32 or 32×48 so that they share groups."""
    cases = {}
    for k in range(count):
        kind = ("text", "text", "img2img", "text", "inpaint", "img2img")[k % 6]
        size = rng.choice([(32, 32), (48, 32)])
        cfg = {"negative_prompt": rng.choice(NEGATIVES), "true_cfg": rng.choice([2.0, 4.0])} if k % 2 else \
            {"negative_prompt": rng.choice([None, "blurry"])}
        fields = dict(steps=rng.choice([3, 4, 6]), sampler=rng.choice(["default", "flow_euler"]), **cfg)
        if kind == "text":
            cases[f"r{k}"] = params(prompt=rng.choice(PROMPTS), seed=rng.randrange(10_000), height=size[1],
                                    width=size[0], **fields)
        else:
            strength = (0.5, 0.9)[len([c for c in cases.values() if c.image is not None]) % 2]
            cases[f"r{k}"] = _image_case(rng, masked=kind == "inpaint", strength=strength, size=size, **fields)
    return cases


@pytest.mark.timeout(600)
def test_shared_calls_with_late_joins_and_cancels_equal_the_pipeline(folder, monkeypatch):
    model = model_of(folder)
    rng = random.Random("qwen-shared")
    cases = _mixed_cases(rng, 10)
    assert {c.strength for c in cases.values() if c.image is not None} == {0.5, 0.9}
    assert any(c.mask is not None for c in cases.values())
    victims = {"v0": params(prompt=PROMPTS[1], negative_prompt="blurry", true_cfg=3.0, steps=14, seed=1),
               "v1": _image_case(rng, masked=True, strength=1.0, steps=14)}
    pending = list(cases.items())
    pending.insert(1, ("v0", victims["v0"]))
    pending.insert(5, ("v1", victims["v1"]))
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    calls = {"mixed_lengths": 0, "shared": 0, "mixed_cfg": 0}
    forward = model.forward

    def counting_forward(inputs):
        calls["shared"] += inputs.rows > 1
        calls["mixed_lengths"] += inputs.hidden_mask is not None
        return forward(inputs)

    monkeypatch.setattr(model, "forward", counting_forward)

    def join_and_cancel(d):
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            request = core.requests.get(vid)
            if request is not None and request.step >= 3 and not request.stopping:
                core.abort_requests([vid])
        running = [r for g in core.groups.values() for r in g.requests if r is not None and g.runnable[r.slot]]
        calls["mixed_cfg"] += len({r.cfg_scale is None for r in running}) > 1

    d = run_to_end(core, before_step=join_and_cancel, waiting=lambda: bool(pending), limit=2000)
    assert set(d.canceled) == set(victims) and set(d.results) == set(cases), d.failed
    assert calls["shared"] > 5 and calls["mixed_lengths"] > 5 and calls["mixed_cfg"] > 3, calls
    worst = 0.0
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], pipeline_output(folder, p))
        worst = max(worst, err)
        kind = "text" if p.image is None else "inpaint" if p.mask else "img2img"
        print(f"shared {rid} {kind} steps={p.steps} true_cfg={p.true_cfg} strength={p.strength}: "
              f"relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid} {kind}: relative L2 {err:.3g}"
    print(f"shared: worst relative L2 {worst:.2e} over {len(cases)} requests; calls {calls}")


def test_embedding_cache_holds_each_prompt_at_its_length(folder):
    model = model_of(folder)
    core = EngineCore(model, CoreConfig(slots=2))
    cache = core.embeddings
    rows = cache.get_many(PROMPTS[:2])
    assert cache.nbytes == sum(c.nbytes for c in rows) == sum(c.hidden.shape[0] * 16 * 4 for c in rows)
    assert rows[0].nbytes < rows[1].nbytes
    again = cache.get_many([PROMPTS[1], PROMPTS[0]])
    assert again[0] is rows[1] and again[1] is rows[0] and cache.stats()["embedding_cache_hits"] == 2


@pytest.mark.timeout(300)
def test_uint8_output_equals_the_pipelines_np_image(folder):
    from engine.decode.stage import postprocess

    model = model_of(folder)
    p = params(prompt="a red circle", negative_prompt="blurry", true_cfg=3.0, steps=4, seed=11)
    latents = run_to_end(EngineCore(model, CoreConfig(slots=2)), {"r": p}).results["r"]
    image, _, dtype = postprocess(model, torch.from_numpy(latents), "uint8")
    want = pipeline_output(folder, p, output_type="np")
    assert dtype == "uint8" and image.shape == want.shape == (32, 32, 3)
    diff = np.abs(image.astype(np.int64) - np.round(want * 255).astype(np.int64))
    print(f"uint8 vs the pipeline's np image: max difference {diff.max()} levels")
    assert diff.max() <= 1 and image.std() > 0
    # the decode workers' decoder, from the folder alone, decodes the same
    worker = VaeDecoder.from_folder(folder)
    assert isinstance(worker, QwenImageVaeDecoder)
    assert np.array_equal(worker.decode(torch.from_numpy(latents)[None])[0], image)


def test_capabilities_and_half_precision_weights(folder):
    """The model contract's capabilities; `--dtype bfloat16`: weights (and prompt rows) in
    bf16, the engine's latents and solver state float32, the result near the fp32 pipeline's."""
    from engine.models.contract import capabilities_of

    assert {"text encoding", "denoising", "image encoding"} <= set(capabilities_of(model_of(folder)))
    model = load_model(folder, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.conditioning_layout[2] == "torch.bfloat16"
    p = params(prompt="a red circle", negative_prompt="blurry", true_cfg=3.0, steps=4, seed=3)
    got = run_to_end(EngineCore(model, CoreConfig(slots=2)), {"r": p}).results["r"]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    err = rel_l2(got, pipeline_output(folder, p))
    print(f"bf16 weights vs the fp32 pipeline: relative L2 {err:.2e}")
    assert 0 < err < 0.05, err


def test_fields_the_model_cannot_use_are_named(folder):
    from engine.core.outputs import RequestRejected

    core = EngineCore(model_of(folder), CoreConfig(slots=2))
    for fields, field in (({"sampler": "dpmpp_2m"}, "sampler"), ({"sampler": "euler"}, "sampler"),
                          ({"original_size": (64, 64)}, "original_size"), ({"height": 36}, "height")):
        with pytest.raises(RequestRejected) as err:
            core.add_request("x", params(prompt="a red circle", **fields))
        assert err.value.field == field, (fields, err.value)


def test_gpu_bench_part_runs_on_a_tiny_transformer():
    """`bench/gpu/qwen_image.py`'s measurement, on a CPU-sized transformer of the same class:
    the batch and the one-at-a-time runs finish every request, and prompts of different
    lengths shared the batch's calls."""
    from bench.gpu import qwen_image as part
    from bench.gpu.report import ROWS

    config = dict(part.QWEN_IMAGE_TRANSFORMER_CONFIG, num_layers=1, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    model = part.qwen_image_model(config, device="cpu", dtype=torch.float32, native_size=64)
    lengths = {c.hidden.shape[0] for c in model.encode([f"prompt {k}" for k in range(3)])}
    assert len(lengths) == 3
    ratio = part.batch_vs_alone(model, 64, 3, 3, device="cpu")
    assert ratio > 0 and ROWS[-1]["status"] == "ok" and "3.0 useful rows per call" in ROWS[-1]["note"], ROWS[-2:]


# --- Qwen-Image-Edit -----------------------------------------------------------------
#
# An Edit folder cannot be saved or loaded here: its `processor` component,
# transformers' Qwen2VLProcessor, checks its video processor's class, which needs
# torchvision (absent from this environment) even when no video is processed. The Edit
# pipeline object is built from the tiny folder's components with that check relaxed for
# the absent video processor only (`edit_pipeline`), and the engine's QwenImageEditModel
# serves that object. The pipeline's target area (1024², hard-coded in its call) is scaled
# to 48² through its module's `calculate_dimensions`, which the pipeline and the engine
# both call: a CPU test cannot run a 1024² image's 16384 tokens per row. EditPlus
# (Qwen-Image-Edit-2509) is served on the same road, one image a request.

EDIT_AREA = 48 * 48


@pytest.fixture(scope="module", params=["QwenImageEditPipeline", "QwenImageEditPlusPipeline"])
def edit_model(folder, request):
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from engine.models.loading import model_class_of

    checked = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, value):
        if name == "video_processor" and value is None:  # the one class torchvision would provide
            return None
        return checked(self, name, value)

    def scaled(calculate):
        # 1024² → 48²; EditPlus's 384² condition area → 32², at least a 32-pixel side
        return lambda area, ratio: calculate(max(area * EDIT_AREA // (1024 * 1024), 32 * 32), ratio)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", check)
        for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
            patch.setattr(module, "calculate_dimensions", scaled(module.calculate_dimensions))
        base = load_pipeline(str(folder))
        processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=base.tokenizer,
                                     video_processor=None)
        pipe = getattr(diffusers, request.param)(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                                                 tokenizer=base.tokenizer, processor=processor,
                                                 transformer=base.transformer)
        pipe.set_progress_bar_config(disable=True)
        yield model_class_of(request.param)(folder, pipe, torch.device("cpu"), torch.float32)


@torch.no_grad()
def edit_pipeline_output(model, p: GenerateParams) -> np.ndarray:
    """QwenImageEditPipeline's own call for `p` (the image's own size), latents C×h×w."""
    pipe = model.pipe
    original = pipe.scheduler
    pipe.scheduler = type(original).from_config(original.config)  # fresh state
    try:
        out = pipe(_pil(p.image).convert("RGB"), p.prompt, negative_prompt=p.negative_prompt,
                   true_cfg_scale=p.true_cfg, num_inference_steps=p.steps,
                   generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent").images
    finally:
        pipe.scheduler = original
    height, width = model.image_size(_pil(p.image), None, None)
    return pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)[0, :, 0].float().numpy()


def _edit_case(rng: random.Random, size=(60, 40), **fields) -> GenerateParams:
    return GenerateParams(**{"prompt": rng.choice(PROMPTS), "image": drawn_image(rng, *size), "steps": 3,
                             "seed": rng.randrange(10_000), "output": "latent", **fields})


def test_edit_model_is_registered_and_checks_its_fields(edit_model):
    from engine.core.outputs import RequestRejected
    from engine.models.loading import model_class_of
    from engine.models.qwen_image import QwenImageEditModel, QwenImageEditPlusModel

    assert model_class_of("QwenImageEditPipeline") is QwenImageEditModel
    assert model_class_of("QwenImageEditPlusPipeline") is QwenImageEditPlusModel
    core = EngineCore(edit_model, CoreConfig(slots=2))
    rng = random.Random("edit-fields")
    image = drawn_image(rng, 60, 40)
    for fields, field in (({}, "image"), ({"image": image, "strength": 0.5}, "strength"),
                          ({"image": image, "mask": drawn_mask(rng, 60, 40)}, "mask"),
                          ({"image": image, "height": 40, "width": 64}, "height"),
                          ({"image": image, "sampler": "ddim"}, "sampler")):
        with pytest.raises(RequestRejected) as err:
            core.add_request("x", GenerateParams(prompt="a red circle", **fields))
        assert err.value.field == field, (fields, err.value)
    # the output is the image's own size at the (scaled) target area: 60×40 → 64×32
    assert edit_model.image_size(_pil(image), None, None) == (32, 64)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cfg", [False, True], ids=["one-row", "true-cfg"])
def test_edit_request_alone_equals_the_pipeline(edit_model, cfg):
    rng = random.Random(f"edit-alone-{cfg}")
    p = _edit_case(rng, steps=4, **({"negative_prompt": "blurry", "true_cfg": 4.0} if cfg else {}))
    core = EngineCore(edit_model, CoreConfig(slots=2))
    image = _pil(p.image).convert("RGB")
    for text in (p.prompt, "blurry" if cfg else None):  # one text at a time, as the pipeline encodes them
        if text is not None:
            core.embeddings.get_many([text], images=[image])
    d = run_to_end(core, {"r": p})
    assert "r" in d.finished, d.failed
    got, want = d.results["r"], edit_pipeline_output(edit_model, p)
    assert got.shape == want.shape == (4, 8, 16)
    err = rel_l2(got, want)
    print(f"{edit_model.pipeline_class} alone {'true-cfg' if cfg else 'one-row'}: relative L2 {err:.2e}")
    assert err <= ALONE_TOL and want.std() > 0.05
    # the cache hit for the request: the rows were keyed by text and image content
    assert core.embeddings.stats()["embedding_cache_hits"] == (2 if cfg else 1)


def test_edit_prompt_rows_are_keyed_by_the_image(edit_model):
    rng = random.Random("edit-cache")
    core = EngineCore(edit_model, CoreConfig(slots=2))
    cache = core.embeddings
    first, second = (_pil(drawn_image(rng, 60, 40)).convert("RGB") for _ in range(2))
    rows = cache.get_many(["a red circle", "a red circle", "a red circle"], images=[first, second, first.copy()])
    assert rows[0] is rows[2] and rows[0] is not rows[1]  # same content, same entry; another image, another
    assert (rows[0].hidden - rows[1].hidden).abs().max() > 1e-4  # the image's vision tokens are in the rows
    assert cache.stats()["embedding_cache_entries"] == 2 and cache.nbytes == rows[0].nbytes + rows[1].nbytes
    with pytest.raises(ValueError):  # an Edit prompt is never encoded without its image
        cache.get_many(["a red circle"])


@pytest.mark.timeout(600)
def test_edit_shared_calls_with_late_joins_and_cancels_equal_the_pipeline(edit_model, monkeypatch):
    """Edit requests of two image shapes (two groups), prompts of different lengths, steps,
    true CFG on and off, each with its own image, sharing calls with late joins and cancels."""
    rng = random.Random("edit-shared")
    cases = {}
    for k in range(7):
        cfg = {"negative_prompt": rng.choice(NEGATIVES), "true_cfg": rng.choice([2.0, 4.0])} if k % 2 else {}
        cases[f"e{k}"] = _edit_case(rng, size=rng.choice([(60, 40), (40, 60)]), steps=rng.choice([3, 4, 5]), **cfg)
    victim = _edit_case(rng, steps=12, negative_prompt="blurry", true_cfg=3.0)
    pending = list(cases.items())
    pending.insert(1, ("victim", victim))
    core = EngineCore(edit_model, CoreConfig(slots=3, max_queue=16))
    calls = {"shared": 0, "mixed_lengths": 0}
    forward = edit_model.forward

    def counting_forward(inputs):
        assert inputs.image_latents is not None and inputs.image_latents.shape[0] == inputs.rows
        calls["shared"] += inputs.rows > 1 and len({float(t) for t in inputs.timestep}) > 1
        calls["mixed_lengths"] += inputs.hidden_mask is not None
        return forward(inputs)

    monkeypatch.setattr(edit_model, "forward", counting_forward)

    def join_and_cancel(d):
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                core.add_request(*pending.pop(0))
        request = core.requests.get("victim")
        if request is not None and request.step >= 3 and not request.stopping:
            core.abort_requests(["victim"])

    d = run_to_end(core, before_step=join_and_cancel, waiting=lambda: bool(pending), limit=2000)
    assert set(d.canceled) == {"victim"} and set(d.results) == set(cases), d.failed
    assert calls["shared"] > 2 and calls["mixed_lengths"] > 2, calls
    worst = 0.0
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], edit_pipeline_output(edit_model, p))
        worst = max(worst, err)
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"
    print(f"{edit_model.pipeline_class} shared: worst relative L2 {worst:.2e} over {len(cases)} requests; "
          f"calls {calls}")
