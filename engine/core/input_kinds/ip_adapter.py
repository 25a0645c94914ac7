"""The IP-Adapter input kind: `ip_image` (an image as a prompt) and `ip_scale`.

At intake the image is decoded and bounded as every image input (`Rejected` naming
`ip_image`), the scale checked (naming `ip_scale`); a model served without
`--ip-adapter` rejects them. At admission (`IPAdapterKind.prepare`) the image encoder
runs once over every admitted image it has not seen (a small cache keyed by the image's
bytes keeps the embeddings of recent ones: a repeated image costs no encoder pass), and
every request served by an IP-Adapter model gets its `ip_embeds` / `ip_scale` rows (see
`engine.models.ip_adapter`): a request without an image gets zeros and scale 0.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math

import torch

from engine.core.input_kinds.base import InputKind
from engine.core.input_kinds.image import _decode
from engine.core.outputs import RequestRejected

MAX_SCALE = 100.0
CACHED_EMBEDDINGS = 256


@dataclasses.dataclass(eq=False)
class IPImage:
    image: object  # PIL image, RGB
    key: str  # the encoded bytes' digest: the embedding cache's key
    scale: float
    input_bytes: int


class IPAdapterKind(InputKind):
    name = "ip_image"
    fields = ("ip_image", "ip_scale")
    timing = "image_encode_s"

    def __init__(self, model, geometry, max_input_bytes: int):
        self.model, self.geometry, self.max_input_bytes = model, geometry, max_input_bytes
        self.embeddings: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.encoded = 0  # images the encoder ran on (the others came from the cache)

    @property
    def served(self) -> bool:
        return bool(getattr(self.model, "ip_adapter", None))

    def check(self, p) -> IPImage | None:
        scale = p.ip_scale
        if p.ip_image is None:
            if scale != 1.0:
                raise RequestRejected("needs an ip_image", "ip_scale")
            return None
        if not self.served:
            raise RequestRejected("this engine serves no IP-Adapter (start it with --ip-adapter PATH)", "ip_image")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or not -MAX_SCALE <= scale <= MAX_SCALE:
            raise RequestRejected(f"must be a finite number in [{-MAX_SCALE:g}, {MAX_SCALE:g}]", "ip_scale")
        image = _decode(p.ip_image, "ip_image", self.max_input_bytes, self.geometry.max_size)
        size = memoryview(p.ip_image).nbytes
        return IPImage(image.convert("RGB") if image.mode != "RGB" else image,
                       hashlib.sha256(p.ip_image).hexdigest(), float(scale), size)

    def nbytes(self, value: IPImage, latent_shape) -> int:
        """The encoded image until prepared; the embedding rows are the slot's request inputs."""
        return value.input_bytes

    def spent(self, value: IPImage) -> int:
        return value.input_bytes

    def prepare(self, requests: list) -> dict:
        if not self.served:
            return {}
        from engine.models.ip_adapter import encode_ip_images, ip_embed_width

        failed = {}
        missing = {}
        for request in requests:
            value = request.inputs.get(self.name)
            if value is not None and value.key not in self.embeddings:
                missing.setdefault(value.key, value.image)
        if missing:
            try:
                encoded = encode_ip_images(self.model, list(missing.values()))
            except Exception as exc:
                encoded = None
                for request in requests:
                    value = request.inputs.get(self.name)
                    if value is not None and value.key in missing:
                        failed[request] = exc
            if encoded is not None:
                self.encoded += len(missing)
                for key, row in zip(missing, encoded):
                    self.embeddings[key] = row
        width = ip_embed_width(self.model)
        for request in requests:
            if request in failed:
                continue
            value = request.inputs.get(self.name)
            embeds = torch.zeros((2, 1, width), dtype=torch.float32)  # the negative prompt's row: zeros
            scale = torch.zeros((2, 1), dtype=torch.float32)
            if value is not None:
                embeds[0, 0] = self.embeddings[value.key]
                self.embeddings.move_to_end(value.key)
                scale[:] = value.scale
            request.request_inputs.update(ip_embeds=embeds, ip_scale=scale)
        while len(self.embeddings) > CACHED_EMBEDDINGS:
            self.embeddings.popitem(last=False)
        return failed
