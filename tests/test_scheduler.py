"""The scheduler alone: no model, no torch (as vLLM's scheduler tests build a scheduler
and requests from plain data). Admission, groups, fairness, bounds and request states."""
from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from engine.core.config import CoreConfig
from engine.core.scheduling.ledger import Ledger, Reservation
from engine.core.outputs import RequestCanceled, RequestFailed, RequestRejected
from engine.core.scheduling.plan import StepOutcome, StepPlan
from engine.core.scheduling.requests import Ending, Request, RequestStatus
from engine.core.scheduling.scheduler import Scheduler
from engine.core.scheduling.slot_map import SlotMap
from engine.protocol import GenerateParams

SHAPE = (4, 8, 8)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness(Scheduler):
    """The scheduler as the conductor drives it, with no runner: each plan's placements
    returned, its outputs and new groups collected, and a runner's outcome made up."""

    def __init__(self, cfg, ledger, clock, refuse_storage=lambda shape: False):
        super().__init__(cfg, ledger, clock)
        self.outputs: list = []
        self.made: list[tuple] = []
        self.refuse_storage = refuse_storage

    def admit(self) -> list[Request]:
        plan = super().admit()
        self.outputs += plan.outputs
        self.made += [key for key, _ in plan.new_groups]
        for key, shape in plan.new_groups:
            if self.refuse_storage(shape):  # as the runner reports an allocation that failed
                self.outputs += self.storage_failed(key, MemoryError("cannot allocate"))
        return [r for r in plan.placed if not r.stopping]

    def abort(self, request_ids):
        running, outputs = super().abort(request_ids)
        self.outputs += outputs
        return running

    def pick_group(self) -> SlotMap | None:
        plan = self.next_step()
        return None if plan is None else self.groups[plan.key]

    def launched(self, group: SlotMap, fence, slots, row_limit=None) -> list:
        slots = np.array(sorted(slots), dtype=np.int64)
        plan = StepPlan(group.key, slots, group.step_index[slots].copy(), [group.requests[s] for s in slots],
                        group.slots, self.row_limit)
        outcome = StepOutcome(fence, slots, {}, 0, 0, {}, None, row_limit)
        return self.update_from_output(plan, outcome)


def create_scheduler(slots: int = 2, trajectory_bytes: int = 1000, decode_buffers: int = 8, refuse_storage=None,
                     **config):
    cfg = CoreConfig(slots=slots, decode_buffers=decode_buffers, **config)
    scheduler = Harness(cfg, Ledger(trajectory_bytes, decode_buffers, 1 << 30), Clock(),
                        refuse_storage or (lambda shape: False))
    return scheduler, scheduler.outputs, scheduler.made


def create_request(rid: str, steps: int = 4, nbytes: int = 100, shape=SHAPE, guided: bool = True,
                   priority: int = 0, deadline_s: float | None = None, arrival: float = 0.0) -> Request:
    trajectory = types.SimpleNamespace(total=steps)
    request = Request(rid, GenerateParams(prompt="p", steps=steps, priority=priority, deadline_s=deadline_s), shape,
                      3.0 if guided else None, arrival, Reservation(nbytes, 10), group_key=("model", shape))
    request.trajectory = trajectory
    return request


def create_requests(n: int, **kwargs) -> list[Request]:
    return [create_request(f"r{i}", **kwargs) for i in range(n)]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def finish_step(scheduler: Scheduler, group: SlotMap) -> list:
    return scheduler.launched(group, object(), [s for s in range(group.slots) if group.runnable[s]])


