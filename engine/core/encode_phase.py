"""The encode phase, between admission and a request's first step (R14, R21): the prompt
rows of everything admitted at this boundary from the embedding cache (the misses in one
batched pass of the model's own encoders), and the images of the image requests in one
batched VAE encoder pass. A failure fails only the requests it belongs to (R15)."""
from __future__ import annotations

import logging

import msgspec

from engine.core.image_inputs import start_from_images
from engine.core.requests import Request

log = logging.getLogger("diffslot.core")


class EncodePhase:
    def __init__(self, model, embeddings, scheduler, reaper, ledger, clock):
        self.model, self.embeddings, self.scheduler, self.reaper = model, embeddings, scheduler, reaper
        self.ledger, self.clock = ledger, clock

    def prompts(self, requests: list[Request]) -> None:
        """The encode phase (R14), between admission and a request's first step: its prompt
        rows from the embedding cache, the misses of all newly admitted requests in one
        batched pass of the model's own encoder(s); its request inputs and adapters. The
        slot then references them. A failure fails the requests it belongs to (R15)."""
        try:
            self._attach(requests)
        except Exception as exc:
            log.warning("encoding the prompts of %d requests raised %s: one at a time", len(requests), exc)
            for request in requests:
                try:
                    self._attach([request])
                except Exception as error:
                    self.scheduler.fail(request, f"the text encoder raised {type(error).__name__}: {error}")
                    self.reaper.drain(request)

    def _attach(self, requests: list[Request]) -> None:
        texts, adapter_sets = [], []
        for request in requests:
            texts.append(request.params.prompt)
            adapter_sets.append(request.params.loras)
            if request.cfg_scale is not None:
                texts.append(self.model.negative_text(request.params))
                adapter_sets.append(request.params.loras)
        started = self.clock()
        rows = self.embeddings.get_many(texts, adapter_sets)
        now = self.clock()
        k = 0
        for request in requests:
            negative = rows[k + 1] if request.cfg_scale is not None else None
            request.group.attach_conditioning(request.slot, rows[k], negative)
            k += request.rows_per_step
            request.timings.encode_s = now - started
            request.admitted_at = now

    def images(self, requests: list[Request]) -> None:
        """The image-encode phase (R21), beside the prompt encode: one batched VAE encoder
        pass per image size over the image requests admitted at this boundary, then each
        request's own draws and first latents (`engine.core.image_inputs`). A failure
        fails the requests it belongs to (R15)."""
        if not requests:
            return
        started = self.clock()
        failed = start_from_images(self.model, requests)
        now = self.clock()
        for request in requests:
            error = failed.get(request)
            if error is not None:
                self.scheduler.fail(request, f"encoding its image raised {type(error).__name__}: {error}")
                self.reaper.drain(request)
                continue
            request.timings.image_encode_s = now - started
            request.admitted_at = now
            # the encoded bytes are spent: the request no longer carries them (nor the ledger counts them)
            self.ledger.give_back_part(request.reservation, request.image_inputs.input_bytes)
            request.params = msgspec.structs.replace(request.params, image=None, mask=None)
            request.image_inputs = None
