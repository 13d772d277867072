"""Command-line options generated from a frozen config dataclass, so the dataclass is the one definition.

Each field becomes `--field-name`; its type gives the parser (bool fields are flags, `X | None` fields default
to None, `tuple[str, ...]` fields take one or more values), `metadata={"help": ..., "choices": ...}` the help text
and allowed values, `"aliases"` other spellings of the same option (another server's name for it: one setting, one
field), `"group"` the --help section it is listed in. Validation stays in the dataclass's `__post_init__`, which the
CLI reaches through `from_namespace`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                  title: str | None = None) -> None:
    """`title`: the --help section of the fields without a `group` of their own (None: the parser's options)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str | None, object] = {}  # --help section -> the parser or its argument group

    def section(name: str | None):
        if name not in groups:
            groups[name] = parser.add_argument_group(name) if name else parser
        return groups[name]

    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        target = section(f.metadata.get("group", title))
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        if _is_str_tuple(hints[f.name]):
            target.add_argument(*flags, dest=f.name, nargs="+", default=default, help=help_text,
                                metavar=f.name.upper())
            continue
        kind = _base_type(hints[f.name])
        if kind is bool:
            target.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        shown = "" if default is None else f" (default: {default})"
        target.add_argument(*flags, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                            help=help_text + shown, metavar=None if f.metadata.get("choices") else f.name.upper())


def from_namespace(cls: type, namespace: argparse.Namespace, **overrides):
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}
    return cls(**(values | overrides))


def _number_or_str(number: type):
    """The parser of `int | str` (`--gpu-experts 16` or `auto`) and `float | str` (`--prefill-cpu-share 0.5` or
    `auto`) options: the number where the text is one, else the text."""
    def parse(text: str) -> int | float | str:
        try:
            return number(text)
        except ValueError:
            return text
    parse.__name__ = f"{number.__name__}_or_str"  # argparse names the type in its errors
    return parse


def _is_str_tuple(hint) -> bool:
    return typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...)


def _base_type(hint) -> type:
    """`int | None` -> int; `int | str` (`float | str`) -> int (float) where the text is a number; `Path` -> Path;
    plain types unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if set(args) in ({int, str}, {float, str}):
            return _number_or_str(next(a for a in args if a is not str))
        if len(args) != 1:
            raise TypeError(f"unsupported option type {hint}")
        hint = args[0]
    if hint not in (int, float, str, bool, Path):
        raise TypeError(f"unsupported option type {hint}")
    return hint
