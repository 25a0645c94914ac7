"""The reaper: acts on launches and copies whose fences are done (R5, R6).

For each slot a finished launch advanced: drop the report if its (slot, epoch) is stale;
fail the request if its latents turned non-finite; drain a canceled or failed request's
slot once no launch touching it is in flight; otherwise report progress and previews,
and publish the final latents (on CUDA through an asynchronous copy with its own fence),
releasing the slot only when nothing reads it any more.
"""
from __future__ import annotations

import logging

from engine.core.outputs import DenoiseFinished, PreviewReady, StepProgress
from engine.core.requests import Request
from engine.core.slots import Group, HostCopy, Launch

log = logging.getLogger("diffslot.core")


class Reaper:
    def __init__(self, scheduler, runner, fences, clock, outputs: list):
        self.scheduler, self.runner, self.fences, self.clock = scheduler, runner, fences, clock
        self.outputs = outputs
        self.inflight: list[Launch] = []
        self.copies: list[HostCopy] = []
        self.stale_reports = 0
        self.on_release = None  # called with each request whose slot is released (adapter references)

    def pending(self) -> bool:
        return bool(self.inflight) or bool(self.copies)

    def wait(self, timeout_s: float) -> None:
        """Nothing to launch, only launches or copies in flight: sleep on the oldest fence
        for at most `timeout_s` instead of letting the busy loop spin on `query()`. The
        bound keeps new submissions and cancels waiting no longer than that."""
        pending = [entry.fence for entry in self.inflight[:1] + self.copies[:1]]
        if pending:
            min(pending, key=lambda fence: fence.seq).wait(timeout_s)

    def reap(self) -> None:
        if self.copies:
            self._finish_copies()
        if not self.inflight:
            return
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
                        self.drain(request)
                    continue
                self.outputs.append(StepProgress(request.request_id, rep.step, request.total_steps))
                if rep.preview is not None:
                    self.outputs.append(PreviewReady(
                        request.request_id, request.preview_steps.index(rep.step), rep.step, request.total_steps,
                        rep.preview.to("cpu").view(request.latent_shape)))  # on CUDA already on the host
                if rep.final:
                    self._publish(rep.group, rep.slot, request)
        self.inflight = still

    def drain(self, request: Request) -> None:
        """Release a canceled or failed request's slot once no launch touching it is in flight."""
        fence = request.group.last_fence[request.slot]
        if fence is not None and not fence.done():
            return  # the reaper comes back when that fence completes
        self._release(request)
        self.scheduler.end(request)

    def _release(self, request: Request) -> None:
        self.scheduler.release_slot(request)
        if self.on_release is not None:
            self.on_release(request)

    def _publish(self, group: Group, slot: int, request: Request) -> None:
        """The final latents leave the slot. On CUDA as an asynchronous copy into page-locked
        memory gated by its own fence (a synchronous `.to("cpu")` would drain the stream,
        including the step launched since); the slot is released when the copy is done."""
        if not self.runner.async_copies:
            self._published(request, group.latents[slot].to("cpu", copy=True))
            return
        host = self.runner.copy_to_host(group.latents[slot])
        self.copies.append(HostCopy(self.fences.record(), group, slot, request, host))

    def _finish_copies(self) -> None:
        still = []
        for copy in self.copies:
            if not copy.fence.done():
                still.append(copy)
            elif copy.request.stopping:  # canceled while its latents were on their way out
                self._release(copy.request)
                self.scheduler.end(copy.request)
            else:
                self._published(copy.request, copy.host)
        self.copies = still

    def _published(self, request: Request, host) -> None:
        self.scheduler.denoised(request)
        self._release(request)
        self.outputs.append(DenoiseFinished(request.request_id, host.view(request.latent_shape), request.params,
                                            request.timings, self.clock()))
