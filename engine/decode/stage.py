"""The decode stage's interface and post-processing: final latents in, finished
outputs (PNG / uint8 / latent) out.

The engine's busy loop only talks to `DecodeStage`. `InProcessDecodeStage` decodes on
one thread of the engine process (torch releases the GIL while it computes, so the
busy loop keeps stepping); `MultiProcessDecodeStage` decodes in worker processes fed
through a shared-memory arena. Both satisfy the Protocol (tests check it).
"""
from __future__ import annotations

import dataclasses
import io
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.flags import cli
from engine.protocol import GenerateParams, Timings

CANCELED = "canceled"  # the `error` of a decode whose output was dropped by `cancel`


@dataclasses.dataclass
class DecodeConfig:
    """How the decode stage runs (`engine.decode.factory.make_decode_stage`)."""

    workers: int | None = dataclasses.field(default=None, metadata=cli(
        "--decode-workers", metavar="N", dest="decode_workers",
        help="decode worker processes over the shared arena; 0 decodes in the engine process (see "
             "--in-process-decode) (default: 1 on CUDA and on a CPU of 2 to 23 cores, more beyond, 0 on one core)"))
    decode_timeout_s: float = dataclasses.field(default=120.0, metadata=cli(
        "--decode-timeout", metavar="S",
        help="a decode running longer fails its request (Failed) and later decodes go on: a worker is killed "
             "and replaced, an in-process decode thread is abandoned and replaced (0: no deadline)"))
    in_process: str = dataclasses.field(default="auto", metadata=cli(
        "--in-process-decode", metavar="MODE", dest="in_process_decode",
        help="with --decode-workers 0: 'inline' decodes on the busy loop's thread between steps, several "
             "latents per VAE call, nothing beside the denoiser; 'thread' on a thread beside it, with the "
             "decode deadline; 'auto' (default): inline on CPU, thread on CUDA (its own stream)"))
    threads_per_worker: int | None = None  # torch threads per worker (default: 1 on CPU, cores / workers on CUDA)
    max_size: int | None = None  # the largest image side the arena holds (default: 4x the native size)
    start_timeout_s: float = 180.0  # workers must have loaded their model by then
    pin_memory: bool | None = None  # page-lock the arena (default: on CUDA)


@dataclasses.dataclass
class DecodedOutput:
    request_id: str
    output_kind: str
    shape: tuple[int, ...]
    dtype: str
    payload: Any  # bytes or a C-contiguous numpy array: sent as one zero-copy frame
    timings: Timings  # decode_wait_s and decode_s filled in
    done_at: float  # time.monotonic() when the output became usable
    error: str | None = None  # set when decoding failed; payload is then None


def encode_png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=3)
    return buffer.getvalue()


def postprocess(model, latents, output_kind: str) -> tuple[Any, tuple[int, ...], str]:
    """(payload, shape, dtype) for one request's final latents C×h×w."""
    if output_kind == "latent":
        array = np.ascontiguousarray(np.asarray(latents, dtype=np.float32))
        return array, array.shape, "float32"
    image = np.ascontiguousarray(model.decode(latents[None])[0])  # H×W×3 uint8
    if output_kind == "uint8":
        return image, image.shape, "uint8"
    png = encode_png(image)
    return png, (len(png),), "uint8"


@runtime_checkable
class DecodeStage(Protocol):
    """What the engine process drives. Neither call blocks the busy loop."""

    def submit(self, request_id: str, latents, params: GenerateParams, timings: Timings,
               ready_at: float | None = None) -> None:
        """Queue one request's final latents (C×h×w) for decode and post-processing."""

    def cancel(self, request_id: str) -> None:
        """Drop the request's decode: its output is never delivered (idempotent)."""

    def poll(self) -> list[DecodedOutput]:
        """Outputs finished since the last poll, failed ones with `error` set."""

    def stats(self) -> dict:
        """Counters for the engine's metrics (worker deaths, hangs, restarts, ...)."""

    def close(self) -> None:
        """Stop; no shared resource outlives this call."""
