"""The encode phase's cache (R14): prompt embeddings keyed by (model revision, prompt,
encoder settings), bounded by entries and by bytes (R22), least recently used first out.

An entry evicted while slots still hold it stays alive through their references and is
freed with the last of them (after its fence); the cache only stops handing it out.
"""
from __future__ import annotations

import collections
from typing import Sequence

from engine.models.loading import Conditioning, DiffusionModel


class EmbeddingCache:
    def __init__(self, model: DiffusionModel, capacity: int = 1024, capacity_bytes: int = 256 << 20):
        self.model = model
        self.capacity, self.capacity_bytes = capacity, capacity_bytes
        self._entries: collections.OrderedDict[tuple, Conditioning] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.encoder_calls = 0

    def _key(self, prompt: str) -> tuple:
        return (self.model.revision, prompt, self.model.encoder_settings)

    def get_many(self, prompts: Sequence[str]) -> list[Conditioning]:
        """Rows for every prompt, in order; the misses in one batched encoder pass."""
        missing = []
        for prompt in prompts:
            key = self._key(prompt)
            if key in self._entries:
                self._entries.move_to_end(key)
            elif prompt not in missing:
                missing.append(prompt)
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        fresh = {}
        if missing:
            self.encoder_calls += 1
            fresh = dict(zip(missing, self.model.encode(missing)))
        rows = [fresh.get(p) or self._entries[self._key(p)] for p in prompts]
        for prompt, conditioning in fresh.items():
            self._entries[self._key(prompt)] = conditioning
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
