"""The runner: how one group's step runs, on its own storage. It applies the scheduler's
`AdmissionPlan` to the slot storage (slots freed, groups made and evicted, requests
placed) and executes a `StepPlan`: builds the row map and gathers the per-row model
inputs from slot-owned state, uploads the step's small arrays, calls the denoiser
(eagerly or through a CUDA graph, in row chunks after an out-of-memory), isolates the
requests whose rows make it raise, applies the fused per-slot update and the generic
schedulers' steps, lets each input kind's slot state act after the update (inpainting's
known region), takes x0 previews and records the launch's fence. It returns a
`StepOutcome`; it never reads or writes the scheduler's state."""
from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np
import torch

from engine.core.device import PinnedBuffers, StepTimer
from engine.core.graphs import CudaGraphCapture, GraphedDenoiser
from engine.core.kernels import update_slots
from engine.core.scheduling.plan import AdmissionPlan, StepOutcome, StepPlan
from engine.core.storage import Batch, SlotStorage, to_host
from engine.core.solvers import G, NUM_COEFS, P, Q
from engine.models.inputs import ModelInputs
from engine.models.model import prompt_rows

log = logging.getLogger("diffslot.core")

#: The per-row adapter inputs (`ModelInputs`), left out of a call whose rows have none.
ADAPTER_FIELDS = ("lora_index", "lora_scale")


