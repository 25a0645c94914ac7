"""SD3 ControlNet per request, in the shared batch: a request alone against diffusers' own
`StableDiffusion3ControlNetPipeline` (one `SD3ControlNetModel`, an `SD3MultiControlNetModel`
list, a start/end window, one row without guidance, a control image resized, an
SD3.5-style ControlNet without text input); one shared batch of plain rows, ControlNet A
at two scales, A+B, a window and a row without guidance, with late joins and a cancel;
LoRA and ControlNet rows in the same calls; the ControlNet run on both rows of a guided
request and on no plain row; every control SD3 does not serve rejected naming its field;
an SD3 ControlNet that does not fit the served transformer refused at start.

The pipeline samples its control latents from torch's global generator (it passes none
to `latent_dist.sample`): the oracle seeds it with the request's seed, as the engine
seeds the generator it draws them from. Tiny random ControlNets built as diffusers'
tests build theirs (`build_controlnet` on a `build_sd3` folder)."""
from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from engine.core import CoreConfig, EngineCore, RequestRejected
from engine.models.controlnet import attach_controlnets, load_controlnet
from engine.models.loading import load_model
from engine.protocol import Control, GenerateParams
from engine.testing.pipeline_oracle import load_pipeline, oracle_scheduler, pipeline_output_of, rel_l2
from engine.testing.tiny_conditioning import build_controlnet
from engine.testing.tiny_pipelines import build_sd, build_sd3

from core_driver import run_to_end
from test_controlnet import _oracle_net, _pil, control_image, encode_alone, msgspec_replace
from test_core import poison_free_slots

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PROMPTS = ["a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnet-sd3")
    sd3 = build_sd3(root / "sd3", seed=41)
    return {"sd3": sd3, "sd": build_sd(root / "sd", seed=42),
            # InstantX-style (zeros for the pooled projection, unshifted control latents)
            "nets": {"a": build_controlnet(root / "a", sd3, seed=1), "b": build_controlnet(root / "b", sd3, seed=2)},
            # SD3.5-style: the pooled prompt, shifted latents, no text input, the transformer's positional embedding
            "text-free": build_controlnet(root / "c", sd3, seed=3, force_zeros_for_pooled_projection=False,
                                          takes_prompt=False)}


@functools.lru_cache(maxsize=2)
def _served(folder, nets: tuple):
    model = load_model(folder)
    attach_controlnets(model, dict(nets))
    return model


def served(folders, which: str = "nets"):
    """The engine's SD3 model with the ControlNets `folders[which]` ("nets": a and b;
    "text-free": c alone, which cannot be summed with them), loaded once."""
    nets = folders["nets"] if which == "nets" else {"c": folders["text-free"]}
    return _served(folders["sd3"], tuple(sorted(nets.items())))


def nets_of(folders) -> dict:
    return {**folders["nets"], "c": folders["text-free"]}


