"""Per-request LoRA adapters, mixed in one batch.

* `engine.lora.kernel`: `lora_delta` / `add_lora_`: each row's own adapters in one call,
  a Triton kernel (shrink then expand, as Punica's SGMV) and its torch reference.
* `engine.lora.layers`: `LoraLinear` / `LoraConv2d` wrappers over the base layers (never
  modified) and the `AdapterRows` every wrapped layer of a model reads per call.
* `engine.lora.pool`: `AdapterPool`: the adapters of a folder, resident up to a byte
  budget with LRU eviction of unreferenced ones, read with diffusers' own loaders.
"""
from engine.lora.kernel import RowGroups, SlotWeights, add_lora_, lora_delta
from engine.lora.layers import AdapterRows, LoraConv2d, LoraLinear
from engine.lora.pool import AdapterError, AdapterPool

__all__ = ["AdapterError", "AdapterPool", "AdapterRows", "LoraConv2d", "LoraLinear", "RowGroups", "SlotWeights",
           "add_lora_", "lora_delta"]
