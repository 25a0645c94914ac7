"""Step caches decided per request in the shared batch (`GenerateParams.cache`), against
diffusers' own cache hooks on the pipeline for each request alone
(`engine.testing.step_cache_oracle`): the same computed/skipped pattern call by call, and
the same latents (≤ 1e-5 alone, ≤ 1e-4 in shared calls with late joins, cancels and
requests without a cache, and across a park and resume)."""
from __future__ import annotations

import logging
import random
import re

import pytest

from engine.core.outputs import RequestRejected
from engine.protocol import GenerateParams, StepCache
from engine.testing.pipeline_oracle import model_of, rel_l2
from engine.testing.step_cache_oracle import cached_pipeline_output
from engine.testing.tiny_pipelines import build_flux, build_sd, build_sd3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALONE_TOL = 1e-5
SHARED_TOL = 1e-4
PATTERN = re.compile(r"^(\S+): step cache (\S+) (\S+)$")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-cache")
    return {
        "flux": build_flux(root / "flux", guidance_embeds=True, seed=3, layers=2, single_layers=2),
        "sd3": build_sd3(root / "sd3", seed=5, layers=3),
        "sd": build_sd(root / "sd", seed=7),
    }


@pytest.fixture
def patterns(caplog):
    """request id → its units' patterns ("C" computed, "S" skipped, units apart by "/"),
    from the engine's debug log as each slot is released."""
    caplog.set_level(logging.DEBUG, logger="diffslot.core")

    def read() -> dict[str, str]:
        found = {}
        for record in caplog.records:
            match = PATTERN.match(record.getMessage())
            if match:
                found[match.group(1)] = match.group(3)
        return found
    return read


def params(**fields) -> GenerateParams:
    return GenerateParams(**{"output": "latent", "prompt": "a red circle", "steps": 8, "height": 16, "width": 16,
                             **fields})


def oracle_pattern(model, p: GenerateParams, pattern: list) -> str:
    """The oracle's per-call pattern as the engine's per-unit one: FLUX's true CFG makes two
    transformer calls a step (cond, then uncond), each its own cache context."""
    marks = "".join("S" if skipped else "C" for skipped in pattern)
    two_calls = model.cfg_scale(p) is not None and not model.cfg_rows_share_cache
    return f"{marks[0::2]}/{marks[1::2]}" if two_calls else marks


def run_and_release(core, requests, **kwargs):
    """Run to the end, then one more step: slots are released (and their patterns logged)
    at the next admission."""
    from core_driver import run_to_end

    driver = run_to_end(core, requests, **kwargs)
    core.step()
    return driver


MAG_RATIOS = (1.0, 1.05, 1.02, 1.01, 1.0, 0.99, 0.98, 0.95)
ALONE = {
    "flux-first_block": ("flux", dict(cache=StepCache("first_block", threshold=0.3))),
    "flux-first_block-true-cfg": ("flux", dict(negative_prompt="blurry", true_cfg=3.0,
                                               cache=StepCache("first_block", threshold=0.3))),
    "flux-mag": ("flux", dict(cache=StepCache("mag", threshold=0.5))),
    "flux-taylorseer": ("flux", dict(cache=StepCache("taylorseer", cache_interval=2, disable_cache_before_step=2))),
    "flux-taylorseer-lite-true-cfg": ("flux", dict(negative_prompt="blurry", true_cfg=3.0, cache=StepCache(
        "taylorseer", cache_interval=2, disable_cache_before_step=2, use_lite_mode=True))),
    "sd3-taylorseer-lite-cfg": ("sd3", dict(guidance=4.0, cache=StepCache(
        "taylorseer", cache_interval=3, disable_cache_before_step=2, max_order=2, use_lite_mode=True))),
    "sd3-first_block-cfg": ("sd3", dict(guidance=4.0, cache=StepCache("first_block", threshold=0.3))),
    "sd3-mag-cfg": ("sd3", dict(guidance=4.0, cache=StepCache("mag", threshold=0.5, mag_ratios=MAG_RATIOS))),
    "sd3-taylorseer-one-row": ("sd3", dict(guidance=1.0, cache=StepCache("taylorseer", cache_interval=2,
                                                                          disable_cache_before_step=2))),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(ALONE))
