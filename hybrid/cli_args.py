"""Command-line options generated from a frozen config dataclass, so the dataclass is the one definition.

Each field becomes `--field-name`; its type gives the parser (bool fields are flags, `X | None` fields default
to None), `metadata={"help": ..., "choices": ...}` the help text and allowed values. Validation stays in the
dataclass's `__post_init__`, which the CLI reaches through `from_namespace`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, type=kind, default=default, choices=f.metadata.get("choices"),
                            help=help_text + shown, metavar=None if f.metadata.get("choices") else f.name.upper())


def from_namespace(cls: type, namespace: argparse.Namespace, **overrides):
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}
    return cls(**(values | overrides))


def _int_or_str(text: str) -> int | str:
    """`int | str` options (`--gpu-experts 16` or `--gpu-experts auto`)."""
    try:
        return int(text)
    except ValueError:
        return text


def _base_type(hint) -> type:
    """`int | None` -> int; `int | str` -> int where the text is a number; `Path` -> Path; plain types unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if set(args) == {int, str}:
            return _int_or_str
        if len(args) != 1:
            raise TypeError(f"unsupported option type {hint}")
        hint = args[0]
    if hint not in (int, float, str, bool, Path):
        raise TypeError(f"unsupported option type {hint}")
    return hint
