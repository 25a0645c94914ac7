"""Checking a request's parameters against the served model (R11): every bad field gets
`RequestRejected` naming it. Shared by `EngineCore` and the benchmark's baseline cores, so
every core behind the engine process rejects the same input the same way."""
from __future__ import annotations

import math

from engine.core.outputs import RequestRejected
from engine.protocol import MAX_PROMPT_CHARS, OUTPUT_KINDS, SAMPLERS, GenerateParams

MAX_GUIDANCE = 100.0


def checked_size(model, p: GenerateParams, max_steps: int) -> tuple[int, int]:
    """(height, width) of a well-formed request; raises RequestRejected naming the field."""
    for field in ("prompt", "negative_prompt"):
        text = getattr(p, field)
        if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS or "\x00" in text:
            raise RequestRejected(f"must be text of at most {MAX_PROMPT_CHARS} characters", field)
        why = model.check_prompt(text) if field == "prompt" or text else None
        if why:
            raise RequestRejected(why, field)
    if type(p.steps) is not int or not 1 <= p.steps <= max_steps:
        raise RequestRejected(f"must be an integer in [1, {max_steps}]", "steps")
    if p.sampler not in SAMPLERS:
        raise RequestRejected(f"unknown sampler {p.sampler!r}; one of {', '.join(SAMPLERS)}", "sampler")
    if not isinstance(p.guidance, (int, float)) or not math.isfinite(p.guidance) \
            or not 0.0 <= p.guidance <= MAX_GUIDANCE:
        raise RequestRejected(f"must be a finite number in [0, {MAX_GUIDANCE:g}]", "guidance")
    if type(p.seed) is not int or not 0 <= p.seed < 2**63:
        raise RequestRejected("must be an integer in [0, 2**63)", "seed")
    if p.output not in OUTPUT_KINDS:
        raise RequestRejected(f"must be one of {', '.join(OUTPUT_KINDS)}", "output")
    multiple, largest = model.size_multiple, 4 * model.native_size
    size = []
    for field in ("height", "width"):
        value = getattr(p, field)
        value = model.native_size if value is None else value
        if type(value) is not int or not multiple <= value <= largest or value % multiple:
            raise RequestRejected(f"must be a multiple of {multiple} in [{multiple}, {largest}]", field)
        size.append(value)
    return size[0], size[1]
