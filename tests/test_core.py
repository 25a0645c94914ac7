"""EngineCore in-process: add_request / abort_requests / step / decode_done / stats.

Every test drives a tiny random-weight UNet (tests/reference.py) step by step and checks
results against DESIGN.md section 3's reference loop (`reference_latents`, relative L2
≤ 1e-5, output="latent"), plus the slot map, cancellation, fences and epochs, evaluation
accounting, admission and fairness (R1, R2, R4, R5, R6, R8, R9).

Free slot storage is filled with NaN before every step (`Driver(poison=True)`: the suite's
`core_driver.CoreDriver` with a poisoning hook): a new occupant that inherited anything of
an earlier one (latents, multistep history, solver tables past its own steps) would come
out NaN. Results are compared only at the end of a
run, after the slots they came from have been poisoned again, so a result that aliased
slot storage would fail too.
"""
from __future__ import annotations

import collections
import math

import pytest
import torch

from engine.testing.reference import reference_latents, rel_l2, tiny_model

from engine.core import (
    CoreConfig, DenoiseFinished, EngineCore, RequestRejected, StepProgress,
)
from engine.core.config import ADMISSIONS, LAYOUTS
from engine.core.fences import DeferredFences
from engine.protocol import GenerateParams

from core_driver import CoreDriver

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model("epsilon")


def P(prompt="a red circle", steps=5, sampler="euler", guidance=3.0, seed=0, output="latent", **kw) -> GenerateParams:
    return GenerateParams(prompt=prompt, steps=steps, sampler=sampler, guidance=guidance, seed=seed,
                          output=output, **kw)


_REFERENCES: dict = {}


def reference(model, p: GenerateParams) -> torch.Tensor:
    key = (model.revision, p.sampler, p.prompt, p.steps, p.guidance, p.seed, p.height, p.width)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_latents(model, p.sampler, p.prompt, p.steps, p.guidance, p.seed,
                                             p.height, p.width)
    return _REFERENCES[key]


