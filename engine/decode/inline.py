"""The decode stage on the busy loop's own thread, between steps (the CPU default).

On a small CPU anything that computes beside the denoiser slows it: a decode thread's
torch work and the busy loop's share the same cores and both thread pools spin, so the
denoiser call itself takes about twice its standalone time while a decode runs. Here
`poll()` (called by the busy loop between steps) decodes what is queued, several latents
of one shape per VAE call, then post-processes each, and nothing runs beside the
denoiser. The price is that a step waits for the decodes queued before it; the VAE of an
image is a small fraction of its denoising, so the loss is that fraction, not a doubling.

A decode here cannot be abandoned at a deadline: a decode that hangs is a busy loop that
hangs, which the engine's watchdog (`--step-timeout`) ends with `EngineDead` to every
client. `InProcessDecodeStage` (a thread with a deadline) is the choice where decodes
may hang or where the device runs them beside the denoiser (CUDA streams).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import msgspec
import numpy as np
import torch

from engine.decode.stage import CANCELED, DecodedOutput, encode_png
from engine.protocol import GenerateParams, Timings

log = logging.getLogger("diffslot.decode")

#: Latents decoded in one VAE call at most (bounds the busy loop's pause per poll).
MAX_BATCH = 8


class InlineDecodeStage:
    def __init__(self, model, on_ready: Callable[[], None] | None = None, *, max_batch: int = MAX_BATCH):
        self.model = model
        self.max_batch = max_batch
        self._todo: collections.deque = collections.deque()
        self._canceled: set[str] = set()
        self.dropped = 0
        self.batches = 0

    def submit(self, request_id: str, latents, params: GenerateParams, timings: Timings,
               ready_at: float | None = None) -> None:
        self._todo.append((request_id, latents, params, timings, ready_at or time.monotonic()))

    def cancel(self, request_id: str) -> None:
        self._canceled.add(request_id)

    def poll(self) -> list[DecodedOutput]:
        done = []
        while self._todo:
            done += self._decode_batch()
        return done

    def _decode_batch(self) -> list[DecodedOutput]:
        """One VAE call over up to `max_batch` queued latents of the first one's shape."""
        first = self._todo[0]
        shape = tuple(first[1].shape)
        batch, rest = [], collections.deque()
        while self._todo and len(batch) < self.max_batch:
            job = self._todo.popleft()
            (batch if tuple(job[1].shape) == shape else rest).append(job)
        self._todo.extendleft(reversed(rest))
        start = time.monotonic()
        outputs = []
        live = [job for job in batch if job[0] not in self._canceled]
        images, error = None, None
        needs_vae = [job for job in live if job[2].output != "latent"]
        if needs_vae:
            try:
                with torch.no_grad():
                    images = self.model.decode(torch.stack([torch.as_tensor(job[1]) for job in needs_vae]))
                self.batches += 1
            except Exception as exc:  # a bad decode fails the requests of this call, not the engine
                log.exception("decode of %d latents failed", len(needs_vae))
                error = f"decode failed: {exc}"
        decoded = {job[0]: k for k, job in enumerate(needs_vae)}
        for request_id, latents, params, timings, ready_at in batch:
            if request_id in self._canceled:
                self._canceled.discard(request_id)
                self.dropped += 1
                payload, out_shape, dtype, failure = None, (), "", CANCELED
            elif params.output == "latent":
                array = np.ascontiguousarray(np.asarray(latents, dtype=np.float32))
                payload, out_shape, dtype, failure = array, array.shape, "float32", None
            elif error is not None:
                payload, out_shape, dtype, failure = None, (), "", error
            else:
                image = np.ascontiguousarray(images[decoded[request_id]])
                if params.output == "uint8":
                    payload, out_shape, dtype = image, image.shape, "uint8"
                else:
                    payload = encode_png(image)
                    out_shape, dtype = (len(payload),), "uint8"
                failure = None
            end = time.monotonic()
            timings = msgspec.structs.replace(timings, decode_wait_s=max(0.0, start - ready_at), decode_s=end - start)
            outputs.append(DecodedOutput(request_id, params.output, tuple(out_shape), dtype, payload, timings, end,
                                         failure))
        return outputs

    def stats(self) -> dict:
        return {"decode_dropped": self.dropped, "decode_batches": self.batches}

    def close(self) -> None:
        self._todo.clear()
