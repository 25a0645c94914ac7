"""Intake: a request's parameters checked against the served model and turned into a
`Request` (R11: every bad field rejected by name), with its schedule (from a bounded
cache), its reservation, its group key and its per-request model inputs."""
from __future__ import annotations

import collections
import dataclasses

from engine.core.image_inputs import checked_image_inputs, default_size
from engine.core.ledger import reservation_for
from engine.core.outputs import RequestRejected
from engine.core.requests import Request
from engine.core.solvers import G, Schedule, Trajectory, UnsupportedSampler, build_schedule
from engine.core.validation import checked_size
from engine.protocol import GenerateParams


class Intake:
    def __init__(self, model, geometry, config, ledger, adapters=None):
        self.model, self.geometry, self.config, self.ledger = model, geometry, config, ledger
        self.adapters = adapters
        # denoiser evaluations a schedule may take: generic schedulers may run more than one per
        # step (PNDM one more, Heun 2 × steps − 1)
        self.schedule_capacity = 2 * config.max_steps + 1
        self.schedules: collections.OrderedDict[tuple, Schedule] = collections.OrderedDict()

    def request(self, request_id: str, p: GenerateParams, arrival: float) -> Request:
        """A validated `Request`; raises RequestRejected naming the field."""
        model = self.model
        images = checked_image_inputs(model, self.geometry, p, self.config.max_input_bytes)
        height, width = checked_size(model, self.geometry, p, self.config.max_steps, default_size(model, images))
        unusable = model.check_params(p)
        if unusable:
            raise RequestRejected(unusable[1], unusable[0])
        if images is not None:
            images.fit(model, p.steps, height, width)
        adapters = self._check_adapters(p)
        cfg_scale = model.cfg_scale(p)
        try:
            options = model.schedule_options(height, width, p.steps)
            schedule = self._schedule(p.sampler, p.steps, cfg_scale or 1.0, options,
                                      None if images is None else images.start)
        except UnsupportedSampler as exc:
            raise RequestRejected(str(exc), "sampler") from None
        if schedule.steps > self.schedule_capacity:
            raise RequestRejected(f"this sampler takes {schedule.steps} evaluations for {p.steps} steps, more than "
                                  f"{self.schedule_capacity}", "steps")
        latent_shape = self.geometry.latent_shape(height, width)
        rows = 1 if cfg_scale is None else 2
        reservation = reservation_for(latent_shape, height, width, p.output,
                                      rows * model.conditioning_nbytes + adapters,
                                      0 if images is None else images.nbytes(latent_shape))
        if not self.ledger.could_ever_fit(reservation):
            field = "image" if images is not None else "height" if height >= width else "width"
            raise RequestRejected("needs more memory than the engine holds at all", field)
        key = (model.revision, latent_shape, str(model.dtype), model.conditioning_layout, model.prediction_type)
        request = Request(request_id, p, latent_shape, cfg_scale, arrival, reservation, key)
        request.trajectory = Trajectory(schedule, p.seed, latent_shape)
        request.request_inputs = model.request_inputs(p, height, width)
        if self.adapters is not None and not p.loras:  # every row of a pool's model says "no adapter"
            request.request_inputs.update(self.adapters.row_inputs([], []))
        request.image_inputs = images
        return request

    def _check_adapters(self, p: GenerateParams) -> int:
        """Rejects a bad `loras`. Returns the adapter bytes to reserve per request: none,
        since resident adapters are shared by every request that references them and the
        pool's whole byte budget is set aside once (`adapter_budget_bytes` in stats);
        `check` rejects a set larger than that budget, and admission waits while the pool
        cannot make a request's adapters resident."""
        if not p.loras:
            return 0
        if self.adapters is None:
            raise RequestRejected("this engine serves no adapters (start it with --lora-dir)", "loras")
        why = self.adapters.check(p.loras)
        if why:
            raise RequestRejected(why, "loras")
        return 0

    def _schedule(self, sampler: str, steps: int, cfg_scale: float, options: tuple,
                  start: int | None = None) -> Schedule:
        """Building a diffusers scheduler costs milliseconds on the busy loop; a schedule
        depends on (sampler, steps, size options, an image request's start step) and, in
        its guidance column only, on the request: keep one per key, least recently used out."""
        key = (sampler, steps, options, start)
        base = self.schedules.get(key)
        if base is None:
            base = self.schedules[key] = build_schedule(sampler, self.model.scheduler_config, steps, 1.0, options,
                                                         start)
            while len(self.schedules) > self.config.max_schedules:
                self.schedules.popitem(last=False)
        else:
            self.schedules.move_to_end(key)
        coefs = base.coefs.copy()
        coefs[:, G] = cfg_scale
        return dataclasses.replace(base, coefs=coefs)
