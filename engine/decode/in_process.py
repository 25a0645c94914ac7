"""The decode stage on a thread of the engine process (`--decode-workers 0`)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import msgspec
import torch

from engine.decode.stage import CANCELED, DecodedOutput, postprocess
from engine.protocol import GenerateParams, Timings

log = logging.getLogger("diffslot.decode")


class InProcessDecodeStage:
    """Decodes one request at a time on a background thread."""

    def __init__(self, model, on_ready: Callable[[], None] | None = None) -> None:
        self.model = model
        self._on_ready = on_ready or (lambda: None)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._canceled: set[str] = set()  # decodes whose output is dropped when it comes
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="diffslot-decode", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, latents, params: GenerateParams, timings: Timings,
               ready_at: float | None = None) -> None:
        self._todo.put((request_id, latents, params, timings, ready_at or time.monotonic()))

    def cancel(self, request_id: str) -> None:
        self._canceled.add(request_id)

    def poll(self) -> list[DecodedOutput]:
        done = []
        while True:
            try:
                output = self._done.get_nowait()
            except queue.Empty:
                return done
            if output.request_id in self._canceled:  # its output is dropped; the reservation still comes back
                self._canceled.discard(output.request_id)
                self.dropped += 1
                output = dataclasses.replace(output, payload=None, error=CANCELED)
            done.append(output)

    def stats(self) -> dict:
        return {"decode_dropped": self.dropped}

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # On CUDA the decode gets a stream of its own, so it runs beside the denoising steps
        # instead of queueing behind them on the default stream (and its `.cpu()` waits for
        # the decode alone).
        device = getattr(self.model, "device", None)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        stream = torch.cuda.Stream(device) if on_cuda else None
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            self._decode_loop()

    def _decode_loop(self) -> None:
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
