"""Arguments that a tool-call format writes as text (MiniMax-M2, GLM, Qwen3-Coder), typed by the parameter's JSON
schema in the request's tools: a string parameter's value is the text as written, any other the JSON it spells."""

from __future__ import annotations

import json

MAX_SCHEMA_DEPTH = 8  # nested anyOf/oneOf read for a parameter's types: the client's schema bounds no recursion
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"), (type(None), "null"))


def _json_type(value) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def _schema_types(schema, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema allows (`type`, `enum`, `anyOf`/`oneOf`); empty: any, or unknown."""
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types = {declared}
    else:
        types = {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else set()
    if isinstance(schema.get("enum"), list):
        types |= {_json_type(value) for value in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types |= _schema_types(option, depth + 1)
    if "integer" in types:
        types.add("number")  # JSON does not tell 3 from 3.0
    return types


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# Qwen3-Coder's template writes a scalar argument with Jinja's `string` filter, so the conversations it learned
# from spell these Python's way
PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}


def is_string_parameter(schema) -> bool:
    """Whether the parameter's value is the text as written (`typed_value`), never JSON."""
    return _schema_types(schema) == {"string"}


def typed_value(text: str, schema, has_python_literals: bool = False):
    """An argument written as text: a string parameter's value as written (less one newline either side, which
    models put around long values), any other parsed as JSON when it is the JSON of a type the schema allows;
    text that is not keeps being text, so a wrong type reaches the client to complain about, never an error here.
    A parameter the schema does not know takes the JSON value when the text is JSON. `has_python_literals`:
    True/False/None are JSON's true/false/null too."""
    types = _schema_types(schema)
    text = text.removeprefix("\n").removesuffix("\n")
    if types == {"string"}:
        return text
    source = PYTHON_LITERALS.get(text.strip(), text) if has_python_literals else text
    try:
        value = json.loads(source, parse_constant=_reject_constant)
    except ValueError:
        return text
    if types and _json_type(value) not in types and not (_json_type(value) == "integer" and "number" in types):
        return text
    return value
