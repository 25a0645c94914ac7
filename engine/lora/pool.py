"""The adapter pool: diffusers-format LoRA files in a folder, resident on the model's
device up to a byte budget, each in one pool slot that every wrapped layer indexes.

* Adapters: every `NAME.safetensors` file in `lora_dir`, and every folder `NAME/` holding
  `pytorch_lora_weights.safetensors` (as `save_lora_weights` writes). `names()` rescans,
  so new files are found without a restart.
* Reading a file is diffusers' own (`engine.lora.files`); what the pool's layers cannot
  serve is refused by `check` with the reason.
* Residency: `acquire(names)` references the adapters once each when they are all
  resident. One that is not gets room (least-recently-used adapters that nothing
  references are evicted) and is loaded by the pool's loader thread (`engine.lora.staging`):
  the file read, the conversion and the copies to the device happen there, off the engine's busy loop, which
  only puts the staged factors in place (pointer and table updates) at a later `acquire`;
  meanwhile `acquire` answers "loading". It answers None, evicting nothing, when there is
  no room now (the rest is referenced), and raises `AdapterError` when the adapters can
  never be resident (a set larger than the budget, a file that changed into one that
  cannot be read or served). `release(slots)` drops the references (after the slot's fence).
* Bytes: the budget covers everything the pool allocates for its adapters: their factors,
  the padded stacks the reference path builds from them (`SlotWeights.footprint`) and the
  layers' device tables (made once at install); `stats()["resident_bytes"]` is that count.
* The folder: names are plain file names (at most 255 bytes), and an entry whose real
  path leaves the folder (a symbolic link to elsewhere) is neither listed nor read.
  Reasons name the adapter, never a path of the server; read errors go to the log.
* Text-encoder LoRA: the text encoders' layers are wrapped too and read their rows from
  `text_rows`; `encode(prompts, loras)` runs the model's own `encode` with each prompt's
  adapters bound, and `text_encoder_key(loras)` is what the embedding cache key must add.

Thread safety: one lock around the pool's bookkeeping; `encode` holds its own lock while
its rows are bound (the denoiser's rows are a separate `AdapterRows`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import logging
import math
import os
import pathlib
import threading
import time
from typing import Mapping, Sequence

import torch

from engine.lora.files import AdapterError, AdapterReader, Factors, file_signature
from engine.lora.folder import FOLDER_WEIGHTS, MAX_NAME_BYTES, AdapterFolder
from engine.lora.kernel import DEFAULT_RANK_LIMIT
from engine.lora.layers import LORA_LAYER_TYPES, AdapterRows, unwrap_layers, wrap_layers
from engine.lora.staging import AdapterStager

log = logging.getLogger("diffslot.lora")

#: Scales beyond this are refused: far outside what any adapter is trained for, and a
#: likely typo (an adapter at 100 turns the image to noise).
MAX_SCALE = 16.0

#: `acquire`'s answer while the loader thread reads an adapter it needs.
LOADING = "loading"

#: How long an adapter just loaded for a waiting request is kept from eviction before that
#: request references it (the next admission does at once; this only bounds a canceled one's).
LOADED_HOLD_S = 5.0


@dataclasses.dataclass(eq=False)
class _Adapter:
    name: str
    path: pathlib.Path  # the safetensors file
    signature: tuple  # (mtime_ns, size) of the file when it was read
    reason: str | None = None  # why it cannot be served; None: it can
    nbytes: int = 0  # on the device, in the layers' dtypes
    components: tuple[str, ...] = ()  # which components it targets
    targets: int = 0  # modules it targets
    max_rank: int = 0
    ranks: dict = dataclasses.field(default_factory=dict)  # (component, module) → rank, from validation
    alone_bytes: int = 0  # its footprint resident alone (slot 0)
    slot: int | None = None  # resident (or being loaded) in this slot
    refcount: int = 0
    last_used: int = 0
    layers: list = dataclasses.field(default_factory=list)  # the wrapped layers holding its factors
    loading: concurrent.futures.Future | None = None  # the loader thread's staging of its factors
    load_error: str | None = None  # why loading this version of the file failed
    unreferenced_load: bool = False  # loaded, not yet referenced: its first reference is its miss
    hold_until: float = 0.0  # not evicted before this (monotonic s) while `unreferenced_load`

    @property
    def text_encoder(self) -> bool:
        return any(c.startswith("text_encoder") for c in self.components)


def _layout_key(layer) -> tuple:
    """What a captured graph of the denoiser reads of a layer beyond the device tables it
    shares: a k×k conv's stacked copy of its adapters (Linear and 1×1 conv layers read the
    tables, updated in place, so their loads and evictions change no graph)."""
    weights = layer.weights
    if weights.is_pointwise:
        return ()
    return (weights.max_rank, tuple(s for s in range(weights.capacity) if weights.A[s] is not None))


class AdapterPool:
    """LoRA adapters of `lora_dir` for `model` (a `engine.models.stable_diffusion.PipelineModel`)."""

    def __init__(self, model, lora_dir: str | os.PathLike, budget_bytes: int, max_per_request: int = 4,
                 max_resident: int = 64, max_scale: float = MAX_SCALE, install: bool = True,
                 max_rank: int = DEFAULT_RANK_LIMIT):
        pipe = getattr(model, "pipe", None)
        if pipe is None or not hasattr(type(pipe), "lora_state_dict"):
            raise AdapterError(f"{getattr(model, 'pipeline_class', type(model).__name__)} has no LoRA loader "
                               "in diffusers: adapters cannot be served for it")
        if max_per_request < 1 or max_resident < max_per_request:
            raise ValueError(f"max_resident ({max_resident}) must be ≥ max_per_request ({max_per_request}) ≥ 1")
        self.model, self.pipe, self.loader = model, pipe, type(pipe)
        self.lora_dir = pathlib.Path(lora_dir)
        self.folder = AdapterFolder(self.lora_dir)
        self.budget_bytes, self.max_per_request = int(budget_bytes), int(max_per_request)
        self.max_resident, self.max_scale = int(max_resident), float(max_scale)
        # the largest rank served: a captured graph's LoRA scratch is sized for it
        self.max_rank = int(max_rank)
        # the components diffusers loads LoRA into, as the pipeline lists them (denoiser first)
        self.components = {name: getattr(pipe, name) for name in self.loader._lora_loadable_modules
                           if isinstance(getattr(pipe, name, None), torch.nn.Module)}
        self.denoiser_name = next(n for n in self.components if not n.startswith("text_encoder"))
        self.rows = AdapterRows()  # the denoiser's: bound by DiffusionModel.run
        self.text_rows = AdapterRows()  # the text encoders': bound by `encode`
        self._adapters: dict[str, _Adapter] = {}
        self._free_slots = list(range(self.max_resident))  # a heap: the lowest free slot first
        self._by_slot: dict[int, _Adapter] = {}
        self._lock = threading.RLock()
        self._encode_lock = threading.Lock()
        self._tick = 0
        self._layers: dict[str, dict] = {}
        self.reader = AdapterReader(self.loader, self.components, self._layers, self.max_rank,
                                    getattr(model, "pipeline_class", type(model).__name__), self.folder.inside)
        self._fixed_bytes = 0  # the layers' device tables: allocated once at install
        self._resident_bytes = 0  # the fixed bytes + the footprint of the adapters with a slot
        self.stager = AdapterStager(self.reader, self._layers, self.denoiser_name)
        self.loads = self.evictions = self.hits = self.misses = 0
        #: bumped whenever a k×k conv layer's adapters change (LoCon): the one thing a
        #: captured CUDA graph of the denoiser depends on (recapture then)
        self.layout_version = 0
        self.installed = False
        if install:
            self.install()
        self.names()

    # ---- wiring -------------------------------------------------------------------------------

    def install(self) -> "AdapterPool":
        """Wrap the denoiser's (and text encoders') Linear and Conv2d layers once, and point
        the model's adapter rows at the pool's (`bind_adapter_rows`: what `DiffusionModel.run` binds)."""
        with self._lock:
            if not self.installed:
                for name, module in self.components.items():
                    if any(isinstance(m, LORA_LAYER_TYPES) for m in module.modules()):
                        raise RuntimeError(f"{name} already has LoRA layers of another pool: one pool per model "
                                           "(its slots index every wrapped layer)")
                    rows = self.rows if name == self.denoiser_name else self.text_rows
                    self._layers[name] = wrap_layers(module, self.max_resident, rows, self.max_rank)
                self._fixed_bytes = sum(layer.weights.table_bytes for layers in self._layers.values()
                                        for layer in layers.values())
                self._resident_bytes = self._fixed_bytes
                self.installed = True
            self.model.bind_adapter_rows(self.rows)
        return self

    def uninstall(self) -> None:
        """Put the base layers back and detach the rows (every adapter is dropped)."""
        with self._lock:
            if any(a.refcount for a in self._adapters.values()):
                raise RuntimeError("adapters are still referenced")
            self._finish_loads(wait=True)
            for adapter in list(self._by_slot.values()):
                self._evict(adapter)
            self.close()
            for module in self.components.values():
                unwrap_layers(module)
            self._layers.clear()
            self._fixed_bytes = self._resident_bytes = 0
            self.installed = False
            if getattr(self.model, "adapter_rows", None) is self.rows:
                self.model.bind_adapter_rows(None)

    # ---- the folder ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the loader thread (after the load it runs, if any)."""
        self.stager.close()

    def names(self) -> list[str]:
        """The adapters in the folder now (rescanned on every call; read when first checked)."""
        with self._lock:
            found = self.folder.scan()
            for name in [n for n, a in self._adapters.items() if n not in found and a.slot is None]:
                del self._adapters[name]  # gone from the folder and not resident
            return sorted(found)

    def _record(self, name: str) -> _Adapter | None:
        """The adapter's record, its file read again if it changed. A resident adapter whose
        file moved, changed or vanished keeps serving its resident copy while referenced."""
        adapter = self._adapters.get(name)
        if adapter is not None and adapter.loading is not None:
            return adapter  # its slot is reserved and the loader reads it: looked at again once loaded
        where = self.folder.locate(name)
        if adapter is not None and adapter.refcount > 0 and (where is None or isinstance(where, str)
                                                             or where != adapter.path):
            return adapter
        if where is None or isinstance(where, str):
            if adapter is not None:
                self._evict(adapter)
                self._adapters.pop(name, None)
            if where is None:
                return None
            adapter = self._adapters[name] = _Adapter(name, self.lora_dir / name, (), reason=where)
            return adapter
        if adapter is None or adapter.path != where:
            if adapter is not None:
                self._evict(adapter)
            adapter = self._adapters[name] = _Adapter(name, where, ())
        try:
            signature = file_signature(where)
        except OSError:
            return None
        if signature != adapter.signature and adapter.refcount == 0:
            self._evict(adapter)  # a stale copy of an edited file
            self._validate(adapter, signature)
        return adapter

    def _validate(self, adapter: _Adapter, signature: tuple) -> None:
        adapter.signature, adapter.reason, adapter.load_error = signature, None, None
        try:
            factors = self.reader.read(adapter.path)
        except AdapterError as exc:
            adapter.reason = str(exc)
            return
        except Exception as exc:  # a corrupt or foreign file: refused, never raised into the engine
            # the details (a path, the reader's words) stay in the log
            log.warning("adapter %r (%s) cannot be read: %s: %s", adapter.name, adapter.path, type(exc).__name__, exc)
            adapter.reason = "cannot be read as a diffusers LoRA file (the engine's log has the details)"
            return
        adapter.nbytes = sum(self.reader.device_bytes(f) for f in factors)
        adapter.components = tuple(sorted({f.component for f in factors}, key=list(self.components).index))
        adapter.targets = len(factors)
        adapter.max_rank = max(int(f.A.shape[0]) for f in factors)
        adapter.ranks = {(f.component, f.module): int(f.A.shape[0]) for f in factors}
        adapter.alone_bytes = self._footprint({0: adapter})

    # ---- the interface the core uses ------------------------------------------------------------

    def check(self, loras) -> str | None:
        """Why these adapters cannot be served (the field is `loras`), or None."""
        if not isinstance(loras, Mapping):
            return "loras must map adapter names to scales"
        if len(loras) > self.max_per_request:
            return f"{len(loras)} adapters requested; at most {self.max_per_request} per request"
        with self._lock:
            adapters = []
            for name, scale in loras.items():
                if not isinstance(name, str):
                    return f"adapter names are strings, not {type(name).__name__}"
                if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                    return f"adapter names are at most {MAX_NAME_BYTES} bytes ({name[:32]!r}... is longer)"
                if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                    return f"scale of {name!r} must be a number, not {type(scale).__name__}"
                if not math.isfinite(scale) or abs(scale) > self.max_scale:
                    return f"scale of {name!r} is {scale}; it must be finite and within ±{self.max_scale:g}"
                adapter = self._record(name)
                if adapter is None:
                    known = self.names()
                    listed = ", ".join(map(repr, known[:20])) + (", ..." if len(known) > 20 else "")
                    return f"unknown adapter {name!r}" + (f"; known: {listed}" if known else
                                                          "; the adapter folder holds none")
                if adapter.reason is not None:
                    return f"adapter {name!r}: {adapter.reason}"
                adapters.append(adapter)
            return self._never_resident(adapters)

    def _never_resident(self, adapters: Sequence[_Adapter]) -> str | None:
        """Why this set can never be resident at once (more than the whole budget), or None."""
        alone = len(adapters) == 1
        need = self._fixed_bytes + (adapters[0].alone_bytes if alone else self._footprint(dict(enumerate(adapters))))
        if need <= self.budget_bytes:
            return None
        return (f"adapters {', '.join(repr(a.name) for a in adapters)} need {need} bytes (factors, the stacks "
                f"built from them and the pool's tables); the adapter pool holds {self.budget_bytes}")

    def _footprint(self, placed: Mapping[int, _Adapter]) -> int:
        """The bytes these adapters take when resident in these slots: their factors and the
        padded stacks of the layers that build one (`SlotWeights.footprint`)."""
        by_layer: dict[tuple, dict[int, int]] = {}
        for slot, adapter in placed.items():
            for key, rank in adapter.ranks.items():
                by_layer.setdefault(key, {})[slot] = rank
        return sum(self._layers[component][module].weights.footprint(ranks)
                   for (component, module), ranks in by_layer.items())

    def nbytes(self, names: Sequence[str]) -> int:
        """Bytes these adapters alone take when resident (in the lowest slots)."""
        with self._lock:
            adapters = []
            for name in names:
                adapter = self._record(name)
                if adapter is None or adapter.reason is not None:
                    raise AdapterError(f"adapter {name!r}: " + (adapter.reason if adapter else "unknown"))
                adapters.append(adapter)
            return self._footprint(dict(enumerate(adapters)))

    def acquire(self, names: Sequence[str]) -> list[int] | str | None:
        """Reference the adapters once each when all are resident: their slots, in order.
        Otherwise nothing is referenced: `LOADING` while the loader thread reads one of
        them (a load this call may have started, after making room for it), None when there
        is no room for them now (nothing evicted). Raises `AdapterError` (naming the
        adapter, never a path) when they can never be resident together."""
        names = list(dict.fromkeys(names))
        with self._lock:
            self._finish_loads()
            adapters = []
            for name in names:
                adapter = self._record(name)
                if adapter is None or adapter.reason is not None:
                    raise AdapterError(f"adapter {name!r}: " + (adapter.reason if adapter else "unknown"))
                if adapter.load_error is not None:  # its last load failed: this request fails with it
                    error, adapter.load_error = adapter.load_error, None  # (the next one tries again)
                    raise AdapterError(f"adapter {name!r}: {error}")
                adapters.append(adapter)
            missing = [a for a in adapters if a.slot is None]
            why = self._never_resident(adapters) if missing else None  # resident now: they fit
            if why is not None:
                raise AdapterError(f"{why}: they can never be resident together")
            if missing and not self._make_room(missing, adapters):
                return None  # the rest is referenced: wait for releases
            for adapter in missing:
                self._start_load(adapter)
            self._tick += 1
            if any(a.loading is not None for a in adapters):
                for adapter in adapters:  # the resident part of the set stays off the eviction list's head
                    adapter.last_used = self._tick
                return LOADING
            for adapter in adapters:
                if adapter.unreferenced_load:
                    adapter.unreferenced_load = False  # its miss was counted when its load started
                else:
                    self.hits += 1
                adapter.refcount += 1
                adapter.last_used = self._tick
            return [a.slot for a in adapters]

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block for at most `timeout_s` while a load is in flight (returns when one ends).
        The busy loop calls it when it has nothing else to do: spinning instead holds the
        GIL from the loader thread, whose file read takes it back once per tensor."""
        with self._lock:
            pending = [a.loading for a in self._adapters.values() if a.loading is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def acquire_waiting(self, names: Sequence[str], timeout_s: float = 300.0) -> list[int] | None:
        """`acquire`, waiting for the loads it starts (tests and benchmarks; never the busy loop)."""
        while True:
            result = self.acquire(names)
            if result != LOADING:
                return result
            with self._lock:
                pending = [a.loading for a in self._adapters.values() if a.loading is not None]
            concurrent.futures.wait(pending, timeout=timeout_s)

    def _make_room(self, missing: list[_Adapter], wanted: list[_Adapter]) -> bool:
        """Evict the fewest least-recently-used unreferenced adapters (none of `wanted`, none
        loading) that leave room for `missing` in the lowest free slots; False (nothing
        evicted) when even evicting them all would not."""
        now = time.monotonic()
        evictable = sorted((a for a in self._by_slot.values()
                            if a.refcount == 0 and a.loading is None and a not in wanted
                            and not (a.unreferenced_load and now < a.hold_until)), key=lambda a: a.last_used)

        def fits(victims: int) -> bool:
            gone = evictable[:victims]
            free = sorted(self._free_slots + [a.slot for a in gone])
            if len(free) < len(missing):
                return False
            placed = {slot: a for slot, a in self._by_slot.items() if a not in gone}
            placed.update(zip(free, missing))
            return self._fixed_bytes + self._footprint(placed) <= self.budget_bytes

        if not fits(len(evictable)):
            return False
        low, high = 0, len(evictable)  # fewer victims never fit better: the least that fits, by bisection
        while low < high:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle + 1
        for victim in evictable[:low]:
            self._evict(victim)
        return True

    def release(self, slots: Sequence[int]) -> None:
        """Drop one reference per slot (after the fence of the last call that used them)."""
        with self._lock:
            for slot in slots:
                adapter = self._by_slot.get(int(slot))
                if adapter is None or adapter.refcount <= 0:
                    raise ValueError(f"adapter slot {slot} is not referenced")
                adapter.refcount -= 1

    def row_inputs(self, slots: Sequence[int], scales: Sequence[float], rows: int = 2) -> dict[str, torch.Tensor]:
        """A request's `lora_index` / `lora_scale` (rows × max_per_request, padded with -1 / 0):
        the same adapters on both guidance branches, as the pipeline's patched UNet applies them."""
        if len(slots) != len(scales) or len(slots) > self.max_per_request:
            raise ValueError(f"{len(slots)} slots, {len(scales)} scales; at most {self.max_per_request}")
        index = torch.full((rows, self.max_per_request), -1, dtype=torch.int32)
        scale = torch.zeros((rows, self.max_per_request), dtype=torch.float32)
        index[:, :len(slots)] = torch.tensor(list(slots), dtype=torch.int32)
        scale[:, :len(slots)] = torch.tensor([float(s) for s in scales], dtype=torch.float32)
        # host tensors: the slot storage stages them to the device without waiting for the stream
        return {"lora_index": index, "lora_scale": scale}

    def slot_of(self, name: str) -> int | None:
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.slot

    @property
    def resident_bytes(self) -> int:
        """The bytes the pool holds by its count: the tables, and the footprint of every
        adapter with a slot (resident or being loaded)."""
        return self._resident_bytes

    def held_bytes(self) -> int:
        """What the wrapped layers really hold now (factors, stacks built, tables): never
        above `resident_bytes`, equal once every stack is built."""
        with self._lock:
            return sum(layer.weights.held_bytes for layers in self._layers.values() for layer in layers.values())

    def stats(self) -> dict:
        with self._lock:
            asked = self.hits + self.misses
            return dict(loads=self.loads, evictions=self.evictions, resident=len(self._by_slot),
                        resident_bytes=self.resident_bytes, budget_bytes=self.budget_bytes,
                        referenced=sum(1 for a in self._by_slot.values() if a.refcount),
                        loading=sum(1 for a in self._by_slot.values() if a.loading is not None), hits=self.hits,
                        misses=self.misses, hit_rate=self.hits / asked if asked else 0.0)

    # ---- text encoders ------------------------------------------------------------------------

    def has_text_encoder(self, name: str) -> bool:
        adapter = self._adapters.get(name)
        return adapter is not None and adapter.text_encoder

    def text_encoder_key(self, loras: Mapping[str, float] | None) -> tuple:
        """What the embedding cache key must add for a request's adapters: the ones with
        text-encoder weights and their scales (() when none: the plain prompt's embedding)."""
        if not loras:
            return ()
        with self._lock:
            return tuple(sorted((name, float(scale)) for name, scale in loras.items()
                                if self._record(name) is not None and self._adapters[name].text_encoder))

    def encode(self, prompts: Sequence[str], loras: Sequence[Mapping[str, float] | None]):
        """`model.encode(prompts)`, each prompt's embedding made with its request's
        text-encoder adapters (acquired by the caller: resident and referenced). Prompts are
        encoded in one batch per distinct set of text-encoder adapters, that set bound to
        every row of the batch (so a model that encodes a subset, e.g. SDXL's zero rows for
        an absent negative prompt, still lines up)."""
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts, {len(loras)} adapter sets")
        by_key: dict[tuple, list[int]] = {}
        for i, chosen in enumerate(loras):
            by_key.setdefault(self.text_encoder_key(chosen), []).append(i)
        out = [None] * len(prompts)
        with self._encode_lock:
            for key, members in by_key.items():
                if key:
                    with self._lock:
                        slots = []
                        for name, _ in key:
                            adapter = self._adapters.get(name)
                            if adapter is None or adapter.slot is None or adapter.refcount == 0:
                                raise AdapterError(f"adapter {name!r} must be acquired before encoding with it")
                            slots.append(adapter.slot)
                    text_encoder = next(m for n, m in self.components.items() if n != self.denoiser_name)
                    self.text_rows.bind_uniform(slots, [scale for _, scale in key],
                                                next(text_encoder.parameters()).device)
                try:
                    for i, embedding in zip(members, self.model.encode([prompts[i] for i in members])):
                        out[i] = embedding
                finally:
                    self.text_rows.clear()
        return out

    # ---- residency ----------------------------------------------------------------------------

    def _start_load(self, adapter: _Adapter) -> None:
        """Reserve the lowest free slot (and the adapter's bytes) and hand the file to the
        loader thread."""
        slot = heapq.heappop(self._free_slots)  # lowest first: the reference's stacks stay compact
        adapter.slot, adapter.layers = slot, []
        self._by_slot[slot] = adapter
        self._recount()
        adapter.loading = self.stager.submit(adapter.name, adapter.path)
        self.misses += 1
        adapter.unreferenced_load = True

    def _finish_loads(self, wait: bool = False) -> None:
        """Put the factors of every finished load in place (on the caller's thread: the
        busy loop), or record why it failed (`wait`: every load in flight first)."""
        for adapter in [a for a in self._by_slot.values() if a.loading is not None]:
            future = adapter.loading
            if not wait and not future.done():
                continue
            adapter.loading = None
            try:
                signature, staged = future.result()
            except Exception as exc:
                self._evict(adapter, loaded=False)
                adapter.unreferenced_load = False
                if isinstance(exc, AdapterError):
                    adapter.load_error = str(exc)
                else:
                    log.warning("adapter %r (%s) could not be loaded: %s: %s", adapter.name, adapter.path,
                                type(exc).__name__, exc)
                    adapter.load_error = "could not be loaded (the engine's log has the details)"
                continue
            ranks = {(f.component, f.module): int(f.A.shape[0]) for f in staged}
            if signature != adapter.signature and ranks != adapter.ranks:
                # the file changed since it was checked, into another shape: checked again when next asked for
                self._evict(adapter, loaded=False)
                adapter.unreferenced_load, adapter.signature = False, ()
                continue
            self._install(adapter, staged)
            adapter.signature, adapter.hold_until = signature, time.monotonic() + LOADED_HOLD_S

    def _install(self, adapter: _Adapter, staged: list[Factors]) -> None:
        slot = adapter.slot
        try:
            for f in staged:
                layer = self._layers[f.component][f.module]
                before = _layout_key(layer)
                layer.weights.put(slot, f.A, f.B, f.scaling)
                adapter.layers.append(layer)
                self.layout_version += before != _layout_key(layer)
        except Exception as exc:
            self._evict(adapter, loaded=False)
            adapter.unreferenced_load = False
            log.warning("adapter %r could not be put in place: %s: %s", adapter.name, type(exc).__name__, exc)
            adapter.load_error = "could not be loaded (the engine's log has the details)"
            return
        self.loads += 1

    def _recount(self) -> None:
        self._resident_bytes = self._fixed_bytes + self._footprint(self._by_slot)

    def _evict(self, adapter: _Adapter, loaded: bool = True) -> None:
        """Drop the adapter's factors and free its slot (`loaded`: it was resident, an
        eviction; otherwise a reservation whose load did not complete)."""
        if adapter.slot is None:
            return
        if adapter.loading is not None:
            raise RuntimeError(f"adapter {adapter.name!r} is being loaded")
        for layer in adapter.layers:
            before = _layout_key(layer)
            layer.weights.clear(adapter.slot)
            self.layout_version += before != _layout_key(layer)
        self._by_slot.pop(adapter.slot, None)
        heapq.heappush(self._free_slots, adapter.slot)
        adapter.slot, adapter.layers = None, []
        self.evictions += loaded
        self._recount()


__all__ = ["AdapterPool", "AdapterError", "FOLDER_WEIGHTS", "LOADING", "MAX_NAME_BYTES", "MAX_SCALE",
           "LORA_LAYER_TYPES"]
