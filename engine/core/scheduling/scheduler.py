"""The scheduler: what runs (torch-free, testable with no model).

It owns the queue in front of admission, the ledger, the groups' slot maps and every
request's state, and it talks to the runner only in data (`engine.core.scheduling.plan`): at a step
boundary `admit` places queued requests into free slots of their group when everything
they will hold fits, and returns an `AdmissionPlan` (placements, new and evicted groups,
slots freed since the last plan); `next_step` returns the `StepPlan` of the group whose
batch runs next (shortest remaining first across groups, aged so none starves);
`update_from_output` applies the runner's `StepOutcome` (steps advanced, rows failed, the
row limit after an out-of-memory).
The reaper reports fences back through `release_slot`, `denoised` and `end`; every method
that ends a request returns its output message rather than keeping a list.

Adapters are a resource of admission, like memory: a request is placed only when the
adapter pool (`engine.lora.interface.AdapterResidency`) makes its adapters resident;
their references are dropped with the slot, after its fence. While the pool's loader
thread reads a request's adapter, that request waits and everyone may pass it; a request
waiting for adapter room is passed at most `bypass_limit` times by requests that also
need adapters, never holding back one that needs none; one whose adapters can never be
resident fails (its reason names `loras`).

Bounds: at most `max_groups` groups live at once (an idle group is evicted, least
recently served first, to make room for a new key); a request that does not fit in
memory now lets at most `bypass_limit` later requests pass it, then admission waits for
it (no starvation); after the device ran out of memory, the row limit per call recovers
by doubling once `oom_recovery_batches` batches ran at the lower limit.

Admission order (`policy`): FIFO, or SRPT — least remaining evaluations first, aged: the
work admitted while a request waits is at most `srpt_aging` × (the work queued ahead of
it when it arrived, which FIFO would have admitted first, + its own); past that it goes
first, in arrival order among the aged. On a saturated engine time is proportional to
work, so a request waits at most about `srpt_aging` times as long as FIFO would make it
wait (plus its own service), whatever the stream of shorter requests behind it.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, Iterable

import numpy as np

from engine.core.scheduling.ledger import Ledger
from engine.core.outputs import RequestCanceled, RequestFailed, RequestRejected
from engine.core.scheduling.plan import AdmissionPlan, StepOutcome, StepPlan
from engine.core.scheduling.requests import Ending, Request, RequestStatus
from engine.core.scheduling.slot_map import SlotMap

log = logging.getLogger("diffslot.core")


class Scheduler:
    def __init__(self, config, ledger: Ledger, clock: Callable[[], float], adapters=None):
        self.config = config
        self.ledger = ledger
        self.clock = clock
        self.adapters = adapters  # engine.lora.interface.AdapterResidency, or None
        self.queue: collections.deque[Request] = collections.deque()
        self.requests: dict[str, Request] = {}
        self.groups: dict[tuple, SlotMap] = {}
        self.batches = 0
        self.row_limit: int | None = None  # rows per denoiser call, once the device ran out of memory
        self._batches_at_limit = 0
        self.group_wait_max = 0  # head-of-line blocking: most batches a runnable group waited
        self.counters = collections.Counter()
        self.admitted_evals = 0  # evaluations admitted so far (the clock of SRPT's aging)
        self._released: list[tuple[tuple, int]] = []  # slots freed since the last plan
        self._parking: list[Request] = []  # victims chosen, parked once their last launch is done
        self.seconds_per_eval = 0.0  # measured: a deadline's slack counts the remaining work at this rate

    # ---- requests in ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"{request.request_id!r} is already in flight", "request_id")
        if len(self.queue) >= self.config.max_queue:
            self.counters["rejected_full"] += 1
            raise RequestRejected(f"queue full ({self.config.max_queue} waiting)", None)
        self.requests[request.request_id] = request
        request.work_ahead = sum(r.remaining_evals for r in self.queue)  # what FIFO would admit first
        request.admitted_mark = self.admitted_evals
        self.queue.append(request)

    def abort(self, request_ids: Iterable[str]) -> tuple[list[Request], list]:
        """Mark each live request canceled. Returns (the running ones, whose slots drain after
        the fence of their last launch, which the caller knows; the outputs of the others)."""
        running, outputs = [], []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.stopping or request.status is RequestStatus.DONE:
                continue
            request.ending = Ending.CANCELED
            self.counters["canceled"] += 1
            self.counters["canceled_evals"] += request.timings.evals
            log.info("request %s canceled while %s", rid, request.status.value)
            if request.status in (RequestStatus.QUEUED, RequestStatus.PARKED):
                self.queue.remove(request)
                outputs.append(self.end(request))
            elif request.status is RequestStatus.RUNNING:
                request.group.runnable[request.slot] = False
                running.append(request)
            elif request.status is RequestStatus.DECODING:
                # the decode stage drops its output; decode_done returns the buffer
                outputs.append(RequestCanceled(rid, self.final_timings(request)))
            # FINISHING: the reaper sees the ending when the final fence completes
        return running, outputs

    def fail(self, request: Request, reason: str) -> None:
        """Fail one request: no new work for it; its slot is released after the fence of
        its last launch, as a cancel's, and it ends with RequestFailed(reason)."""
        if request.stopping:
            return
        request.ending, request.failure = Ending.FAILED, reason
        self.counters["failed"] += 1
        log.warning("request %s failed: %s", request.request_id, reason)
        if request.status is RequestStatus.RUNNING:
            request.group.runnable[request.slot] = False

    # ---- admission --------------------------------------------------------------------

    def slot_cap(self) -> int:
        """Slots a group may use: all, until the device ran out of memory."""
        return self.config.slots if self.row_limit is None else max(1, self.row_limit // 2)

    def aged(self, request: Request) -> bool:
        """SRPT's bound reached: passed `bypass_limit` times while it waited for memory, or
        more work admitted since it arrived than `srpt_aging` × (the work ahead of it + its own)."""
        admitted_since = self.admitted_evals - request.admitted_mark
        return request.bypassed >= self.config.bypass_limit or \
            admitted_since > self.config.srpt_aging * (request.work_ahead + request.remaining_evals)

    def starving(self, request: Request) -> bool:
        """The lowest priorities still progress: past `priority_aging` × (the work queued
        ahead of it when it arrived + its own) admitted while it waits, it goes first."""
        admitted_since = self.admitted_evals - request.admitted_mark
        return admitted_since > self.config.priority_aging * (request.work_ahead + request.remaining_evals)

    def _order(self, position: int, request: Request) -> tuple:
        """Admission order: the starving first (in arrival order); then higher priority
        first; within a priority, requests with a deadline by least slack, then the others
        by the policy (FIFO, or SRPT with its aging)."""
        if self.starving(request):
            return (0, 0, 0, position)
        if request.deadline is not None:
            slack = request.deadline - self.clock() - request.remaining_evals * self.seconds_per_eval
            return (1, -request.priority, 0, slack)
        if self.config.policy == "fifo" or self.aged(request):
            return (1, -request.priority, 1, -1, position)
        return (1, -request.priority, 1, request.remaining_evals, position)

    def _candidates(self) -> list[Request]:
        keys = [self._order(k, r) for k, r in enumerate(self.queue)]
        return [r for _, r in sorted(zip(keys, self.queue), key=lambda pair: pair[0])]

    def admit(self) -> AdmissionPlan:
        """Place what fits at this step boundary, parking running requests of a lower
        priority where a higher one cannot be placed. The plan also carries the slots
        parked and freed, and the groups made or evicted since the last one, for the
        runner's storage."""
        plan = AdmissionPlan(released=self._released)
        self._released = []
        self._park_ready(plan)
        if self.config.admission == "static" and any(g.active for g in self.groups.values()):
            return plan  # a new batch only when the last one is finished, as a pipeline call
        waiting_for_memory: list[Request] = []
        waiting_for_adapters: list[Request] = []  # for adapter room: they hold back only others needing adapters
        full_groups: set[tuple] = set()
        limit = self.config.bypass_limit
        for request in self._candidates():
            if any(r.bypassed >= limit for r in waiting_for_memory):
                break  # an aged request waits for memory: nobody passes it any more
            needs_adapters = bool(request.params.loras) and self.adapters is not None
            if needs_adapters and any(r.bypassed >= limit for r in waiting_for_adapters):
                continue  # an aged request waits for adapter room: no other adapter user passes it
            key = request.group_key
            if key in full_groups:
                continue  # FIFO within a group: once full, its later requests wait too
            group = self.groups.get(key) or self._new_group(key, request, plan)
            slot = self._free_slot(group)
            if slot < 0 and group is not None and self._preempt_for(request, plan, group=group):
                slot = self._free_slot(group)
            if slot < 0:
                full_groups.add(key)
                continue
            if not self._fits(request):  # victims parked at once free their bytes now, others after their fence
                self._preempt_for(request, plan)
            if not self._fits(request):
                waiting_for_memory.append(request)  # a known boundary: it waits, others may pass
                continue
            adapters = self._acquire_adapters(request, plan)
            if adapters is not True:
                if adapters == "room":
                    waiting_for_adapters.append(request)
                continue  # loading (anyone may pass), or it ended (never resident)
            for waiting in waiting_for_memory:
                waiting.bypassed += 1
            if needs_adapters:
                for waiting in waiting_for_adapters:
                    waiting.bypassed += 1
            self.queue.remove(request)
            self.admitted_evals += request.remaining_evals
            if request.status is RequestStatus.PARKED:
                self.ledger.resume(request.reservation)
                request.timings.parked_s += self.clock() - request.parked_at
                self.counters["resumed"] += 1
            else:
                self.ledger.take(request.reservation)
            self._place(request, group, slot)
            plan.placed.append(request)
        return plan

    def _free_slot(self, group: SlotMap | None) -> int:
        return -1 if group is None or group.active >= self.slot_cap() else group.free_slot()

    def _fits(self, request: Request) -> bool:
        if request.status is RequestStatus.PARKED:  # it kept its decode and output reservation
            return self.ledger.fits_trajectory(request.reservation)
        return self.ledger.fits(request.reservation)

    # ---- preemption -------------------------------------------------------------------

    def _preempt_for(self, request: Request, plan: AdmissionPlan, group: SlotMap | None = None) -> bool:
        """Choose running requests of a lower priority to park so that `request` can be
        placed: one slot of `group`, or (no group) its trajectory bytes. Victims whose
        last launch is done are parked now (True: something was freed in this plan); the
        others once their fence is done, while `request` waits. Nothing is chosen while
        earlier victims are still on their way out (no thrash)."""
        c = self.config
        if not c.preemption or c.admission == "static" or self._parking:
            return False
        pool = [group] if group is not None else list(self.groups.values())
        eligible = sorted(
            (r for g in pool for r in g.requests
             if r is not None and r.status is RequestStatus.RUNNING and not r.stopping
             and r.priority < request.priority and r.parks < c.max_preemptions
             and self.batches - r.admitted_batch >= c.preempt_min_steps
             and self.ledger.can_park(r.reservation)),
            key=lambda r: (r.priority, -r.remaining_evals))
        need = 1 if group is not None else (self.ledger.used.trajectory_bytes + request.reservation.trajectory_bytes
                                            - self.ledger.capacity.trajectory_bytes)
        victims, freed = [], 0
        for victim in eligible:
            if freed >= need:
                break
            victims.append(victim)
            freed += 1 if group is not None else victim.reservation.trajectory_bytes
        if freed < need or not victims:
            return False
        for victim in victims:
            victim.parking = True
            victim.group.runnable[victim.slot] = False
            self._parking.append(victim)
            log.info("request %s (priority %d) to be parked for %s (priority %d)", victim.request_id,
                     victim.priority, request.request_id, request.priority)
        return self._park_ready(plan) > 0

    def _park_ready(self, plan: AdmissionPlan) -> int:
        """Park every chosen victim whose last launch's fence is done; returns how many."""
        parked, waiting = 0, []
        for request in self._parking:
            fence = request.group.last_fence[request.slot]
            if request.stopping:  # canceled or failed meanwhile: it drains as any other
                request.parking = False
            elif fence is not None and not fence.done():
                waiting.append(request)
            else:
                self._park(request, plan)
                parked += 1
        self._parking = waiting
        return parked

    def _park(self, request: Request, plan: AdmissionPlan) -> None:
        group, slot = request.group, request.slot
        plan.parked.append((group.key, slot, request))
        group.release(slot)  # the runner parks the slot's storage before anything reuses it
        self.ledger.park(request.reservation)
        request.parking = False
        request.status = RequestStatus.PARKED
        request.parks += 1
        request.timings.preemptions += 1
        request.parked_at = self.clock()
        self.queue.append(request)
        self.counters["preemptions"] += 1
        self.counters["parked_bytes_total"] += request.reservation.trajectory_bytes
        log.info("request %s parked at step %d (epoch now %d)", request.request_id, request.steps_at_release,
                 group.epoch[slot])

    def _acquire_adapters(self, request: Request, plan: AdmissionPlan) -> bool | str:
        """Reference the request's resident adapters: True once done (or none needed);
        "loading" while the pool loads one (it waits); "room" when there is no room for
        them now (it waits, as for memory); "failed" when they can never be resident (it
        ends here, never placed, its reason naming `loras`)."""
        loras = request.params.loras
        if not loras or self.adapters is None or request.adapters:
            return True  # none needed, or a parked request resuming with the references it kept
        try:
            slots = self.adapters.acquire(list(loras))
        except Exception as exc:  # the file changed or broke since validation: this request fails
            if isinstance(exc, ValueError):  # the pool's own reason: it names adapters, never a path
                why = str(exc)
            else:
                log.exception("request %s: its adapters could not be acquired", request.request_id)
                why = "its adapters could not be loaded (the engine's log has the details)"
            self.queue.remove(request)
            self.fail(request, f"loras: {why}")
            plan.outputs.append(self.end(request))
            return "failed"
        if slots is None:
            return "room"
        if isinstance(slots, str):
            return slots
        request.adapters = tuple(slots)
        return True

    def _new_group(self, key: tuple, request: Request, plan: AdmissionPlan) -> SlotMap | None:
        """A group for a new key, evicting an idle one when `max_groups` are live; None
        when every live group is busy (the request waits)."""
        if len(self.groups) >= self.config.max_groups:
            idle = [g for g in self.groups.values() if g.active == 0]
            if not idle:
                return None
            victim = min(idle, key=lambda g: g.last_served)
            del self.groups[victim.key]
            plan.evicted.append(victim.key)
            self.counters["groups_evicted"] += 1
            log.debug("idle group %s evicted", victim.key)
        group = self.groups[key] = SlotMap(key, request.latent_shape, self.config.slots)
        group.last_served = self.batches  # its wait counts from its creation
        plan.new_groups.append((key, request.latent_shape))
        return group

    def storage_failed(self, key: tuple, error: Exception) -> list:
        """The runner could not allocate a new group's storage: the requests placed in it
        fail (the allocation fails the requests that needed it, not the engine) and the
        group goes. Returns their outputs."""
        group = self.groups.pop(key)
        outputs = []
        for request in [r for r in group.requests if r is not None]:
            self.fail(request, f"no memory for a group of its size ({error})")
            if request.adapters and self.adapters is not None:
                self.adapters.release(request.adapters)
                request.adapters = ()
            outputs.append(self.end(request))
        return outputs

    def _place(self, request: Request, group: SlotMap, slot: int) -> None:
        resumed = request.status is RequestStatus.PARKED
        group.place(request, slot, request.steps_at_release if resumed else 0)
        request.status = RequestStatus.RUNNING
        request.admitted_batch = self.batches
        if resumed:
            log.info("request %s resumed in slot %d at step %d", request.request_id, slot, request.steps_at_release)
            return
        request.admitted_at = self.clock()  # moved past its encode pass by the preparation phase
        request.timings.queue_s = request.admitted_at - request.arrival
        log.info("request %s admitted to slot %d (epoch %d)", request.request_id, slot, group.epoch[slot])

    # ---- one step -----------------------------------------------------------------

    def next_step(self) -> StepPlan | None:
        """The group whose batch runs next: a group due by its wait first (longest waiting
        first), then the highest priority, then the group whose soonest-finishing request
        finishes soonest (see `_group_order`)."""
        runnable = [g for g in self.groups.values() if g.runnable.any()]
        if not runnable:
            return None
        due = self.config.group_aging * (len(runnable) - 1)
        group = min(runnable, key=lambda g: self._group_order(g, due))
        for g in runnable:
            if g is not group:
                self.group_wait_max = max(self.group_wait_max, self.batches + 1 - g.last_served)
        slots = np.flatnonzero(group.runnable)
        return StepPlan(group.key, slots, group.step_index[slots].copy(), [group.requests[s] for s in slots],
                        group.slots, self.row_limit)

    def _group_order(self, group: SlotMap, due: float) -> tuple:
        """Shortest remaining first across groups, aged. A group's cost to its next finished
        request is the fewest steps any of its rows has left × what one of its calls computes
        (rows × latent elements: a proxy the scheduler knows without a model). A group that
        waited `due` = `group_aging` × (other runnable groups) batches goes first, so no group
        waits more than about (`group_aging` + 1) × (other runnable groups) batches, and a
        group_aging of 0 is plain round robin."""
        waited = self.batches - group.last_served
        if waited >= due:
            return (0, -waited)
        slots = np.flatnonzero(group.runnable)
        requests = [group.requests[s] for s in slots]
        steps_left = int(min(r.total_steps - int(group.step_index[s]) for r, s in zip(requests, slots)))
        per_call = sum(r.rows_per_step for r in requests) * int(np.prod(group.latent_shape))
        return (1, -max(r.priority for r in requests), steps_left * per_call, group.last_served)

    def update_from_output(self, plan: StepPlan, outcome: StepOutcome) -> list[tuple[int, int, Request, bool]]:
        """Apply what the runner did: its failed rows fail their requests; every launched
        slot advances one step. Returns (slot, step, request, final) for each launched slot."""
        group = self.groups[plan.key]
        self.batches += 1
        group.last_served = self.batches
        if outcome.useful_rows and outcome.step_seconds:
            self.seconds_per_eval = outcome.step_seconds / outcome.useful_rows
        if outcome.row_limit is not None:
            self.row_limit, self._batches_at_limit = outcome.row_limit, 0
            self.counters["oom_splits"] += 1
            log.warning("device out of memory: now at most %d rows a call and %d slots a group",
                        self.row_limit, self.slot_cap())
        elif self.row_limit is not None:
            self._batches_at_limit += 1
            if self._batches_at_limit >= self.config.oom_recovery_batches:
                self._recover_row_limit()
        for slot, why in outcome.failed.items():
            request = group.requests[slot]
            group.last_fence[slot] = outcome.fence
            self.fail(request, f"the denoiser raised {why}")
        advanced = []
        for slot in outcome.advanced.tolist():
            request = group.requests[slot]
            request.timings.evals += request.rows_per_step
            request.timings.padded_evals += outcome.padded_rows
            request.timings.cached_steps += outcome.cached.get(slot, 0.0)
            group.step_index[slot] += 1
            group.last_fence[slot] = outcome.fence
            step = int(group.step_index[slot])
            final = step == request.total_steps
            if final:
                group.runnable[slot] = False
                request.status = RequestStatus.FINISHING
            advanced.append((slot, step, request, final))
        return advanced

    def _recover_row_limit(self) -> None:
        self._batches_at_limit = 0
        doubled = 2 * self.row_limit
        self.row_limit = None if doubled >= 2 * self.config.slots else doubled
        log.info("row limit after out-of-memory recovers to %s", self.row_limit or "none")

    # ---- requests out ----------------------------------------------------------------

    def release_slot(self, request: Request) -> None:
        """The fence of the slot's last launch is done: the slot is free (epoch + 1), its
        adapter references dropped, and the runner's storage told in the next plan."""
        group, slot = request.group, request.slot
        group.release(slot)
        self.ledger.give_back_trajectory(request.reservation)
        if request.adapters and self.adapters is not None:
            self.adapters.release(request.adapters)
            request.adapters = ()
        if self.groups.get(group.key) is group:
            self._released.append((group.key, slot))
        log.debug("slot %d released (epoch now %d) by %s", slot, group.epoch[slot], request.request_id)

    def denoised(self, request: Request) -> None:
        request.timings.denoise_s = self.clock() - request.admitted_at
        request.status = RequestStatus.DECODING
        self.counters["completed"] += 1

    def end(self, request: Request):
        """End a request that never reaches the decode stage (canceled or failed); returns
        its output message."""
        if request.status is RequestStatus.PARKED:  # its slot state is on the host
            self.ledger.drop_parked(request.reservation)
            self.ledger.give_back_decode(request.reservation)
            request.parked = None
            if request.adapters and self.adapters is not None:
                self.adapters.release(request.adapters)
                request.adapters = ()
        elif request.status is not RequestStatus.QUEUED:  # a queued request holds no reservation yet
            self.ledger.give_back_trajectory(request.reservation)
            self.ledger.give_back_decode(request.reservation)
        timings = self.final_timings(request)
        request.status = RequestStatus.DONE
        self.requests.pop(request.request_id, None)
        if request.ending is Ending.FAILED:
            return RequestFailed(request.request_id, request.failure)
        return RequestCanceled(request.request_id, timings)

    def decode_done(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.DECODING:
            return False
        self.ledger.give_back_decode(request.reservation)
        request.status = RequestStatus.DONE
        del self.requests[request_id]
        return not request.stopping

    def final_timings(self, request: Request):
        t = request.timings
        now = self.clock()
        if request.status is RequestStatus.QUEUED:
            t.queue_s = now - request.arrival
        elif request.admitted_at and not t.denoise_s:
            t.denoise_s = now - request.admitted_at
        t.total_s = now - request.arrival
        return t

    def stats(self) -> dict:
        groups = self.groups.values()
        total_slots = sum(g.slots for g in groups) or self.config.slots
        busy = sum(g.active for g in groups)
        c = self.counters
        return {
            "slots": total_slots,
            "slots_busy": busy,
            "slot_occupancy": busy / total_slots,
            "queue_depth": len(self.queue),
            "groups": len(self.groups),
            "groups_evicted": c["groups_evicted"],
            "batches": self.batches,
            "canceled_requests": c["canceled"],
            "failed_requests": c["failed"],
            "oom_splits": c["oom_splits"],
            "row_limit": self.row_limit or 0,
            "canceled_evals": c["canceled_evals"],
            "rejected_full": c["rejected_full"],
            "completed": c["completed"],
            "max_group_wait_batches": self.group_wait_max,
            "reserved_trajectory_bytes": self.ledger.used.trajectory_bytes,
            "reserved_output_bytes": self.ledger.used.output_bytes,
            "reserved_decode_buffers": self.ledger.used.decode_buffers,
            "preemptions": c["preemptions"],
            "resumed": c["resumed"],
            "parked_requests": sum(r.status is RequestStatus.PARKED for r in self.queue),
            "parked_bytes": self.ledger.parked_used,
            "parked_bytes_total": c["parked_bytes_total"],
        }
