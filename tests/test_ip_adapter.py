"""IP-Adapter per request, in the shared batch: a request alone against diffusers' own
pipeline with `load_ip_adapter` + `set_ip_adapter_scale` (SD and SDXL); one shared batch
of plain rows, IP-Adapter rows at several scales (one image sent twice: encoded once) and
an IP-Adapter + ControlNet row, with late joins and cancels; bad fields rejected by name.
The IP-Adapter weights and image encoder are built in code (`build_ip_adapter`)."""
from __future__ import annotations

import functools
import io
import random

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from engine.core import CoreConfig, EngineCore, RequestRejected
from engine.core.solvers import make_scheduler
from engine.models.controlnet import attach_controlnets
from engine.models.ip_adapter import attach_ip_adapter
from engine.models.loading import load_model
from engine.protocol import Control, GenerateParams
from engine.testing.pipeline_oracle import pipeline_output_of, rel_l2
from engine.testing.tiny_conditioning import build_controlnet, build_ip_adapter
from engine.testing.tiny_pipelines import build_sd, build_sdxl

from core_driver import run_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PROMPTS = ["a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ip-adapter")
    sd, sdxl = build_sd(root / "sd", seed=51), build_sdxl(root / "sdxl", seed=52)
    return {"sd": sd, "sdxl": sdxl, "sd-ip": build_ip_adapter(root / "sd-ip", sd, seed=1),
            "sdxl-ip": build_ip_adapter(root / "sdxl-ip", sdxl, seed=2),
            "sd-net": build_controlnet(root / "sd-net", sd, seed=3)}


@functools.lru_cache(maxsize=4)
def _served(folder, ip, net):
    model = load_model(folder)
    attach_ip_adapter(model, ip)
    if net is not None:
        attach_controlnets(model, {"a": net})
    return model


def served(folders, name):
    return _served(folders[name], folders[f"{name}-ip"], folders.get(f"{name}-net"))


