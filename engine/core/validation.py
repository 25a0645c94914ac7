"""Checking a request's parameters against the served model: every bad field gets
`RequestRejected` naming it. Shared by `EngineCore` and the benchmark's baseline cores, so
every core behind the engine process rejects the same input the same way."""
from __future__ import annotations

import math

from engine.core.outputs import RequestRejected
from engine.protocol import MAX_PRIORITY, MAX_PROMPT_CHARS, MICRO_CONDITIONING, OUTPUT_KINDS, SAMPLERS, GenerateParams

MAX_GUIDANCE = 100.0


def checked_size(model, geometry, p: GenerateParams, max_steps: int,
                 image_size: tuple[int | None, int | None] = (None, None)) -> tuple[int, int]:
    """(height, width) of a well-formed request; raises RequestRejected naming the field.
    `geometry`: the model's `engine.models.geometry.Geometry`. `image_size`: an image
    request's (height, width) where not given (the image's own, as its pipeline rounds
    them); a side that comes from the image and does not fit names `image`."""
    for field in ("prompt", "negative_prompt"):
        text = getattr(p, field)
        if field == "negative_prompt" and text is None:
            continue  # not given
        if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
            raise RequestRejected(f"must be text of at most {MAX_PROMPT_CHARS} characters", field)
        if "\x00" in text:  # text encoders' tokenizers treat NUL unpredictably; no prompt needs one
            raise RequestRejected(f"contains a NUL character (\\x00) at position {text.index(chr(0))}: "
                                  "remove it", field)
        why = model.check_prompt(text) if field == "prompt" or text else None
        if why:
            raise RequestRejected(why, field)
    if type(p.steps) is not int or not 1 <= p.steps <= max_steps:
        raise RequestRejected(f"must be an integer in [1, {max_steps}]", "steps")
    if p.sampler not in SAMPLERS:
        raise RequestRejected(f"unknown sampler {p.sampler!r}; one of {', '.join(SAMPLERS)}", "sampler")
    for field in ("guidance", "true_cfg"):
        value = getattr(p, field)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= MAX_GUIDANCE:
            raise RequestRejected(f"must be a finite number in [0, {MAX_GUIDANCE:g}]", field)
    for field in MICRO_CONDITIONING:
        value = getattr(p, field)
        lowest = 0 if field == "crops_coords_top_left" else 1  # a size is at least one pixel
        if value is not None and not (isinstance(value, (tuple, list)) and len(value) == 2
                                      and all(type(v) is int and lowest <= v <= 65536 for v in value)):
            raise RequestRejected(f"must be two integers in [{lowest}, 65536], (height, width) or (top, left) in "
                                  "pixels", field)
    if type(p.seed) is not int or not 0 <= p.seed < 2**63:
        raise RequestRejected("must be an integer in [0, 2**63)", "seed")
    if type(p.priority) is not int or not -MAX_PRIORITY <= p.priority <= MAX_PRIORITY:
        raise RequestRejected(f"must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}] (higher first)", "priority")
    if p.deadline_s is not None and (isinstance(p.deadline_s, bool) or not isinstance(p.deadline_s, (int, float))
                                     or not math.isfinite(p.deadline_s) or p.deadline_s <= 0):
        raise RequestRejected("must be a positive number of seconds after arrival", "deadline_s")
    if p.output not in OUTPUT_KINDS:
        raise RequestRejected(f"must be one of {', '.join(OUTPUT_KINDS)}", "output")
    multiple, largest = geometry.size_multiple, geometry.max_size
    size = []
    for field, from_image in zip(("height", "width"), image_size):
        value = getattr(p, field)
        if value is None and from_image is not None:
            if not multiple <= from_image <= largest or from_image % multiple:
                raise RequestRejected(f"its {field} of {from_image} pixels is not a multiple of {multiple} in "
                                      f"[{multiple}, {largest}]: give height and width to resize it", "image")
            value = from_image
        value = geometry.native_size if value is None else value
        if type(value) is not int or not multiple <= value <= largest or value % multiple:
            raise RequestRejected(f"must be a multiple of {multiple} in [{multiple}, {largest}]", field)
        size.append(value)
    return size[0], size[1]