def test_request_alone_equals_the_hooked_pipeline(folders, patterns, case):
    from engine.core import CoreConfig, EngineCore

    name, fields = ALONE[case]
    model = model_of(folders[name])
    p = params(**fields)
    core = EngineCore(model, CoreConfig(slots=2))
    driver = run_and_release(core, {"r": p})
    want, pattern = cached_pipeline_output(folders[name], p, model.mag_ratios)
    expected = oracle_pattern(model, p, pattern)
    got = patterns()["r"]
    assert got == expected
    assert "S" in got and "C" in got, f"{case}: a pattern that tests nothing ({got})"
    err = rel_l2(driver.results["r"], want)
    assert err <= ALONE_TOL, f"{case}: relative L2 {err:.3g}"
    units = got.split("/")
    skipped = sum(u.count("S") for u in units) / len(units)
    assert driver.finished["r"].timings.cached_steps == pytest.approx(skipped)
    stats = core.stats()
    assert stats["cache_hits"] == sum(u.count("S") for u in units)
    assert stats["cache_decisions"] == sum(len(u) for u in units)


def test_the_cache_changes_the_result(folders):
    """The comparison above can fail: the same request without its cache differs from the
    hooked pipeline by far more than the tolerance."""
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders["flux"])
    p = params(cache=StepCache("first_block", threshold=0.3))
    want, _ = cached_pipeline_output(folders["flux"], p, model.mag_ratios)
    core = EngineCore(model, CoreConfig(slots=2))
    plain = run_and_release(core, {"r": params()}).results["r"]
    assert rel_l2(plain, want) > 100 * ALONE_TOL


def _mixed(rng: random.Random, count: int) -> dict[str, GenerateParams]:
    caches = [None, StepCache("first_block", threshold=0.15), StepCache("first_block", threshold=0.4),
              StepCache("mag", threshold=0.3), StepCache("mag", threshold=0.8, max_skip_steps=2),
              StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1),
              StepCache("taylorseer", cache_interval=3, disable_cache_before_step=2, max_order=2),
              StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1, use_lite_mode=True)]
    cases = {}
    for k in range(count):
        fields = dict(prompt=rng.choice(["a red circle", "a big blue cat", "the small green dog", ""]),
                      steps=rng.choice([5, 6, 8]), seed=rng.randrange(10_000), guidance=rng.choice([2.0, 4.5]),
                      cache=caches[k % len(caches)])
        if k % 3 == 1:
            fields.update(negative_prompt="blurry", true_cfg=3.0)
        cases[f"r{k}"] = params(**fields)
    return cases


