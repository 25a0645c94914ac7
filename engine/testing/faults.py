"""Fault injection for tests of failure isolation (R15): a model wrapper whose denoiser
raises, returns NaN, or runs out of memory for chosen prompts, at the row level, as a
real denoiser fails on an input it cannot take.

`python -m engine serve --inject-faults SPEC` wraps the served model with it (tests only):
SPEC is `raise=PROMPT`, `nan=PROMPT`, `encode=PROMPT` (the text encoder raises) or
`oom=ROWS` joined by commas.
"""
from __future__ import annotations

import torch

from engine.models.loading import Conditioning, DiffusionModel


class FaultyModel:
    """Delegates everything to `model`; its `denoise` misbehaves for the poison prompts."""

    def __init__(self, model: DiffusionModel, *, raise_on: str | None = None, nan_on: str | None = None,
                 encode_raise_on: str | None = None, oom_above_rows: int | None = None):
        self._model = model
        self.encode_raise_on = encode_raise_on
        self._poison: dict[str, str] = {}
        self._poison_rows: dict[int, str] = {}  # id(Conditioning) → fault, filled as prompts are encoded
        if raise_on is not None:
            self._poison[raise_on] = "raise"
        if nan_on is not None:
            self._poison[nan_on] = "nan"
        self.oom_above_rows = oom_above_rows
        self.calls: list[int] = []  # rows per denoiser call

    def __getattr__(self, name):
        return getattr(self._model, name)

    def encode(self, prompts) -> list[Conditioning]:
        if self.encode_raise_on is not None and self.encode_raise_on in prompts:
            raise UnicodeError("injected fault: the tokenizer cannot take this prompt")
        rows = self._model.encode(prompts)
        for prompt, row in zip(prompts, rows):
            if prompt in self._poison:
                self._poison_rows[id(row)] = self._poison[prompt]
        return rows

    def denoise(self, x: torch.Tensor, t: torch.Tensor, rows) -> torch.Tensor:
        self.calls.append(len(rows))
        if self.oom_above_rows is not None and len(rows) > self.oom_above_rows:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {len(rows)} rows")
        faults = [self._poison_rows.get(id(row)) for row in rows]
        if "raise" in faults:
            raise ValueError("injected fault: this input breaks the denoiser")
        out = self._model.denoise(x, t, rows)
        for i, fault in enumerate(faults):
            if fault == "nan":
                out[i] = float("nan")
        return out


def parse_spec(spec: str) -> dict:
    options = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key == "raise":
            options["raise_on"] = value
        elif key == "nan":
            options["nan_on"] = value
        elif key == "encode":
            options["encode_raise_on"] = value
        elif key == "oom":
            options["oom_above_rows"] = int(value)
        else:
            raise ValueError(f"unknown fault {key!r}: use raise=PROMPT, nan=PROMPT, encode=PROMPT or oom=ROWS")
    return options
