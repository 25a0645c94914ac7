"""The adapter input kind: `loras`, adapter name → scale.

Intake checks the names and scales against the adapter pool. Residency is a resource of
admission, like memory: the scheduler places a request only once the pool has made its
adapters resident and referenced them (`AdapterResidency.acquire`), and drops the
references with its slot, after the fence. At preparation the request's pool slots and
scales become its `lora_index` / `lora_scale` rows (the same on both guidance branches),
which the slot's request-input table holds and the row map gathers per row; a request
without adapters gets rows that say "none", so every row of a pool's model has them.
"""
from __future__ import annotations

from engine.core.input_kinds.base import InputKind
from engine.core.outputs import RequestRejected


class AdapterKind(InputKind):
    name = "loras"
    fields = ("loras",)

    def __init__(self, adapters):
        self.adapters = adapters  # engine.lora.interface.AdapterResidency, or None

    def check(self, p) -> dict | None:
        """Rejects a bad `loras`. Resident adapters are shared by every request that
        references them and the pool's whole byte budget is set aside once
        (`adapter_budget_bytes` in stats), so a request reserves no adapter bytes; the pool
        rejects a set larger than that budget."""
        if not p.loras:
            return None
        if self.adapters is None:
            raise RequestRejected("this engine serves no adapters (start it with --lora-dir)", "loras")
        why = self.adapters.check(p.loras)
        if why:
            raise RequestRejected(why, "loras")
        return dict(p.loras)

    def prepare(self, requests: list) -> dict:
        if self.adapters is None:
            return {}
        for request in requests:
            loras = request.params.loras or {}
            request.request_inputs.update(self.adapters.row_inputs(list(request.adapters), list(loras.values())))
        return {}
