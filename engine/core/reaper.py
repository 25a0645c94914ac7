"""The reaper: acts on launches and copies whose fences are done.

For each slot a finished launch advanced: drop the report if its (slot, epoch) is stale;
fail the request if its latents turned non-finite; drain a canceled or failed request's
slot once no launch touching it is in flight; otherwise report progress and previews,
and publish the final latents (on CUDA through an asynchronous copy with its own fence),
releasing the slot only when nothing reads it any more. `reap` and `drain` return the
outputs they produce; the scheduler learns of every release and ending through its own
calls (`release_slot`, `denoised`, `end`).
"""
from __future__ import annotations

import logging

from engine.core.outputs import DenoiseFinished, PreviewReady, StepProgress
from engine.core.scheduling.requests import Request
from engine.core.storage import HostCopy, Launch

log = logging.getLogger("diffslot.core")


class Reaper:
    def __init__(self, scheduler, runner, fences, clock):
        self.scheduler, self.runner, self.fences, self.clock = scheduler, runner, fences, clock
        self.inflight: list[Launch] = []
        self.copies: list[HostCopy] = []
        self.stale_reports = 0

    def pending(self) -> bool:
        return bool(self.inflight) or bool(self.copies)

    def wait(self, timeout_s: float) -> None:
        """Nothing to launch, only launches or copies in flight: sleep on the oldest fence
        for at most `timeout_s` instead of letting the busy loop spin on `query()`. The
        bound keeps new submissions and cancels waiting no longer than that."""
        pending = [entry.fence for entry in self.inflight[:1] + self.copies[:1]]
        if pending:
            min(pending, key=lambda fence: fence.seq).wait(timeout_s)

    def reap(self) -> list:
        outputs: list = []
        if self.copies:
            self._finish_copies(outputs)
        if not self.inflight:
            return outputs
        still = []
        for launch in self.inflight:
            if not launch.fence.done():
                still.append(launch)
                continue
            flags = launch.finite.tolist()
            for rep in launch.reports:
                if rep.group.epoch[rep.slot] != rep.epoch or rep.group.requests[rep.slot] is not rep.request:
                    self.stale_reports += 1
                    log.debug("stale report for slot %d epoch %d dropped", rep.slot, rep.epoch)
                    continue
                request = rep.request
                if not flags[rep.slot]:
                    self.scheduler.fail(request, f"non-finite latents at step {rep.step}")
                if request.stopping:
                    if rep.final or rep.group.last_fence[rep.slot] is launch.fence:
                        outputs += self.drain(request)
                    continue
                outputs.append(StepProgress(request.request_id, rep.step, request.total_steps))
                if rep.preview is not None:
                    outputs.append(PreviewReady(
                        request.request_id, request.preview_steps.index(rep.step), rep.step, request.total_steps,
                        rep.preview.to("cpu").view(request.latent_shape)))  # on CUDA already on the host
                if rep.final:
                    self._publish(request, outputs)
        self.inflight = still
        return outputs

    def drain(self, request: Request) -> list:
        """Release a canceled or failed request's slot once no launch touching it is in
        flight; returns its output then, else nothing (the reaper comes back when that
        fence completes)."""
        fence = request.group.last_fence[request.slot]
        if fence is not None and not fence.done():
            return []
        self.scheduler.release_slot(request)
        return [self.scheduler.end(request)]

    def _publish(self, request: Request, outputs: list) -> None:
        """The final latents leave the slot. On CUDA as an asynchronous copy into page-locked
        memory gated by its own fence (a synchronous `.to("cpu")` would drain the stream,
        including the step launched since); the slot is released when the copy is done."""
        latents = self.runner.storage[request.group_key].latents[request.slot]
        if not self.runner.async_copies:
            self._published(request, latents.to("cpu", copy=True), outputs)
            return
        host = self.runner.copy_to_host(latents)
        self.copies.append(HostCopy(self.fences.record(), request, host))

    def _finish_copies(self, outputs: list) -> None:
        still = []
        for copy in self.copies:
            if not copy.fence.done():
                still.append(copy)
            elif copy.request.stopping:  # canceled while its latents were on their way out
                self.scheduler.release_slot(copy.request)
                outputs.append(self.scheduler.end(copy.request))
            else:
                self._published(copy.request, copy.host, outputs)
        self.copies = still

    def _published(self, request: Request, host, outputs: list) -> None:
        self.scheduler.denoised(request)
        self.scheduler.release_slot(request)
        outputs.append(DenoiseFinished(request.request_id, host.view(request.latent_shape), request.params,
                                       request.timings, self.clock()))
