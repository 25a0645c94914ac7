"""Command-line flags declared on the fields of configuration classes, so that each
default is written once, on its field.

A dataclass field that is a flag carries `cli(...)` metadata: its flag names and help.
`add_config_arguments` turns those fields into argparse options whose defaults are the
fields' own, and `config_from_args` builds the class back from the parsed flags. A class
whose module does not deal in command lines (the core's `CoreConfig`; the protocol's
`GenerateParams`, a msgspec Struct) gets its flags from a `specs` table instead,
{field name: `flag(...)`}, kept beside the command line that offers them.

Every command line of the project declares its flags this way: `python -m engine`,
`python -m frontend` (and its `http` gateway), `python -m frontend.ray_app` and the
queue instrument. Standard library only (msgspec only when given a Struct), so that
any layer may use it.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

MISSING = dataclasses.MISSING


def flag(*flags: str, help: str, metavar: str | None = None, choices: typing.Sequence[str] | None = None,
         negate: bool = False, dest: str | None = None, parse: typing.Callable[[str], typing.Any] | None = None) -> dict:
    """A field's flag: `flags[0]` (the others are aliases), parsed into `dest` (default:
    the field's name). `negate`: a bool field that defaults to True, turned off by the flag.
    `parse`: the text → value function, for a field whose type is not a plain one."""
    return {"flags": flags, "help": help, "metavar": metavar, "choices": choices, "negate": negate, "dest": dest,
            "parse": parse}


def cli(*flags: str, **options) -> dict:
    """Field metadata making the field a flag (see `flag`)."""
    return {"cli": flag(*flags, **options)}


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: typing.Any
    default: typing.Any  # MISSING: the flag is required
    spec: dict


def _fields(cls: type, specs: dict[str, dict] | None) -> list[_Field]:
    """The fields of `cls` (a dataclass or a msgspec Struct) that are flags."""
    specs = specs or {}
    found = []
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            spec = specs.get(field.name) or field.metadata.get("cli")
            if spec is not None:
                default = field.default_factory() if field.default_factory is not MISSING else field.default
                found.append(_Field(field.name, hints[field.name], default, spec))
        return found
    import msgspec

    for field in msgspec.structs.fields(cls):
        if field.name in specs:
            default = field.default
            if field.default_factory is not msgspec.NODEFAULT:
                default = field.default_factory()
            found.append(_Field(field.name, field.type, MISSING if default is msgspec.NODEFAULT else default,
                                specs[field.name]))
    return found


def _dest(field: _Field) -> str:
    return field.spec.get("dest") or field.name


def _without_none(hint):
    """int for `int | None`, etc."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _is_list(hint) -> bool:
    return typing.get_origin(_without_none(hint)) in (list, tuple)


def _value_type(hint) -> type:
    """The type one flag value is parsed into: int for `int | None`, str for `list[str]`."""
    hint = _without_none(hint)
    if typing.get_origin(hint) in (list, tuple):
        hint = typing.get_args(hint)[0]
    return hint


def add_config_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                         specs: dict[str, dict] | None = None, defaults: dict | None = None,
                         only: typing.Collection[str] | None = None) -> None:
    """One option per field of `cls` that is a flag (`cli` metadata, or an entry in
    `specs`), with dest = the field's name and the field's default (or `defaults[name]`,
    for a caller that wants another). A bool field is a switch; a list field is a
    repeatable flag; a field without a default is a required flag. Its help ends with
    the default, where there is one to show (not None, nor "")."""
    for field in _fields(cls, specs):
        if only is not None and field.name not in only:
            continue
        spec = field.spec
        default = (defaults or {}).get(field.name, field.default)
        kind = _without_none(field.hint)
        help_text = spec["help"]
        if kind is bool:
            action = "store_false" if spec.get("negate") else "store_true"
            parser.add_argument(*spec["flags"], dest=_dest(field), action=action, default=default, help=help_text)
            continue
        options: dict[str, typing.Any] = {"metavar": spec.get("metavar"), "choices": spec.get("choices")}
        if default is MISSING:
            options.update(required=True, default=None)
        elif _is_list(field.hint):
            options.update(action="append", default=list(default))
        else:
            options.update(default=default)
            if default not in (None, "") and help_text != argparse.SUPPRESS:
                help_text += " (default %(default)s)"
        parser.add_argument(*spec["flags"], dest=_dest(field), type=spec.get("parse") or _value_type(field.hint),
                            help=help_text, **options)


def config_from_args(cls: type, args: argparse.Namespace, *, specs: dict[str, dict] | None = None, **fields):
    """`cls` from the parsed flags of its fields (those `add_config_arguments` made), and
    `fields` for the rest."""
    values = {}
    for field in _fields(cls, specs):
        if field.name in fields or not hasattr(args, _dest(field)):
            continue
        value = getattr(args, _dest(field))
        if typing.get_origin(_without_none(field.hint)) is tuple and value is not None:
            value = tuple(value)
        values[field.name] = value
    return cls(**values, **fields)


def config_from_mapping(cls: type, mapping: typing.Mapping[str, typing.Any], **fields):
    """`cls` from `mapping`'s values of its flag fields, by field name, each parsed as its
    flag's value would be (`serve run module:builder key=value` passes strings); other
    keys are ignored, and `fields` give the rest. Switches and repeatable flags have no
    one-string form: give them in `fields`."""
    values = {}
    for field in _fields(cls, None):
        if field.name in fields or field.name not in mapping:
            continue
        if _without_none(field.hint) is bool or _is_list(field.hint):
            raise TypeError(f"{field.name}: a switch or a repeatable flag, not one value")
        raw = mapping[field.name]
        values[field.name] = None if raw is None else _value_type(field.hint)(raw)
    return cls(**values, **fields)