def test_the_scheduler_imports_no_torch():
    code = ("import sys; import engine.core.scheduling.scheduler, engine.core.scheduling.slot_map, engine.core.scheduling.requests; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_fifo_admission_fills_free_slots_and_queues_the_rest():
    scheduler, _, _ = create_scheduler(slots=2, policy="fifo")  # the default is SRPT
    for r in create_requests(3):
        scheduler.add(r)
    assert ids(scheduler.admit()) == ["r0", "r1"]
    assert [r.status for r in scheduler.requests.values()] == [RequestStatus.RUNNING] * 2 + [RequestStatus.QUEUED]
    assert scheduler.admit() == []  # the group is full
    (group,) = scheduler.groups.values()
    assert group.requests[0].request_id == "r0" and group.active == 2


def test_a_full_queue_rejects_at_once_and_a_reused_id_names_request_id():
    scheduler, _, _ = create_scheduler(max_queue=1)
    scheduler.add(create_request("a"))
    with pytest.raises(RequestRejected) as full:
        scheduler.add(create_request("b"))
    assert full.value.field is None and "queue full" in full.value.reason
    with pytest.raises(RequestRejected) as reused:
        scheduler.add(create_request("a"))
    assert reused.value.field == "request_id"


def test_requests_of_other_shapes_get_their_own_group_and_a_group_aging_of_0_takes_turns():
    scheduler, _, made = create_scheduler(slots=1, group_aging=0)
    scheduler.add(create_request("small"))
    scheduler.add(create_request("big", shape=(4, 16, 16)))
    assert ids(scheduler.admit()) == ["small", "big"] and len(made) == 2
    served = []
    for _ in range(4):
        group = scheduler.pick_group()
        served.append(group.latent_shape)
        finish_step(scheduler, group)
    assert served == [SHAPE, (4, 16, 16)] * 2
    assert scheduler.group_wait_max == 1


def serve(scheduler, batches: int) -> str:
    """Run `batches` batches; the first letter of each served group's request ids."""
    order = ""
    for _ in range(batches):
        group = scheduler.pick_group()
        if group is None:
            break
        order += "".join(sorted({r.request_id[0] for r in group.requests if r is not None}))
        finish_step(scheduler, group)
        for request in list(scheduler.requests.values()):
            if request.status is RequestStatus.FINISHING:
                scheduler.release_slot(request)
                scheduler.denoised(request)
                scheduler.decode_done(request.request_id)
    return order


def test_the_group_whose_next_request_finishes_soonest_runs_first():
    """A 4-step request of a small size among long requests of other sizes is served
    step after step, not once every round: fewest steps left × what one call computes
    decides, so a short big-size request still waits for a short small-size one."""
    scheduler, _, _ = create_scheduler(slots=1, trajectory_bytes=10_000, group_aging=4)
    for i, size in enumerate((8, 10, 12)):
        scheduler.add(create_request(f"{'lmn'[i]}", steps=20, shape=(4, size, size)))
    scheduler.add(create_request("short", steps=4, shape=(4, 14, 14)))
    scheduler.add(create_request("quick", steps=2, shape=(4, 16, 16)))
    scheduler.admit()
    order = serve(scheduler, 7)
    # quick: 2 steps × 256 < short: 4 steps × 196 < l: 20 × 64 < m < n; no group comes due
    # before it waited 4 × (the other runnable groups) batches
    assert order == "qqssssl", order


def test_no_group_waits_more_than_its_aging_bound_under_a_stream_of_short_work():
    """A long request's group among a steady stream of 1-step requests of another size:
    without aging it would never run. With group_aging a, it waits at most
    (a + 1) × (other runnable groups) batches, and it does run."""
    for aging in (0.0, 1.0, 2.0, 4.0):
        scheduler, _, _ = create_scheduler(slots=1, trajectory_bytes=10_000, group_aging=aging)
        scheduler.add(create_request("long", steps=30, shape=(4, 16, 16)))
        scheduler.admit()
        long_served = 0
        for i in range(40):
            scheduler.add(create_request(f"s{i}", steps=1))
            scheduler.admit()
            long_served += serve(scheduler, 1) == "l"
        assert scheduler.group_wait_max <= (aging + 1) * 1, (aging, scheduler.group_wait_max)
        assert long_served >= 40 // (int(aging) + 2), (aging, long_served)
        assert scheduler.group_wait_max > aging * 1 - 1  # the bound is reached: short work did go first


def test_a_group_holding_a_higher_priority_runs_before_shorter_work():
    for aging, expected in ((10.0, "uuuuuuss"), (2.0, "uusuusuu")):  # aging still bounds the wait
        scheduler, _, _ = create_scheduler(slots=1, trajectory_bytes=10_000, group_aging=aging)
        scheduler.add(create_request("short", steps=2))
        scheduler.add(create_request("urgent", steps=6, priority=1, shape=(4, 16, 16)))
        scheduler.admit()
        assert serve(scheduler, 8) == expected, aging


def test_a_request_that_does_not_fit_lets_a_bounded_number_pass_then_waits_first():
    scheduler, _, _ = create_scheduler(slots=8, trajectory_bytes=1000, bypass_limit=2)
    scheduler.add(create_request("filler", nbytes=600))
    assert ids(scheduler.admit()) == ["filler"]
    scheduler.add(create_request("huge", nbytes=700))  # fits only once the filler is gone
    for r in create_requests(4, nbytes=50):
        scheduler.add(r)
    # two small ones pass the waiting request, then it blocks everyone behind it
    assert ids(scheduler.admit()) == ["r0", "r1"]
    assert scheduler.requests["huge"].bypassed == 2
    assert scheduler.admit() == []
    # the memory comes back: the aged request goes first
    for rid in ("filler", "r0", "r1"):
        request = scheduler.requests[rid]
        scheduler.release_slot(request)
    assert ids(scheduler.admit())[0] == "huge"


def test_srpt_admits_least_remaining_work_first_and_ages_bypassed_requests():
    scheduler, _, _ = create_scheduler(slots=1, policy="srpt", bypass_limit=2)
    scheduler.add(create_request("long", steps=50))
    scheduler.add(create_request("short", steps=4))
    assert ids(scheduler.admit()) == ["short"]
    scheduler.requests["long"].bypassed = 2  # passed twice already: its turn, whatever its length
    scheduler.add(create_request("shorter", steps=2))
    scheduler.release_slot(scheduler.requests["short"])
    assert ids(scheduler.admit()) == ["long"]


@pytest.mark.parametrize("aging", [0.5, 2.0, 5.0])
def test_srpt_aging_bounds_the_work_admitted_ahead_of_a_long_request(aging):
    """A steady stream of short requests behind a long one: SRPT lets them pass, but only
    until the work admitted since the long one arrived exceeds `srpt_aging` × (the work
    queued ahead of it + its own); then it is admitted, whatever still waits."""
    scheduler, _, _ = create_scheduler(slots=1, policy="srpt", srpt_aging=aging)
    scheduler.add(create_request("first", steps=4))
    running = scheduler.admit()[0]
    scheduler.add(create_request("ahead", steps=10))  # 20 evaluations queued ahead of the long one
    scheduler.add(create_request("long", steps=50))  # 100 evaluations
    bound = aging * (20 + 100)
    mark, k = scheduler.admitted_evals, 0
    while scheduler.requests["long"].status is RequestStatus.QUEUED:
        scheduler.add(create_request(f"s{k}", steps=4))  # 8 evaluations each, always the shortest
        k += 1
        since = scheduler.admitted_evals - mark  # admitted while the long one waited
        scheduler.release_slot(running)
        scheduler.ledger.give_back_decode(running.reservation)  # its output decoded
        running = scheduler.admit()[0]
        assert k < 200, "the long request starved"
    assert k > 1 and scheduler.requests["s0"].status is not RequestStatus.QUEUED  # shorter ones did pass it
    assert bound < since <= bound + 20, (since, bound)  # admitted at the first boundary past its bound
    assert len(scheduler.queue) >= 1  # with shorter work still waiting


def test_higher_priority_first_then_the_policy_within_a_priority():
    scheduler, _, _ = create_scheduler(slots=1, policy="srpt")
    scheduler.add(create_request("batch-short", steps=2, priority=-10))
    scheduler.add(create_request("default-long", steps=40))
    scheduler.add(create_request("interactive-long", steps=30, priority=10))
    scheduler.add(create_request("interactive-short", steps=4, priority=10))
    assert ids(scheduler._candidates()) == ["interactive-short", "interactive-long", "default-long", "batch-short"]


def test_deadlines_order_a_priority_by_slack():
    scheduler, _, _ = create_scheduler(slots=1, policy="srpt")
    scheduler.seconds_per_eval = 0.5
    scheduler.add(create_request("none", steps=2))
    scheduler.add(create_request("far", steps=2, deadline_s=100.0))
    scheduler.add(create_request("near-but-long", steps=20, deadline_s=30.0))  # slack 30 − 40 × 0.5 = 10
    scheduler.add(create_request("near-short", steps=2, deadline_s=12.0))  # slack 12 − 4 × 0.5 = 10 → 10, later
    scheduler.add(create_request("tight", steps=10, deadline_s=15.0))  # slack 15 − 20 × 0.5 = 5
    order = ids(scheduler._candidates())
    assert order[0] == "tight" and order[-1] == "none" and order.index("far") == 3, order


@pytest.mark.parametrize("aging", [2.0, 8.0])
def test_the_lowest_priority_still_progresses_within_its_bound(aging):
    """A steady stream of interactive requests over one batch request: it waits, but only
    until the work admitted since it arrived exceeds `priority_aging` × (the work queued
    ahead of it + its own); then it goes first."""
    scheduler, _, _ = create_scheduler(slots=1, priority_aging=aging, srpt_aging=1000.0)
    scheduler.add(create_request("first", steps=4, priority=10))
    running = scheduler.admit()[0]
    scheduler.add(create_request("batch", steps=10, priority=-10))  # 20 evaluations, none queued ahead
    bound = aging * 20
    mark, k = scheduler.admitted_evals, 0
    while scheduler.requests["batch"].status is RequestStatus.QUEUED:
        scheduler.add(create_request(f"i{k}", steps=4, priority=10))
        k += 1
        since = scheduler.admitted_evals - mark
        scheduler.release_slot(running)
        scheduler.ledger.give_back_decode(running.reservation)
        running = scheduler.admit()[0]
        assert k < 500, "the batch request starved"
    assert k > 1 and bound < since <= bound + 8, (since, bound)


def test_preemption_parks_the_lowest_priority_with_most_work_left_and_resumes_at_its_step():
    scheduler, outputs, _ = create_scheduler(slots=2, preempt_min_steps=1)
    scheduler.ledger.parked_capacity = 1000
    for rid, steps in (("a", 6), ("b", 9)):
        scheduler.add(create_request(rid, steps=steps, priority=-1))
    assert ids(scheduler.admit()) == ["a", "b"]
    group = scheduler.pick_group()
    scheduler.launched(group, None, [0, 1])  # a fence of None: nothing in flight
    scheduler.add(create_request("urgent", steps=2, priority=5))
    plan = super(type(scheduler), scheduler).admit()
    assert [(slot, r.request_id) for _, slot, r in plan.parked] == [(1, "b")] and ids(plan.placed) == ["urgent"]
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.PARKED and b.steps_at_release == 1 and b.remaining_evals == 16
    assert scheduler.ledger.parked_used == 100 and scheduler.stats()["preemptions"] == 1
    scheduler.release_slot(scheduler.requests["urgent"])  # done
    scheduler.ledger.give_back_decode(scheduler.requests["urgent"].reservation)
    assert ids(scheduler.admit()) == ["b"] and group.step_index[b.slot] == 1 and scheduler.ledger.parked_used == 0


def test_idle_groups_are_evicted_beyond_the_bound_and_busy_ones_never():
    scheduler, _, made = create_scheduler(slots=1, max_groups=2)
    sizes = [(4, 8 * k, 8) for k in range(1, 5)]
    for k, shape in enumerate(sizes[:2]):
        scheduler.add(create_request(f"s{k}", shape=shape))
    assert len(scheduler.admit()) == 2
    scheduler.add(create_request("third", shape=sizes[2]))
    assert scheduler.admit() == [] and len(scheduler.groups) == 2  # both groups busy: it waits
    scheduler.release_slot(scheduler.requests["s0"])
    assert ids(scheduler.admit()) == ["third"]
    assert len(scheduler.groups) == 2 and ("model", sizes[0]) not in scheduler.groups
    assert scheduler.stats()["groups_evicted"] == 1


def test_a_group_that_cannot_be_allocated_fails_only_its_request():
    scheduler, outputs, _ = create_scheduler(slots=1, refuse_storage=lambda shape: shape != SHAPE)
    scheduler.add(create_request("too-big", shape=(4, 64, 64)))
    scheduler.add(create_request("fine"))
    assert ids(scheduler.admit()) == ["fine"]
    assert [type(o) for o in outputs] == [RequestFailed] and outputs[0].request_id == "too-big"
    assert "too-big" not in scheduler.requests and len(scheduler.groups) == 1


def test_static_admission_waits_for_the_whole_batch():
    scheduler, _, _ = create_scheduler(slots=2, admission="static")
    for r in create_requests(3):
        scheduler.add(r)
    assert len(scheduler.admit()) == 2
    scheduler.release_slot(scheduler.requests["r0"])
    assert scheduler.admit() == []  # r1 still runs
    scheduler.release_slot(scheduler.requests["r1"])
    assert ids(scheduler.admit()) == ["r2"]


def test_abort_of_a_queued_request_ends_it_at_once_and_a_running_one_drains():
    scheduler, outputs, _ = create_scheduler(slots=1)
    running, queued = create_request("running"), create_request("queued")
    scheduler.add(running)
    scheduler.add(queued)
    scheduler.admit()
    drain = scheduler.abort(["queued", "running", "running", "unknown"])
    assert drain == [running] and running.ending is Ending.CANCELED
    assert not running.group.runnable[running.slot] and running.group.requests[running.slot] is running
    assert [type(o) for o in outputs] == [RequestCanceled] and outputs[0].request_id == "queued"
    assert "queued" not in scheduler.requests and not scheduler.queue


def test_launched_advances_each_slot_and_marks_the_last_step_finishing():
    scheduler, _, _ = create_scheduler(slots=2, policy="fifo")
    scheduler.add(create_request("two", steps=2))
    scheduler.add(create_request("three", steps=3, guided=False))
    scheduler.admit()
    group = scheduler.pick_group()
    finish_step(scheduler, group)
    advanced = finish_step(scheduler, group)
    assert [(step, r.request_id, final) for _, step, r, final in advanced] == [(2, "two", True), (2, "three", False)]
    two, three = scheduler.requests["two"], scheduler.requests["three"]
    assert two.status is RequestStatus.FINISHING and two.step == 2 and two.timings.evals == 4
    assert three.status is RequestStatus.RUNNING and three.timings.evals == 2 and three.remaining_evals == 1


def test_the_row_limit_after_out_of_memory_caps_slots_and_recovers():
    scheduler, _, _ = create_scheduler(slots=8, oom_recovery_batches=3)
    scheduler.add(create_request("r"))
    scheduler.admit()
    group = scheduler.pick_group()
    scheduler.launched(group, object(), [], row_limit=8)  # the runner found 16 rows did not fit
    assert scheduler.row_limit == 8 and scheduler.slot_cap() == 4
    scheduler.launched(group, object(), [], row_limit=4)
    assert scheduler.row_limit == 4 and scheduler.slot_cap() == 2
    for _ in range(3):
        scheduler.launched(group, object(), [])
    assert scheduler.row_limit == 8
    for _ in range(3):
        scheduler.launched(group, object(), [])
    assert scheduler.row_limit is None and scheduler.slot_cap() == 8


def test_decode_done_returns_the_reservation_once():
    scheduler, _, _ = create_scheduler(slots=1)
    request = create_request("r")
    scheduler.add(request)
    scheduler.admit()
    scheduler.denoised(request)
    scheduler.release_slot(request)
    assert scheduler.ledger.used.trajectory_bytes == 0 and scheduler.ledger.used.decode_buffers == 1
    assert scheduler.decode_done("r") is True
    assert scheduler.decode_done("r") is False
    assert scheduler.ledger.used.decode_buffers == 0 and not scheduler.requests
