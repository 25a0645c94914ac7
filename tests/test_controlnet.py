"""ControlNet per request, in the shared batch: a request alone against diffusers' own
`StableDiffusionControlNetPipeline` / `StableDiffusionXLControlNetPipeline` (one
ControlNet, a multi-ControlNet list, a start/end window, guess mode, a ControlNet that
pools its residuals) and `StableDiffusionControlNetImg2ImgPipeline`; one shared batch of
plain rows, ControlNet A, A+B at two scales, a window, guess mode and img2img rows with late
joins and cancels, another with the pooling ControlNet's rows; each
ControlNet run only on the rows that use it at their step; controls parked and resumed
with their slot; every bad control rejected naming `controls`; a ControlNet that does not
fit the served UNet refused at start. Tiny random ControlNets built as diffusers' tests
build them (`build_controlnet`); control images drawn with PIL from a seeded generator."""
from __future__ import annotations

import functools
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from engine.core import CoreConfig, EngineCore, RequestRejected
from engine.core.solvers import make_scheduler
from engine.models.controlnet import attach_controlnets, load_controlnet
from engine.models.loading import load_model
from engine.protocol import Control, GenerateParams
from engine.testing.pipeline_oracle import load_pipeline, rel_l2
from engine.testing.tiny_conditioning import build_controlnet
from engine.testing.tiny_pipelines import build_flux, build_sd, build_sdxl

from core_driver import run_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PROMPTS = ["a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnet")
    sd, sdxl = build_sd(root / "sd", seed=31), build_sdxl(root / "sdxl", seed=32)
    flux = build_flux(root / "flux", guidance_embeds=True, seed=33)
    return {"sd": sd, "sdxl": sdxl, "flux": flux,
            "sd-nets": {"a": build_controlnet(root / "sd-a", sd, seed=1),
                        "b": build_controlnet(root / "sd-b", sd, seed=2),
                        # a shuffle-style ControlNet: mean-pooled residuals, its pipelines in guess mode
                        "s": build_controlnet(root / "sd-s", sd, seed=6, global_pool_conditions=True)},
            "sdxl-nets": {"a": build_controlnet(root / "sdxl-a", sdxl, seed=3)},
            "flux-nets": {"a": build_controlnet(root / "flux-a", flux, seed=4),
                          "b": build_controlnet(root / "flux-b", flux, seed=5)}}


@functools.lru_cache(maxsize=4)
def _served(folder, nets: tuple):
    model = load_model(folder)
    attach_controlnets(model, dict(nets))
    return model


def served(folders, name):
    """The engine's model of folder `name` with its ControlNets, loaded once."""
    return _served(folders[name], tuple(sorted(folders[f"{name}-nets"].items())))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def control_image(rng: random.Random, width: int = 16, height: int = 16) -> bytes:
    """White outlines and filled shapes on black, as an edge or silhouette control."""
    image = Image.new("RGB", (width, height), 0)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 3)):
        x0, y0 = rng.randrange(width - 3), rng.randrange(height - 3)
        box = [x0, y0, rng.randint(x0 + 2, width), rng.randint(y0 + 2, height)]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, outline=(255, 255, 255),
                                                                  fill=(255, 255, 255) if rng.random() < 0.5 else None)
    return png(image)