@pytest.mark.timeout(600)
def test_shared_calls_decide_per_request(folders, patterns):
    """Cache-off requests and requests of every kind at two settings share calls at
    different steps, joining late, beside canceled ones: each request equals its own
    pipeline with its own hook, call by call."""
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders["flux"])
    rng = random.Random(30)
    cases = _mixed(rng, 10)
    core = EngineCore(model, CoreConfig(slots=4, max_queue=32))
    pending = list(cases.items())
    victims = ["v0", "v1"]
    pending.insert(1, ("v0", params(steps=12, seed=1, cache=StepCache("first_block", threshold=0.2))))
    pending.insert(4, ("v1", params(steps=12, seed=2, negative_prompt="", true_cfg=2.0,
                                    cache=StepCache("taylorseer", cache_interval=2))))
    seen = {"skipped_in_shared": 0, "before": 0}

    def join_and_cancel(d):
        for _ in range(rng.choice((0, 1, 1, 2))):
            if pending:
                core.add_request(*pending.pop(0))
        for vid in victims:
            request = core.requests.get(vid)
            if request is not None and request.step >= 3 and vid not in d.canceled:
                core.abort_requests([vid])
        seen["before"] = core.runner.cache_rows_skipped
        seen["sharing"] = len(core.requests) > 1

    def count(d, outputs):
        if core.runner.cache_rows_skipped > seen["before"] and seen["sharing"]:
            seen["skipped_in_shared"] += 1

    d = run_and_release(core, (), before_step=join_and_cancel, after_step=count, waiting=lambda: bool(pending),
                        limit=2000)
    assert set(d.canceled) == set(victims) and set(d.results) == set(cases)
    assert seen["skipped_in_shared"] > 3, seen
    found = patterns()
    worst = 0.0
    for rid, p in cases.items():
        if p.cache is None:
            assert rid not in found
            err = rel_l2(d.results[rid], _plain_output(folders["flux"], p))
        else:
            want, pattern = cached_pipeline_output(folders["flux"], p, model.mag_ratios)
            assert found[rid] == oracle_pattern(model, p, pattern), rid
            err = rel_l2(d.results[rid], want)
        worst = max(worst, err)
        assert err <= SHARED_TOL, f"{rid} {p}: relative L2 {err:.3g}"
    kinds_that_skipped = {cases[rid].cache.kind for rid, pat in found.items() if rid in cases and "S" in pat}
    assert kinds_that_skipped == {"first_block", "mag", "taylorseer"}, found


def _lite(interval: int, before: int) -> StepCache:
    return StepCache("taylorseer", cache_interval=interval, disable_cache_before_step=before, use_lite_mode=True)


@pytest.mark.timeout(300)
def test_lite_calls_replay_the_captured_graph(folders, patterns):
    """A call whose only caches are TaylorSeer Lite's runs as an uncached one: the rows on
    a prediction step leave before the call, the rest are padded to a bucket and replay
    its graph (`EagerCapture` re-runs the function on the captured buffers, so a stale
    copy-in shows as a wrong result). Each request still equals diffusers' lite hook
    alone, call by call."""
    from engine.core import CoreConfig, EngineCore
    from engine.core.graphs import EagerCapture, GraphedDenoiser

    model = model_of(folders["flux"])
    core = EngineCore(model, CoreConfig(slots=4, layout="bucketed"))
    capture = EagerCapture()
    seen_rows = []

    class Recording(GraphedDenoiser):
        def __call__(self, inputs):
            seen_rows.append(inputs.rows)
            return super().__call__(inputs)
    core.graphed = Recording(model, capture)
    cases = {"a": params(steps=6, seed=1, cache=_lite(2, 1)), "b": params(steps=8, seed=2, cache=_lite(3, 2)),
             "c": params(steps=5, seed=3, negative_prompt="blurry", true_cfg=3.0, cache=_lite(2, 2)),
             "plain": params(steps=6, seed=4)}
    late = params(steps=6, seed=5, prompt="a blue cross", cache=_lite(2, 1))
    d = run_and_release(core, cases, arrivals={2: [("late", late)]})
    found = patterns()
    for rid, p in {**cases, "late": late}.items():
        if p.cache is None:
            err = rel_l2(d.results[rid], _plain_output(folders["flux"], p))
        else:
            want, pattern = cached_pipeline_output(folders["flux"], p, model.mag_ratios)
            assert found[rid] == oracle_pattern(model, p, pattern), rid
            assert "S" in found[rid], rid
            err = rel_l2(d.results[rid], want)
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"
    assert core.runner.cache_rows_skipped > 0
    # every call that ran went through the graph, at bucket sizes, fewer rows than the batches had
    assert core.graphed.replays == len(seen_rows) and capture.captures > 0  # none eager
    assert set(seen_rows) <= {1, 2, 4, 8}, seen_rows
    assert sum(seen_rows) < core.runner.useful_rows + core.runner.padded_rows
    assert core.graphed.failed == set()


def _plain_output(folder, p):
    from engine.testing.pipeline_oracle import pipeline_output_of

    return pipeline_output_of(folder, p)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cache", [StepCache("first_block", threshold=0.25),
                                   StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1),
                                   StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1,
                                             use_lite_mode=True)], ids=["first_block", "taylorseer", "lite"])
