"""Bounds of the core (R22) on the real core and a real tiny model: nothing that grows
with distinct inputs grows without bound, an allocation failure fails only the request
that needed it, an out-of-memory row limit recovers, and a request that cannot fit now
does not block the requests behind it."""
from __future__ import annotations

import pytest

from engine.core import CoreConfig, EngineCore
from engine.protocol import GenerateParams
from engine.testing.faults import FaultyModel
from engine.testing.reference import reference_latents, rel_l2, tiny_model

from core_driver import run_to_end

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def drive(core: EngineCore, limit: int = 5000, watch=None) -> tuple[dict, dict]:
    """Run `core` to the end: ({id: final latents}, {id: error, or "canceled"});
    `watch(core)` after every step."""
    d = run_to_end(core, keep="torch", limit=limit,
                   after_step=None if watch is None else (lambda d, outputs: watch(d.core)))
    return d.results, {**d.failed, **{rid: "canceled" for rid in d.canceled}}


def test_many_distinct_sizes_keep_the_group_count_bounded_and_lose_nothing():
    model = tiny_model("epsilon")
    core = EngineCore(model, CoreConfig(slots=2, max_groups=3, max_queue=64, output_budget_bytes=1 << 28,
                                        trajectory_budget_bytes=1 << 28))
    sizes = [(4 * h, 4 * w) for h in range(1, 7) for w in range(1, 7)]  # 36 sizes
    for k, (h, w) in enumerate(sizes):
        core.add_request(f"r{k}", GenerateParams(prompt="a red circle", steps=1, sampler="euler", guidance=1.0,
                                                 seed=k, height=h, width=w, output="latent"))
    most = []
    done, failed = drive(core, watch=lambda c: most.append(len(c.groups)))
    assert not failed and len(done) == len(sizes)
    assert max(most) <= 3 and core.stats()["groups_evicted"] >= len(sizes) - 3
    for k in (0, 17, 35):  # evicted and recreated groups start clean: each equals the reference
        h, w = sizes[k]
        want = reference_latents(model, "euler", "a red circle", 1, 1.0, k, height=h, width=w)
        assert rel_l2(done[f"r{k}"], want) <= 1e-5


def test_a_group_allocation_failure_fails_only_its_request():
    core = EngineCore(tiny_model("epsilon"), CoreConfig(slots=2, trajectory_budget_bytes=1 << 24,
                                                        output_budget_bytes=1 << 26))
    make_storage = core.runner.make_storage

    def refusing(key, latent_shape):
        if latent_shape[1] == 16:
            raise MemoryError("cannot allocate 2 slots of 4×16×16")
        return make_storage(key, latent_shape)

    core.runner.make_storage = refusing
    core.add_request("big", GenerateParams(prompt="a red circle", steps=2, height=16, width=16, output="latent"))
    core.add_request("ok", GenerateParams(prompt="a red circle", steps=2, output="latent"))
    done, failed = drive(core)
    assert set(done) == {"ok"} and "no memory for a group" in failed["big"]
    assert core.ledger.used.trajectory_bytes == 0 and core.ledger.used.decode_buffers == 0


def test_the_out_of_memory_row_limit_recovers_once_memory_allows():
    model = FaultyModel(tiny_model("epsilon"), oom_above_rows=2)
    core = EngineCore(model, CoreConfig(slots=4, oom_recovery_batches=4))
    for k in range(4):
        core.add_request(f"a{k}", GenerateParams(prompt="a red circle", steps=6, guidance=3.0, seed=k, output="latent"))
    drive(core)
    assert core.row_limit is not None and core.stats()["oom_splits"] >= 1
    model.oom_above_rows = None  # the memory came back
    calls_before = len(model.calls)
    for k in range(4):
        core.add_request(f"b{k}", GenerateParams(prompt="a red circle", steps=24, guidance=3.0, seed=k, output="latent"))
    done, failed = drive(core)
    assert not failed and len(done) == 4
    assert core.row_limit is None and core.scheduler.slot_cap() == 4
    assert max(model.calls[calls_before:]) == 8  # all four slots in one call again


def test_a_request_that_cannot_fit_now_does_not_block_the_ones_behind_it():
    model = tiny_model("epsilon")
    native = model.native_size
    probe = EngineCore(model, CoreConfig(slots=4))
    one = probe.intake.request("probe", GenerateParams(prompt="a red circle", steps=2, guidance=3.0, output="latent"),
                               0.0).reservation.trajectory_bytes  # one native request's share
    core = EngineCore(model, CoreConfig(slots=4, trajectory_budget_bytes=4 * one, bypass_limit=3, policy="fifo"))
    core.add_request("long", GenerateParams(prompt="a red circle", steps=40, guidance=3.0, output="latent"))
    core.add_request("wide", GenerateParams(prompt="a red circle", steps=2, guidance=3.0, height=native,
                                            width=4 * native, output="latent"))  # needs 4 native shares
    core.add_request("long2", GenerateParams(prompt="a red circle", steps=40, guidance=3.0, output="latent"))
    for k in range(3):
        core.add_request(f"s{k}", GenerateParams(prompt="a red circle", steps=2, guidance=3.0, seed=k,
                                                 output="latent"))
    core.step()
    # three requests pass the one that cannot fit now; then it is first, and nobody passes it
    assert core.requests["wide"].slot == -1 and core.requests["wide"].bypassed == 3
    assert all(core.requests[r].slot >= 0 for r in ("long", "long2", "s0", "s1"))
    order = []
    done, failed = drive(core, watch=lambda c: order.extend(
        r for r in ("wide", "s2") if r in c.requests and c.requests[r].slot >= 0 and r not in order))
    assert not failed and set(done) == {"long", "long2", "wide", "s0", "s1", "s2"} and order == ["wide", "s2"]


def test_the_embedding_cache_is_bounded_by_bytes():
    model = tiny_model("epsilon")
    one = model.conditioning_nbytes
    core = EngineCore(model, CoreConfig(slots=2, embedding_cache_bytes=2 * one))
    for k, prompt in enumerate(["a red circle", "a green square", "a blue triangle"]):
        core.add_request(f"r{k}", GenerateParams(prompt=prompt, steps=1, guidance=1.0, output="latent"))
        drive(core)
    stats = core.stats()
    assert stats["embedding_cache_entries"] == 2 and stats["embedding_cache_bytes"] <= 2 * one


def test_schedules_are_bounded_and_keyed_by_their_options():
    core = EngineCore(tiny_model("epsilon"), CoreConfig(slots=1, max_schedules=3))
    for steps in range(1, 7):
        core.add_request(f"r{steps}", GenerateParams(prompt="a red circle", steps=steps, sampler="euler",
                                                     output="latent"))
        drive(core)
    assert core.stats()["schedules_cached"] == 3
