"""The denoising core: `EngineCore`, a conductor over the scheduler (`scheduling/`, what
runs), the per-request input kinds (`input_kinds/`), the runner and its slot storage (how),
and the reaper (fences). Pure: no sockets, threads or signals.

Names load lazily so that importing a torch-free module of this package
(`engine.core.outputs`, `engine.core.config`, `engine.core.interface`, `engine.core.scheduling`)
does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineCore": "engine.core.engine_core",
    "SlotStorage": "engine.core.storage",
    "CoreConfig": "engine.core.config",
    "LAYOUTS": "engine.core.config",
    "ADMISSIONS": "engine.core.config",
    "Ledger": "engine.core.scheduling.ledger",
    "Reservation": "engine.core.scheduling.ledger",
    "CoreInterface": "engine.core.interface",
    "ModelInfo": "engine.core.interface",
    "StepProgress": "engine.core.outputs",
    "DenoiseFinished": "engine.core.outputs",
    "RequestCanceled": "engine.core.outputs",
    "RequestFailed": "engine.core.outputs",
    "RequestRejected": "engine.core.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