def test_a_parked_cache_comes_back_bit_for_bit(folders, patterns, cache):
    """A cached request parked by a higher-priority one, then resumed, equals its hooked
    pipeline: its cache state went to host memory and back with its slot."""
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders["flux"])
    low = params(steps=10, seed=4, cache=cache)
    high = params(steps=3, seed=5, priority=5)
    core = EngineCore(model, CoreConfig(slots=1, preempt_min_steps=2))
    added = {"high": False}

    def add_high(d):
        request = core.requests.get("low")
        if not added["high"] and request is not None and request.step >= 4:
            core.add_request("high", high)
            added["high"] = True

    d = run_and_release(core, {"low": low}, before_step=add_high)
    assert d.finished["low"].timings.preemptions == 1
    want, pattern = cached_pipeline_output(folders["flux"], low, model.mag_ratios)
    assert patterns()["low"] == oracle_pattern(model, low, pattern)
    assert rel_l2(d.results["low"], want) <= ALONE_TOL


def test_the_server_default_and_off(folders, patterns):
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders["flux"])
    core = EngineCore(model, CoreConfig(slots=2, cache=StepCache("first_block", threshold=0.3)))
    d = run_and_release(core, {"default": params(), "off": params(cache=StepCache("off"))})
    found = patterns()
    assert "S" in found["default"] and "off" not in found
    assert d.finished["default"].timings.cached_steps > 0 and d.finished["off"].timings.cached_steps == 0


