"""Per-request LoRA through the engine (R20): requests with different adapters and scales
share one denoiser call; each equals diffusers' pipeline with `load_lora_weights` +
`set_adapters(names, adapter_weights=scales)`; the adapters' references are released after
the fence, their bytes are in the ledger, and a bad `loras` is rejected naming the field."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from engine.core import CoreConfig, EngineCore, RequestRejected
from engine.lora import AdapterPool
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.loras import lora_pipeline, lora_pipeline_output, make_lora
from engine.testing.tiny_pipelines import build_sd

from core_driver import run_to_end

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

ADAPTERS = {
    "A": dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]),
    "B": dict(r=8, lora_alpha=4, target_modules=["to_k", "to_v", "proj_in", "proj_out"]),
    "C": dict(r=2, lora_alpha=2, target_modules=["to_q", "to_out.0", "ff.net.2"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from diffusers import StableDiffusionPipeline

    root = tmp_path_factory.mktemp("lora-engine")
    folder = build_sd(root / "sd", scheduler="ddim", seed=3)
    lora_dir = root / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=11):
        if name == "B":
            make_lora(pipe, name, seed, {"unet": spec}, lora_dir, f"{name}.safetensors")
        else:
            make_lora(pipe, name, seed, {"unet": spec}, lora_dir / name)
    model = load_model(folder)
    pool = AdapterPool(model, lora_dir, budget_bytes=64 << 20)
    return folder, lora_dir, model, pool


def run(core: EngineCore, params: dict, join_at: dict | None = None, cancel_at: dict | None = None,
        max_steps: int = 2000) -> tuple[dict, set]:
    """Run to the end: each request added before step() call `join_at[id]` (default 0),
    canceled before call `cancel_at[id]`. Returns (final latents by id, canceled ids)."""
    arrivals, cancels = collections.defaultdict(list), collections.defaultdict(list)
    for rid, request in params.items():
        arrivals[(join_at or {}).get(rid, 0)].append((rid, request))
    for rid, at in (cancel_at or {}).items():
        cancels[at].append(rid)
    d = run_to_end(core, arrivals=arrivals, cancels=cancels, limit=max_steps)
    return d.results, set(d.canceled)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def p(prompt: str, loras: dict, seed: int, steps: int = 4, sampler: str = "ddim", guidance: float = 3.0):
    return GenerateParams(prompt=prompt, steps=steps, sampler=sampler, guidance=guidance, seed=seed,
                          output="latent", loras=loras)


def test_a_request_alone_equals_the_pipeline_with_its_adapters(setup):
    folder, lora_dir, model, pool = setup
    for loras in ({"A": 1.0}, {"A": 0.7, "C": -1.3}):
        core = EngineCore(model, CoreConfig(slots=2), adapters=pool)
        params = p("a red circle", loras, seed=5, steps=3, sampler="dpmpp_2m")
        done, _ = run(core, {"r": params})
        want = lora_pipeline_output(folder, lora_dir, params)
        err = rel_l2(done["r"], want)
        print(f"LoRA {loras} alone: relative L2 {err:.2g}")
        assert err <= 1e-5
        plain = lora_pipeline_output(folder, lora_dir, p("a red circle", {}, seed=5, steps=3, sampler="dpmpp_2m"))
        assert rel_l2(done["r"], plain) > 1e-3  # the adapters changed the result


def test_mixed_adapters_share_calls_with_late_joins_and_cancels(setup):
    folder, lora_dir, model, pool = setup
    params = {
        "none": p("a red circle", {}, 1),
        "A1": p("a blue cat", {"A": 1.0}, 2, steps=5, sampler="euler"),
        "A05": p("a blue cat", {"A": 0.5}, 3, sampler="dpmpp_2m"),
        "B": p("the small green dog", {"B": 1.0}, 4, steps=6, guidance=1.0),
        "AC": p("a red circle", {"A": 0.7, "C": -1.3}, 5, steps=5),
        "AC2": p("a red circle", {"A": 1.2, "C": 0.4}, 6, steps=3, sampler="euler_ancestral"),
        "victim": p("a photo of a yellow cross", {"B": 0.8, "C": 1.0}, 7, steps=30),
    }
    core = EngineCore(model, CoreConfig(slots=4), adapters=pool)
    rows_seen = []
    real_run = model.run

    def spying_run(inputs):
        if inputs.lora_index is not None:
            rows_seen.append({tuple(r) for r in inputs.lora_index.tolist()})
        return real_run(inputs)

    model.run = spying_run
    try:
        done, canceled = run(core, params, join_at={"AC": 2, "AC2": 3, "B": 4}, cancel_at={"victim": 5})
    finally:
        del model.run
    assert canceled == {"victim"} and set(done) == set(params) - {"victim"}
    errors = {rid: rel_l2(latents, lora_pipeline_output(folder, lora_dir, params[rid])) for rid, latents in done.items()}
    print(f"LoRA shared batch: worst relative L2 {max(errors.values()):.2g}")
    assert max(errors.values()) <= 1e-4, errors
    assert max(len(distinct) for distinct in rows_seen) >= 3  # calls held rows of different adapter sets
    assert all(a.refcount == 0 for a in pool._adapters.values())  # every reference released after its fence
    stats = core.stats()
    assert stats["adapter_resident"] >= 3 and stats["adapter_hits"] > 0


def test_bad_loras_are_rejected_naming_the_field_and_lose_nothing_else(setup):
    _, _, model, pool = setup
    core = EngineCore(model, CoreConfig(slots=2), adapters=pool)
    for loras in ({"nope": 1.0}, {"A": float("nan")}, {"A": 100.0}, {k: 1.0 for k in "ABCDE"}):
        with pytest.raises(RequestRejected) as info:
            core.add_request("bad", p("a red circle", loras, 1))
        assert info.value.field == "loras"
    no_pool = EngineCore(model, CoreConfig(slots=2))
    with pytest.raises(RequestRejected) as info:
        no_pool.add_request("bad", p("a red circle", {"A": 1.0}, 1))
    assert info.value.field == "loras" and "--lora-dir" in info.value.reason
    done, _ = run(core, {"ok": p("a red circle", {"B": 1.0}, 1, steps=2)})
    assert set(done) == {"ok"}


def test_a_full_adapter_pool_makes_admission_wait_and_evicts_only_unreferenced(setup):
    folder, lora_dir, model, pool = setup
    sizes = {name: pool.nbytes([name]) for name in ADAPTERS}
    pool.uninstall()  # one pool per model
    tight = AdapterPool(model, lora_dir, budget_bytes=max(sizes["A"], sizes["B"]))  # one of A, B at a time
    try:
        core = EngineCore(model, CoreConfig(slots=4, policy="fifo"), adapters=tight)  # a first, in arrival order
        core.add_request("a", p("a red circle", {"A": 1.0}, 1, steps=6))
        core.add_request("b", p("a blue cat", {"B": 1.0}, 2, steps=2))
        core.step()
        assert core.requests["a"].slot >= 0 and core.requests["b"].slot == -1  # B waits: A is referenced
        assert core.stats()["adapter_resident_bytes"] == sizes["A"] <= core.stats()["adapter_budget_bytes"]
        done, _ = run(core, {})
        assert set(done) == {"a", "b"} and tight.stats()["evictions"] >= 1
    finally:
        tight.uninstall()
        pool.install()


def test_calls_without_adapters_leave_the_adapter_rows_out(setup, monkeypatch):
    """A denoiser call none of whose requests names an adapter carries no `lora_index` /
    `lora_scale`: its wrapped layers run as the base layers (on CUDA no LoRA kernel is
    launched), and under graphs it has a graph of its own. A call with one does carry them."""
    folder, lora_dir, model, pool = setup
    seen = []
    run_model = type(model).run

    def watched(self, inputs):
        seen.append(inputs.lora_index is not None)
        return run_model(self, inputs)

    monkeypatch.setattr(type(model), "run", watched)
    core = EngineCore(model, CoreConfig(slots=2), adapters=pool)
    run(core, {"plain": p("a red circle", {}, seed=1, steps=2)})
    assert seen and not any(seen)
    seen.clear()
    run(core, {"plain": p("a red circle", {}, seed=1, steps=2), "lora": p("a blue square", {"A": 1.0}, seed=2, steps=2)})
    assert any(seen)
