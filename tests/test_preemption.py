"""Priorities and step-level preemption in the engine core: a request of higher priority
that cannot be admitted parks running requests of a lower one at a step boundary (their
whole slot state to host memory, after their fence), and they resume later in any free
slot of their group. The oracle: a request parked and resumed any number of times equals
the same request uninterrupted, bit for bit, with every sampler (stochastic ones
included). The model runs its UNet in float64 rounded to float32, so a row's output does
not depend on the batch it shares (`tests/test_solvers.py`), and resuming in another slot
beside other requests is compared exactly too."""
from __future__ import annotations

import pytest
import torch

from core_driver import CoreDriver
from engine.core import CoreConfig, EngineCore
from engine.core.fences import DeferredFences
from engine.protocol import GenerateParams
from tests.test_solvers import invariant_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLERS = ("default", "euler", "euler_ancestral", "ddim", "dpmpp_2m")


def low(sampler: str, steps: int = 8, seed: int = 3, **fields) -> GenerateParams:
    return GenerateParams(prompt="a red circle", steps=steps, sampler=sampler, guidance=3.0, seed=seed,
                          output="latent", priority=-10, **fields)


def high(seed: int, steps: int = 3) -> GenerateParams:
    return GenerateParams(prompt="a green square", steps=steps, sampler="euler", guidance=2.0, seed=seed,
                          output="latent", priority=10)


def alone(params: GenerateParams) -> torch.Tensor:
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1))
    return torch.from_numpy(CoreDriver(core).run({"r": params}).results["r"])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_parked_twice_equals_the_uninterrupted_request_bit_for_bit(sampler):
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1, preempt_min_steps=1))
    driver = CoreDriver(core).run({"low": low(sampler)}, arrivals={2: [("h1", high(1))], 6: [("h2", high(2))]})
    stats = core.stats()
    assert stats["preemptions"] == 2 and stats["resumed"] == 2, stats
    assert driver.finished["low"].timings.preemptions == 2
    assert set(driver.finished) == {"low", "h1", "h2"}
    # the high-priority requests ran while it was parked: each finished before it
    order = [rid for served in driver.served for rid in sorted(served)]
    assert order.index("h1") < len(order) - 1 - order[::-1].index("low")
    assert torch.equal(torch.from_numpy(driver.results["low"]), alone(low(sampler)))
    for rid, seed in (("h1", 1), ("h2", 2)):
        assert torch.equal(torch.from_numpy(driver.results[rid]), alone(high(seed)))
    assert stats["parked_bytes"] == 0 and stats["reserved_trajectory_bytes"] == 0


def test_resumed_in_another_slot_beside_others_equals_the_request_alone():
    """Two low-priority requests fill both slots; a high one parks the one with more work
    left; when a slot frees, it resumes there, beside the other."""
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=2, preempt_min_steps=1))
    requests = {"a": low("dpmpp_2m", steps=10, seed=5), "b": low("euler_ancestral", steps=6, seed=6)}
    driver = CoreDriver(core).run(requests, arrivals={2: [("h", high(7, steps=4))]})
    assert core.stats()["preemptions"] == 1
    assert driver.finished["a"].timings.preemptions == 1  # the one with more work left
    for rid, params in requests.items():
        assert torch.equal(torch.from_numpy(driver.results[rid]), alone(params)), rid


def test_equal_priority_parks_nobody_and_a_parked_request_can_be_canceled():
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1, preempt_min_steps=1))
    driver = CoreDriver(core).run({"a": low("euler")}, arrivals={2: [("b", low("ddim", seed=9))]})
    assert core.stats()["preemptions"] == 0 and set(driver.finished) == {"a", "b"}

    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1, preempt_min_steps=1))
    driver = CoreDriver(core)
    driver.add({"low": low("dpmpp_2m")})
    for _ in range(3):
        driver.step()
    driver.add({"h": high(4, steps=6)})
    driver.step()
    assert core.requests["low"].status.value == "parked" and core.stats()["parked_bytes"] > 0
    core.abort_requests(["low"])
    driver.run()
    assert "low" in driver.canceled and driver.canceled["low"].timings.evals == 6  # three guided steps
    stats = core.stats()
    assert stats["parked_bytes"] == 0 and stats["parked_requests"] == 0 and stats["reserved_trajectory_bytes"] == 0
    assert stats["reserved_output_bytes"] == 0 and stats["reserved_decode_buffers"] == 0


def test_a_victim_is_parked_only_after_its_fence():
    fences = DeferredFences()
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1, preempt_min_steps=1), fences=fences)
    driver = CoreDriver(core, release=True)
    driver.add({"low": low("euler")})
    for _ in range(2):
        driver.step()
    driver.release = False
    core.step()  # a launch of "low" in flight, its fence held
    driver.add({"h": high(4)})
    core.step()
    request = core.requests["low"]
    assert request.parking and request.status.value == "running", "parked while a launch may read its slot"
    assert core.requests["h"].slot == -1
    fences.release_all()
    core.step()
    assert request.status.value == "parked" and core.requests["h"].status.value == "running"
    driver.release = True
    driver.run()
    assert torch.equal(torch.from_numpy(driver.results["low"]), alone(low("euler")))


def test_preemption_off_and_the_hysteresis_bound():
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1, preemption=False))
    CoreDriver(core).run({"low": low("euler")}, arrivals={2: [("h", high(1))]})
    assert core.stats()["preemptions"] == 0
    # each request is parked at most max_preemptions times, and only after preempt_min_steps
    core = EngineCore(invariant_model("epsilon"), CoreConfig(slots=1, preempt_min_steps=2, max_preemptions=1))
    arrivals = {k: [(f"h{k}", high(k, steps=1))] for k in range(1, 12)}
    driver = CoreDriver(core).run({"low": low("euler", steps=12)}, arrivals=arrivals)
    assert driver.finished["low"].timings.preemptions == 1 and core.stats()["preemptions"] == 1