@pytest.mark.parametrize("cache, why", [
    (StepCache("deep"), "kind"),
    (StepCache("first_block", threshold=-1.0), "threshold"),
    (StepCache("first_block", cache_interval=2), "takes no cache_interval"),
    (StepCache("taylorseer", threshold=0.1), "takes no threshold"),
    (StepCache("taylorseer", cache_interval=0), "cache_interval"),
    (StepCache("taylorseer", factors_dtype="int8"), "factors_dtype"),
    (StepCache("mag", use_lite_mode=True), "takes no use_lite_mode"),
    (StepCache("mag", mag_ratios=(1.0, float("nan"))), "finite"),
])
def test_bad_caches_are_rejected_naming_cache(folders, cache, why):
    from engine.core import CoreConfig, EngineCore

    core = EngineCore(model_of(folders["flux"]), CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as info:
        core.add_request("r", params(cache=cache))
    assert info.value.field == "cache" and why in str(info.value)
    assert not core.requests


def test_models_that_cannot_cache_reject_it(folders):
    from engine.core import CoreConfig, EngineCore

    sd = EngineCore(model_of(folders["sd"]), CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as info:
        sd.add_request("r", params(height=None, width=None, cache=StepCache("first_block")))
    assert info.value.field == "cache" and "UNet" in str(info.value)
    sd3 = EngineCore(model_of(folders["sd3"]), CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as info:  # no calibrated ratios for this folder
        sd3.add_request("r", params(cache=StepCache("mag")))
    assert info.value.field == "cache" and "mag_ratios" in str(info.value)


def test_admission_reserves_the_cache_state(folders):
    """The ledger holds a cached request's state bytes on top of an uncached one's, and
    the bytes a unit really holds stay within them."""
    from engine.core import CoreConfig, EngineCore

    model = model_of(folders["flux"])
    core = EngineCore(model, CoreConfig(slots=2))
    plain = core.intake.request("a", params(), 0.0).reservation.trajectory_bytes
    for cache in (StepCache("first_block"), StepCache("mag"), StepCache("taylorseer", max_order=2),
                  StepCache("taylorseer", max_order=2, use_lite_mode=True)):
        p = params(negative_prompt="x", true_cfg=2.0, cache=cache)
        request = core.intake.request("b", p, 0.0)
        extra = request.reservation.trajectory_bytes - core.intake.request("c", params(
            negative_prompt="x", true_cfg=2.0), 0.0).reservation.trajectory_bytes
        assert extra > 0 and plain > 0
        core2 = EngineCore(model, CoreConfig(slots=2))
        held = []

        def measure(d, outputs, core2=core2):
            for storage in core2.storage.values():
                state = storage.kind_states.get("cache")
                if state is not None:
                    held.append(state.nbytes)
        run_and_release(core2, {"b": p}, after_step=measure)
        assert held and 0 < max(held) <= extra, (cache.kind, max(held), extra)


def test_the_flag_and_the_http_extra_carry_a_cache():
    import json

    from engine.protocol import parse_step_cache
    from frontend.http.errors import APIError
    from frontend.http.schemas import parse_edit, parse_generation

    assert parse_step_cache("first_block:0.12") == StepCache("first_block", threshold=0.12)
    assert parse_step_cache("taylorseer") == StepCache("taylorseer")
    assert parse_step_cache("taylorseer:lite") == StepCache("taylorseer", use_lite_mode=True)
    for bad in ("deep", "taylorseer:0.1", "mag:x", "mag:lite", "first_block:lite"):
        with pytest.raises(ValueError):
            parse_step_cache(bad)
    body = json.dumps({"prompt": "a red circle", "cache": {"kind": "mag", "threshold": 0.2}}).encode()
    assert parse_generation(body, ("shapes",)).params[0].cache == StepCache("mag", threshold=0.2)
    body = json.dumps({"prompt": "a red circle", "cache": {"kind": "taylorseer", "use_lite_mode": True}}).encode()
    assert parse_generation(body, ("shapes",)).params[0].cache == StepCache("taylorseer", use_lite_mode=True)
    bad = json.dumps({"prompt": "a red circle", "cache": {"kind": "mag", "speed": 2}}).encode()
    with pytest.raises(APIError) as info:
        parse_generation(bad, ("shapes",))
    assert info.value.param == "cache.speed"
    form = (b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na red circle\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"cache\"\r\n\r\n{\"kind\": \"first_block\"}\r\n"
            b"--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\nPNG\r\n--b--\r\n")
    gen = parse_edit("multipart/form-data; boundary=b", form, ("shapes",), 1 << 20)
    assert gen.params[0].cache == StepCache("first_block")


def test_the_cli_flags_parse_a_cache():
    from engine.__main__ import build_parser as engine_parser
    from frontend.__main__ import build_parser as client_parser

    args = engine_parser().parse_args(["serve", "--cache", "first_block:0.1"])
    assert args.cache == StepCache("first_block", threshold=0.1)
    args = client_parser().parse_args(["generate", "--prompt", "a red circle", "-o", "x.png", "--cache", "off"])
    assert args.cache == StepCache("off")


@pytest.mark.timeout(300)
def test_rows_that_skip_keep_their_adapters(folders, patterns, tmp_path):
    """LoRA rows and step caches in one call: the rows a gathered block runs on keep their
    own adapters (and rows without one none), each equal to the pipeline with its adapters
    and its hook."""
    from diffusers import StableDiffusion3Pipeline

    from engine.core import CoreConfig, EngineCore
    from engine.lora import AdapterPool
    from engine.models.loading import load_model
    from engine.testing.loras import make_lora

    folder = folders["sd3"]
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    make_lora(pipe, "A", 11, {"transformer": dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"])},
              lora_dir / "A")
    model = load_model(folder)
    pool = AdapterPool(model, lora_dir, budget_bytes=64 << 20)
    core = EngineCore(model, CoreConfig(slots=4), adapters=pool)
    cases = {
        "lora-fbc": params(guidance=4.0, seed=1, loras={"A": 1.5}, cache=StepCache("first_block", threshold=0.3)),
        "plain-fbc": params(guidance=4.0, seed=2, steps=6, cache=StepCache("first_block", threshold=0.3)),
        "lora": params(guidance=4.0, seed=3, loras={"A": 0.7}),
        "lora-taylor": params(guidance=1.0, seed=4, loras={"A": 1.0},
                              cache=StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1)),
        "lora-lite": params(guidance=4.0, seed=5, loras={"A": 1.2}, cache=_lite(2, 1)),
    }
    d = run_and_release(core, cases)
    found = patterns()
    assert core.runner.cache_rows_skipped > 0
    for rid, p in cases.items():
        if p.cache is None:
            from engine.testing.loras import lora_pipeline_output

            want = lora_pipeline_output(folder, lora_dir, p)
        else:
            want, pattern = cached_pipeline_output(folder, p, lora_dir=lora_dir)
            assert found[rid] == oracle_pattern(model, p, pattern), rid
        err = rel_l2(d.results[rid], want)
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"


# --- Qwen-Image: prompt rows of per-row lengths ------------------------------------------------

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from engine.testing.tiny_qwen_image import build_qwen_image

    return build_qwen_image(tmp_path_factory.mktemp("qwen-cache") / "qwen", seed=1, layers=3)


def qwen_params(**fields) -> GenerateParams:
    return GenerateParams(**{"output": "latent", "height": 32, "width": 32, "steps": 8, **fields})


def qwen_oracle(folder, p: GenerateParams):
    from test_qwen_image import pipeline_output

    return cached_pipeline_output(folder, p, run=lambda: pipeline_output(folder, p))


@pytest.mark.timeout(600)
def test_qwen_image_requests_of_different_prompt_lengths_cache_as_alone(qwen, patterns):
    """Prompts of different lengths padded per call: each request's cache state keeps its
    text part at its own length, as its pipeline call alone; alone ≤ 1e-5, shared ≤ 1e-4."""
    from engine.core import CoreConfig, EngineCore

    model = model_of(qwen)
    fbc, mag = StepCache("first_block", threshold=0.6), StepCache("mag", threshold=0.5, mag_ratios=MAG_RATIOS)
    taylor = StepCache("taylorseer", cache_interval=2, disable_cache_before_step=1)
    cases = {
        "fbc-short": qwen_params(prompt="a red circle", seed=1, cache=fbc),
        "fbc-long-cfg": qwen_params(prompt="the small green dog and a big blue cat", negative_prompt="blurry",
                                    true_cfg=3.0, seed=2, cache=fbc),
        "taylor-long": qwen_params(prompt="a photo of a yellow cross on the small green dog", seed=3, cache=taylor),
        "mag-mid": qwen_params(prompt="a big blue cat", seed=4, steps=6, cache=mag),
        "lite-cfg": qwen_params(prompt="a yellow cross", negative_prompt="", true_cfg=2.0, seed=7,
                                cache=StepCache("taylorseer", cache_interval=2, disable_cache_before_step=2,
                                                use_lite_mode=True)),
        "plain": qwen_params(prompt="a red circle and a big blue cat", seed=5),
    }
    alone = EngineCore(model, CoreConfig(slots=2))
    d = run_and_release(alone, {"fbc-long-cfg": cases["fbc-long-cfg"]})
    want, pattern = qwen_oracle(qwen, cases["fbc-long-cfg"])
    assert patterns()["fbc-long-cfg"] == oracle_pattern(model, cases["fbc-long-cfg"], pattern)
    assert rel_l2(d.results["fbc-long-cfg"], want) <= ALONE_TOL
    shared = EngineCore(model, CoreConfig(slots=4))
    d = run_and_release(shared, cases, arrivals={2: [("late", qwen_params(prompt="a blue cross", seed=6,
                                                                                  cache=taylor))]})
    found = patterns()
    assert shared.runner.cache_rows_skipped > 0
    for rid, p in {**cases, "late": qwen_params(prompt="a blue cross", seed=6, cache=taylor)}.items():
        if p.cache is None:
            from test_qwen_image import pipeline_output

            want = pipeline_output(qwen, p)
        else:
            want, pattern = qwen_oracle(qwen, p)
            assert found[rid] == oracle_pattern(model, p, pattern), rid
            assert "S" in found[rid], rid
        err = rel_l2(d.results[rid], want)
        assert err <= SHARED_TOL, f"{rid}: relative L2 {err:.3g}"