def assert_reference(model, finished: DenoiseFinished | torch.Tensor, p: GenerateParams) -> None:
    ref = reference(model, p)
    got = finished.latents if isinstance(finished, DenoiseFinished) else finished
    name = finished.request_id if isinstance(finished, DenoiseFinished) else "result"
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(ref.shape), (name, got.dtype, got.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite latents (stale slot state leaked)"
    err = rel_l2(got, ref)
    assert err <= TOL, f"{name}: rel L2 {err:.3g} vs reference"


def poison_free_slots(core: EngineCore) -> None:
    """NaN into every slot no request owns: latents, history and the solver tables."""
    for g in core.groups.values():
        storage = core.storage[g.key]
        free = torch.from_numpy(~g.busy)
        storage.latents[free] = math.nan
        storage.history[free] = math.nan
        storage.coef_table[~g.busy] = math.nan
        storage.timestep_table[~g.busy] = math.nan
        storage.divisor_table[~g.busy] = math.nan


def assert_drained(core: EngineCore) -> None:
    """Every request ended: all slots free, every reservation returned."""
    s = core.stats()
    assert not core.has_unfinished_requests()
    assert not core.requests and not core.queue and not core.inflight
    assert s["slots_busy"] == 0 and s["slot_occupancy"] == 0.0 and s["queue_depth"] == 0, s
    assert s["reserved_trajectory_bytes"] == 0, s
    assert s["reserved_output_bytes"] == 0, s
    assert s["reserved_decode_buffers"] == 0, s
    for g in core.groups.values():
        assert not g.busy.any() and not g.runnable.any() and all(r is None for r in g.requests)


def Driver(core: EngineCore, poison: bool = True, auto_decode: bool = True, release: bool = False) -> CoreDriver:
    """The suite's core driver as these tests use it: free slots poisoned before every step
    (when `poison`), DenoiseFinished acknowledged with decode_done at once unless
    `auto_decode` is False, deferred fences released before each step when `release` is
    set; a failed request or an output these tests never ask for (a preview) fails."""
    return CoreDriver(core, auto_decode=auto_decode, keep=None, release=release, fail_on_error=True, previews=False,
                      before_step=(lambda d: poison_free_slots(d.core)) if poison else None)


# ---------------------------------------------------------------------- correctness in a mixed batch

MIXED = {  # step() call at which each arrives
    0: [("e50", P("a red circle", 50, "euler", 3.0, 11)),
        ("d1", P("a green square", 1, "ddim", 1.0, 12))],
    1: [("a5", P("a blue triangle", 5, "euler_ancestral", 3.0, 13))],
    3: [("m20", P("a red circle", 20, "dpmpp_2m", 7.5, 14)),
        ("m2", P("a blue triangle", 2, "dpmpp_2m", 1.0, 15))],
    6: [("d5", P("a green square", 5, "ddim", 2.0, 16))],
    10: [("a20", P("", 20, "euler_ancestral", 1.0, 17))],
}


def run_mixed_against_reference(model, core: EngineCore) -> "Driver":
    """Drive MIXED through `core`; every request must finish equal to the reference."""
    d = Driver(core)
    d.run(arrivals=MIXED)
    params = {rid: p for batch in MIXED.values() for rid, p in batch}
    assert set(d.finished) == set(params)
    for rid, p in params.items():
        assert_reference(model, d.finished[rid], p)
    return d


@pytest.mark.parametrize("admission", ADMISSIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_group_equals_reference(model, layout, admission):
    # the schedule below is FIFO's (SRPT's own order is tested in test_scheduler.py)
    core = EngineCore(model, CoreConfig(slots=3, layout=layout, admission=admission, policy="fifo"))
    d = Driver(core)
    d.run(arrivals=MIXED)
    params = {rid: p for batch in MIXED.values() for rid, p in batch}
    assert set(d.finished) == set(params) and not d.canceled
    poison_free_slots(core)  # results are copies, not views of slot storage
    for rid, p in params.items():
        f = d.finished[rid]
        assert_reference(model, f, p)
        assert d.progress[rid] == list(range(1, p.steps + 1))
        t = f.timings
        assert t.queue_s >= 0 and t.denoise_s > 0
        assert t.evals == p.steps * (1 if p.guidance == 1.0 else 2)
        assert t.padded_evals >= 0 and (layout != "compact" or t.padded_evals == 0)
    s = core.stats()
    assert s["completed"] == len(params) and s["useful_evals"] == sum(f.timings.evals for f in d.finished.values())
    # continuous: e50 runs batches 0-49 and everything else fits beside it in 3 slots (a20, the
    # last, is admitted at batch 13 and ends at 32). static: waves {e50, d1} for 50 batches,
    # {a5, m20, m2} for 20, {d5, a20} for 20.
    assert s["batches"] == (50 if admission == "continuous" else 90)
    assert_drained(core)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cuda_host_path_on_cpu_tensors_equals_reference(model, layout):
    """The CUDA path's host side, run on CPU tensors: the step's arrays through the packed
    staging ring (one upload a step), final latents through fence-gated copies."""
    core = EngineCore(model, CoreConfig(slots=3, layout=layout))
    core.staged_uploads = core.async_copies = True
    run_mixed_against_reference(model, core)
    (storage,) = core.storage.values()
    assert storage.staging is not None and storage.staging.uploads == core.batches
    assert_drained(core)


@pytest.mark.parametrize("prediction,samplers", [
    ("v_prediction", ("euler", "euler_ancestral", "ddim", "dpmpp_2m")),
    ("sample", ("euler", "ddim", "dpmpp_2m")),
    ("flow", ("flow_euler", "dpmpp_2m")),
])
def test_prediction_types_mixed(prediction, samplers):
    m = tiny_model(prediction)
    core = EngineCore(m, CoreConfig(slots=2, layout="compact"))
    arrivals = collections.defaultdict(list)
    params = {}
    for i, sampler in enumerate(samplers):
        p = P(("a red circle", "a green square")[i % 2], 3 + 2 * i, sampler, (3.0, 1.0)[i % 2], 40 + i)
        params[sampler] = p
        arrivals[i].append((sampler, p))
    d = Driver(core)
    d.run(arrivals=arrivals)
    for rid, p in params.items():
        assert_reference(m, d.finished[rid], p)
    assert_drained(core)


# ---------------------------------------------------------------------- cancellation

@pytest.mark.parametrize("layout", LAYOUTS)
def test_cancel_long_request_beside_short_ones(model, layout):
    core = EngineCore(model, CoreConfig(slots=3, layout=layout, policy="fifo"))  # arrival order: s4 waits
    short = {"s1": P("a green square", 5, "euler", 3.0, 1), "s2": P("a blue triangle", 2, "ddim", 1.0, 2),
             "s3": P("a red circle", 5, "euler_ancestral", 3.0, 3), "s4": P("a green square", 4, "dpmpp_2m", 2.0, 4)}
    arrivals = {0: [("long", P("a red circle", 50, "dpmpp_2m", 3.0, 9)), ("s1", short["s1"]), ("s2", short["s2"])],
                2: [("s3", short["s3"]), ("s4", short["s4"])]}
    d = Driver(core)
    for k in range(4):  # four batches; the long request (2 rows per step) has run in each
        for rid, p in arrivals.get(k, ()):
            core.add_request(rid, p)
        d.step()
    assert d.progress["long"] == [1, 2, 3, 4] and core.requests["s4"].slot == -1  # s4 waits for a slot
    long_slot = core.requests["long"].slot
    core.abort_requests(["long"])
    core.abort_requests(["long"])  # twice: idempotent
    assert core.stats()["canceled_requests"] == 1
    d.step()
    assert core.requests["s4"].slot == long_slot  # the canceled slot, recycled
    d.run()
    assert "long" not in d.finished and "long" in d.canceled
    assert d.canceled["long"].timings.evals == 4 * 2  # work done so far, nothing after the cancel
    assert d.progress["long"] == [1, 2, 3, 4]
    for rid, p in short.items():
        assert_reference(model, d.finished[rid], p)
    s = core.stats()
    assert s["canceled_requests"] == 1 and s["canceled_evals"] == 8
    # cancel again, a finished id and an unknown id: no effect, no error, no output
    core.abort_requests(["long", "s1", "nobody"])
    assert core.step() == [] and core.stats() == s
    assert_drained(core)


def test_cancel_while_queued(model):
    core = EngineCore(model, CoreConfig(slots=1))
    a, b = P("a red circle", 6, "dpmpp_2m", 3.0, 1), P("a blue triangle", 6, "euler", 3.0, 2)
    core.add_request("a", a)
    core.add_request("b", b)
    d = Driver(core)
    d.step()
    d.step()
    assert core.stats()["queue_depth"] == 1
    core.abort_requests(["b"])
    assert core.stats()["queue_depth"] == 0 and "b" not in core.requests
    d.run()
    assert "b" not in d.finished and "b" not in d.progress
    t = d.canceled["b"].timings
    assert t.evals == 0 and t.padded_evals == 0 and t.queue_s >= 0 and t.denoise_s == 0
    assert core.stats()["canceled_evals"] == 0
    assert_reference(model, d.finished["a"], a)
    assert_drained(core)


def test_cancel_while_decoding(model):
    """After DenoiseFinished, before decode_done: Canceled, and decode_done says drop it."""
    core = EngineCore(model, CoreConfig(slots=2, decode_buffers=2))
    a, b = P("a red circle", 3, "euler", 3.0, 1), P("a green square", 6, "ddim", 1.0, 2)
    core.add_request("a", a)
    core.add_request("b", b)
    d = Driver(core, auto_decode=False)
    while "a" not in d.finished:
        d.step()
    assert core.stats()["reserved_decode_buffers"] == 2
    core.abort_requests(["a"])
    core.abort_requests(["a"])
    outputs = d.step()
    assert [o for o in outputs if o.request_id == "a"] == [d.canceled["a"]]
    assert d.canceled["a"].timings.evals == 6
    assert core.decode_done("a") is False  # the decode output is dropped
    assert core.decode_done("a") is False  # and only once
    assert core.stats()["reserved_decode_buffers"] == 1  # b's
    core.abort_requests(["a"])  # finished and gone: nothing
    d.auto_decode = True  # b is acknowledged as it finishes
    d.run()
    assert "a" in d.canceled and "b" not in d.canceled
    assert_reference(model, d.finished["b"], b)
    assert core.stats()["canceled_evals"] == 6
    assert_drained(core)


# ---------------------------------------------------------------------- deferred fences, epochs

def test_canceled_slot_not_reused_before_fence(model):
    fences = DeferredFences()
    core = EngineCore(model, CoreConfig(slots=1), fences=fences)
    a, b = P("a red circle", 10, "dpmpp_2m", 3.0, 1), P("a green square", 4, "dpmpp_2m", 3.0, 2)
    core.add_request("a", a)
    d = Driver(core)
    d.step()
    d.step()
    f0, f1 = fences.pending
    core.abort_requests(["a"])
    core.add_request("b", b)
    for _ in range(3):  # a's launches are in flight: its slot, storage and identity stay put
        assert d.step() == []
        s = core.stats()
        assert s["queue_depth"] == 1 and s["slots_busy"] == 1 and s["batches"] == 2, s
        assert core.requests["b"].slot == -1
    group = next(iter(core.groups.values()))
    assert group.epoch[0] == 0 and group.requests[0] is core.requests["a"]
    fences.release(f1)  # the last launch completes first: the slot is released now
    d.step()
    assert d.canceled["a"].timings.evals == 4 and "a" not in d.finished and "a" not in d.progress
    assert group.epoch[0] == 1 and group.requests[0] is core.requests["b"]
    assert core.stats()["batches"] == 3 and core.stats()["stale_reports"] == 0
    fences.release(f0)  # a late completion for (slot 0, epoch 0): dropped and counted
    d.release = True
    d.run()
    assert core.stats()["stale_reports"] == 1
    assert "a" not in d.progress  # nothing of a's late report reached the outputs
    assert_reference(model, d.finished["b"], b)
    assert_drained(core)


def test_finished_slot_not_reused_before_fence_and_stale_reports(model):
    fences = DeferredFences()
    core = EngineCore(model, CoreConfig(slots=1), fences=fences)
    a, b = P("a red circle", 3, "euler_ancestral", 3.0, 1), P("a blue triangle", 5, "dpmpp_2m", 3.0, 2)
    core.add_request("a", a)
    d = Driver(core)
    for _ in range(3):
        d.step()
    f0, f1, f2 = fences.pending
    assert core.requests["a"].status.value == "finishing"
    core.add_request("b", b)
    assert d.step() == [] and core.stats()["queue_depth"] == 1 and core.stats()["batches"] == 3
    fences.release(f2)  # the final launch completes before the two earlier ones
    outputs = d.step()
    assert "a" in d.finished and d.progress["a"] == [3]
    assert not any(isinstance(o, StepProgress) and o.request_id == "b" for o in outputs)  # b's fence is held
    group = next(iter(core.groups.values()))
    assert group.epoch[0] == 1 and group.requests[0] is core.requests["b"]
    fences.release(f1)
    fences.release(f0)
    d.step()
    assert core.stats()["stale_reports"] == 2 and d.progress["a"] == [3]
    d.release = True
    d.run()
    assert_reference(model, d.finished["a"], a)
    assert_reference(model, d.finished["b"], b)
    assert core.stats()["stale_reports"] == 2
    assert_drained(core)


def test_cancel_while_finishing(model):
    """Cancel after the last launch, before its fence: Canceled, never DenoiseFinished."""
    fences = DeferredFences()
    core = EngineCore(model, CoreConfig(slots=2), fences=fences)
    a, b = P("a red circle", 2, "ddim", 3.0, 1), P("a green square", 4, "euler", 1.0, 2)
    core.add_request("a", a)
    core.add_request("b", b)
    d = Driver(core)
    d.step()
    d.step()
    assert core.requests["a"].status.value == "finishing"
    core.abort_requests(["a"])
    d.step()  # b runs on; a's final fence is still held
    assert "a" not in d.canceled and "a" not in d.finished and core.requests["a"].slot >= 0
    d.release = True
    d.run()
    assert "a" not in d.finished and d.canceled["a"].timings.evals == 4
    assert_reference(model, d.finished["b"], b)
    assert_drained(core)


def test_final_latents_leave_by_an_asynchronous_copy_gated_by_its_fence(model):
    """The CUDA publish path (run here with deferred fences): the final latents are copied
    out asynchronously; DenoiseFinished and the slot's release wait for the copy's fence;
    a cancel while the copy is in flight ends as Canceled."""
    fences = DeferredFences()
    core = EngineCore(model, CoreConfig(slots=2), fences=fences)
    core.async_copies = True
    a, b = P("a red circle", 2, "dpmpp_2m", 3.0, 1), P("a green square", 2, "euler", 1.0, 2)
    core.add_request("a", a)
    core.add_request("b", b)
    d = Driver(core)
    d.step()
    d.step()
    fences.release(fences.pending[0])
    fences.release(fences.pending[0])  # both launches done: the copies are recorded now
    d.step()
    assert not d.finished and len(core.copies) == 2
    group = next(iter(core.groups.values()))
    assert group.busy.sum() == 2, "a slot was released while its copy may still read it"
    core.abort_requests(["b"])
    copy_a, copy_b = (c.fence for c in core.copies)
    fences.release(copy_a)
    fences.release(copy_b)
    d.step()
    assert set(d.finished) == {"a"} and "b" in d.canceled
    assert_reference(model, d.finished["a"], a)
    assert group.busy.sum() == 0 and list(group.epoch) == [1, 1]
    assert_drained(core)


# ---------------------------------------------------------------------- multistep histories

@pytest.mark.parametrize("layout", ("compact", "padded"))
def test_interleaved_multistep_histories(model, layout):
    """dpmpp_2m keeps x0 of the previous step per slot: two requests at different orders
    in one batch (A mid-way, B at its first step), A canceled, its slot recycled to C."""
    core = EngineCore(model, CoreConfig(slots=2, layout=layout))
    a = P("a red circle", 12, "dpmpp_2m", 3.0, 1)
    b = P("a green square", 8, "dpmpp_2m", 1.0, 2)
    c = P("a blue triangle", 6, "dpmpp_2m", 5.0, 3)
    d = Driver(core)
    core.add_request("A", a)
    for _ in range(4):
        d.step()
    core.add_request("B", b)
    d.step()  # A at its 5th step (second order), B at its first (first order), one batch
    assert d.served[-1] == {"A", "B"} and d.progress["A"][-1] == 5 and d.progress["B"] == [1]
    core.add_request("C", c)
    d.step()
    assert core.requests["C"].slot == -1  # queued: both slots busy
    a_slot = core.requests["A"].slot
    core.abort_requests(["A"])
    d.step()  # free slots are poisoned (history included) just before C is placed
    assert core.requests["C"].slot == a_slot
    d.run()
    assert "A" in d.canceled and "A" not in d.finished
    assert_reference(model, d.finished["B"], b)
    assert_reference(model, d.finished["C"], c)
    assert_drained(core)


# ---------------------------------------------------------------------- random streams

def test_random_stream_isolation(model):
    """An euler_ancestral request's result is bit-identical alone or among neighbours that
    start, finish and are canceled around it (their own ancestral noise included). The
    padded layout keeps the denoiser's batch shape and the request's row fixed, so the
    comparison is exact; compact batches of other sizes differ in float rounding only
    (that is covered, to 1e-5, by the reference tests)."""
    x = P("a red circle", 12, "euler_ancestral", 3.0, 5)

    def run(neighbours: bool) -> torch.Tensor:
        core = EngineCore(model, CoreConfig(slots=4, layout="padded"))
        arrivals = {0: [("x", x)]}
        cancels = {}
        if neighbours:
            arrivals[0] += [("n1", P("a green square", 3, "euler_ancestral", 1.0, 5))]  # same seed
            arrivals[2] = [("n2", P("a blue triangle", 20, "euler_ancestral", 3.0, 6)),
                           ("n3", P("a red circle", 2, "dpmpp_2m", 3.0, 7))]
            arrivals[4] = [("n4", P("a red circle", 4, "euler_ancestral", 2.0, 8)),
                           ("n5", P("", 6, "euler", 1.0, 9))]
            cancels = {6: ["n2"], 7: ["n5"]}
        d = Driver(core)
        d.run(arrivals=arrivals, cancels=cancels)
        assert set(d.canceled) == ({"n2", "n5"} if neighbours else set())
        assert_drained(core)
        return d.finished["x"].latents

    alone, crowded = run(False), run(True)
    assert torch.equal(alone, crowded)
    assert_reference(model, alone, x)


# ---------------------------------------------------------------------- evaluation accounting

# slots=4, immediate fences. Arrivals before step() call k; guidance 1 → 1 row per step,
# otherwise 2 rows (cond + uncond):
#   k=0: r1 (3 steps, 2 rows)   r2 (2 steps, 1 row)
#   k=1: r3 (1 step, 1 row)
#   k=2: r4 (2 steps, 2 rows)   r5 (1 step, 1 row)
# continuous (a finished slot is free at the next step):
#   batch 0: r1 2 + r2 1          = 3 rows
#   batch 1: r1 2 + r2 1 + r3 1   = 4   (r2, r3 finish)
#   batch 2: r1 2 + r4 2 + r5 1   = 5   (r1, r5 finish)
#   batch 3: r4 2                 = 2
#   useful 14 = r1 6 + r2 2 + r3 1 + r4 4 + r5 1
# static (a new wave only when the slots are all idle): r3 waits for r1, r2; r4, r5 too:
#   batch 0: r1 2 + r2 1 = 3; batch 1: r1 2 + r2 1 = 3; batch 2: r1 2 = 2;
#   batch 3: r3 1 + r4 2 + r5 1 = 4; batch 4: r4 2 = 2;   useful 14
# padded: every batch is 2 * slots = 8 rows → padded = 8 - useful per batch
#   continuous: 5 + 4 + 3 + 6 = 18             static: 5 + 5 + 6 + 4 + 6 = 26
# bucketed: next power of two, at most 2 * slots = 8
#   continuous: 3→4 (1), 4→4 (0), 5→8 (3), 2→2 (0) = 4
#   static:     3→4 (1), 3→4 (1), 2→2 (0), 4→4 (0), 2→2 (0) = 2
# per request, padded_evals = sum of the padded rows of the batches it was in:
#   padded continuous: r1 5+4+3=12, r2 5+4=9, r3 4, r4 3+6=9, r5 3
#   padded static:     r1 5+5+6=16, r2 5+5=10, r3 4, r4 4+6=10, r5 4
#   bucketed continuous: r1 1+0+3=4, r2 1+0=1, r3 0, r4 3+0=3, r5 3
#   bucketed static:     r1 1+1+0=2, r2 1+1=2, r3 0, r4 0+0=0, r5 0
ACCOUNTING_ARRIVALS = {
    0: [("r1", P("a red circle", 3, "euler", 3.0, 1)), ("r2", P("a green square", 2, "ddim", 1.0, 2))],
    1: [("r3", P("a blue triangle", 1, "euler", 1.0, 3))],
    2: [("r4", P("a red circle", 2, "dpmpp_2m", 2.0, 4)), ("r5", P("", 1, "euler_ancestral", 1.0, 5))],
}
ACCOUNTING_EVALS = {"r1": 6, "r2": 2, "r3": 1, "r4": 4, "r5": 1}
ACCOUNTING = {  # (layout, admission): batches, useful, padded, per-request padded_evals
    ("compact", "continuous"): (4, 14, 0, dict(r1=0, r2=0, r3=0, r4=0, r5=0)),
    ("padded", "continuous"): (4, 14, 18, dict(r1=12, r2=9, r3=4, r4=9, r5=3)),
    ("bucketed", "continuous"): (4, 14, 4, dict(r1=4, r2=1, r3=0, r4=3, r5=3)),
    ("compact", "static"): (5, 14, 0, dict(r1=0, r2=0, r3=0, r4=0, r5=0)),
    ("padded", "static"): (5, 14, 26, dict(r1=16, r2=10, r3=4, r4=10, r5=4)),
    ("bucketed", "static"): (5, 14, 2, dict(r1=2, r2=2, r3=0, r4=0, r5=0)),
}


@pytest.mark.parametrize("layout,admission", list(ACCOUNTING))
def test_evaluation_accounting(model, layout, admission):
    batches, useful, padded, per_request = ACCOUNTING[(layout, admission)]
    core = EngineCore(model, CoreConfig(slots=4, layout=layout, admission=admission))
    d = Driver(core)
    d.run(arrivals=ACCOUNTING_ARRIVALS)
    s = core.stats()
    assert (s["batches"], s["useful_evals"], s["padded_evals"]) == (batches, useful, padded)
    assert s["useful_ratio"] == pytest.approx(useful / (useful + padded))
    assert {rid: f.timings.evals for rid, f in d.finished.items()} == ACCOUNTING_EVALS
    assert {rid: f.timings.padded_evals for rid, f in d.finished.items()} == per_request
    for rid, p in ((rid, p) for batch in ACCOUNTING_ARRIVALS.values() for rid, p in batch):
        assert_reference(model, d.finished[rid], p)
    assert_drained(core)


# ---------------------------------------------------------------------- timings and stats

class StepClock:
    """A clock that moves one second per denoiser call and stands still otherwise."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timings_exact_with_a_step_clock():
    m = tiny_model("epsilon")
    clock = StepClock()
    run = m.run

    def ticking(*args):
        clock.now += 1.0
        return run(*args)

    m.run = ticking
    core = EngineCore(m, CoreConfig(slots=1, layout="padded", policy="fifo"), clock=clock)  # r1 first
    r1, r2 = P("a red circle", 2, "euler", 3.0, 1), P("a green square", 3, "ddim", 1.0, 2)
    core.add_request("r1", r1)  # both arrive at t=0
    core.add_request("r2", r2)
    d = Driver(core)
    d.run()
    # r1: admitted at 0, batches at t 0→1, 1→2, published at 2. r2 admitted at 2, three batches.
    t1, t2 = d.finished["r1"].timings, d.finished["r2"].timings
    assert (t1.queue_s, t1.denoise_s, t1.evals, t1.padded_evals) == (0.0, 2.0, 4, 0)
    assert (t2.queue_s, t2.denoise_s, t2.evals, t2.padded_evals) == (2.0, 3.0, 3, 3)  # padded: 2 rows / step
    assert (d.finished["r1"].finished_at, d.finished["r2"].finished_at) == (2.0, 5.0)
    assert_drained(core)


def test_engine_stats(model):
    core = EngineCore(model, CoreConfig(slots=2, policy="fifo"))  # a and b admitted first
    assert core.stats()["slot_occupancy"] == 0.0 and core.stats()["useful_ratio"] == 1.0
    a, b, c = P("a red circle", 5, "euler", 3.0, 1), P("a green square", 5, "ddim", 1.0, 2), P("", 3, "euler", 3.0, 3)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        core.add_request(rid, p)
    assert core.stats()["queue_depth"] == 3
    d = Driver(core)
    d.step()
    s = core.stats()
    assert (s["slots_busy"], s["slot_occupancy"], s["queue_depth"], s["batches"], s["useful_evals"]) == \
        (2, 1.0, 1, 1, 3)
    d.step()
    core.abort_requests(["b"])  # 2 steps × 1 row done
    s = core.stats()
    assert (s["canceled_requests"], s["canceled_evals"], s["slots_busy"]) == (1, 2, 1)
    d.step()  # c takes b's slot
    s = core.stats()
    assert (s["slots_busy"], s["queue_depth"], s["useful_evals"]) == (2, 0, 3 + 3 + 4)
    d.run()
    s = core.stats()
    # a 5 steps × 2 rows, b 2 steps × 1 row before its cancel, c 3 steps × 2 rows
    assert s["completed"] == 2 and s["useful_evals"] == 10 + 2 + 6
    assert s["padded_evals"] == 0 and s["useful_ratio"] == 1.0 and s["slot_occupancy"] == 0.0
    assert d.canceled["b"].timings.evals == 2
    assert_reference(model, d.finished["a"], a)
    assert_reference(model, d.finished["c"], c)
    assert_drained(core)


# ---------------------------------------------------------------------- admission, backpressure (R8)

def test_queue_bound_rejects_with_retry_after(model):
    core = EngineCore(model, CoreConfig(slots=1, max_queue=2))
    q1, q2, q3 = P("a red circle", 3, "euler", 3.0, 1), P("a green square", 2, "euler", 3.0, 2), P("", 2, "ddim", 1.0, 3)
    core.add_request("q1", q1)
    core.add_request("q2", q2)
    with pytest.raises(RequestRejected) as e:
        core.add_request("q3", q3)
    assert e.value.retry_after_s > 0 and e.value.field is None and "queue" in e.value.reason
    s = core.stats()
    assert s["rejected_full"] == 1 and s["queue_depth"] == 2 and "q3" not in core.requests
    d = Driver(core)
    d.step()  # q1 admitted: room for one more
    core.add_request("q3", q3)
    d.run()
    for rid, p in (("q1", q1), ("q2", q2), ("q3", q3)):
        assert_reference(model, d.finished[rid], p)
    assert_drained(core)


def test_decode_buffer_reservation_holds_admission(model):
    core = EngineCore(model, CoreConfig(slots=2, decode_buffers=1))
    a, b = P("a red circle", 2, "euler", 3.0, 1), P("a green square", 3, "dpmpp_2m", 3.0, 2)
    core.add_request("a", a)
    core.add_request("b", b)
    d = Driver(core, auto_decode=False)
    d.step()
    assert core.requests["b"].slot == -1  # a free slot, but the only decode buffer is a's
    d.step()
    assert "a" in d.finished
    for _ in range(3):  # a awaits decode_done: b stays queued, nothing runs
        d.step()
        s = core.stats()
        assert s["queue_depth"] == 1 and s["slots_busy"] == 0 and s["batches"] == 2
        assert s["reserved_decode_buffers"] == 1 and core.requests["b"].slot == -1
    assert core.decode_done("a") is True
    d.step()
    assert core.requests["b"].slot >= 0 and d.progress["b"] == [1]
    d.auto_decode = True  # b is acknowledged as it finishes
    d.run()
    assert_reference(model, d.finished["a"], a)
    assert_reference(model, d.finished["b"], b)
    assert_drained(core)


def test_request_too_large_to_ever_fit(model):
    # the default budgets hold one request at the largest size (tests/test_image_limits.py);
    # a budget set to 2 native requests cannot hold 16× the native latents
    native = EngineCore(model, CoreConfig(slots=2)).intake.request("n", P(), 0.0).reservation.trajectory_bytes
    core = EngineCore(model, CoreConfig(slots=2, trajectory_budget_bytes=2 * native))
    with pytest.raises(RequestRejected) as e:
        core.add_request("big", P(height=core.geometry.max_size, width=core.geometry.max_size))
    assert e.value.field == "height" and e.value.retry_after_s == 0 and "trajectory budget" in e.value.reason
    assert core.stats()["queue_depth"] == 0 and not core.requests
    assert_drained(core)


# ---------------------------------------------------------------------- bad input (R11)

BAD = [
    ("prompt", dict(prompt="purple hexagon")),
    ("prompt", dict(prompt=3)),
    ("steps", dict(steps=0)),
    ("steps", dict(steps=10**6)),
    ("steps", dict(steps=True)),
    ("steps", dict(steps=1.5)),
    ("steps", dict(steps=-3)),
    ("sampler", dict(sampler="heun")),
    ("sampler", dict(sampler="flow_euler")),  # flow matching only; the model predicts epsilon
    ("guidance", dict(guidance=math.nan)),
    ("guidance", dict(guidance=math.inf)),
    ("guidance", dict(guidance=-math.inf)),
    ("guidance", dict(guidance=-0.5)),
    ("guidance", dict(guidance="3")),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=1.0)),
    ("output", dict(output="gif")),
    ("height", dict(height=7)),
    ("height", dict(height=0)),
    ("height", dict(height=10**4)),
    ("width", dict(width=9)),
    ("width", dict(width=8.0)),
]


def test_bad_input_rejected_naming_the_field(model):
    core = EngineCore(model, CoreConfig(slots=2))
    assert core.geometry.size_multiple == 2
    good = P("a green square", 4, "dpmpp_2m", 3.0, 21)
    core.add_request("good", good)
    for i, (field, overrides) in enumerate(BAD):
        p = P(**{**dict(prompt="a red circle", steps=3), **overrides})
        with pytest.raises(RequestRejected) as e:
            core.add_request(f"bad{i}", p)
        assert e.value.field == field, (overrides, e.value)
        assert e.value.retry_after_s == 0
    with pytest.raises(RequestRejected) as e:
        core.add_request("good", P("a red circle", 2))  # a duplicate of an unfinished id
    assert e.value.field == "request_id"
    with pytest.raises(RequestRejected) as e:
        core.add_request("", P("a red circle", 2))
    assert e.value.field == "request_id"
    assert list(core.requests) == ["good"] and core.stats()["queue_depth"] == 1
    d = Driver(core)
    d.run()
    assert set(d.finished) == {"good"} and not d.canceled
    assert_reference(model, d.finished["good"], good)  # the duplicate left the original alone
    # and after all of that, a fresh valid request still completes correctly
    after = P("a blue triangle", 5, "euler_ancestral", 2.0, 22)
    core.add_request("after", after)
    d.run()
    assert_reference(model, d.finished["after"], after)
    s = core.stats()
    assert s["completed"] == 2 and s["rejected_full"] == 0
    assert_drained(core)


# ---------------------------------------------------------------------- fairness across groups (R2)

@pytest.mark.parametrize("group_aging", [0.0, 2.0])
def test_fairness_across_latent_shapes(model, group_aging):
    """Two groups (8×8 and 16×16 latents; the tiny model's native size is 8, its size
    multiple 2 and its largest size 32). Group A's requests all arrive first and outnumber
    its slots; B's request behind them is admitted at once into its own group. With a
    group aging of 0 their batches alternate while both have work; with 2, the group
    nearer a finished request goes first but neither waits more than 3 batches."""
    core = EngineCore(model, CoreConfig(slots=2, trajectory_budget_bytes=1 << 24, output_budget_bytes=1 << 24,
                                        group_aging=group_aging))
    assert core.geometry.size_multiple == 2 and model.native_size == 8
    a = {f"a{i}": P(("a red circle", "a green square")[i % 2], 6, "euler", 3.0, i) for i in range(4)}
    b = {"b0": P("a blue triangle", 6, "dpmpp_2m", 3.0, 7, height=16, width=16),
         "b1": P("a red circle", 4, "euler_ancestral", 1.0, 8, height=16, width=16)}
    for rid, p in {**a, **b}.items():
        core.add_request(rid, p)
    d = Driver(core)
    d.run()
    groups = [{rid[0] for rid in served} for served in d.served if served]
    assert all(len(g) == 1 for g in groups)  # one group per batch
    order = "".join(g.pop() for g in groups)
    # B's two requests run side by side (6 batches); A's four take 2 waves of 6 batches.
    assert order.count("b") == 6 and order.count("a") == 12
    if group_aging == 0:  # while both groups have work (the first 12 batches) they strictly alternate
        assert order[:12] in ("ab" * 6, "ba" * 6), order
    assert core.stats()["max_group_wait_batches"] <= (group_aging + 1) * 1, order  # one other runnable group
    assert len(core.groups) == 2
    for rid in ("a0", "a3", "b0", "b1"):
        p = {**a, **b}[rid]
        assert_reference(model, d.finished[rid], p)
    assert tuple(d.finished["b0"].latents.shape) == (4, 16, 16)
    assert_drained(core)


# ---- CUDA graphs (bucketed layout), through the capture contract on CPU ----------------------

def test_bucketed_graphs_replay_equals_eager_reference(model):
    """One graph per bucket size, captured once on fixed buffers and replayed with each
    step's latents, timesteps and conditioning copied in (`EagerCapture` re-runs the
    function on the captured buffers, so a stale or missing copy-in shows as a wrong
    result). Mixed requests joining late change the bucket as they go."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser

    core = EngineCore(model, CoreConfig(slots=3, layout="bucketed"))
    capture = EagerCapture()
    core.graphed = GraphedDenoiser(model, capture)
    run_mixed_against_reference(model, core)
    # buckets of 1, 2, 4 and 6 rows (3 slots × 2): at most one capture each, replayed at every step
    sizes = {key[0][1][0] for key in core.graphed.graphs}  # rows of the first field, `sample`
    assert capture.captures == len(core.graphed.graphs) == len(sizes) and sizes <= {1, 2, 4, 6}, sizes
    assert core.graphed.replays == core.batches > capture.captures
    assert_drained(core)


def test_graph_capture_failure_runs_that_size_eagerly(model):
    from engine.core.graphs import GraphedDenoiser

    class Refuses:
        def capture(self, fn, inputs):
            raise RuntimeError("operation not permitted when stream is capturing")

    core = EngineCore(model, CoreConfig(slots=2, layout="bucketed"))
    core.graphed = GraphedDenoiser(model, Refuses())
    p = P("a green square", 4, "dpmpp_2m", 3.0, 5)
    core.add_request("r", p)
    d = Driver(core)
    d.run()
    assert_reference(model, d.finished["r"], p)
    assert len(core.graphed.failed) == 1 and not core.graphed.graphs and core.graphed.replays == 0
    assert EngineCore(model, CoreConfig(slots=2, layout="bucketed")).graphed is None  # CPU: no CUDA graphs


def test_step_sleeps_on_a_fence_when_launches_are_all_it_has(model):
    """Nothing to launch, a launch still in flight: step() waits on its fence for at most
    `fence_wait_s` (a sleeping wait on CUDA) instead of returning at once for the busy
    loop to spin on query()."""
    from engine.core.fences import DeferredFence

    waits = []

    class WatchedFence(DeferredFence):
        __slots__ = ()

        def wait(self, timeout=None):
            waits.append(timeout)
            return self.released

    class WatchedFences(DeferredFences):
        def record(self):
            fence = WatchedFence(len(self.pending))
            self.pending.append(fence)
            return fence

    fences = WatchedFences()
    core = EngineCore(model, CoreConfig(slots=2, fence_wait_s=0.003), fences=fences)
    core.add_request("r", P("a red circle", 2, "euler", 3.0, 1))
    core.step()
    core.step()  # both steps launched (the host runs ahead of the fences)
    assert waits == [] and len(core.inflight) == 2
    core.step()  # nothing runnable, both launches in flight: sleeps on the oldest fence
    assert waits == [0.003] and len(core.inflight) == 2
    fences.release_all()
    outputs = core.step()  # reaped and published: nothing waits
    assert waits == [0.003] and any(isinstance(o, DenoiseFinished) for o in outputs)


def test_every_bucket_is_captured_before_serving(model):
    """`capture_graphs` captures each bucket of the native size up front, so serving native
    requests captures nothing more (a capture mid-serving stalls the busy loop on CUDA)."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser

    core = EngineCore(model, CoreConfig(slots=3, layout="bucketed"))
    capture = EagerCapture()
    core.graphed = GraphedDenoiser(model, capture)
    core.capture_graphs()
    assert capture.captures == 4  # buckets of 1, 2, 4 and 6 rows
    run_mixed_against_reference(model, core)
    assert capture.captures == 4 and core.graphed.replays >= core.batches
    assert_drained(core)


def test_graphs_are_bounded_least_recently_replayed_out(model):
    """R22: one graph per shape a client asks for would grow without bound; beyond
    `max_graphs` the least recently replayed is dropped, and an evicted shape still runs
    (it is captured again)."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser
    from engine.models.model import model_inputs

    capture = EagerCapture()
    graphed = GraphedDenoiser(model, capture, max_graphs=2)
    prompt = model.encode(["a red circle"])[0]

    def call(rows: int) -> torch.Tensor:
        x = torch.randn(rows, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(rows))
        inputs = model_inputs(x, torch.full((rows,), 500.0), [prompt] * rows)
        got = graphed(inputs)
        assert torch.allclose(got, model.run(inputs))
        return got

    for rows in (1, 2, 1, 4):  # 2 is least recently replayed when 4 arrives
        call(rows)
    assert len(graphed.graphs) == 2 and graphed.evictions == 1
    assert {key[0][1][0] for key in graphed.graphs} == {1, 4}
    call(2)
    assert capture.captures == 4 and graphed.evictions == 2


def test_graph_key_has_the_memory_format_and_a_layout_change_drops_stale_graphs(model):
    """A channels-last call and a contiguous one of the same shape get graphs of their own;
    when the adapter layout a graph reads changes, the graphs of the old one are dropped at
    once (never replayed again), not left to fill the bound."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser
    from engine.models.model import model_inputs

    layout = [0]
    capture = EagerCapture()
    graphed = GraphedDenoiser(model, capture, layout_version=lambda: layout[0])
    prompt = model.encode(["a red circle"])[0]
    x = torch.randn(2, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(1))
    for sample in (x, x.contiguous(memory_format=torch.channels_last), x):
        inputs = model_inputs(sample, torch.full((2,), 500.0), [prompt] * 2)
        assert torch.allclose(graphed(inputs), model.run(inputs))
    assert capture.captures == 2 and len(graphed.graphs) == 2
    assert {key[0][3] for key in graphed.graphs} == {"contiguous", "channels_last"}
    layout[0] = 1
    graphed(model_inputs(x, torch.full((2,), 500.0), [prompt] * 2))
    assert len(graphed.graphs) == 1 and graphed.evictions == 2 and capture.captures == 3


def test_graph_capture_out_of_memory_is_retried_later(model):
    """A capture that runs out of device memory (other requests held it) runs that call
    eagerly and is tried again after a few calls, not given up for good."""
    from engine.core.graphs import EagerCapture, GraphedDenoiser
    from engine.models.model import model_inputs

    class ShortOfMemoryOnce(EagerCapture):
        def capture(self, fn, inputs):
            if not self.captures:
                self.captures += 1
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().capture(fn, inputs)

    capture = ShortOfMemoryOnce()
    graphed = GraphedDenoiser(model, capture)
    prompt = model.encode(["a red circle"])[0]
    x = torch.randn(1, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(2))
    inputs = model_inputs(x, torch.full((1,), 500.0), [prompt])
    for _ in range(GraphedDenoiser.RETRY_AFTER_CALLS + 1):
        assert torch.allclose(graphed(inputs), model.run(inputs))
    assert graphed.out_of_memory == 1 and not graphed.failed
    assert len(graphed.graphs) == 1 and graphed.replays == 1  # captured at the retry, then replayed