def _pil(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@functools.lru_cache(maxsize=8)
def _oracle_net(path):
    import json
    import pathlib

    import diffusers

    kind = json.loads((pathlib.Path(path) / "config.json").read_text())["_class_name"]
    return getattr(diffusers, kind).from_pretrained(path, low_cpu_mem_usage=False).eval()


@torch.no_grad()
def controlnet_pipeline_output(folder, nets: dict, p: GenerateParams, base=None) -> np.ndarray:
    """The ControlNet pipeline's latents for `p`: one `ControlNetModel` for one control, a
    `MultiControlNetModel` of the named ones (in order) for several; the img2img
    ControlNet pipeline with an image; the sampler swapped in as the pipeline oracle does."""
    import diffusers
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    base = base or load_pipeline(str(folder))
    if type(base).__name__.startswith("Flux"):
        return flux_controlnet_pipeline_output(base, nets, p)
    xl = type(base).__name__.startswith("StableDiffusionXL")
    image_kind = "" if p.image is None else "Inpaint" if p.mask is not None else "Img2Img"
    kind = ("StableDiffusionXL" if xl else "StableDiffusion") + "ControlNet" + image_kind + "Pipeline"
    controls = p.controls
    single = len(controls) == 1
    models = [_oracle_net(str(nets[c.name])) for c in controls]
    pipe = getattr(diffusers, kind).from_pipe(base, controlnet=models[0] if single else MultiControlNetModel(models))
    pipe.set_progress_bar_config(disable=True)
    images = [_pil(c.image) for c in controls]

    def each(values):
        return values[0] if single else list(values)

    kwargs = dict(controlnet_conditioning_scale=each([c.scale for c in controls]),
                  control_guidance_start=each([c.start for c in controls]),
                  control_guidance_end=each([c.end for c in controls]), guess_mode=p.guess_mode)
    if p.image is not None:
        kwargs.update(image=_pil(p.image).convert("RGB"), control_image=each(images))
        if p.mask is not None:
            kwargs["mask_image"] = _pil(p.mask)
        if p.strength is not None:
            kwargs["strength"] = p.strength
    else:
        kwargs["image"] = each(images)
    original = pipe.scheduler
    config = dict(original.config, _class_name=type(original).__name__)
    pipe.scheduler = make_scheduler(p.sampler, config) if p.sampler != "default" else type(original).from_config(config)
    out = pipe(p.prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.steps, guidance_scale=p.guidance,
               height=p.height, width=p.width, generator=torch.Generator("cpu").manual_seed(p.seed),
               output_type="latent", **kwargs)
    return out.images[0].float().numpy()


def flux_controlnet_pipeline_output(base, nets: dict, p: GenerateParams) -> np.ndarray:
    """`FluxControlNetPipeline` (with `FluxMultiControlNetModel` for several), its packed
    latents unpacked as its decode path unpacks them."""
    from diffusers import FluxControlNetPipeline
    from diffusers.models.controlnets.controlnet_flux import FluxMultiControlNetModel

    controls = p.controls
    models = [_oracle_net(str(nets[c.name])) for c in controls]
    single = len(models) == 1
    pipe = FluxControlNetPipeline.from_pipe(base, controlnet=models[0] if single else FluxMultiControlNetModel(models))
    pipe.set_progress_bar_config(disable=True)

    def each(values):
        return values[0] if single else list(values)

    out = pipe(p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=p.true_cfg, num_inference_steps=p.steps,
               guidance_scale=p.guidance, height=p.height, width=p.width,
               control_image=each([_pil(c.image) for c in controls]),
               controlnet_conditioning_scale=each([c.scale for c in controls]),
               control_guidance_start=each([c.start for c in controls]),
               control_guidance_end=each([c.end for c in controls]),
               generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent").images
    native = pipe.default_sample_size * pipe.vae_scale_factor
    return pipe._unpack_latents(out, p.height or native, p.width or native, pipe.vae_scale_factor)[0].float().numpy()


def plain_pipeline_output(folder, p: GenerateParams) -> np.ndarray:
    from engine.testing.pipeline_oracle import pipeline_output_of

    return pipeline_output_of(folder, p)


def oracle(folders, name, p):
    if not p.controls:
        return plain_pipeline_output(folders[name], p)
    return controlnet_pipeline_output(folders[name], folders[f"{name}-nets"], p)


def encode_alone(core: EngineCore, p: GenerateParams) -> None:
    """The prompt rows one text at a time, as the pipeline encodes them (the alone tests
    compare the ControlNet path, not the text encoder's batch invariance)."""
    for text in (p.prompt, core.model.negative_text(p) if core.model.cfg_scale(p) is not None else None):
        if text is not None:
            core.embeddings.get_many([text])


def request(rng: random.Random, controls=(), **fields) -> GenerateParams:
    drawn = dict(prompt=rng.choice(PROMPTS), negative_prompt=rng.choice(["", "blurry"]), steps=rng.choice([5, 7]),
                 guidance=rng.choice([1.0, 3.5]), seed=rng.randrange(10_000), output="latent", controls=tuple(controls))
    return GenerateParams(**{**drawn, **fields})


# ---- a request alone equals the pipeline ------------------------------------------------------

ALONE = [
    ("sd", "single", "default"), ("sd", "single", "dpmpp_2m"), ("sd", "multi", "default"),
    ("sd", "window", "euler_ancestral"), ("sd", "guess", "default"), ("sd", "guess-one-row", "default"),
    ("sd", "resized", "default"), ("sd", "pooled", "default"), ("sd", "pooled-twice", "default"),
    ("sd", "pooled-second", "dpmpp_2m"), ("sdxl", "single", "default"), ("sdxl", "guess", "default"),
    ("flux", "single", "default"), ("flux", "multi", "flow_euler"), ("flux", "window", "default"),
    ("flux", "true-cfg", "default"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, case, sampler", ALONE, ids=[f"{n}-{c}-{s}" for n, c, s in ALONE])
def test_request_alone_equals_the_controlnet_pipeline(folders, name, case, sampler):
    rng = random.Random(f"alone-{name}-{case}-{sampler}")
    model = served(folders, name)
    a = Control("a", control_image(rng), scale=round(rng.uniform(0.5, 1.5), 2))
    fields = dict(sampler=sampler, guidance=3.5)
    if case == "multi":
        controls = [a, Control("b", control_image(rng), scale=0.6), Control("a", control_image(rng), scale=1.2)]
    elif case == "window":
        controls = [Control("a", a.image, scale=1.1, start=0.2, end=0.7), Control("b", control_image(rng), end=0.5)]
    elif case.startswith("guess"):
        controls = [a]
        fields.update(guess_mode=True, guidance=1.0 if case == "guess-one-row" else 3.5)
    elif case.startswith("pooled"):  # a global-pool ControlNet: alone, twice or second (no guess mode then)
        pooled = Control("s", control_image(rng), scale=1.3)
        controls = {"pooled": [pooled], "pooled-twice": [pooled, Control("s", control_image(rng), scale=0.7)],
                    "pooled-second": [a, pooled]}[case]
    elif case == "resized":  # a control image of another size, resized to the output's
        controls = [Control("a", control_image(rng, 20, 12), scale=0.9)]
        fields.update(height=16, width=24)
    else:
        controls = [a]
    if case == "true-cfg":  # FLUX: one ControlNet pass with the prompt, its residuals for both calls
        fields.update(true_cfg=2.5, negative_prompt="blurry")
    if name == "sdxl":
        controls = [c for c in controls if c.name == "a"]
    p = request(rng, controls, **fields)
    core = EngineCore(model, CoreConfig(slots=2))
    encode_alone(core, p)
    d = run_to_end(core, {"r": p})
    assert "r" in d.finished, d.failed
    got = d.finished["r"].latents.numpy()
    want = oracle(folders, name, p)
    err = rel_l2(got, want)
    # the residuals' own effect (FLUX's control latents draw from the generator: scale 0 keeps the draws)
    plain = oracle(folders, name, msgspec_replace(p, controls=tuple(msgspec_replace(c, scale=0.0) for c in p.controls),
                                                  guess_mode=False))
    print(f"alone {name} {case} {sampler}: relative L2 {err:.2e} (the control moves it {rel_l2(plain, want):.2f})")
    assert got.shape == want.shape
    assert err <= ALONE_TOL
    assert rel_l2(plain, want) > 100 * ALONE_TOL, "the control changed nothing: the test could not fail"


def msgspec_replace(p, **fields):
    import msgspec

    return msgspec.structs.replace(p, **fields)


IMAGE_CASES = [("sd", False), ("sd", True), ("sdxl", False), ("sdxl", True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, masked", IMAGE_CASES, ids=[f"{n}-{'inpaint' if m else 'img2img'}" for n, m in IMAGE_CASES])
def test_controlnet_img2img_and_inpainting_equal_their_pipelines(folders, name, masked):
    """`StableDiffusion(XL)ControlNetImg2ImgPipeline` / `...ControlNetInpaintPipeline`: the
    image kind's start and the controls kind's residuals together."""
    from test_image_inputs import draw_image, draw_mask, encoded

    rng = random.Random(f"image-{name}-{masked}")
    p = request(rng, [Control("a", control_image(rng), scale=0.8)], image=encoded(draw_image(rng, 16, 16)),
                mask=encoded(draw_mask(rng, 16, 16)) if masked else None, strength=0.7, steps=8, guidance=3.5,
                height=16, width=16)
    core = EngineCore(served(folders, name), CoreConfig(slots=2))
    encode_alone(core, p)
    got = run_to_end(core, {"r": p}).finished["r"].latents.numpy()
    want = oracle(folders, name, p)
    print(f"{name} {'inpaint' if masked else 'img2img'}: relative L2 {rel_l2(got, want):.2e}")
    assert rel_l2(got, want) <= ALONE_TOL


# ---- the shared batch ---------------------------------------------------------------------------

class RowCounter:
    """Wraps each ControlNet's forward: the rows it was run on, per call."""

    def __init__(self, model):
        self.calls = {name: [] for name in model.controlnets}
        self.saved = {}
        for name, net in model.controlnets.items():
            self.saved[name] = net.forward

            def counted(sample, *args, _name=name, _forward=net.forward, **kwargs):
                self.calls[_name].append(int(sample.shape[0]))
                return _forward(sample, *args, **kwargs)

            net.forward = counted

    def restore(self, model):
        for name, net in model.controlnets.items():
            del net.forward


@pytest.mark.timeout(400)
def test_plain_controlled_windowed_guessing_and_image_rows_share_batches(folders):
    from test_image_inputs import draw_image, encoded

    model = served(folders, "sd")
    rng = random.Random("shared")
    samplers = ["default", "dpmpp_2m", "euler_ancestral"]
    kinds = ["plain", "a", "a+b", "window", "guess", "img2img", "img2img+a"]
    cases = {}
    for k in range(10):
        kind = kinds[k % len(kinds)]
        fields = dict(sampler=samplers[k % 3])
        controls = []
        if kind in ("a", "img2img+a"):
            controls = [Control("a", control_image(rng), scale=rng.choice([0.7, 1.3]))]
        elif kind == "a+b":
            controls = [Control("a", control_image(rng), scale=0.8), Control("b", control_image(rng), scale=1.4)]
        elif kind == "window":
            controls = [Control("b", control_image(rng), scale=1.2, start=0.3, end=0.8)]
        elif kind == "guess":
            controls = [Control("a", control_image(rng), scale=1.0)]
            fields["guess_mode"] = True
        if kind.startswith("img2img"):
            fields.update(image=encoded(draw_image(rng, 16, 16)), strength=rng.choice([0.5, 0.8]))
        cases[f"r{k}-{kind}"] = request(rng, controls, **fields)
    victims = {"v0": request(rng, [Control("a", control_image(rng))], steps=20),
               "v1": request(rng, [Control("b", control_image(rng)), Control("a", control_image(rng))], steps=20)}
    pending = list(cases.items())
    pending.insert(1, ("v0", victims["v0"]))
    pending.insert(4, ("v1", victims["v1"]))
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    seen = {"mixed": 0}

    def join_cancel_and_count(d):
        for _ in range(rng.choice((0, 1, 1, 2))):  # late joins
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            r = core.requests.get(vid)
            if r is not None and r.step >= 3 and not r.stopping:
                core.abort_requests([vid])
        running = [r for g in core.groups.values() for r in g.requests if r is not None and g.runnable[r.slot]]
        seen["mixed"] += {bool(r.params.controls) or "controls" in r.slot_inputs for r in running} == {True, False}

    counter = RowCounter(model)
    try:
        d = run_to_end(core, before_step=join_cancel_and_count, waiting=lambda: bool(pending), limit=2000)
    finally:
        counter.restore(model)
    assert set(d.canceled) == set(victims) and set(d.results) == set(cases), d.failed
    assert seen["mixed"] > 5, "controlled and plain requests did not share batches"
    # each ControlNet ran on a sub-batch only: never on every row of a call
    assert counter.calls["a"] and counter.calls["b"]
    assert max(counter.calls["b"]) < 8
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], oracle(folders, "sd", p))
        print(f"shared {rid} {p.sampler}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


@pytest.mark.timeout(400)
def test_flux_plain_controlled_windowed_and_true_cfg_rows_share_batches(folders):
    model = served(folders, "flux")
    rng = random.Random("flux-shared")
    kinds = ["plain", "a", "a+b", "window", "true-cfg"]
    cases = {}
    for k in range(7):
        kind = kinds[k % len(kinds)]
        fields = dict(sampler=["default", "flow_euler"][k % 2], negative_prompt=None)
        controls = []
        if kind in ("a", "true-cfg"):
            controls = [Control("a", control_image(rng), scale=rng.choice([0.7, 1.3]))]
        elif kind == "a+b":
            controls = [Control("a", control_image(rng), scale=0.8), Control("b", control_image(rng), scale=1.4)]
        elif kind == "window":
            controls = [Control("b", control_image(rng), scale=1.2, start=0.3, end=0.8)]
        if kind == "true-cfg":
            fields.update(true_cfg=2.0, negative_prompt="blurry")
        cases[f"r{k}-{kind}"] = request(rng, controls, **fields)
    victims = {"v0": request(rng, [Control("a", control_image(rng))], steps=20, negative_prompt=None)}
    pending = list(cases.items())
    pending.insert(1, ("v0", victims["v0"]))
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))

    def join_and_cancel(d):
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                core.add_request(*pending.pop(0))
        r = core.requests.get("v0")
        if r is not None and r.step >= 3 and not r.stopping:
            core.abort_requests(["v0"])

    d = run_to_end(core, before_step=join_and_cancel, waiting=lambda: bool(pending), limit=2000)
    assert set(d.canceled) == set(victims) and set(d.results) == set(cases), d.failed
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], oracle(folders, "flux", p))
        print(f"flux shared {rid} {p.sampler}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


@pytest.mark.timeout(300)
def test_pooled_controlnet_rows_share_batches_with_plain_rows(folders):
    """A shuffle-style ControlNet (`global_pool_conditions`: mean-pooled residuals, which
    put its request in guess mode) beside plain rows, a ControlNet A row and A with the
    pooled one after it, joining late, one pooled request canceled, free slots poisoned
    before every step: each request equals its pipeline."""
    from test_core import poison_free_slots

    model = served(folders, "sd")
    rng = random.Random("pooled-shared")
    cases = {"plain": request(rng, steps=6, guidance=3.5),
             "pooled": request(rng, [Control("s", control_image(rng), scale=1.2)], steps=6, guidance=3.5),
             "a": request(rng, [Control("a", control_image(rng), scale=0.9)], steps=5, guidance=3.5),
             "pooled-one-row": request(rng, [Control("s", control_image(rng))], steps=5, guidance=1.0),
             "a-then-pooled": request(rng, [Control("a", control_image(rng)), Control("s", control_image(rng),
                                                                                       scale=0.8)],
                                      steps=6, guidance=3.5, sampler="dpmpp_2m")}
    victim = request(rng, [Control("s", control_image(rng))], steps=20, guidance=3.5)
    items = list(cases.items())
    arrivals = {0: items[:2] + [("v", victim)], 2: items[2:4], 3: items[4:]}
    core = EngineCore(model, CoreConfig(slots=4, max_queue=16))
    counter = RowCounter(model)
    try:
        d = run_to_end(core, arrivals=arrivals, cancels={4: ["v"]}, before_step=lambda d: poison_free_slots(d.core))
    finally:
        counter.restore(model)
    assert set(d.results) == set(cases) and set(d.canceled) == {"v"}, d.failed
    assert counter.calls["s"]
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], oracle(folders, "sd", p))
        print(f"pooled shared {rid}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


@pytest.mark.timeout(120)
def test_each_controlnet_runs_only_on_its_rows_in_their_window(folders):
    """Four requests in one call: plain, A (two rows), A+B windowed to the first half
    (two rows, guess mode: one row each), the pooling ControlNet S (two rows, guess mode as
    its pipeline: one row); the ControlNets' row counts per step say who ran."""
    model = served(folders, "sd")
    rng = random.Random("rows")
    cases = {"plain": request(rng, steps=4, guidance=3.5),
             "a": request(rng, [Control("a", control_image(rng))], steps=4, guidance=3.5),
             "ab": request(rng, [Control("a", control_image(rng)), Control("b", control_image(rng), end=0.5)],
                           steps=4, guidance=3.5, guess_mode=True),
             "s": request(rng, [Control("s", control_image(rng))], steps=4, guidance=3.5)}
    counter = RowCounter(model)
    try:
        d = run_to_end(EngineCore(model, CoreConfig(slots=4)), cases)
    finally:
        counter.restore(model)
    assert set(d.finished) == set(cases)
    assert counter.calls["a"] == [3] * 4  # a's two rows and ab's prompt row, every step
    assert counter.calls["b"] == [1] * 2  # ab's prompt row, the first half of its steps
    assert counter.calls["s"] == [1] * 4  # s's prompt row: pooled residuals put it in guess mode


@pytest.mark.timeout(300)
def test_lora_rows_and_controlnet_rows_share_calls(folders, tmp_path):
    """Plain, LoRA, ControlNet and LoRA + ControlNet rows in the same calls, each equal to
    the pipeline (`load_lora_weights` + `set_adapters`, the ControlNet pipeline made
    `from_pipe` of it): the adapter rows and the ControlNets' sub-batches do not disturb each other."""
    from diffusers import StableDiffusionPipeline

    from engine.lora import AdapterPool
    from engine.testing.loras import lora_pipeline, make_lora

    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    spec = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    make_lora(StableDiffusionPipeline.from_pretrained(folders["sd"]), "A", 41, {"unet": spec}, lora_dir / "A")
    model = load_model(folders["sd"])  # its own: the pool wraps its UNet's layers
    attach_controlnets(model, folders["sd-nets"])
    core = EngineCore(model, CoreConfig(slots=4), adapters=AdapterPool(model, lora_dir, budget_bytes=64 << 20))
    rng = random.Random("lora")
    cases = {"plain": request(rng, steps=5, guidance=3.5),
             "lora": request(rng, steps=5, guidance=3.5, loras={"A": 0.8}),
             "control": request(rng, [Control("a", control_image(rng), scale=0.9)], steps=5, guidance=3.5),
             "both": request(rng, [Control("a", control_image(rng)), Control("b", control_image(rng), scale=0.7)],
                             steps=5, guidance=3.5, loras={"A": 1.2})}
    d = run_to_end(core, cases)
    assert set(d.results) == set(cases), d.failed
    pipe = lora_pipeline(str(folders["sd"]), str(lora_dir))
    for rid, p in cases.items():
        if p.loras:
            pipe.enable_lora()
            pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
        else:
            pipe.disable_lora()
        if p.controls:
            want = controlnet_pipeline_output(folders["sd"], folders["sd-nets"], p, base=pipe)
        else:
            from engine.testing.loras import lora_pipeline_output

            want = lora_pipeline_output(folders["sd"], lora_dir, p)
        err = rel_l2(d.results[rid], want)
        print(f"lora-shared {rid}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


# ---- parking ------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_controls_are_parked_and_brought_back_with_the_slot(folders):
    model = served(folders, "sd")
    rng = random.Random("park")
    low = request(rng, [Control("a", control_image(rng), scale=1.2), Control("b", control_image(rng), start=0.2)],
                  steps=10, guidance=3.5, priority=0)
    highs = {f"h{k}": request(rng, steps=3, priority=10) for k in range(2)}
    core = EngineCore(model, CoreConfig(slots=1, preempt_min_steps=1))
    arrivals = {3: list(highs.items())}

    def add_highs(d):
        for item in arrivals.pop(d.calls, []):
            core.add_request(*item)

    d = run_to_end(core, {"low": low}, before_step=add_highs, limit=500)
    assert set(d.finished) == {"low", *highs}, d.failed
    assert d.finished["low"].timings.preemptions >= 1
    assert rel_l2(d.results["low"], oracle(folders, "sd", low)) <= SHARED_TOL


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_bad_controls_are_rejected_naming_the_field(folders):
    rng = random.Random("bad")
    image = control_image(rng)
    core = EngineCore(served(folders, "sd"), CoreConfig(slots=2))
    bad = {
        "unknown name": [Control("nope", image)],
        "not an image": [Control("a", b"not an image")],
        "empty image": [Control("a", b"")],
        "nan scale": [Control("a", image, scale=float("nan"))],
        "huge scale": [Control("a", image, scale=1e6)],
        "empty window": [Control("a", image, start=0.5, end=0.5)],
        "window past the end": [Control("a", image, end=1.5)],
        "negative start": [Control("a", image, start=-0.1)],
        "too many": [Control("a", image)] * 9,
        # diffusers' multi-ControlNet adds the others into the first's residuals in place: 1 × 1 ones first fail
        "a pooled one before a full one": [Control("s", image), Control("a", image)],
    }
    for why, controls in bad.items():
        with pytest.raises(RequestRejected) as info:
            core.add_request(why, GenerateParams(prompt="a red circle", controls=tuple(controls)))
        assert info.value.field == "controls", why
    with pytest.raises(RequestRejected) as info:
        core.add_request("guess", GenerateParams(prompt="a red circle", guess_mode=True))
    assert info.value.field == "guess_mode"
    from engine.protocol import StepCache

    flux = EngineCore(served(folders, "flux"), CoreConfig(slots=2))
    for fields, field in (({"guess_mode": True}, "guess_mode"), ({"cache": StepCache(kind="first_block")}, "controls"),
                          ({"image": image, "height": 16, "width": 16}, "controls")):
        with pytest.raises(RequestRejected) as info:  # FLUX has no guess mode; residuals and a step cache don't mix
            flux.add_request("r", GenerateParams(prompt="a red circle", controls=(Control("a", image),), **fields))
        assert info.value.field == field
    plain = EngineCore(load_model(folders["sd"]), CoreConfig(slots=2))  # serves no ControlNet
    with pytest.raises(RequestRejected) as info:
        plain.add_request("r", GenerateParams(prompt="a red circle", controls=(Control("a", image),)))
    assert info.value.field == "controls" and "--controlnet" in info.value.reason
    # nothing else was lost: a good request still runs
    d = run_to_end(core, {"ok": GenerateParams(prompt="a red circle", steps=2, output="latent",
                                               controls=(Control("a", image),))})
    assert "ok" in d.finished


def test_a_controlnet_that_does_not_fit_the_denoiser_is_refused(folders):
    sd = load_model(folders["sd"])
    with pytest.raises(ValueError, match="not the served unet"):
        load_controlnet(sd, folders["sdxl-nets"]["a"])
    with pytest.raises(ValueError, match="does not serve"):
        load_controlnet(sd, folders["flux-nets"]["a"])
    with pytest.raises(ValueError, match="not a ControlNet folder"):
        load_controlnet(sd, folders["sd"])


# ---- the interfaces: engine process, Python client, HTTP, CLI -------------------------------

@pytest.mark.timeout(400)
def test_controls_and_ip_images_through_the_engine_process_the_client_http_and_the_cli(folders, tmp_path):
    import base64
    import json
    import subprocess
    import sys

    import httpx

    from engine.protocol import Completed
    from frontend import Client
    from tests.http_helpers import serving
    from tests.output_contract import assert_images_close
    from tests.proc_helpers import REPO, env

    pytest.importorskip("openai")
    rng = random.Random("interfaces")
    nets = folders["sd-nets"]
    edges, other = control_image(rng), control_image(rng)
    from engine.testing.tiny_conditioning import build_ip_adapter

    ip_folder = build_ip_adapter(tmp_path / "ip", folders["sd"], seed=5)
    picture = control_image(rng)
    with serving("--model", str(folders["sd"]), "--slots", "2", "--decode-workers", "1",
                 "--controlnet", f"a={nets['a']}", "--controlnet", f"b={nets['b']}",
                 "--ip-adapter", str(ip_folder)) as (engine, gw):
        listed = httpx.get(gw.url + "/v1/models", timeout=30).json()["data"]
        assert {(m["id"], m.get("type")) for m in listed} >= {("a", "controlnet"), ("b", "controlnet")}

        # the Python client: nested bytes travel as frames (controls.N.image), latents against the pipeline
        p = GenerateParams(prompt="a red circle", steps=4, guidance=3.0, seed=11, output="latent", negative_prompt="",
                           controls=(Control("a", edges, scale=0.8), Control("b", other, scale=1.2, end=0.5)))
        with Client(engine.address) as client:
            result = client.submit(p, progress=False).result(timeout=120)
            assert isinstance(result, Completed), result
            latents = np.asarray(result.output).reshape(4, 8, 8)
            assert rel_l2(latents, oracle(folders, "sd", p)) <= SHARED_TOL
            png_fields = dict(prompt="a red circle", steps=4, guidance=3.0, seed=11, negative_prompt="",
                              controls=(Control("a", edges, scale=0.8),))
            direct = client.submit(GenerateParams(**png_fields), progress=False).result(timeout=120)
            assert isinstance(direct, Completed), direct
            plain = client.submit(GenerateParams(**{**png_fields, "controls": ()}), progress=False).result(timeout=120)
            ip_fields = dict(prompt="a red circle", steps=4, guidance=3.0, seed=12, negative_prompt="",
                             ip_image=picture, ip_scale=0.7)
            direct_ip = client.submit(GenerateParams(**ip_fields), progress=False).result(timeout=120)
            assert isinstance(direct_ip, Completed), direct_ip

        # the openai client: extra_body controls with a base64 image; the same image as the Python client's
        openai_client = gw.openai()
        body = {"steps": 4, "guidance": 3.0, "seed": 11, "negative_prompt": "",
                "controls": [{"name": "a", "image": base64.b64encode(edges).decode(), "scale": 0.8}]}
        r = openai_client.images.generate(prompt="a red circle", response_format="b64_json", extra_body=body)
        assert_images_close(r.data[0].b64_json, direct.output)
        from tests.output_contract import image_difference

        assert image_difference(r.data[0].b64_json, plain.output) > 1, "the control changed nothing"
        # the IP-Adapter through the openai client: ip_image as base64
        r = openai_client.images.generate(prompt="a red circle", response_format="b64_json", extra_body={
            "steps": 4, "guidance": 3.0, "seed": 12, "negative_prompt": "",
            "ip_image": base64.b64encode(picture).decode(), "ip_scale": 0.7})
        assert_images_close(r.data[0].b64_json, direct_ip.output)
        # a bad control: 400 naming controls, nothing else lost
        bad = httpx.post(gw.url + "/v1/images/generations", timeout=60, json={
            "prompt": "a red circle", "controls": [{"name": "nope", "image": base64.b64encode(edges).decode()}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "controls", bad.text
        # the edits form: controls as JSON text beside the image file
        r = openai_client.images.edit(image=("in.png", other, "image/png"), prompt="a red circle",
                                      extra_body={"steps": 4, "strength": 0.6, "seed": 3,
                                                  "controls": json.dumps([{"name": "a", "scale": 0.9,
                                                                           "image": base64.b64encode(edges).decode()}])})
        assert r.data[0].b64_json

        # the CLI: --control NAME=PATH:SCALE
        path = tmp_path / "edges.png"
        path.write_bytes(edges)
        out = tmp_path / "out.png"
        done = subprocess.run([sys.executable, "-m", "frontend", "generate", "--address", engine.address,
                               "--prompt", "a red circle", "--steps", "4", "--guidance", "3", "--seed", "11",
                               "--control", f"a={path}:0.8", "-o", str(out)],
                              cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert_images_close(base64.b64encode(out.read_bytes()).decode(), direct.output)
        path = tmp_path / "picture.png"
        path.write_bytes(picture)
        done = subprocess.run([sys.executable, "-m", "frontend", "generate", "--address", engine.address,
                               "--prompt", "a red circle", "--steps", "4", "--guidance", "3", "--seed", "12",
                               "--ip-image", str(path), "--ip-scale", "0.7", "-o", str(out)],
                              cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert_images_close(base64.b64encode(out.read_bytes()).decode(), direct_ip.output)
