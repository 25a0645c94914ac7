"""Intake: a request's parameters checked against the served model and turned into a
`Request` (every bad field rejected by name), with its schedule (from a bounded cache),
its reservation, its group key, its per-request model inputs and each input kind's
checked value."""
from __future__ import annotations

import collections
import dataclasses

from engine.core.scheduling.ledger import reservation_for
from engine.core.outputs import RequestRejected
from engine.core.scheduling.requests import Request
from engine.core.solvers import G, Schedule, Trajectory, UnsupportedSampler, build_schedule
from engine.core.validation import checked_size
from engine.protocol import GenerateParams


class Intake:
    def __init__(self, model, geometry, config, ledger, kinds):
        self.model, self.geometry, self.config, self.ledger = model, geometry, config, ledger
        self.kinds = kinds  # engine.core.input_kinds: every per-request input kind
        # denoiser evaluations a schedule may take: generic schedulers may run more than one per
        # step (PNDM one more, Heun 2 × steps − 1)
        self.schedule_capacity = 2 * config.max_steps + 1
        self.schedules: collections.OrderedDict[tuple, Schedule] = collections.OrderedDict()

    def request(self, request_id: str, p: GenerateParams, arrival: float) -> Request:
        """A validated `Request`; raises RequestRejected naming the field."""
        model = self.model
        values = {kind.name: kind.check(p) for kind in self.kinds}
        used = [kind for kind in self.kinds if values[kind.name] is not None]
        implied = next((size for size in (kind.output_size(values[kind.name]) for kind in used)
                        if size != (None, None)), (None, None))
        height, width = checked_size(model, self.geometry, p, self.config.max_steps, implied)
        unusable = model.check_params(p)
        if unusable:
            raise RequestRejected(unusable[1], unusable[0])
        starts = [kind.start_step(values[kind.name], p.steps, height, width) for kind in used]
        start = max((s for s in starts if s is not None), default=None)  # None: the full schedule
        cfg_scale = model.cfg_scale(p)
        try:
            options = model.schedule_options(height, width, p.steps)
            schedule = self._schedule(p.sampler, p.steps, cfg_scale or 1.0, options, start)
        except UnsupportedSampler as exc:
            raise RequestRejected(str(exc), "sampler") from None
        if schedule.steps > self.schedule_capacity:
            raise RequestRejected(f"this sampler takes {schedule.steps} evaluations for {p.steps} steps, more than "
                                  f"{self.schedule_capacity}", "steps")
        latent_shape = self.geometry.latent_shape(height, width)
        rows = 1 if cfg_scale is None else 2
        input_bytes = sum(kind.nbytes(values[kind.name], latent_shape) for kind in used)
        reservation = reservation_for(latent_shape, height, width, p.output, rows * model.conditioning_nbytes,
                                      input_bytes)
        if not self.ledger.could_ever_fit(reservation):
            field = next((kind.fields[0] for kind in used if kind.nbytes(values[kind.name], latent_shape)),
                         "height" if height >= width else "width")
            capacity = self.ledger.capacity
            if reservation.trajectory_bytes > capacity.trajectory_bytes:
                need = (f"{reservation.trajectory_bytes} bytes of working memory, more than the engine's trajectory "
                        f"budget of {capacity.trajectory_bytes} bytes (trajectory_budget_bytes)")
            else:
                need = (f"{reservation.output_bytes} bytes of output, more than the engine's output budget of "
                        f"{capacity.output_bytes} bytes (output_budget_bytes)")
            raise RequestRejected(f"needs more memory than the engine holds at all: {need}", field)
        key = (model.revision, latent_shape, str(model.dtype), model.conditioning_layout, model.prediction_type)
        request = Request(request_id, p, latent_shape, cfg_scale, arrival, reservation, key)
        request.trajectory = Trajectory(schedule, p.seed, latent_shape)
        request.request_inputs = model.request_inputs(p, height, width)
        request.inputs = {kind.name: values[kind.name] for kind in used}
        return request

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
