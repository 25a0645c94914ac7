"""The preparation phase's cache: prompt embeddings keyed by (model revision, prompt,
encoder settings), bounded by entries and by bytes, least recently used first out.

An entry evicted while slots still hold it stays alive through their references and is
freed with the last of them (after its fence); the cache only stops handing it out.
"""
from __future__ import annotations

import collections
from typing import Sequence

from engine.models.loading import Conditioning, DiffusionModel


class EmbeddingCache:
    def __init__(self, model: DiffusionModel, capacity: int = 1024, capacity_bytes: int = 256 << 20,
                 adapters=None):
        self.model = model
        self.adapters = adapters  # engine.lora.AdapterPool: text-encoder LoRA changes an embedding
        self.capacity, self.capacity_bytes = capacity, capacity_bytes
        self._entries: collections.OrderedDict[tuple, Conditioning] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.encoder_calls = 0

    def _key(self, prompt: str | None, loras=None) -> tuple:
        adapters = () if self.adapters is None else self.adapters.text_encoder_key(loras)
        return (self.model.revision, prompt, self.model.encoder_settings, adapters)

    def get_many(self, prompts: Sequence[str | None], adapter_sets: Sequence | None = None) -> list[Conditioning]:
        """Rows for every prompt, in order; the misses in one batched encoder pass.
        `adapter_sets[i]`: the adapters (name → scale) prompt i is encoded with."""
        adapter_sets = adapter_sets if adapter_sets is not None else [None] * len(prompts)
        keys = [self._key(p, a) for p, a in zip(prompts, adapter_sets)]
        missing: dict[tuple, tuple] = {}
        for key, prompt, loras in zip(keys, prompts, adapter_sets):
            if key in self._entries:
                self._entries.move_to_end(key)
            elif key not in missing:
                missing[key] = (prompt, loras)
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        fresh = {}
        if missing:
            self.encoder_calls += 1
            texts = [prompt for prompt, _ in missing.values()]
            if self.adapters is not None and any(key[-1] for key in missing):
                encoded = self.adapters.encode(texts, [loras for _, loras in missing.values()])
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
