"""The decode stage: final latents in, finished outputs (PNG / uint8 / latent) out.

The engine's busy loop only talks to this interface:

    stage.submit(request_id, latents, params, timings, ready_at)   # never blocks
    stage.poll() -> list[DecodedOutput]                             # never blocks
    stage.close()

`InProcessDecodeStage` decodes on one thread of the engine process (torch releases
the GIL while it computes, so the busy loop keeps stepping). The multi-process
stage with a shared-memory arena (R7) implements the same three calls.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import queue
import threading
import time
from typing import Any, Callable

import msgspec
import numpy as np

from engine.protocol import GenerateParams, Timings

log = logging.getLogger("diffslot.decode")


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


class InProcessDecodeStage:
    """Decodes one request at a time on a background thread."""

    def __init__(self, model, on_ready: Callable[[], None] | None = None) -> None:
        self.model = model
        self._on_ready = on_ready or (lambda: None)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="diffslot-decode", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, latents, params: GenerateParams, timings: Timings,
               ready_at: float | None = None) -> None:
        self._todo.put((request_id, latents, params, timings, ready_at or time.monotonic()))

    def poll(self) -> list[DecodedOutput]:
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._todo.get()) is not None:
            request_id, latents, params, timings, ready_at = job
            start = time.monotonic()
            try:
                payload, shape, dtype = postprocess(self.model, latents, params.output)
                error = None
            except Exception as exc:  # a bad decode fails its request, not the engine
                log.exception("request %s: decode failed", request_id)
                payload, shape, dtype, error = None, (), "", f"decode failed: {exc}"
            end = time.monotonic()
            timings = msgspec.structs.replace(timings, decode_wait_s=start - ready_at, decode_s=end - start)
            self._done.put(DecodedOutput(request_id, params.output, tuple(shape), dtype, payload,
                                         timings, end, error))
            self._on_ready()


def make_decode_stage(model, workers: int, on_ready: Callable[[], None] | None = None, *,
                      buffers: int | None = None, **options):
    """The decode stage for `--decode-workers N`.

    N ≥ 1: `engine.decode_workers.MultiProcessDecodeStage` — N worker processes, each
    loading the model's VAE from its folder, fed through a shared-memory arena of
    `buffers` decode buffers (default: CoreConfig's `decode_buffers`, 8; pass the core's
    value so the arena holds every decode admission reserves). Blocks until the workers
    have loaded their model; raises if they cannot. `options` go to the stage
    (decode_timeout_s, max_size, threads_per_worker, ...).
    N == 0: decode on a thread of the engine process (`InProcessDecodeStage`).
    """
    if workers <= 0:
        return InProcessDecodeStage(model, on_ready=on_ready)
    from engine.decode_workers import MultiProcessDecodeStage

    device = str(getattr(model, "device", "cpu"))
    options.setdefault("pin_memory", device.startswith("cuda"))
    # FIX [workload bench, issue 7]: on a CPU device the denoiser shares the cores with the decode
    # workers, and the stage's default of cpu_count // workers torch threads per worker
    # oversubscribes them: on 2 cores with the denoiser busy, one shapes-model VAE decode took
    # ~430 ms p50 with 2 threads vs ~15 ms with 1 (OpenMP threads waiting on descheduled
    # siblings), and decode dominated time to usable output. On CPU, one thread per worker.
    if not device.startswith("cuda"):
        options.setdefault("threads_per_worker", 1)
    return MultiProcessDecodeStage(model, workers, buffers or 8, device, on_ready=on_ready, **options)
