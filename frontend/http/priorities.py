"""Priority classes: which engine priority a caller's request runs at.

A request may name a class (`extra_body={"priority": "interactive"}`) or an integer in
[-MAX_PRIORITY, MAX_PRIORITY]; without one it gets its caller's default class. Each
caller also has a ceiling: a request asking for more runs at the ceiling (the response's
`x-diffslot-priority` header says what it ran at), so a key cannot buy its way past the
operator's choice. Batch jobs run at the `batch` class (or the ceiling, if lower).

The operator assigns classes per API key with `--key-class KEY=CLASS[:CEILING]`
(repeatable; DIFFSLOT_KEY_CLASSES takes the same, comma-separated, out of the process
list). `*=CLASS[:CEILING]` sets them for every caller not named, which otherwise gets
class and ceiling `default`: nobody outranks the default unless allowed to.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping

from engine.protocol import MAX_PRIORITY, PRIORITY_CLASSES
from frontend.http.errors import bad_request

KEY_CLASSES_ENV = "DIFFSLOT_KEY_CLASSES"
EVERY_OTHER_CALLER = "*"
PRIORITY_HEADER = "x-diffslot-priority"


def priority_value(value: int | str, param: str = "priority") -> int:
    """A class name or an integer (also an integer written as text, as forms send it) →
    the engine's priority; anything else is a 400 naming `param`."""
    if isinstance(value, str):
        text = value.strip()
        if text in PRIORITY_CLASSES:
            return PRIORITY_CLASSES[text]
        try:
            value = int(text)
        except ValueError:
            raise bad_request(f"Invalid value for '{param}': {value!r}; expected one of "
                              f"{', '.join(repr(c) for c in PRIORITY_CLASSES)} or an integer in "
                              f"[{-MAX_PRIORITY}, {MAX_PRIORITY}] (higher first).", param) from None
    if type(value) is not int or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise bad_request(f"Invalid value for '{param}': {value!r}; expected an integer in "
                          f"[{-MAX_PRIORITY}, {MAX_PRIORITY}] (higher first) or one of "
                          f"{', '.join(repr(c) for c in PRIORITY_CLASSES)}.", param)
    return value


@dataclasses.dataclass(frozen=True)
class CallerClass:
    default: int = PRIORITY_CLASSES["default"]
    ceiling: int = PRIORITY_CLASSES["default"]

    def priority(self, requested: int | None) -> int:
        """What a request asking for `requested` (None: nothing) runs at."""
        return min(self.default if requested is None else requested, self.ceiling)

    def batch_priority(self, requested: int | None) -> int:
        """What a batch line runs at: its own priority or the batch class, never above
        the batch class nor the ceiling."""
        batch = PRIORITY_CLASSES["batch"]
        return min(batch if requested is None else requested, batch, self.ceiling)


def parse_key_class(spec: str) -> tuple[str, CallerClass]:
    """`KEY=CLASS[:CEILING]` → (KEY, its class); ValueError saying what is wrong."""
    key, sep, classes = spec.rpartition("=")
    if not sep or not key:
        raise ValueError(f"--key-class {spec!r}: expected KEY=CLASS[:CEILING]")
    default_name, _, ceiling_name = classes.partition(":")
    try:
        default = priority_value(default_name)
        ceiling = priority_value(ceiling_name) if ceiling_name else max(default, PRIORITY_CLASSES["default"])
    except Exception:
        raise ValueError(f"--key-class {spec!r}: CLASS and CEILING are one of {', '.join(PRIORITY_CLASSES)} "
                         f"or integers in [{-MAX_PRIORITY}, {MAX_PRIORITY}]") from None
    if ceiling < default:
        raise ValueError(f"--key-class {spec!r}: the ceiling is below the default class")
    return key, CallerClass(default, ceiling)


def key_class_specs(flags: Iterable[str] | None = None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The `--key-class` flags, then DIFFSLOT_KEY_CLASSES' entries."""
    return [*(flags or ()), *(s.strip() for s in environ.get(KEY_CLASSES_ENV, "").split(",") if s.strip())]


class PriorityPolicy:
    """Each caller's class. Callers are CallerGate's ids: API keys are named by their
    position among the gateway's keys, so the specs are resolved against that list."""

    def __init__(self, specs: Iterable[str] = (), api_keys: Iterable[str] = ()):
        positions = {key: f"key#{i}" for i, key in enumerate(api_keys)}
        self.others = CallerClass()
        self.by_caller: dict[str, CallerClass] = {}
        for spec in specs:
            key, caller_class = parse_key_class(spec)
            if key == EVERY_OTHER_CALLER:
                self.others = caller_class
            elif key in positions:
                self.by_caller[positions[key]] = caller_class
            else:  # a class for a key that cannot authenticate is a typo: say so at start
                raise ValueError(f"--key-class: the key {key[:4]}… is not one of the gateway's API keys")

    def of(self, caller: str) -> CallerClass:
        return self.by_caller.get(caller, self.others)
