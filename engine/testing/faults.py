"""Fault injection for tests of failure isolation: a model wrapper whose denoiser
raises, returns NaN, or runs out of memory for chosen prompts, at the row level, as a
real denoiser fails on an input it cannot take.

`python -m engine serve --inject-faults SPEC` wraps the served model with it (tests only):
SPEC is `raise=PROMPT`, `nan=PROMPT`, `encode=PROMPT` (the text encoder raises) or
`oom=ROWS` joined by commas.
"""
from __future__ import annotations

import torch

from engine.models.inputs import ModelInputs
from engine.models.model import Conditioning, DiffusionModel, model_inputs


class FaultyModel:
    """Delegates everything to `model`; its `run` misbehaves for the rows of the poison
    prompts (recognised by their embedding rows, as the denoiser sees them)."""

    def __init__(self, model: DiffusionModel, *, raise_on: str | None = None, nan_on: str | None = None,
                 encode_raise_on: str | None = None, oom_above_rows: int | None = None):
        self._model = model
        self.encode_raise_on = encode_raise_on
        self._poison: dict[str, str] = {}
        self._poison_rows: list[tuple[torch.Tensor, str]] = []  # (hidden rows, fault), as prompts are encoded
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
                self._poison_rows.append((row.hidden, self._poison[prompt]))
        return rows

    def _fault_of(self, hidden: torch.Tensor) -> str | None:
        for poisoned, fault in self._poison_rows:
            if torch.equal(hidden, poisoned):
                return fault
        return None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        rows = inputs.rows
        self.calls.append(rows)
        if self.oom_above_rows is not None and rows > self.oom_above_rows:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {rows} rows")
        faults = [self._fault_of(h) for h in inputs.hidden] if self._poison_rows else [None] * rows
        if "raise" in faults:
            raise ValueError("injected fault: this input breaks the denoiser")
        out = self._model.run(inputs)
        for i, fault in enumerate(faults):
            if fault == "nan":
                out[i] = float("nan")
        return out

    def denoise(self, x: torch.Tensor, t: torch.Tensor, rows, **request_inputs) -> torch.Tensor:
        return self.run(model_inputs(x, t, rows, **request_inputs))


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
