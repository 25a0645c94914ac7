"""A tiny deterministic stand-in for `engine.core.EngineCore`, without any model.

Same interface (add_request / abort_requests / step / has_work /
has_unfinished_requests / decode_done / stats) and output types of the same names and
fields, so the engine process, the wire protocol and the client library can be tested
fast, without torch or diffusers. Each step advances every
running request by one; its final "latents" depend only on its own parameters, so
a request's result never depends on its neighbours, as with the real core.

Run an engine process around it:
    python tests/fake_core.py --address ipc:///tmp/x.sock [--step-delay 0.005] [--size 32]
with the engine process's own flags too (engine.serve.options: --step-timeout, ...).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import sys
import time
import zlib

import numpy as np


from engine.core.interface import ModelInfo  # noqa: E402
from engine.protocol import OUTPUT_KINDS, GenerateParams, Timings, output_nbytes  # noqa: E402

from engine.core.outputs import (  # noqa: E402 - the core's own output types, torch-free
    DenoiseFinished, PreviewReady, RequestCanceled, RequestFailed, RequestRejected, StepProgress,
)

from engine.protocol import SAMPLERS  # noqa: E402
MAX_STEPS = 1000


# the shapes model's prompts: the fake knows them as a class-conditional model would
from engine.models.shapes.draw import PROMPTS  # noqa: E402


class HangingLatents(np.ndarray):
    """Latents whose decode never returns (FakeConfig.hang_decode_prompt): a VAE stuck in a call."""


class FakeModel:
    """What the fake core and the decode stage need of a model: prompts, sizes, decode."""

    latent_channels = 4
    vae_scale = 4

    def __init__(self, native_size: int = 32, decode_delay_s: float = 0.0, path: str = "fake"):
        self.native_size = native_size
        self.decode_delay_s = decode_delay_s  # to make cancels land during decode
        self.prompts = PROMPTS
        self.path = path  # what model_info names it, as the real core names its folder
        self.hang_s = 3600.0

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def decode(self, latents) -> np.ndarray:
        """B×C×h×w → uint8 B×H×W×3: the first three channels, squashed and upsampled."""
        if isinstance(latents, HangingLatents):
            time.sleep(self.hang_s)
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        x = np.asarray(latents, dtype=np.float32)[:, :3]
        x = np.repeat(np.repeat(x, self.vae_scale, axis=2), self.vae_scale, axis=3)
        return np.ascontiguousarray(((np.tanh(x) + 1) * 127.5).round().astype(np.uint8).transpose(0, 2, 3, 1))


def fake_latents(params: GenerateParams, shape: tuple[int, ...]) -> np.ndarray:
    """The deterministic 'result' of a request: a function of its own parameters only."""
    key = zlib.crc32(f"{params.prompt}|{params.sampler}|{params.steps}|{params.guidance!r}".encode())
    rng = np.random.default_rng([params.seed, key])
    return rng.standard_normal(shape, dtype=np.float32)


@dataclasses.dataclass
class FakeConfig:
    slots: int = 16
    max_queue: int = 64
    step_delay_s: float = 0.0  # sleep per step with work, to make cancels land mid-denoise
    fail_prompt: str | None = None  # requests with this prompt fail at their first step
    hang_decode_prompt: str | None = None  # the decode of requests with this prompt never returns


@dataclasses.dataclass
class _Req:
    request_id: str
    params: GenerateParams
    arrival: float
    shape: tuple[int, ...]
    step: int = 0
    admitted_at: float | None = None
    evals: int = 0
    previews: list = dataclasses.field(default_factory=list)  # steps after which a preview goes out


class FakeCore:
    def __init__(self, model: FakeModel, config: FakeConfig | None = None):
        self.model = model
        self.config = config or FakeConfig()
        self.queue: collections.OrderedDict[str, _Req] = collections.OrderedDict()
        self.running: dict[str, _Req] = {}
        self.decoding: dict[str, bool] = {}  # request id → canceled meanwhile
        self.pending: list = []  # outputs to hand out at the next step()
        self.useful_evals = 0
        self.total_evals = 0
        self.canceled_evals = 0
        self.steps_run = 0

    # ------------------------------------------------------------------ interface
    def add_request(self, request_id: str, params: GenerateParams, arrival_time: float | None = None,
                    partial_images: int = 0) -> None:
        height, width = self._validate(params)
        if not 0 <= partial_images <= 3:
            raise RequestRejected("must be an integer in [0, 3]", "partial_images", 0.0)
        if len(self.queue) >= self.config.max_queue:
            raise RequestRejected("queue full", None, 0.5)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = _Req(request_id, params, arrival, self.model.latent_shape(height, width))
        steps = params.steps
        req.previews = sorted({max(1, round(steps * (k + 1) / (partial_images + 1))) for k in range(partial_images)}
                              - {steps})
        self.queue[request_id] = req

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            req = self.queue.pop(rid, None) or self.running.pop(rid, None)
            if req is not None:
                self.canceled_evals += req.evals
                self.pending.append(RequestCanceled(rid, self._timings(req)))
            elif rid in self.decoding and not self.decoding[rid]:
                self.decoding[rid] = True
                self.pending.append(RequestCanceled(rid, Timings()))

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue or self.running or self.pending or self.decoding)

    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.pending)

    def step(self) -> list:
        outputs, self.pending = self.pending, []
        while self.queue and len(self.running) < self.config.slots:
            _, req = self.queue.popitem(last=False)
            req.admitted_at = time.monotonic()
            self.running[req.request_id] = req
        if not self.running:
            return outputs
        if self.config.step_delay_s:
            time.sleep(self.config.step_delay_s)
        self.steps_run += 1
        for rid, req in list(self.running.items()):
            if req.params.prompt == self.config.fail_prompt:
                del self.running[rid]
                outputs.append(RequestFailed(rid, "injected failure"))
                continue
            rows = 1 if req.params.guidance == 1 else 2
            req.step += 1
            req.evals += rows
            self.useful_evals += rows
            self.total_evals += rows
            outputs.append(StepProgress(rid, req.step, req.params.steps))
            if req.step in req.previews:  # a preview: the final latents, scaled by progress
                latents = fake_latents(req.params, req.shape) * (req.step / req.params.steps)
                outputs.append(PreviewReady(rid, req.previews.index(req.step), req.step, req.params.steps, latents))
            if req.step == req.params.steps:
                del self.running[rid]
                self.decoding[rid] = False
                latents = fake_latents(req.params, req.shape)
                if req.params.prompt == self.config.hang_decode_prompt:
                    latents = latents.view(HangingLatents)
                outputs.append(DenoiseFinished(rid, latents, req.params, self._timings(req), time.monotonic()))
        return outputs

    def decode_done(self, request_id: str) -> bool:
        return not self.decoding.pop(request_id, True)

    def output_bytes(self, params: GenerateParams) -> int:
        native = self.model.native_size
        height, width = params.height or native, params.width or native
        if not (type(height) is int and type(width) is int and 0 < height <= 1024 and 0 < width <= 1024):
            return 0
        return output_nbytes(params.output, height, width, self.model.latent_shape(height, width))

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model.path, native_size=self.model.native_size, prompts=self.model.prompts,
                         pipeline="fake")

    def adapter_names(self) -> list[str]:
        return []

    def stats(self) -> dict:
        return {  # the real core's keys, and `decoding`
            "slots": self.config.slots,
            "slots_busy": len(self.running),
            "slot_occupancy": len(self.running) / self.config.slots,
            "queue_depth": len(self.queue),
            "decoding": len(self.decoding),
            "batches": self.steps_run,
            "useful_evals": self.useful_evals,
            "padded_evals": self.total_evals - self.useful_evals,
            "useful_ratio": self.useful_evals / self.total_evals if self.total_evals else 1.0,
            "canceled_evals": self.canceled_evals,
            "stale_reports": 0,
        }

    # ------------------------------------------------------------------ helpers
    def _validate(self, params: GenerateParams) -> tuple[int, int]:
        if params.prompt not in self.model.prompts:
            raise RequestRejected(f"unknown prompt {params.prompt!r}", "prompt", 0.0)
        if not 1 <= params.steps <= MAX_STEPS:
            raise RequestRejected(f"steps must be in 1..{MAX_STEPS}", "steps", 0.0)
        if params.sampler not in SAMPLERS:
            raise RequestRejected(f"unknown sampler {params.sampler!r}", "sampler", 0.0)
        if not (math.isfinite(params.guidance) and 0 <= params.guidance <= 50):
            raise RequestRejected("guidance must be a finite number in [0, 50]", "guidance", 0.0)
        if not 0 <= params.seed < 2**63:
            raise RequestRejected("seed must be in [0, 2**63)", "seed", 0.0)
        if params.output not in OUTPUT_KINDS:
            raise RequestRejected(f"output must be one of {', '.join(OUTPUT_KINDS)}", "output", 0.0)
        sizes = []
        for name in ("height", "width"):
            value = getattr(params, name)
            value = self.model.native_size if value is None else value
            if not (8 <= value <= 1024 and value % self.model.vae_scale == 0):
                raise RequestRejected(f"{name} must be a multiple of {self.model.vae_scale} in [8, 1024]", name, 0.0)
            sizes.append(value)
        return sizes[0], sizes[1]

    def _timings(self, req: _Req) -> Timings:
        now = time.monotonic()
        admitted = req.admitted_at if req.admitted_at is not None else now
        return Timings(queue_s=admitted - req.arrival, denoise_s=now - admitted, evals=req.evals)


def main(argv=None, *, wrap_core=None, proc_defaults: dict | None = None) -> int:
    """An engine process around FakeCore. `wrap_core(core)` wraps it (fault injection);
    `proc_defaults` replace ProcConfig's defaults (the tests' engines give up sooner)."""
    from engine.decode.in_process import InProcessDecodeStage
    from engine.decode.stage import DecodeConfig
    from engine.flags import add_config_arguments, config_from_args
    from engine.serve.options import add_proc_arguments, proc_config_from_args
    from engine.serve.proc import configure_logging, run_engine

    ap = argparse.ArgumentParser(description="an engine process around FakeCore (tests only)")
    ap.add_argument("--address", required=True)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--size", type=int, default=32, help="native image size")
    ap.add_argument("--decode-delay", type=float, default=0.0)
    ap.add_argument("--fail-prompt", default=None)
    ap.add_argument("--hang-decode-prompt", default=None)
    ap.add_argument("--model-path", default="fake", help="what the fake model is called, as a folder path")
    add_proc_arguments(ap, defaults=proc_defaults)
    add_config_arguments(ap, DecodeConfig, only={"decode_timeout_s"})
    args = ap.parse_args(argv)
    configure_logging()
    model = FakeModel(args.size, args.decode_delay, args.model_path)
    core = FakeCore(model, FakeConfig(args.slots, args.max_queue, args.step_delay, args.fail_prompt,
                                      args.hang_decode_prompt))
    try:
        config = proc_config_from_args(args, address=args.address, model_name=args.model_path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    decode_config = config_from_args(DecodeConfig, args)
    return run_engine(wrap_core(core) if wrap_core else core, config,
                      lambda on_ready: InProcessDecodeStage(model, on_ready,
                                                            decode_timeout_s=decode_config.decode_timeout_s))


if __name__ == "__main__":
    sys.exit(main())
