"""The scheduler: what runs (torch-free, testable with no model).

It owns the queue in front of admission, the ledger, the groups' slot maps and every
request's state. At a step boundary `admit` places queued requests into free slots of
their group when everything they will hold fits (R8), and `pick_group` chooses the one
group whose batch runs next (R2: the runnable group served longest ago). The runner
executes; the reaper reports back through `release_slot` and `end`.

Bounds (R22): at most `max_groups` groups live at once (an idle group is evicted, least
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

from engine.core.ledger import Ledger
from engine.core.outputs import RequestCanceled, RequestFailed, RequestRejected
from engine.core.requests import Ending, Request, RequestStatus
from engine.core.slot_map import SlotMap

log = logging.getLogger("diffslot.core")


class Scheduler:
    def __init__(self, config, ledger: Ledger, make_group: Callable[[tuple, tuple], SlotMap],
                 clock: Callable[[], float], outputs: list, acquire: Callable[[Request], bool] | None = None):
        self.config = config
        self.ledger = ledger
        self.make_group = make_group
        self.clock = clock
        self.outputs = outputs  # shared with the core: what `step()` returns
        # admission's last check: resources outside the ledger (adapters made resident); False:
        # the request waits, as for memory
        self.acquire = acquire
        self.queue: collections.deque[Request] = collections.deque()
        self.requests: dict[str, Request] = {}
        self.groups: dict[tuple, SlotMap] = {}
        self.batches = 0
        self.row_limit: int | None = None  # rows per denoiser call, once the device ran out of memory
        self._batches_at_limit = 0
        self.group_wait_max = 0  # head-of-line blocking: most batches a runnable group waited
        self.counters = collections.Counter()
        self.admitted_evals = 0  # evaluations admitted so far (the clock of SRPT's aging)

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

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Mark each live request canceled. Returns the running ones: their slots drain
        after the fence of their last launch (the caller knows the fences)."""
        running = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.stopping or request.status is RequestStatus.DONE:
                continue
            request.ending = Ending.CANCELED
            self.counters["canceled"] += 1
            self.counters["canceled_evals"] += request.timings.evals
            log.info("request %s canceled while %s", rid, request.status.value)
            if request.status is RequestStatus.QUEUED:
                self.queue.remove(request)
                self.end(request)
            elif request.status is RequestStatus.RUNNING:
                request.group.runnable[request.slot] = False
                running.append(request)
            elif request.status is RequestStatus.DECODING:
                # the decode stage drops its output; decode_done returns the buffer
                self.outputs.append(RequestCanceled(rid, self.final_timings(request)))
            # FINISHING: the reaper sees the ending when the final fence completes
        return running

    def fail(self, request: Request, reason: str) -> None:
        """Fail one request (R15): no new work for it; its slot is released after the
        fence of its last launch, as a cancel's, and it ends with RequestFailed(reason)."""
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

    def _candidates(self) -> list[Request]:
        """The queue in admission order: FIFO, or (srpt) the aged first in arrival order,
        then least remaining evaluations first."""
        if self.config.policy == "fifo":
            return list(self.queue)
        order = [(0, k) if self.aged(r) else (1, r.remaining_evals) for k, r in enumerate(self.queue)]
        return [r for _, r in sorted(zip(order, self.queue), key=lambda pair: pair[0])]

    def admit(self) -> list[Request]:
        """Place what fits at this step boundary; returns the placed requests (whose
        prompts the encode phase then attaches)."""
        if self.config.admission == "static" and any(g.active for g in self.groups.values()):
            return []  # a new batch only when the last one is finished, as a pipeline call
        placed: list[Request] = []
        waiting_for_memory: list[Request] = []
        full_groups: set[tuple] = set()
        for request in self._candidates():
            if waiting_for_memory and any(r.bypassed >= self.config.bypass_limit for r in waiting_for_memory):
                break  # an aged request waits for memory: nobody passes it any more
            key = self.group_key(request)
            if key in full_groups:
                continue  # FIFO within a group: once full, its later requests wait too
            group = self.groups.get(key) or self._new_group(key, request)
            slot = -1 if group is None or group.active >= self.slot_cap() else group.free_slot()
            if slot < 0:
                full_groups.add(key)
                continue
            if not self.ledger.fits(request.reservation) or (self.acquire is not None and not self.acquire(request)):
                waiting_for_memory.append(request)  # a known boundary: it waits, others may pass
                continue
            for waiting in waiting_for_memory:
                waiting.bypassed += 1
            self.queue.remove(request)
            self.admitted_evals += request.remaining_evals
            self.ledger.take(request.reservation)
            self._place(request, group, slot)
            placed.append(request)
        return placed

    def group_key(self, request: Request) -> tuple:
        return request.group_key

    def _new_group(self, key: tuple, request: Request) -> SlotMap | None:
        """A group for a new key, evicting an idle one when `max_groups` are live; None
        when every live group is busy (the request waits)."""
        if len(self.groups) >= self.config.max_groups:
            idle = [g for g in self.groups.values() if g.active == 0]
            if not idle:
                return None
            victim = min(idle, key=lambda g: g.last_served)
            del self.groups[victim.key]
            self.counters["groups_evicted"] += 1
            log.debug("idle group %s evicted", victim.key)
        try:
            group = self.make_group(key, request.latent_shape)
        except MemoryError as exc:  # the allocation fails the request that needed it, not the engine
            self.queue.remove(request)
            self.fail(request, f"no memory for a group of its size ({exc})")
            self.end(request)
            return None
        self.groups[key] = group
        return group

    def _place(self, request: Request, group: SlotMap, slot: int) -> None:
        group.place(request, slot)
        request.status = RequestStatus.RUNNING
        request.admitted_at = self.clock()  # moved past its encode pass by the encode phase
        request.timings.queue_s = request.admitted_at - request.arrival
        log.info("request %s admitted to slot %d (epoch %d)", request.request_id, slot, group.epoch[slot])

    # ---- one step -----------------------------------------------------------------

    def pick_group(self) -> SlotMap | None:
        """Fair across groups: the runnable group served longest ago goes next."""
        runnable = [g for g in self.groups.values() if g.runnable.any()]
        if not runnable:
            return None
        group = min(runnable, key=lambda g: g.last_served)
        for g in runnable:
            if g is not group:
                self.group_wait_max = max(self.group_wait_max, self.batches - g.last_served)
        return group

    def launched(self, group: SlotMap, fence, slots: Iterable[int]) -> list[tuple[int, int, Request, bool]]:
        """A batch of `group` was launched: advance its slots. Returns (slot, step, request,
        final) for each."""
        self.batches += 1
        group.last_served = self.batches
        if self.row_limit is not None:
            self._batches_at_limit += 1
            if self._batches_at_limit >= self.config.oom_recovery_batches:
                self._recover_row_limit()
        advanced = []
        for slot in slots:
            request = group.requests[slot]
            request.timings.evals += request.rows_per_step
            group.step_index[slot] += 1
            group.last_fence[slot] = fence
            step = int(group.step_index[slot])
            final = step == request.total_steps
            if final:
                group.runnable[slot] = False
                request.status = RequestStatus.FINISHING
            advanced.append((slot, step, request, final))
        return advanced

    def out_of_memory(self, rows: int) -> int:
        """The device could not run `rows` rows: halve the rows per call (and, through
        admission, the slots a group may fill). Returns the new limit."""
        self.row_limit = max(1, rows // 2)
        self._batches_at_limit = 0
        self.counters["oom_splits"] += 1
        return self.row_limit

    def _recover_row_limit(self) -> None:
        self._batches_at_limit = 0
        doubled = 2 * self.row_limit
        self.row_limit = None if doubled >= 2 * self.config.slots else doubled
        log.info("row limit after out-of-memory recovers to %s", self.row_limit or "none")

    # ---- requests out ----------------------------------------------------------------

    def release_slot(self, request: Request) -> None:
        """The fence of the slot's last launch is done: the slot is free (epoch + 1)."""
        group, slot = request.group, request.slot
        group.release(slot)
        self.ledger.give_back_trajectory(request.reservation)
        log.debug("slot %d released (epoch now %d) by %s", slot, group.epoch[slot], request.request_id)

    def denoised(self, request: Request) -> None:
        request.timings.denoise_s = self.clock() - request.admitted_at
        request.status = RequestStatus.DECODING
        self.counters["completed"] += 1

    def end(self, request: Request) -> None:
        """End a request that never reaches the decode stage (canceled or failed)."""
        if request.status is not RequestStatus.QUEUED:  # a queued request holds no reservation yet
            self.ledger.give_back_trajectory(request.reservation)
            self.ledger.give_back_decode(request.reservation)
        timings = self.final_timings(request)
        request.status = RequestStatus.DONE
        self.requests.pop(request.request_id, None)
        if request.ending is Ending.FAILED:
            self.outputs.append(RequestFailed(request.request_id, request.failure))
        else:
            self.outputs.append(RequestCanceled(request.request_id, timings))

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
        }
