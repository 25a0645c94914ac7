"""Per-request LoRA through the engine (R20): requests with different adapters and scales
share one denoiser call; each equals diffusers' pipeline with `load_lora_weights` +
`set_adapters(names, adapter_weights=scales)`; the adapters' references are released after
the fence, their bytes are in the ledger, and a bad `loras` is rejected naming the field."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from engine.core import CoreConfig, EngineCore, RequestRejected
from engine.lora import AdapterPool
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.loras import lora_pipeline_output, make_lora
from engine.testing.tiny_pipelines import build_sd

from core_driver import CoreDriver, run_to_end

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
        max_steps: int = 20000) -> tuple[dict, set]:
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
        driver = CoreDriver(core)
        while core.requests["a"].slot < 0:  # A loads on the pool's loader thread meanwhile
            driver.step()
            assert driver.calls < 20000
        assert core.requests["b"].slot == -1  # B waits: A is referenced
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


@pytest.fixture
def own_pool(setup, tmp_path):
    """A pool of its own over a folder of its own (the module's pool is set aside: one
    pool per model), made by `make(budget_bytes, **options)`; C and X are copies of C."""
    import shutil

    folder, lora_dir, model, pool = setup
    own_dir = tmp_path / "loras"
    own_dir.mkdir()
    for name in ("C", "X"):
        shutil.copytree(lora_dir / "C", own_dir / name)
    made = []
    pool.uninstall()

    def make(budget_bytes=64 << 20, **options):
        made.append(AdapterPool(model, own_dir, budget_bytes=budget_bytes, **options))
        return made[-1]

    try:
        yield model, own_dir, lora_dir, make
    finally:
        for own in made:
            for adapter in own._adapters.values():
                adapter.refcount = 0  # a test that failed half-way left references
            own.uninstall()
        pool.install()


def test_a_slow_adapter_load_never_stalls_a_plain_request(own_pool):
    """The adapter file is read on the pool's loader thread: while it reads (held here), a
    request without adapters runs every step to the end, and the one that needs the
    adapter waits at admission; once the load finishes it runs too."""
    import threading

    model, own_dir, _, make = own_pool
    pool = make()
    release = threading.Event()
    stage = pool.stager.stage

    def slow_stage(name, path):
        assert threading.current_thread() is not threading.main_thread()  # never the busy loop
        release.wait(60)
        return stage(name, path)

    pool.stager.stage = slow_stage
    core = EngineCore(model, CoreConfig(slots=4), adapters=pool)
    driver = CoreDriver(core)
    driver.add({"lora": p("a blue cat", {"X": 1.0}, 1, steps=3), "plain": p("a red circle", {}, 2, steps=4)})
    try:
        while "plain" not in driver.finished:
            driver.step()
            assert driver.calls < 20000 and not driver.failed
        assert driver.progress["plain"] == [1, 2, 3, 4]  # every step ran while the load was held
        assert core.requests["lora"].slot == -1 and pool.stats()["loading"] == 1
    finally:
        release.set()
    driver.run()
    assert set(driver.finished) == {"plain", "lora"} and not driver.failed
    assert pool.stats()["loads"] == 1 and pool.stats()["loading"] == 0


@pytest.mark.parametrize("change,why", [("larger", "never be resident"), ("corrupt", "cannot be read"),
                                        ("removed", "unknown")])
def test_an_adapter_replaced_over_the_budget_fails_its_request_and_no_one_waits(own_pool, change, why):
    """A queued request's adapter file is replaced by a larger one that no longer fits the
    pool's budget (or by one that cannot be read, or removed): that request fails naming
    `loras`; every other request completes, those without adapters never held back by it,
    even once it has been passed `bypass_limit` times while it waited for adapter room."""
    import shutil

    model, own_dir, lora_dir, make = own_pool
    probe = make()
    budget = probe.nbytes(["C"])  # room for one of C and X at a time
    probe.uninstall()
    pool = make(budget)
    core = EngineCore(model, CoreConfig(slots=4, policy="fifo", bypass_limit=1), adapters=pool)
    driver = CoreDriver(core)
    driver.add({"c": p("a red circle", {"C": 1.0}, 1, steps=12), "x": p("a blue cat", {"X": 1.0}, 2, steps=2)})
    while not (core.requests["c"].slot >= 0 and pool.stats()["loading"] == 0):
        driver.step()
        assert driver.calls < 20000
    plain = {f"plain{k}": p("a red circle", {}, 10 + k, steps=2) for k in range(3)}
    driver.add(plain)
    driver.add({"c2": p("the small green dog", {"C": 0.5}, 5, steps=2)})
    for _ in range(3):
        driver.step()
    assert core.requests["x"].slot == -1 and core.requests["x"].bypassed >= 1  # waiting for room, passed
    # the file replaced under load by a larger adapter (over the whole budget), or worse
    shutil.rmtree(own_dir / "X")
    if change == "larger":
        shutil.copytree(lora_dir / "A", own_dir / "X")
    elif change == "corrupt":
        (own_dir / "X").mkdir()
        (own_dir / "X" / "pytorch_lora_weights.safetensors").write_bytes(b"\xff" * 100)
    driver.add({"late": p("a photo of a yellow cross", {}, 20, steps=2)})
    driver.run(limit=20000)
    assert set(driver.finished) == {"c", "c2", "late", *plain}
    assert set(driver.failed) == {"x"} and driver.failed["x"].startswith("loras:")
    assert why in driver.failed["x"] and str(own_dir) not in driver.failed["x"], driver.failed["x"]
    assert all(a.refcount == 0 for a in pool._adapters.values())


def test_plain_requests_pass_one_waiting_for_adapter_room(own_pool):
    """A request that waits for adapter room (the pool full of referenced adapters) and has
    been passed `bypass_limit` times holds back later adapter users, never requests that
    need no adapter."""
    model, own_dir, _, make = own_pool
    probe = make()
    budget = probe.nbytes(["C"])
    probe.uninstall()
    pool = make(budget)
    core = EngineCore(model, CoreConfig(slots=8, policy="fifo", bypass_limit=1), adapters=pool)
    driver = CoreDriver(core)
    driver.add({"c": p("a red circle", {"C": 1.0}, 1, steps=40), "x": p("a blue cat", {"X": 1.0}, 2, steps=2)})
    while core.requests["c"].slot < 0:
        driver.step()
        assert driver.calls < 20000
    driver.add({"c2": p("a blue cat", {"C": 1.0}, 4, steps=2)})  # C resident: c2 passes x, which is aged now
    while "c2" not in driver.finished:
        driver.step()
        assert driver.calls < 20000
    assert core.requests["x"].bypassed >= 1
    driver.add({"c3": p("a blue cat", {"C": 0.5}, 5, steps=2)})
    driver.add({f"plain{k}": p("a red circle", {}, 10 + k, steps=2) for k in range(3)})
    while not all(f"plain{k}" in driver.finished for k in range(3)):
        driver.step()
        assert driver.calls < 20000
    assert core.requests["c"].status.value == "running"  # C still referenced: x still waits ...
    assert core.requests["x"].slot == -1 and core.requests["c3"].slot == -1  # ... and holds c3 back
    core.abort_requests(["c"])
    driver.run(limit=20000)
    assert {"c2", "c3", "x", "plain0", "plain1", "plain2"} <= set(driver.finished) and not driver.failed


def test_resident_bytes_count_what_the_pool_allocates(own_pool, setup):
    """The pool's count covers the factors and the padded stacks the reference path
    builds from them: after calls that build every stack, what the layers really hold
    equals the count, and the count stays within the budget under eviction."""
    model, own_dir, lora_dir, make = own_pool
    import shutil

    shutil.copytree(lora_dir / "A", own_dir / "A")
    shutil.copy(lora_dir / "B.safetensors", own_dir / "B.safetensors")
    probe = make()
    budget = max(probe.nbytes(["A", "B"]), probe.nbytes(["C", "B"]), probe.nbytes(["X", "A"]))
    probe.uninstall()
    pool = make(budget)
    core = EngineCore(model, CoreConfig(slots=2), adapters=pool)
    for k, loras in enumerate(({"A": 1.0}, {"B": 0.5, "C": 1.0}, {"X": 1.0, "A": -1.0}, {"B": 1.0})):
        driver = run_to_end(core, {f"r{k}": p("a red circle", loras, k, steps=2)}, limit=20000)
        assert set(driver.finished) == {f"r{k}"}, driver.failed
        for layers in pool._layers.values():  # the stacks of layers not called yet (the text encoder)
            for layer in layers.values():
                if layer.weights.max_rank:
                    layer.weights.reference_stack()
        held, counted = pool.held_bytes(), pool.stats()["resident_bytes"]
        assert held == counted <= budget, (loras, held, counted, budget)
    assert pool.stats()["evictions"] >= 1


def test_graphs_captured_before_serving_cover_calls_with_and_without_adapters(setup):
    """With an adapter pool, every bucket of the native size is captured before serving
    both with the adapter rows and without them (calls none of whose rows has an adapter
    leave them out), so native requests of either kind capture nothing mid-serving (a
    capture synchronises the device)."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser

    folder, lora_dir, model, pool = setup
    core = EngineCore(model, CoreConfig(slots=2, layout="bucketed"), adapters=pool)
    capture = EagerCapture()
    core.graphed = GraphedDenoiser(model, capture, lambda: pool.layout_version)
    core.capture_graphs()
    assert capture.captures == 2 * 3  # buckets of 1, 2 and 4 rows, each with and without adapter rows
    replays = core.graphed.replays
    native = model.geometry.native_size
    done, _ = run(core, {"plain": p("a red circle", {}, 1, steps=3),
                         "lora": GenerateParams(prompt="a blue cat", steps=3, sampler="ddim", guidance=3.0, seed=2,
                                                output="latent", loras={"A": 1.0}, height=native, width=native)})
    assert set(done) == {"plain", "lora"}
    assert capture.captures == 6 and core.graphed.replays - replays == core.batches


