"""Image inputs (R21): img2img and inpainting requests against diffusers' own image
pipelines (StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline, the SDXL ones,
SD3's and FLUX's img2img) with the same image, mask, strength, sampler and seed: a
request alone, and mixed strengths, masks and text-to-image requests sharing batches with
late joins and cancels; the truncated schedules; the image-encode phase, its batching,
timing and failures; the ledger; mask state released after the fence; the masked-blend
kernel against its torch reference (Triton's interpreter); every validation error naming
its field. Input images are drawn with PIL, fresh per case from a seeded generator."""
from __future__ import annotations

import io
import random
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled, RequestRejected
from engine.core import kernels as engine_kernels
from engine.core.fences import DeferredFences
from engine.core.solvers import build_schedule
from engine.models.stable_diffusion import StableDiffusionModel
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.pipeline_oracle import load_pipeline, model_of, oracle_scheduler, pipeline_output_of, rel_l2
from engine.testing.tiny_pipelines import build_class_conditional, build_flux, build_sd, build_sd3, build_sdxl

from core_driver import run_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PROMPTS = ["a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross", ""]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-inputs")
    return {
        "sd": build_sd(root / "sd", scheduler="ddim", seed=21),
        "sd-pndm": build_sd(root / "sd-pndm", scheduler="pndm", seed=22),  # the generic path
        "sdxl": build_sdxl(root / "sdxl", seed=23),
        "sd3": build_sd3(root / "sd3", with_t5=False, seed=24),
        "flux": build_flux(root / "flux", guidance_embeds=True, seed=25),
    }




def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buffer.getvalue()


def draw_image(rng: random.Random, width: int, height: int) -> Image.Image:
    """A grey-level background with a few filled shapes of random colours and places."""
    image = Image.new("RGB", (width, height), (rng.randrange(256),) * 3)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(2, 4)):
        x0, y0 = rng.randrange(width - 2), rng.randrange(height - 2)
        box = [x0, y0, rng.randint(x0 + 2, width), rng.randint(y0 + 2, height)]
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return image