class Runner:
    def __init__(self, model, config, device: torch.device, fences, schedule_capacity: int,
                 graph_layout_version=None):
        self.model, self.config, self.device, self.fences = model, config, device, fences
        self.schedule_capacity = schedule_capacity
        self.storage: dict[tuple, SlotStorage] = {}
        self.timer = StepTimer(device)  # device time per step (host time says nothing on CUDA)
        self.denoiser_s = 0.0  # host seconds inside one-call denoiser steps: on a CPU, its busy time
        self.useful_rows = self.padded_rows = 0
        self.park_s = 0.0  # host seconds moving parked slot state out and back
        # step caches: unit-steps decided, unit-steps that skipped work, rows that skipped it
        self.cache_decisions = self.cache_hits = self.cache_rows_skipped = 0
        self.staged_uploads = device.type == "cuda"  # tests turn it on with CPU tensors
        self.async_copies = device.type == "cuda"
        # bucketed layout on CUDA: each bucket's denoiser call is captured once and replayed
        self.graphed: GraphedDenoiser | None = None
        if config.cuda_graphs and config.layout == "bucketed" and device.type == "cuda":
            self.graphed = GraphedDenoiser(model, CudaGraphCapture(device), graph_layout_version)
        # prompts of different lengths (Qwen-Image) padded per call: to a multiple under graphs
        self.text_length_multiple = getattr(model, "text_length_multiple", 1) if self.graphed else 1

    # ---- the storage -----------------------------------------------------------------

    def make_storage(self, key: tuple, latent_shape: tuple[int, int, int]) -> SlotStorage:
        return SlotStorage(key, latent_shape, self.config.slots, self.schedule_capacity, self.device)

    def apply(self, plan: AdmissionPlan) -> dict[tuple, Exception]:
        """The plan's changes to the storage, but its placements (`place`, once the
        preparation phase has readied them). Returns the new groups whose storage could not
        be allocated, with the error: their requests fail, not the engine."""
        for key, slot, request in plan.parked:  # after their fence: the slot's state to host memory
            started = time.perf_counter()
            storage = self.storage[key]
            request.parked = storage.park(slot)
            storage.release(slot)
            self.park_s += time.perf_counter() - started
        for key, slot in plan.released:
            storage = self.storage.get(key)
            if storage is not None:
                storage.release(slot)
        for key in plan.evicted:
            self.storage.pop(key, None)
        failed = {}
        for key, latent_shape in plan.new_groups:
            try:
                self.storage[key] = self.make_storage(key, latent_shape)
            except MemoryError as exc:
                failed[key] = exc
        return failed

    def place(self, requests) -> None:
        """Start the slots of newly admitted, prepared requests, and bring back the parked
        state of resumed ones."""
        for request in requests:
            storage = self.storage[request.group_key]
            if request.parked is None:
                storage.place(request.slot, request)
                continue
            started = time.perf_counter()
            storage.unpark(request.slot, request.parked)
            request.parked = None
            self.park_s += time.perf_counter() - started

    # ---- the row map ---------------------------------------------------------------

    def build_batch(self, plan: StepPlan) -> Batch:
        group = self.storage[plan.key]
        layout = self.config.layout
        act, steps = plan.slots, plan.steps
        runnable = np.zeros(group.slots, dtype=bool)
        runnable[act] = True
        step_index = np.zeros(group.slots, dtype=np.int64)
        step_index[act] = steps
        two = group.two_rows[act]
        if layout == "padded":
            # a fixed batch: every slot, both branches, whatever it holds
            row_slot = np.repeat(np.arange(group.slots), 2)
            row_branch_uncond = np.tile([False, True], group.slots)
            cond_row, uncond_row = 2 * act, np.where(two, 2 * act + 1, -1)
        else:
            rows_each = 1 + two
            start = np.cumsum(rows_each) - rows_each
            row_slot = np.repeat(act, rows_each)
            row_branch_uncond = np.zeros(len(row_slot), dtype=bool)
            row_branch_uncond[start[two] + 1] = True
            cond_row, uncond_row = start, np.where(two, start + 1, -1)
            if layout == "bucketed":
                target = bucket_rows(len(row_slot), 2 * group.slots)
                pad = target - len(row_slot)
                row_slot = np.concatenate([row_slot, np.full(pad, act[0])])
                row_branch_uncond = np.concatenate([row_branch_uncond, np.ones(pad, dtype=bool)])
        useful = int(act.size + two.sum())
        # per-row input divisor and timestep at the row's slot's own step (idle slots: step 0)
        row_step = step_index[row_slot]
        row_divisor = group.divisor_table[row_slot, row_step]
        row_timestep = group.timestep_table[row_slot, row_step]
        # each row's inputs: its slot's (the negative prompt's on the uncond branch); padding
        # rows and idle slots borrow an active slot's, their output unused
        cond_slot = np.where(runnable[row_slot], row_slot, act[0])
        branch = (row_branch_uncond & group.two_rows[cond_slot]).astype(np.int64)
        row_conditioning = group.conditioning[cond_slot, branch].tolist()
        # noise, drawn from each stochastic request's own generator, in its own order
        generic = group.generic[act]
        requests = dict(zip(act.tolist(), plan.requests))
        kernel = ~generic
        noisy = np.flatnonzero(group.stochastic[act][kernel])
        noise_row = np.full(int(kernel.sum()), -1, dtype=np.int64)
        noise_row[noisy] = np.arange(noisy.size)
        kernel_slots = act[kernel]
        noise = None
        if noisy.size:  # up with the step's other arrays (page-locked staging on CUDA)
            noise = torch.stack([requests[s].trajectory.step_noise(int(step_index[s]))
                                 for s in kernel_slots[noisy].tolist()]).numpy()
        index = np.stack([kernel_slots, cond_row[kernel], uncond_row[kernel], noise_row], axis=1).astype(np.int32)
        coefs = group.coef_table[kernel_slots, steps[kernel]]
        arrays = {"index": index, "coefs": coefs, "row_slot": row_slot, "row_divisor": row_divisor,
                  "row_timestep": row_timestep, "row_input": 2 * cond_slot + branch}
        if noise is not None:
            arrays["noise"] = noise
        dev = self._upload(group, arrays)
        noise = dev["noise"] if noise is not None else torch.empty(0, device=self.device)
        # a call none of whose requests names an adapter leaves the adapter rows out: its
        # wrapped layers are the base layers (no LoRA kernel launched), and it has its own graph
        skipped = () if any(r.adapters for r in plan.requests) else ADAPTER_FIELDS
        inputs = ModelInputs(
            sample=None, timestep=dev["row_timestep"],
            **prompt_rows(row_conditioning, self.text_length_multiple),
            **{name: table.index_select(0, dev["row_input"]) for name, table in group.request_inputs.items()
               if name not in skipped})
        controls = group.kind_states.get("controls")
        if controls is not None:  # the rows' ControlNets at their own steps (padding and idle rows: none)
            real = np.zeros(len(row_slot), dtype=bool)
            real[cond_row] = True
            real[uncond_row[uncond_row >= 0]] = True
            inputs.controls = controls.call(self.model.controlnets, row_slot, branch, step_index, real)
        return Batch(
            slots=act, slot_rows=np.stack([cond_row, uncond_row], axis=1), index=dev["index"], index_host=index, coefs=dev["coefs"],
            generic=np.stack([act[generic], cond_row[generic], uncond_row[generic]], axis=1),
            row_slot=row_slot, row_index=dev["row_slot"], row_divisor=dev["row_divisor"], inputs=inputs,
            noise=noise, useful_rows=useful, padded_rows=len(row_slot) - useful)

    def _upload(self, group: SlotStorage, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The step's small arrays on the device. On CUDA through persistent page-locked
        staging, packed: one asynchronous host-to-device copy a step (a `non_blocking` copy
        from pageable memory would be synchronous); on CPU the arrays themselves."""
        if not self.staged_uploads:
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        if group.staging is None:
            rows, entries = 2 * group.slots, group.slots
            group.staging = PinnedBuffers({
                "index": (np.int32, (entries, 4)), "coefs": (np.float32, (entries, NUM_COEFS)),
                "row_slot": (np.int64, (rows,)), "row_divisor": (np.float32, (rows,)),
                "row_timestep": (np.float32, (rows,)), "row_input": (np.int64, (rows,)),
                "noise": (np.float32, (entries, group.numel))}, self.device)
        staged = group.staging.acquire()
        for name, array in arrays.items():
            staged.host[name][:len(array)] = array
        return staged.upload({name: len(array) for name, array in arrays.items()})

    # ---- one step --------------------------------------------------------------------

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepOutcome:
        """Run one step of the plan's group. The outcome says which slots' steps were
        launched, which slots' rows made the denoiser raise (every other slot's step
        stands), and the rows per call that fit if the device ran out of memory."""
        timing = self.timer.start()
        group = self.storage[plan.key]
        batch = self.build_batch(plan)
        x_in = group.latents.index_select(0, batch.row_index) / batch.row_divisor[:, None]  # as scale_model_input
        x_in = x_in.view(len(batch.row_slot), *group.latent_shape)
        for slot, cond_row, uncond_row in batch.generic.tolist():  # the scheduler's own scaling
            trajectory, t = plan.request_at(slot).trajectory, self._generic_timestep(plan, slot)
            scaled = trajectory.scale_model_input(group.latents[slot].view(1, *group.latent_shape), t)
            x_in[cond_row] = scaled[0]
            if uncond_row >= 0:
                x_in[uncond_row] = scaled[0]
        if group.channels_last[batch.row_slot].all():
            # only requests whose pipeline keeps channels-last latents: the denoiser's rounding as theirs
            x_in = x_in.contiguous(memory_format=torch.channels_last)
        inputs = dataclasses.replace(batch.inputs, sample=x_in.to(self.model.dtype))
        culprits: dict[int, Exception] = {}
        self._row_limit, self._row_limit_changed = plan.row_limit, False
        cache_call = self._cache_call(group, batch)
        try:
            out = self._denoise_fitting(inputs, cache_call)
        except Exception as exc:  # find the requests that cause it; the others go on
            self._caches_off(cache_call)
            out, batch, culprits = self._isolate_failure(group, batch, inputs, exc)
            cache_call = None
        cached = self._count_cache(cache_call)
        if getattr(self.model, "combines_guidance", False):
            self._combine_guidance(plan, group, batch, out)
        previews = self._previews(plan, group, batch, out)
        update_slots(out, group.latents, group.history, batch.noise, batch.index, batch.coefs)
        if len(batch.generic):
            self._step_generic(plan, group, batch, out, previews)
        if group.kind_states:  # e.g. inpainting: the known region back, after every sampler's update
            steps = np.array([plan.step_at(s) for s in batch.slots.tolist()], dtype=np.int64)
            for state in group.kind_states.values():
                state.after_update(group.latents, batch.slots, steps)
        if previews and self.async_copies:  # to the host behind this step's fence, not by a draining .to("cpu")
            previews = {slot: None if x0 is None else self.copy_to_host(x0) for slot, x0 in previews.items()}
        # one reduction per step over the group's slots, copied to the host behind the step's
        # fence and read by the reaper once it is done: reading the device tensor itself would
        # synchronise the stream (and every launch queued since) every step
        finite = torch.isfinite(group.latents).all(1)
        if self.async_copies:
            flags = torch.empty(finite.shape, dtype=torch.bool, pin_memory=self.device.type == "cuda")
            finite = flags.copy_(finite, non_blocking=True)
        fence = self.fences.record()
        self.useful_rows += batch.useful_rows
        self.padded_rows += batch.padded_rows
        self.timer.stop(timing)
        return StepOutcome(fence=fence, advanced=batch.slots, useful_rows=batch.useful_rows,
                           padded_rows=batch.padded_rows, previews=previews, finite=finite,
                           failed={slot: f"{type(error).__name__}: {error}" for slot, error in culprits.items()},
                           row_limit=self._row_limit if self._row_limit_changed else None,
                           step_seconds=self.timer.poll(), cached=cached)

    def _denoise(self, inputs: ModelInputs, rows: list[int] | None = None, cache_call=None) -> torch.Tensor:
        """The denoiser over the batch's rows (or a subset), in chunks of the row limit once
        the device has run out of memory for more. A call with step caches runs eagerly (its
        rows that skip work leave the call, so no captured graph fits it), unless its only
        caches are TaylorSeer Lite's, whose rows that skip leave before the call; a call
        split into chunks runs without them, and its requests from then on."""
        n = inputs.rows
        limit = self._row_limit
        if rows is None and (limit is None or limit >= n):  # the common case: one call
            started = time.perf_counter()
            if cache_call is not None:
                from engine.models.step_cache import run_call

                bucket = (lambda k: bucket_rows(k, n)) if self.graphed else None
                out = run_call(cache_call, inputs, self.model.run, self.graphed or self.model.run, bucket)
            else:
                out = (self.graphed or self.model.run)(inputs)
            self.denoiser_s += time.perf_counter() - started  # on CUDA: the launches' host time
            return out.reshape(n, -1)
        self._caches_off(cache_call)
        rows = list(range(n)) if rows is None else rows
        limit = limit or len(rows)
        outs = []
        for start in range(0, len(rows), limit):
            chunk = rows[start:start + limit]
            index = torch.tensor(chunk, device=self.device)
            outs.append(self.model.run(inputs.select(index)).reshape(len(chunk), -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _denoise_fitting(self, inputs: ModelInputs, cache_call=None) -> torch.Tensor:
        """Device out of memory: halve the rows per denoiser call (and, through admission,
        the slots in use) until the step fits; never die of it."""
        while True:
            try:
                return self._denoise(inputs, cache_call=cache_call)
            except Exception as exc:
                rows = self._row_limit or inputs.rows
                if not _out_of_memory(exc) or rows == 1:
                    raise
                self._row_limit, self._row_limit_changed = max(1, rows // 2), True
                log.warning("device out of memory at %d rows: now at most %d rows a call", rows, self._row_limit)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    # ---- step caches ------------------------------------------------------------------

    def _cache_call(self, group: SlotStorage, batch: Batch):
        """The step caches of this call's rows, each unit's mode decided (None: no row has one)."""
        state = group.kind_states.get("cache")
        if state is None or not state.slots:
            return None
        from engine.models.cache_units import CacheCall, UnitCall

        units = []
        for slot, rows in zip(batch.slots.tolist(), batch.slot_rows.tolist()):
            value = state.slots.get(slot)
            if value is None:
                continue
            for unit, branches in zip(value.units, value.branches):
                if not unit.off:
                    texts = [group.conditioning[slot, b].hidden for b in branches]
                    length = max(t.shape[0] for t in texts) if texts[0].dim() >= 2 else None
                    units.append(UnitCall([rows[b] for b in branches], unit, unit.mode(), slot=slot,
                                          text_length=length))
        return CacheCall(len(batch.row_slot), units) if units else None

    @staticmethod
    def _caches_off(cache_call) -> None:
        """A call that did not run whole: its units' states no longer follow their pipeline
        calls, so those requests go on without a cache."""
        if cache_call is not None:
            for unit in cache_call.units:
                unit.state.off = True

    def _count_cache(self, cache_call) -> dict[int, float]:
        """slot → the share of its units that skipped work this step."""
        if cache_call is None or cache_call.units[0].state.off:
            return {}
        units_of_slot = collections.Counter(u.slot for u in cache_call.units)
        share: dict[int, float] = {}
        for unit in cache_call.units:
            share[unit.slot] = share.get(unit.slot, 0.0) + unit.hit / units_of_slot[unit.slot]
        self.cache_decisions += len(cache_call.units)
        self.cache_hits += sum(u.hit for u in cache_call.units)
        self.cache_rows_skipped += cache_call.rows_skipped
        return share

    def _isolate_failure(self, group: SlotStorage, batch: Batch, inputs: ModelInputs, exc: Exception):
        """The batch raised: run its requests' rows again in halves until the requests that
        raise alone are found; keep every other row's output. Noise was drawn before the
        denoiser, once, so no request's random stream shifts."""
        rows_of = {}
        for slot in batch.slots.tolist():
            rows_of[slot] = np.flatnonzero(batch.row_slot == slot).tolist()
            if not group.two_rows[slot] and self.config.layout != "compact":
                rows_of[slot] = rows_of[slot][:1]  # padded layouts: only the cond row is useful
        out = torch.zeros(inputs.rows, group.numel, device=self.device, dtype=self.model.dtype)
        culprits: dict[int, Exception] = {}

        def probe(slots: list[int]) -> None:
            rows = [r for s in slots for r in rows_of[s]]
            try:
                out[rows] = self._denoise(inputs, rows).to(out.dtype)
            except Exception as error:
                if len(slots) == 1:
                    culprits[slots[0]] = error
                    return
                probe(slots[: len(slots) // 2])
                probe(slots[len(slots) // 2:])

        probe(list(rows_of))
        log.warning("batch of %d requests raised %s: %d request(s) fail alone", len(rows_of), exc, len(culprits))
        if not culprits:
            return out, batch, culprits
        bad = list(culprits)
        keep_entries = ~np.isin(batch.index_host[:, 0], bad)
        keep_generic = ~np.isin(batch.generic[:, 0], bad) if len(batch.generic) else np.ones(0, bool)
        keep = torch.from_numpy(keep_entries).to(self.device)
        batch = dataclasses.replace(batch, index=batch.index[keep], index_host=batch.index_host[keep_entries],
                                    coefs=batch.coefs[keep], generic=batch.generic[keep_generic],
                                    slots=batch.slots[~np.isin(batch.slots, bad)])
        return out, batch, culprits

    def _previews(self, plan: StepPlan, group: SlotStorage, batch: Batch, out: torch.Tensor) -> dict:
        """x0 estimates of the slots whose preview is due after this step: the guided output
        converted to the data prediction, x0 = p·x + q·out (the kernel's own first stage)."""
        due = {}
        for j, (slot, cond_row, uncond_row, _) in enumerate(batch.index_host.tolist()):
            if plan.step_at(slot) + 1 not in plan.request_at(slot).preview_steps:
                continue
            guided = out[cond_row] if uncond_row < 0 else \
                out[uncond_row] + batch.coefs[j, G] * (out[cond_row] - out[uncond_row])
            due[slot] = batch.coefs[j, P] * group.latents[slot] + batch.coefs[j, Q] * guided.float()
        for slot, cond_row, uncond_row in batch.generic.tolist():
            if plan.step_at(slot) + 1 in plan.request_at(slot).preview_steps:
                due[slot] = None  # filled from the scheduler's own x0 in `_step_generic`
        return due

    def _combine_guidance(self, plan: StepPlan, group: SlotStorage, batch: Batch, out: torch.Tensor) -> None:
        """A model whose pipeline combines the two branches otherwise than `u + g (c − u)`
        (Qwen-Image's norm-preserving true CFG) writes each guided pair's result into both
        its rows; the kernel's (and the generic path's) combine of two equal rows is then
        that result, exactly."""
        pairs = [(c, u, plan.request_at(s).cfg_scale) for s, c, u, _ in batch.index_host.tolist() if u >= 0]
        pairs += [(c, u, plan.request_at(s).cfg_scale) for s, c, u in batch.generic.tolist() if u >= 0]
        if pairs:
            cond_rows, uncond_rows, scales = zip(*pairs)
            self.model.combine_guidance(out, group.latent_shape, cond_rows, uncond_rows, scales)

    def _generic_timestep(self, plan: StepPlan, slot: int) -> torch.Tensor:
        trajectory = plan.request_at(slot).trajectory  # an image request runs the schedule's tail from `begin`
        return trajectory.scheduler.timesteps[trajectory.schedule.begin + plan.step_at(slot)]

    def _step_generic(self, plan: StepPlan, group: SlotStorage, batch: Batch, out: torch.Tensor,
                      previews: dict) -> None:
        """Slots whose scheduler the kernel does not express: the guidance combine as the
        pipeline writes it, then the request's own scheduler's `step`."""
        shape = (1, *group.latent_shape)
        for slot, cond_row, uncond_row in batch.generic.tolist():
            request = plan.request_at(slot)
            guided = out[cond_row]
            if uncond_row >= 0:
                uncond = out[uncond_row]
                guided = uncond + request.cfg_scale * (guided - uncond)
            else:  # a copy: the scheduler keeps what it is given (PNDM's ets), and a graph's
                guided = guided.clone()  # output buffer is rewritten by the next replay
            x = group.latents[slot].view(shape).clone()  # schedulers keep references (PNDM's cur_sample)
            x_next, x0 = request.trajectory.scheduler_step(guided.view(shape).float(),
                                                           self._generic_timestep(plan, slot), x)
            group.latents[slot].copy_(x_next.reshape(-1))
            if slot in previews:  # the scheduler's own x0 where it reports one (PNDM does not)
                previews[slot] = (x0 if x0 is not None else x_next).reshape(-1).clone()

    def copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy into fresh page-locked memory, complete once the next fence
        recorded on this stream is done."""
        return to_host(tensor)


def _out_of_memory(exc: Exception) -> bool:
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)  # the CPU allocator's words


def bucket_rows(rows: int, limit: int) -> int:
    """Round up to a power of two (at most `limit`): few shapes, stable graphs."""
    size = 1
    while size < rows:
        size *= 2
    return max(rows, min(size, limit))
