"""The preparation phase's cache: prompt embeddings keyed by (model revision, prompt,
encoder settings, text-encoder adapters, image content), bounded by entries and by bytes,
least recently used first out. The image is an edit model's (Qwen-Image-Edit), whose
prompt rows hold the image's vision tokens: a digest of its pixels keys them.

An entry evicted while slots still hold it stays alive through their references and is
freed with the last of them (after its fence); the cache only stops handing it out.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Sequence

from engine.models.model import Conditioning, DiffusionModel


class EmbeddingCache:
    def __init__(self, model: DiffusionModel, capacity: int = 1024, capacity_bytes: int = 256 << 20,
                 adapters=None):
        self.model = model
        self.adapters = adapters  # engine.lora.AdapterPool: text-encoder LoRA changes an embedding
        self.capacity, self.capacity_bytes = capacity, capacity_bytes
        self._entries: collections.OrderedDict[tuple, Conditioning] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.encoder_calls = 0

    def _key(self, prompt: str | None, loras=None, image_digest: str | None = None) -> tuple:
        adapters = () if self.adapters is None else self.adapters.text_encoder_key(loras)
        key = (self.model.revision, prompt, self.model.encoder_settings, adapters)
        return key if image_digest is None else (*key, image_digest)

    def get_many(self, prompts: Sequence[str | None], adapter_sets: Sequence | None = None,
                 images: Sequence | None = None) -> list[Conditioning]:
        """Rows for every prompt, in order; the misses in one batched encoder pass.
        `adapter_sets[i]`: the adapters (name → scale) prompt i is encoded with;
        `images[i]`: the image (PIL) prompt i is encoded with, for an edit model."""
        adapter_sets = adapter_sets if adapter_sets is not None else [None] * len(prompts)
        digests = [image_digest(i) for i in images] if images is not None else [None] * len(prompts)
        keys = [self._key(p, a, d) for p, a, d in zip(prompts, adapter_sets, digests)]
        missing: dict[tuple, tuple] = {}
        for k, (key, prompt, loras) in enumerate(zip(keys, prompts, adapter_sets)):
            if key in self._entries:
                self._entries.move_to_end(key)
            elif key not in missing:
                missing[key] = (prompt, loras, None if images is None else images[k])
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        fresh = {}
        if missing:
            self.encoder_calls += 1
            texts = [prompt for prompt, _, _ in missing.values()]
            with_adapters = self.adapters is not None and any(key[3] for key in missing)
            if images is not None:
                if with_adapters:
                    raise ValueError("text-encoder adapters are not served with an image-conditioned prompt")
                encoded = self.model.encode(texts, images=[image for _, _, image in missing.values()])
            elif with_adapters:
                encoded = self.adapters.encode(texts, [loras for _, loras, _ in missing.values()])
            else:
                encoded = self.model.encode(texts)
            fresh = dict(zip(missing, encoded))
        rows = [fresh.get(key) or self._entries[key] for key in keys]
        for key, conditioning in fresh.items():
            self._entries[key] = conditioning
            self.nbytes += conditioning.nbytes
        while len(self._entries) > self.capacity or (self.nbytes > self.capacity_bytes and len(self._entries) > 1):
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes
        return rows

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {
            "embedding_cache_entries": len(self._entries),
            "embedding_cache_bytes": self.nbytes,
            "embedding_cache_hits": self.hits,
            "embedding_cache_misses": self.misses,
            "embedding_cache_hit_rate": self.hits / lookups if lookups else 0.0,
            "encoder_batches": self.encoder_calls,
        }


def image_digest(image) -> str:
    """A digest of a PIL image's content (mode, size, pixels): equal images, equal keys."""
    digest = hashlib.blake2b(f"{image.mode} {image.width}x{image.height}".encode(), digest_size=16)
    digest.update(image.tobytes())
    return digest.hexdigest()
