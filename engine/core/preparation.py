"""The preparation phase, between admission and a request's first step: everything the
requests admitted at one boundary need before their slots start, in batched passes.

- prompt rows from the embedding cache, the misses of all of them in one batched pass of
  the model's own encoder(s) (with each request's text-encoder adapters);
- each input kind's `prepare` (the image kind's batched VAE encode and draws; the adapter
  kind's rows), then the bytes it no longer holds go back to the ledger and its frame
  fields leave the request's params.

What it leaves is data on each request, which the runner's storage places. A failure
fails only the requests it belongs to: `run` returns {request: why}.
"""
from __future__ import annotations

import logging

import msgspec

from engine.core.scheduling.requests import Request
from engine.protocol import FRAME_FIELDS

log = logging.getLogger("diffslot.core")


class Preparation:
    def __init__(self, model, embeddings, kinds, ledger, clock):
        self.model, self.embeddings, self.kinds = model, embeddings, kinds
        self.ledger, self.clock = ledger, clock

    def run(self, requests: list[Request]) -> dict[Request, str]:
        failed: dict[Request, str] = {}
        if not requests:
            return failed
        self._prompts(requests, failed)
        for kind in self.kinds:
            live = [r for r in requests if r not in failed]
            started = self.clock()
            errors = kind.prepare(live)
            now = self.clock()
            for request, error in errors.items():
                failed[request] = f"preparing its {kind.name} raised {type(error).__name__}: {error}"
            for request in live:
                value = request.inputs.get(kind.name)
                if value is None or request in errors:
                    continue
                # what it no longer holds: the ledger's bytes, the frame fields' bytes
                self.ledger.give_back_part(request.reservation, kind.spent(value))
                spent = {field: None for field in kind.fields if field in FRAME_FIELDS}
                if spent:
                    request.params = msgspec.structs.replace(request.params, **spent)
                if kind.timing:
                    setattr(request.timings, kind.timing, now - started)
                request.admitted_at = now
        for request in requests:
            request.inputs.clear()  # decoded inputs live only until here
        return failed

    def _prompts(self, requests: list[Request], failed: dict) -> None:
        try:
            self._attach(requests)
        except Exception as exc:
            log.warning("encoding the prompts of %d requests raised %s: one at a time", len(requests), exc)
            for request in requests:
                try:
                    self._attach([request])
                except Exception as error:
                    failed[request] = f"the text encoder raised {type(error).__name__}: {error}"

    def _attach(self, requests: list[Request]) -> None:
        texts, adapter_sets, images = [], [], []
        # an edit model (Qwen-Image-Edit) encodes each prompt with its request's image
        takes_image = getattr(self.model, "prompt_takes_image", False)
        for request in requests:
            image = request.inputs["image"].image if takes_image else None
            texts.append(request.params.prompt)
            adapter_sets.append(request.params.loras)
            images.append(image)
            if request.cfg_scale is not None:
                texts.append(self.model.negative_text(request.params))
                adapter_sets.append(request.params.loras)
                images.append(image)
        started = self.clock()
        rows = self.embeddings.get_many(texts, adapter_sets, images if takes_image else None)
        now = self.clock()
        k = 0
        for request in requests:
            negative = rows[k + 1] if request.cfg_scale is not None else None
            request.conditioning = (rows[k], negative)
            k += request.rows_per_step
            request.timings.encode_s = now - started
            request.admitted_at = now