@torch.no_grad()
def oracle(folders, p: GenerateParams, base=None) -> np.ndarray:
    """`StableDiffusion3ControlNetPipeline`'s latents for `p` (an `SD3MultiControlNetModel`
    of the named ControlNets, in order, for several; made `from_pipe` of `base`, the SD3
    pipeline by default), the sampler swapped in as the pipeline oracle does; the plain
    pipeline's without controls."""
    from diffusers import StableDiffusion3ControlNetPipeline
    from diffusers.models.controlnets.controlnet_sd3 import SD3MultiControlNetModel

    if not p.controls:
        return pipeline_output_of(folders["sd3"], p)
    nets = nets_of(folders)
    models = [_oracle_net(str(nets[c.name])) for c in p.controls]
    single = len(models) == 1
    base = load_pipeline(str(folders["sd3"])) if base is None else base
    pipe = StableDiffusion3ControlNetPipeline.from_pipe(
        base, controlnet=models[0] if single else SD3MultiControlNetModel(models))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = oracle_scheduler(p.sampler, pipe.scheduler)

    def each(values):
        return values[0] if single else list(values)

    torch.manual_seed(p.seed)  # the control latents' draw: the pipeline passes no generator to it
    out = pipe(p.prompt, negative_prompt=p.negative_prompt, num_inference_steps=p.steps, guidance_scale=p.guidance,
               height=p.height, width=p.width, control_image=each([_pil(c.image) for c in p.controls]),
               controlnet_conditioning_scale=each([c.scale for c in p.controls]),
               control_guidance_start=each([c.start for c in p.controls]),
               control_guidance_end=each([c.end for c in p.controls]),
               generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent")
    return out.images[0].float().numpy()


def request(rng: random.Random, controls=(), **fields) -> GenerateParams:
    drawn = dict(prompt=rng.choice(PROMPTS), negative_prompt=rng.choice(["", "blurry"]), steps=rng.choice([4, 5]),
                 guidance=rng.choice([1.0, 3.5]), seed=rng.randrange(10_000), output="latent", controls=tuple(controls))
    return GenerateParams(**{**drawn, **fields})


class RowCounter:
    """Wraps each ControlNet's forward: the rows it was run on, per call."""

    def __init__(self, model):
        self.model, self.calls = model, {name: [] for name in model.controlnets}
        for name, net in model.controlnets.items():
            def counted(*args, _name=name, _forward=net.forward, **kwargs):
                self.calls[_name].append(int(kwargs["hidden_states"].shape[0]))
                return _forward(*args, **kwargs)

            net.forward = counted

    def restore(self):
        for net in self.model.controlnets.values():
            del net.forward


# ---- a request alone equals the pipeline ------------------------------------------------------

ALONE = [("single", "default"), ("single", "dpmpp_2m"), ("multi", "flow_euler"), ("window", "default"),
         ("one-row", "default"), ("resized", "default"), ("text-free", "default")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, sampler", ALONE, ids=[f"{c}-{s}" for c, s in ALONE])
def test_request_alone_equals_the_sd3_controlnet_pipeline(folders, case, sampler):
    rng = random.Random(f"sd3-alone-{case}-{sampler}")
    a = Control("a", control_image(rng), scale=round(rng.uniform(0.5, 1.5), 2))
    fields = dict(sampler=sampler, guidance=3.5, negative_prompt="blurry")
    controls = [a]
    if case == "multi":
        controls = [a, Control("b", control_image(rng), scale=0.6), Control("a", control_image(rng), scale=1.2)]
    elif case == "window":
        controls = [Control("a", a.image, scale=1.1, start=0.2, end=0.7), Control("b", control_image(rng), end=0.5)]
    elif case == "one-row":
        fields["guidance"] = 1.0
    elif case == "resized":  # a control image of another size, resized to the output's
        controls = [Control("a", control_image(rng, 20, 12), scale=0.9)]
        fields.update(height=16, width=24)
    elif case == "text-free":
        controls = [Control("c", a.image, scale=1.3)]
    p = request(rng, controls, **fields)
    core = EngineCore(served(folders, "text-free" if case == "text-free" else "nets"), CoreConfig(slots=2))
    encode_alone(core, p)
    d = run_to_end(core, {"r": p})
    assert "r" in d.finished, d.failed
    got = d.finished["r"].latents.numpy()
    want = oracle(folders, p)
    err = rel_l2(got, want)
    # the residuals' own effect (the control latents are drawn either way)
    plain = oracle(folders, msgspec_replace(p, controls=tuple(msgspec_replace(c, scale=0.0) for c in p.controls)))
    print(f"sd3 alone {case} {sampler}: relative L2 {err:.2e} (the control moves it {rel_l2(plain, want):.2f})")
    assert got.shape == want.shape
    assert err <= ALONE_TOL
    assert rel_l2(plain, want) > 100 * ALONE_TOL, "the control changed nothing: the test could not fail"


# ---- the shared batch ---------------------------------------------------------------------------

@pytest.mark.timeout(400)
def test_plain_controlled_and_windowed_sd3_rows_share_batches(folders):
    """Plain rows, A at two scales, A+B, a window and a request without guidance join a
    running batch late; one controlled request is canceled; free slots are poisoned before
    every step. Each request equals its pipeline; the ControlNets ran on sub-batches only."""
    model = served(folders)
    rng = random.Random("sd3-shared")
    kinds = ["plain", "a", "a+b", "window", "one-row", "a", "plain"]
    cases = {}
    for k, kind in enumerate(kinds):
        fields = dict(sampler=["default", "flow_euler"][k % 2], guidance=1.0 if kind == "one-row" else 3.5)
        controls = []
        if kind in ("a", "one-row"):  # A at 0.7 and at 1.3 (the two "a" rows), 1.0 without guidance
            controls = [Control("a", control_image(rng), scale={1: 0.7, 5: 1.3}.get(k, 1.0))]
        elif kind == "a+b":
            controls = [Control("a", control_image(rng), scale=0.8), Control("b", control_image(rng), scale=1.4)]
        elif kind == "window":
            controls = [Control("b", control_image(rng), scale=1.2, start=0.3, end=0.8)]
        cases[f"r{k}-{kind}"] = request(rng, controls, **fields)
    victim = request(rng, [Control("a", control_image(rng))], steps=20, guidance=3.5)
    pending = list(cases.items())
    pending.insert(1, ("v", victim))
    core = EngineCore(model, CoreConfig(slots=4, max_queue=16))
    seen = {"mixed": 0}

    def join_cancel_poison(d):
        for _ in range(rng.choice((0, 1, 1, 2))):  # late joins
            if pending:
                core.add_request(*pending.pop(0))
        r = core.requests.get("v")
        if r is not None and r.step >= 2 and not r.stopping:
            core.abort_requests(["v"])
        running = [r for g in core.groups.values() for r in g.requests if r is not None and g.runnable[r.slot]]
        seen["mixed"] += {"controls" in r.slot_inputs for r in running} == {True, False}
        poison_free_slots(core)

    counter = RowCounter(model)
    try:
        d = run_to_end(core, before_step=join_cancel_poison, waiting=lambda: bool(pending), limit=1000)
    finally:
        counter.restore()
    assert set(d.canceled) == {"v"} and set(d.results) == set(cases), d.failed
    assert seen["mixed"] > 3, "controlled and plain requests did not share batches"
    assert counter.calls["a"] and counter.calls["b"] and max(counter.calls["b"]) < 8
    for rid, p in cases.items():
        err = rel_l2(d.results[rid], oracle(folders, p))
        print(f"sd3 shared {rid} {p.sampler}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


@pytest.mark.timeout(120)
def test_the_controlnet_runs_on_both_rows_of_a_guided_request_and_on_no_plain_row(folders):
    """As the pipeline runs its ControlNet on `torch.cat([latents] * 2)`: both rows of a
    guided request, one of a request without guidance, none of a plain one; B only in its
    window (the first half of the steps)."""
    model = served(folders)
    rng = random.Random("sd3-rows")
    cases = {"plain": request(rng, steps=4, guidance=3.5),
             "a": request(rng, [Control("a", control_image(rng))], steps=4, guidance=3.5),
             "one-row": request(rng, [Control("a", control_image(rng)), Control("b", control_image(rng), end=0.5)],
                                steps=4, guidance=1.0)}
    counter = RowCounter(model)
    try:
        d = run_to_end(EngineCore(model, CoreConfig(slots=4)), cases)
    finally:
        counter.restore()
    assert set(d.finished) == set(cases), d.failed
    assert counter.calls["a"] == [3] * 4
    assert counter.calls["b"] == [1] * 2


@pytest.mark.timeout(300)
def test_lora_rows_and_sd3_controlnet_rows_share_calls(folders, tmp_path):
    """Plain, LoRA, ControlNet and LoRA + ControlNet rows in the same calls, each equal to
    the pipeline (`load_lora_weights` + `set_adapters`, the ControlNet pipeline made
    `from_pipe` of it)."""
    from engine.lora import AdapterPool
    from engine.testing.loras import lora_pipeline, lora_pipeline_output, make_lora

    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    spec = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "add_q_proj", "to_out.0", "ff.net.2"])
    make_lora(load_pipeline(str(folders["sd3"])), "S", 21, {"transformer": spec}, lora_dir / "S")
    model = load_model(folders["sd3"])  # its own: the pool wraps its transformer's layers
    attach_controlnets(model, folders["nets"])
    core = EngineCore(model, CoreConfig(slots=4), adapters=AdapterPool(model, lora_dir, budget_bytes=64 << 20))
    rng = random.Random("sd3-lora")
    cases = {"plain": request(rng, steps=4, guidance=3.5),
             "lora": request(rng, steps=4, guidance=3.5, loras={"S": 0.8}),
             "control": request(rng, [Control("a", control_image(rng), scale=0.9)], steps=4, guidance=3.5),
             "both": request(rng, [Control("a", control_image(rng)), Control("b", control_image(rng), scale=0.7)],
                             steps=4, guidance=3.5, loras={"S": 1.2})}
    d = run_to_end(core, cases)
    assert set(d.results) == set(cases), d.failed
    pipe = lora_pipeline(str(folders["sd3"]), str(lora_dir))
    for rid, p in cases.items():
        if p.controls:
            if p.loras:
                pipe.enable_lora()
                pipe.set_adapters(list(p.loras), adapter_weights=list(p.loras.values()))
            else:
                pipe.disable_lora()
            want = oracle(folders, p, base=pipe)
        else:
            want = lora_pipeline_output(folders["sd3"], lora_dir, p)
        err = rel_l2(d.results[rid], want)
        print(f"sd3 lora-shared {rid}: relative L2 {err:.2e}")
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


# ---- what SD3 does not serve --------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_controls_sd3_does_not_serve_are_rejected_naming_the_field(folders):
    from engine.protocol import StepCache

    rng = random.Random("sd3-bad")
    image = control_image(rng)
    core = EngineCore(served(folders), CoreConfig(slots=2))
    bad = [({"image": image, "height": 16, "width": 16}, "controls"),  # no SD3 ControlNet img2img pipeline
           ({"guess_mode": True}, "guess_mode"),  # SD/SDXL only
           ({"cache": StepCache(kind="first_block")}, "controls"),
           ({"controls": (Control("c", image),)}, "controls")]  # not served beside a and b
    for fields, field in bad:
        with pytest.raises(RequestRejected) as info:
            core.add_request("r", GenerateParams(prompt="a red circle", **{"controls": (Control("a", image),),
                                                                             **fields}))
        assert info.value.field == field, fields
    d = run_to_end(core, {"ok": GenerateParams(prompt="a red circle", steps=2, output="latent",
                                               controls=(Control("a", image),))})
    assert "ok" in d.finished  # nothing else was lost


def test_an_sd3_controlnet_that_does_not_fit_is_refused_at_start(folders, tmp_path):
    from diffusers import SD3ControlNetModel

    sd3, sd = load_model(folders["sd3"]), load_model(folders["sd"])
    with pytest.raises(ValueError, match="does not serve"):
        load_controlnet(sd, folders["nets"]["a"])
    with pytest.raises(ValueError, match="does not serve"):
        load_controlnet(sd3, build_controlnet(tmp_path / "sd-net", folders["sd"], seed=1))
    config = dict(SD3ControlNetModel.load_config(folders["nets"]["a"]))
    for change, why in (({"pooled_projection_dim": 96}, "pooled_projection_dim"),
                        ({"num_attention_heads": 2}, "width"),
                        ({"extra_conditioning_channels": 1}, "inpainting"),
                        ({"pos_embed_max_size": 8}, "positional embedding")):
        folder = tmp_path / why.replace(" ", "-")
        SD3ControlNetModel.from_config({**config, **change}).save_pretrained(folder)
        with pytest.raises(ValueError, match=why):
            load_controlnet(sd3, folder)
    with pytest.raises(ValueError, match="cannot be summed"):  # the multi-ControlNet runs all as its first
        attach_controlnets(sd3, {**folders["nets"], "c": folders["text-free"]})