def test_a_parked_request_keeps_its_adapter_references_and_takes_no_more_at_resume(own_pool):
    """A request with adapters parked for a higher priority keeps its references while
    parked (its adapters stay resident) and resumes with them: it references nothing
    again, and once everything has ended no adapter is referenced."""
    model, own_dir, _, make = own_pool
    pool = make()
    core = EngineCore(model, CoreConfig(slots=1, preempt_min_steps=1), adapters=pool)
    driver = CoreDriver(core)
    driver.add({"low": GenerateParams(prompt="a blue cat", steps=8, sampler="ddim", guidance=3.0, seed=1,
                                      output="latent", loras={"C": 1.0}, priority=0)})
    while not driver.progress.get("low"):
        driver.step()
        assert driver.calls < 20000
    driver.step()
    driver.add({"high": GenerateParams(prompt="a red circle", steps=2, sampler="ddim", guidance=3.0, seed=2,
                                       output="latent", priority=5)})  # a higher class than the running one
    parked = False
    while core.has_unfinished_requests():
        driver.step()
        parked |= "low" in core.requests and core.requests["low"].status.value == "parked"
        if parked and "low" in core.requests:
            assert pool._adapters["C"].refcount == 1  # kept while parked, never taken twice
        assert driver.calls < 20000
    assert parked and set(driver.finished) == {"low", "high"}
    assert all(a.refcount == 0 for a in pool._adapters.values()), {n: a.refcount for n, a in pool._adapters.items()}