def picture(rng: random.Random, width: int = 24, height: int = 20) -> bytes:
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.randrange(width - 3), rng.randrange(height - 3)
        draw.ellipse([x0, y0, x0 + rng.randint(2, 10), y0 + rng.randint(2, 10)],
                     fill=tuple(rng.randrange(256) for _ in range(3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _pil(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


@functools.lru_cache(maxsize=4)
def ip_pipeline(folder: str, ip: str):
    import diffusers

    from engine.models.geometry import pipeline_class_of
    import pathlib

    pipe = getattr(diffusers, pipeline_class_of(pathlib.Path(folder))).from_pretrained(folder, low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(ip, subfolder="", weight_name="ip_adapter.safetensors", image_encoder_folder="image_encoder")
    return pipe


@torch.no_grad()
def oracle(folders, name, p: GenerateParams) -> np.ndarray:
    """The pipeline for `p`: the plain one without an IP image; with one, the pipeline with
    the IP-Adapter loaded and `set_ip_adapter_scale(ip_scale)` (the ControlNet pipeline
    `from_pipe` of it with controls)."""
    if p.ip_image is None:
        return pipeline_output_of(folders[name], p)
    pipe = ip_pipeline(str(folders[name]), str(folders[f"{name}-ip"]))
    kwargs = {}
    if p.controls:
        import diffusers
        from diffusers import ControlNetModel

        (control,) = p.controls
        pipe = diffusers.StableDiffusionControlNetPipeline.from_pipe(
            pipe, controlnet=ControlNetModel.from_pretrained(folders[f"{name}-net"]))
        pipe.set_progress_bar_config(disable=True)
        kwargs.update(image=_pil(control.image), controlnet_conditioning_scale=control.scale)
    pipe.set_ip_adapter_scale(p.ip_scale)
    original = pipe.scheduler
    config = dict(original.config, _class_name=type(original).__name__)
    pipe.scheduler = make_scheduler(p.sampler, config) if p.sampler != "default" else type(original).from_config(config)
    try:
        out = pipe(p.prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.steps,
                   guidance_scale=p.guidance, height=p.height, width=p.width, ip_adapter_image=_pil(p.ip_image),
                   generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent", **kwargs)
    finally:
        pipe.scheduler = original
    return out.images[0].float().numpy()


def request(rng, **fields) -> GenerateParams:
    drawn = dict(prompt=rng.choice(PROMPTS), negative_prompt=rng.choice(["", "blurry"]), steps=rng.choice([4, 6]),
                 guidance=rng.choice([1.0, 3.5]), seed=rng.randrange(10_000), output="latent")
    return GenerateParams(**{**drawn, **fields})


def encode_alone(core, p):
    for text in (p.prompt, core.model.negative_text(p) if core.model.cfg_scale(p) is not None else None):
        if text is not None:
            core.embeddings.get_many([text])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, sampler", [("sd", "default"), ("sd", "dpmpp_2m"), ("sdxl", "default")])
def test_request_alone_equals_the_pipeline_with_the_ip_adapter(folders, name, sampler):
    rng = random.Random(f"alone-{name}-{sampler}")
    model = served(folders, name)
    for scale, guidance in ((0.6, 3.5), (1.3, 1.0)):
        p = request(rng, ip_image=picture(rng), ip_scale=scale, guidance=guidance, sampler=sampler)
        core = EngineCore(model, CoreConfig(slots=2))
        encode_alone(core, p)
        d = run_to_end(core, {"r": p})
        assert "r" in d.finished, d.failed
        want = oracle(folders, name, p)
        err = rel_l2(d.results["r"], want)
        moved = rel_l2(oracle(folders, name, msgspec.structs.replace(p, ip_scale=0.0)), want)
        print(f"alone {name} {sampler} scale {scale}: relative L2 {err:.2e} (the image moves it {moved:.2f})")
        assert err <= ALONE_TOL
        assert moved > 100 * ALONE_TOL, "the IP image changed nothing: the test could not fail"
        assert d.finished["r"].timings.image_encode_s > 0


@pytest.mark.timeout(400)
def test_plain_ip_and_controlnet_rows_share_batches(folders):
    model = served(folders, "sd")
    rng = random.Random("shared")
    shared_image = picture(rng)
    cases = {}
    for k in range(8):
        fields = dict(sampler=["default", "dpmpp_2m", "euler_ancestral"][k % 3])
        if k % 4 == 1:
            fields.update(ip_image=shared_image, ip_scale=rng.choice([0.5, 1.2]))
        elif k % 4 == 2:
            fields.update(ip_image=picture(rng), ip_scale=0.8)
        elif k % 4 == 3:
            fields.update(ip_image=picture(rng), ip_scale=0.7,
                          controls=(Control("a", picture(rng, 16, 16), scale=0.9),))
        cases[f"r{k}"] = request(rng, **fields)
    victims = {"v0": request(rng, ip_image=picture(rng), steps=20), "v1": request(rng, steps=20)}
    pending = list(cases.items())
    pending.insert(1, ("v0", victims["v0"]))
    pending.insert(4, ("v1", victims["v1"]))
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    kind = next(k for k in core.kinds if k.name == "ip_image")

    def join_and_cancel(d):
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            r = core.requests.get(vid)
            if r is not None and r.step >= 2 and not r.stopping:
                core.abort_requests([vid])

    d = run_to_end(core, before_step=join_and_cancel, waiting=lambda: bool(pending), limit=2000)
    assert set(d.canceled) == set(victims) and set(d.results) == set(cases), d.failed
    distinct = {p.ip_image for p in [*cases.values(), *victims.values()] if p.ip_image is not None}
    assert kind.encoded == len(distinct)  # the image sent twice was encoded once
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], oracle(folders, "sd", p))
        print(f"shared {rid} ip={p.ip_image is not None} controls={len(p.controls)}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


def test_bad_ip_fields_are_rejected_naming_them(folders):
    rng = random.Random("bad")
    core = EngineCore(served(folders, "sd"), CoreConfig(slots=2))
    for fields, field in (({"ip_image": b"not an image"}, "ip_image"), ({"ip_image": b""}, "ip_image"),
                          ({"ip_image": picture(rng), "ip_scale": float("inf")}, "ip_scale"),
                          ({"ip_scale": 0.5}, "ip_scale")):
        with pytest.raises(RequestRejected) as info:
            core.add_request("r", GenerateParams(prompt="a red circle", **fields))
        assert info.value.field == field, fields
    plain = EngineCore(load_model(folders["sd"]), CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as info:
        plain.add_request("r", GenerateParams(prompt="a red circle", ip_image=picture(rng)))
    assert info.value.field == "ip_image" and "--ip-adapter" in info.value.reason