def draw_mask(rng: random.Random, width: int, height: int) -> Image.Image:
    """White (repaint) rectangles on black, covering part of the image, never all of it."""
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    for _ in range(rng.randint(1, 2)):
        x0, y0 = rng.randrange(width // 2), rng.randrange(height // 2)
        draw.rectangle([x0, y0, x0 + rng.randint(2, width // 2), y0 + rng.randint(2, height // 2)], fill=255)
    return mask


def encode_alone(core: EngineCore, p: GenerateParams) -> None:
    """Put the request's prompt rows in the embedding cache one text at a time, as the
    pipeline encodes prompt and negative prompt. A batched encoder pass rounds a row by
    its batch (SDXL's pooled rows by ~2e-7), which a few img2img steps amplify to ~1e-5:
    the alone tests compare the image path, not the text encoder's batch invariance."""
    for text in (p.prompt, core.model.negative_text(p) if core.model.cfg_scale(p) is not None else None):
        if text is not None:
            core.embeddings.get_many([text])


def image_request(rng: random.Random, name: str, sampler: str, masked: bool, *, strength, size=None, **fields):
    """A request with a fresh drawn image (and mask) of `size` (width, height; default 16×16).
    SD's and SDXL's img2img pipelines take the image's size; the others are given height
    and width (the image's, or `fields`' to resize it)."""
    width, height = size or (16, 16)
    sized = masked or name in ("sd3", "flux")
    drawn = dict(
        prompt=rng.choice(PROMPTS[:4]), negative_prompt=rng.choice(["", "blurry"]), steps=rng.choice([5, 8]),
        sampler=sampler, guidance=rng.choice([1.0, 3.5]), seed=rng.randrange(10_000), output="latent",
        image=encoded(draw_image(rng, width, height)),
        mask=encoded(draw_mask(rng, width, height)) if masked else None, strength=strength,
        **({"height": height, "width": width} if sized else {}))
    return GenerateParams(**{**drawn, **fields})


# ---- a request alone equals the pipeline -----------------------------------------------------

ALONE = [
    ("sd", "default", False), ("sd", "dpmpp_2m", False), ("sd", "euler_ancestral", False),
    ("sd", "default", True), ("sd", "dpmpp_2m", True), ("sd", "euler", True),
    ("sd-pndm", "default", False), ("sd-pndm", "default", True),
    ("sdxl", "default", False), ("sdxl", "dpmpp_2m", False),
    ("sdxl", "euler_ancestral", True), ("sdxl", "default", True),
    ("sd3", "default", False), ("flux", "flow_euler", False),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, sampler, masked", ALONE, ids=[f"{n}-{s}-{'inpaint' if m else 'img2img'}"
                                                               for n, s, m in ALONE])
def test_request_alone_equals_the_image_pipeline(folders, name, sampler, masked):
    folder = folders[name]
    model = model_of(folder)
    rng = random.Random(f"alone-{name}-{sampler}-{masked}")
    # inpainting at strength 1 starts from pure noise; None: the pipeline's own default strength
    strengths = [round(rng.uniform(0.3, 0.95), 2), 1.0 if masked else None]
    for strength in strengths:
        # SDXL's inpainting pipeline takes only multiples of 8 pixels
        size = rng.choice([(16, 16), (24, 16)] + [(20, 12)] * (name in ("sd", "sd-pndm")))
        p = image_request(rng, name, sampler, masked, strength=strength, size=size)
        core = EngineCore(model, CoreConfig(slots=2))
        encode_alone(core, p)
        d = run_to_end(core, {"r": p})
        assert "r" in d.finished, d.failed
        got = d.finished["r"]
        want = pipeline_output_of(folder, p)
        assert got.latents.shape == want.shape == model.latent_shape(size[1], size[0])
        err = rel_l2(got.latents.numpy(), want)
        print(f"alone {name} {sampler} {'inpaint' if masked else 'img2img'} strength={strength}: relative L2 {err:.2e}")
        assert err <= ALONE_TOL, f"{name} {sampler} strength={strength} {p.steps} steps: relative L2 {err:.3g}"
        # evaluations: only the steps the truncated schedule runs
        used = strength if strength is not None else model.default_strength("mask" if masked else "image")
        steps = p.steps - model.start_step(p.steps, used) + (name == "sd-pndm")  # PNDM: one evaluation more
        assert got.timings.evals == steps * (1 if model.cfg_scale(p) is None else 2)
        assert got.timings.image_encode_s > 0


@pytest.mark.timeout(120)
def test_height_and_width_resize_the_image_as_the_pipeline(folders):
    folder = folders["sd"]
    rng = random.Random("resize")
    for fmt in ("JPEG", "WEBP"):  # lossy: the pipeline gets the image decoded from the same bytes
        p = GenerateParams(prompt="a red circle", steps=6, guidance=3.0, seed=rng.randrange(10_000), output="latent",
                           image=encoded(draw_image(rng, 24, 20), fmt), mask=encoded(draw_mask(rng, 24, 20)),
                           strength=0.7, height=12, width=16)
        got = run_to_end(EngineCore(model_of(folder), CoreConfig(slots=2)), {"r": p}).finished["r"]
        assert got.latents.shape == (4, 6, 8)
        assert rel_l2(got.latents.numpy(), pipeline_output_of(folder, p)) <= ALONE_TOL


# ---- shared batches ------------------------------------------------------------------------

# SD3's and FLUX's image pipelines run their own scheduler or flow_euler only
SHARED_SAMPLERS = {"sd": ["default", "dpmpp_2m", "euler_ancestral"], "sdxl": ["default", "dpmpp_2m", "euler_ancestral"],
                   "sd3": ["default", "flow_euler", "default"], "flux": ["default", "flow_euler", "default"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sd", "sdxl", "sd3", "flux"])
def test_mixed_strengths_masks_and_text_requests_share_batches(folders, name):
    """SD3's and FLUX's image pipelines take no mask: there, img2img at two strengths."""
    folder = folders[name]
    model = model_of(folder)
    rng = random.Random(f"shared-{name}")
    samplers = SHARED_SAMPLERS[name]
    masks = name in ("sd", "sdxl")
    cases = {}
    for k in range(9):
        sampler = samplers[(k + k // 3) % 3]  # every kind with every sampler
        kind = k % 3  # text-to-image, img2img, inpainting (SD3, FLUX: img2img again)
        if kind == 0:
            cases[f"r{k}"] = GenerateParams(prompt=rng.choice(PROMPTS), steps=rng.choice([4, 6]), sampler=sampler,
                                            guidance=rng.choice([1.0, 3.0]), seed=rng.randrange(10_000),
                                            output="latent")
        else:
            strength = rng.choice([0.4, 0.7, 1.0])
            cases[f"r{k}"] = image_request(rng, name, sampler, kind == 2 and masks, strength=strength)
    victims = {"v0": image_request(rng, name, samplers[1], masks, strength=1.0, steps=20),
               "v1": image_request(rng, name, "default", False, strength=1.0, steps=20)}
    pending = list(cases.items())
    pending.insert(1, ("v0", victims["v0"]))
    pending.insert(5, ("v1", victims["v1"]))
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    seen = {"shared_with_images": 0}

    def join_cancel_and_count(d):
        for _ in range(rng.choice((0, 1, 1, 2))):  # late joins
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            request = core.requests.get(vid)
            if request is not None and request.step >= 3 and not request.stopping:
                core.abort_requests([vid])
        running = [r for g in core.groups.values() for r in g.requests if r is not None and g.runnable[r.slot]]
        from_image = {r.trajectory.schedule.start_noising is not None for r in running}
        seen["shared_with_images"] += from_image == {True, False}

    d = run_to_end(core, before_step=join_cancel_and_count, waiting=lambda: bool(pending), limit=2000)
    results, canceled, shared_with_images = d.results, set(d.canceled), seen["shared_with_images"]
    assert canceled == set(victims) and set(results) == set(cases)
    assert shared_with_images > 5, "image and text requests did not share batches"
    for rid, p in cases.items():
        want = pipeline_output_of(folder, p)
        err = rel_l2(results[rid], want)
        kind = "text" if p.image is None else "inpaint" if p.mask else "img2img"
        print(f"shared {name} {rid} {kind} {p.sampler} strength={p.strength}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid} {kind} {p.sampler}: relative L2 {err:.3g}"


# ---- truncated schedules ---------------------------------------------------------------------

@pytest.mark.parametrize("sampler", ["euler", "euler_ancestral", "ddim", "dpmpp_2m", "default"])
def test_truncated_schedule_is_the_tail_the_pipeline_runs(folders, sampler):
    folder = folders["sd-pndm" if sampler == "default" else "sd"]
    model = model_of(folder)
    config = model.scheduler_config
    for steps, strength in ((10, 0.55), (7, 1.0), (9, 0.3)):
        start = model.start_step(steps, strength)
        schedule = build_schedule(sampler, config, steps, 2.0, (), start)
        sched = oracle_scheduler(sampler, load_pipeline(str(folder)).scheduler)  # diffusers' own, not the engine's
        sched.set_timesteps(steps)
        tail = sched.timesteps[start * sched.order:]  # the pipeline's get_timesteps
        np.testing.assert_array_equal(schedule.timesteps, tail.numpy().astype(np.float32))
        assert schedule.begin == start * sched.order and schedule.steps == len(tail)
        assert tuple(schedule.step_noising[-1]) == (1.0, 0.0)  # the last step keeps the image's own latents
        if sampler == "dpmpp_2m":
            full = build_schedule(sampler, config, steps, 2.0)
            from engine.core.solvers import HC

            assert schedule.coefs[0, HC] == 0.0  # first order at the request's own first step
            if start:
                assert full.coefs[start, HC] != 0.0  # where the whole schedule is already second order
                np.testing.assert_array_equal(schedule.coefs[1:], full.coefs[start + 1:])


# ---- the image-encode phase --------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_image_encode_phase_batches_per_size_and_fails_alone(folders):
    folder = folders["sd"]
    model = model_of(folder)
    rng = random.Random("encode-phase")
    params = {f"r{k}": image_request(rng, "sd", "default", k == 1, strength=0.6, size=size)
              for k, size in enumerate([(16, 16), (16, 16), (20, 12)])}
    calls = []
    original = model.encode_image_moments

    def counting(pixels):
        calls.append(len(pixels))
        if len(calls) == 1:  # the first batched pass raises: each image is retried alone
            raise RuntimeError("encoder failure")
        return original(pixels)

    model.encode_image_moments = counting
    try:
        results = run_to_end(EngineCore(model, CoreConfig(slots=4)), params).finished
    finally:
        del model.encode_image_moments
    assert sorted(calls) == [1, 1, 1, 2]  # a batch per size: (2 → raised → 1 + 1), 1
    for rid, p in params.items():  # retried without shifting any random stream
        assert rel_l2(results[rid].latents.numpy(), pipeline_output_of(folder, p)) <= ALONE_TOL

    original = model.preprocess_image

    def failing(image, height, width):
        if width == 20:
            raise ValueError("bad pixels")
        return original(image, height, width)

    model.preprocess_image = failing
    try:
        core = EngineCore(model, CoreConfig(slots=4))
        d = run_to_end(core, params)
    finally:
        del model.preprocess_image
    assert "bad pixels" in d.failed["r2"]
    assert set(d.finished) == {"r0", "r1"}
    assert core.ledger.used.trajectory_bytes == 0 and not core.requests


def test_ledger_counts_image_inputs_and_releases_them(folders):
    model = model_of(folders["sd"])
    rng = random.Random("ledger")
    core = EngineCore(model, CoreConfig(slots=4, max_queue=8))
    text = GenerateParams(prompt="a red circle", steps=3, guidance=1.0, output="latent")
    img2img = image_request(rng, "sd", "default", False, strength=0.8, guidance=1.0, steps=3)
    inpaint = image_request(rng, "sd", "default", True, strength=0.8, guidance=1.0, steps=3)
    for rid, p in (("t", text), ("i", img2img), ("m", inpaint)):
        core.add_request(rid, p)
    sizes = {rid: core.requests[rid].reservation.trajectory_bytes for rid in ("t", "i", "m")}
    numel = 4 * 8 * 8  # the image latents; inpainting also the noise and the mask, a row each
    assert sizes["i"] - sizes["t"] == len(img2img.image) + 4 * numel
    assert sizes["m"] - sizes["t"] == len(inpaint.image) + len(inpaint.mask) + 3 * 4 * numel
    core.admit()  # the encoded bytes are spent in the encode phase: given back; the latent rows stay
    assert core.ledger.used.trajectory_bytes == sum(sizes.values()) - len(img2img.image) - len(inpaint.image) \
        - len(inpaint.mask)
    run_to_end(core)
    assert core.ledger.used.trajectory_bytes == 0


def test_mask_state_is_released_only_after_the_fence(folders):
    model = model_of(folders["sd"])
    rng = random.Random("fence")
    fences = DeferredFences()
    core = EngineCore(model, CoreConfig(slots=1), fences=fences)
    core.add_request("m", image_request(rng, "sd", "default", True, strength=1.0, steps=6))
    core.step()
    group = next(iter(core.groups.values()))
    known = core.storage[group.key].kind_states["image"]
    assert known.masked[0] and known.mask[0].max() == 1.0
    core.abort_requests(["m"])
    core.step()
    assert known.masked[0] and group.requests[0] is not None  # its launch is still in flight
    fences.release_all()
    outputs = core.step() + core.step()  # the storage learns of the release with the next plan
    assert any(isinstance(o, RequestCanceled) for o in outputs)
    assert not known.masked[0] and group.requests[0] is None
    # the next request in that slot is not blended with the old mask: it equals the pipeline
    core.add_request("t", GenerateParams(prompt="a red circle", steps=3, guidance=1.0, output="latent"))
    got = run_to_end(core, release=True).results["t"]
    from engine.testing.pipeline_oracle import pipeline_output

    want = pipeline_output(folders["sd"], "default", "a red circle", 3, 1.0, seed=0)
    assert rel_l2(got, want) <= ALONE_TOL


# ---- validation ------------------------------------------------------------------------------

def test_bad_image_inputs_are_rejected_naming_the_field(folders, tmp_path):
    sd = model_of(folders["sd"])
    rng = random.Random("validation")
    png = encoded(draw_image(rng, 16, 16))
    mask = encoded(draw_mask(rng, 16, 16))
    base = dict(prompt="a red circle", steps=6, output="latent")
    gif = io.BytesIO()
    draw_image(rng, 16, 16).save(gif, format="GIF")
    cases = [
        ({"image": b"not an image"}, "image"),
        ({"image": png[:40]}, "image"),  # truncated
        ({"image": gif.getvalue()}, "image"),  # a real image, not PNG, JPEG or WebP
        ({"image": b""}, "image"),
        ({"image": png, "mask": b"\x89PNG garbage"}, "mask"),
        ({"image": png, "mask": encoded(draw_mask(rng, 16, 12))}, "mask"),  # another size
        ({"image": encoded(draw_image(rng, 68, 16))}, "image"),  # larger than the engine's 64
        ({"image": encoded(draw_image(rng, 18, 16))}, "image"),  # its size is no multiple of 4
        ({"image": png, "strength": 0.0}, "strength"),
        ({"image": png, "strength": 1.5}, "strength"),
        ({"image": png, "strength": float("nan")}, "strength"),
        ({"image": png, "strength": 0.1}, "strength"),  # 6 steps × 0.1 leave no step
        ({"strength": 0.5}, "strength"),  # without an image
        ({"mask": mask}, "mask"),  # without an image
    ]
    core = EngineCore(sd, CoreConfig(slots=2, max_input_bytes=4096))
    for k, (fields, field) in enumerate(cases):
        with pytest.raises(RequestRejected) as info:
            core.add_request(f"bad{k}", GenerateParams(**base, **fields))
        assert info.value.field == field, (fields.keys(), info.value)
    with pytest.raises(RequestRejected) as info:  # over the byte limit
        core.add_request("big", GenerateParams(**base, image=encoded(Image.effect_noise((64, 64), 60).convert("RGB"))))
    assert info.value.field == "image" and "bytes" in info.value.reason
    assert not core.requests  # nothing was queued

    sd3 = EngineCore(model_of(folders["sd3"]), CoreConfig(slots=2))
    for fields, field in (({"image": png, "mask": mask}, "mask"), ({"image": png, "sampler": "dpmpp_2m"}, "sampler")):
        with pytest.raises(RequestRejected) as info:
            sd3.add_request("x", GenerateParams(**base, **fields))
        assert info.value.field == field
    classes = EngineCore(load_model(build_class_conditional(tmp_path / "cc", seed=1)), CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as info:
        classes.add_request("x", GenerateParams(**base, image=png))
    assert info.value.field == "image"

    class NineChannels:  # a 9-channel inpainting UNet in a text-to-image folder: said plainly
        latent_channels = 4
        image_pipelines = StableDiffusionModel.image_pipelines
        pipe = type("Pipe", (), {"unet": type("Unet", (), {"config": type("C", (), {"in_channels": 9})})})

    why = StableDiffusionModel.image_support(NineChannels(), "mask")
    assert "inpainting UNet" in why and "not served yet" in why

    # well-formed: the image's size is the output size, the pipeline's default strength
    core.add_request("ok", GenerateParams(**base, image=encoded(draw_image(rng, 20, 12))))
    request = core.requests["ok"]
    assert request.latent_shape == (4, 6, 10) and request.inputs["image"].strength == 0.8
    assert core.output_bytes(GenerateParams(**base, image=encoded(draw_image(rng, 20, 12)))) > 0


# ---- the masked-blend kernel -------------------------------------------------------------------

def _worker_blend(arrays: dict, block: int):
    """In the Triton-interpreter worker: the blend kernel on numpy copies of the inputs."""
    from engine.core import kernels
    from triton_interpreter import assert_interpreted

    assert_interpreted(kernels._blend_known_region_kernel)
    t = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    kernels.blend_known_region_triton(**t, block=block)
    return t["latents"].numpy()


def blend_case(seed: int) -> tuple[dict, int]:
    g = torch.Generator().manual_seed(seed)
    slots = int(torch.randint(1, 9, (1,), generator=g))
    numel = int(torch.randint(1, 300, (1,), generator=g))
    entries = int(torch.randint(1, slots + 1, (1,), generator=g))
    index = torch.randperm(slots, generator=g)[:entries].to(torch.int32)
    latents = torch.randn(slots, numel, generator=g) * 3
    mask = (torch.rand(slots, numel, generator=g) < 0.4).float()
    coefs = torch.rand(entries, 2, generator=g)
    coefs[-1] = torch.tensor([1.0, 0.0])  # a final step's (1, 0)
    return dict(latents=latents, image_latents=torch.randn(slots, numel, generator=g),
                noise=torch.randn(slots, numel, generator=g), mask=mask, index=index, coefs=coefs), \
        [16, 32, 64, 128][seed % 4]


@pytest.mark.timeout(300)
def test_blend_kernel_matches_its_reference_in_the_interpreter(triton_interpreter):
    for seed in range(6):
        inputs, block = blend_case(seed)
        ref = {k: v.clone() for k, v in inputs.items()}
        engine_kernels.blend_known_region_reference(**ref)
        got = triton_interpreter.submit(_worker_blend, {k: v.numpy() for k, v in inputs.items()},
                                        block).result(timeout=300)
        assert torch.equal(torch.from_numpy(got), ref["latents"]), f"seed {seed}"
        slots = inputs["index"].long()
        others = torch.ones(len(inputs["latents"]), dtype=torch.bool)
        others[slots] = False
        assert torch.equal(ref["latents"][others], inputs["latents"][others])  # other slots untouched
        keep = inputs["mask"][slots] == 1  # the repainted region keeps the sampler's update
        assert torch.equal(ref["latents"][slots][keep], inputs["latents"][slots][keep])
        known = ~keep & (inputs["coefs"][:, 1:] == 0).expand_as(keep)
        assert torch.equal(ref["latents"][slots][known], inputs["image_latents"][slots][known])


def test_blend_pass_cost_on_cpu():
    """The torch pass beside the fused update at 16 slots of SD's 4 × 64 × 64 latents
    (printed, for the record; the update dominates nowhere near)."""
    slots, numel = 16, 4 * 64 * 64
    inputs = dict(latents=torch.randn(slots, numel), image_latents=torch.randn(slots, numel),
                  noise=torch.randn(slots, numel), mask=(torch.rand(slots, numel) < 0.5).float(),
                  index=torch.arange(slots, dtype=torch.int32), coefs=torch.rand(slots, 2))
    engine_kernels.blend_known_region_reference(**inputs)
    started = time.perf_counter()
    for _ in range(20):
        engine_kernels.blend_known_region_reference(**inputs)
    per_call = (time.perf_counter() - started) / 20
    print(f"blend pass, torch on CPU, 16 slots × {numel}: {per_call * 1e3:.2f} ms")
    assert per_call < 0.5


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "euler_ancestral"])
def test_a_parked_slot_comes_back_bit_for_bit(folders, sampler):
    """A slot's whole storage (latents, multistep history, solver tables, prompt rows,
    request-input rows, the inpainting known region) parked to host memory after its
    fence, the slot then poisoned, and brought back: the request ends exactly as it would
    have uninterrupted."""
    model = model_of(folders["sd"])
    params = image_request(random.Random("park"), "sd", sampler, True, strength=0.9, steps=8, guidance=3.5,
                           negative_prompt="blurry")

    def run(park_at: int | None):
        core = EngineCore(model, CoreConfig(slots=2))
        core.add_request("r", params)
        while core.has_unfinished_requests():
            if park_at is not None and "r" in core.requests and core.requests["r"].step == park_at:
                request = core.requests["r"]
                storage = core.storage[request.group_key]
                parked = storage.park(request.slot)
                assert parked.kinds and parked.nbytes > 0  # the known region went too
                storage.latents[request.slot] = float("nan")
                storage.history[request.slot] = float("nan")
                storage.coef_table[request.slot] = float("nan")
                storage.kind_states["image"].image_latents[request.slot] = float("nan")
                storage.release(request.slot)
                storage.unpark(request.slot, parked)
                park_at = None
            for out in core.step():
                if isinstance(out, DenoiseFinished):
                    core.decode_done("r")
                    return out.latents
        raise AssertionError("no result")

    assert torch.equal(run(park_at=3), run(park_at=None))
