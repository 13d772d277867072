"""The grammar of a forced tool call (`tool_choice` "required" or a named function), for every tool-call format the
server parses: the output after the call's opening (the parser's `forced_prefix`, which the prompt ends with) is
one call of one of the request's tools (of the named one) whose arguments the format's parser reads back as an
object valid against the tool's JSON schema, then the call's and the section's closing tags, then a stop token.

The grammar is an xgrammar structural tag (`{"type": "structural_tag", "format": ...}`) built of constant strings
(the format's tags, written as its chat template writes them), JSON values (xgrammar's grammar of the schema,
compact, without optional whitespace that a model could pad its output with), and, in the formats that write each
argument as text (MiniMax-M2, GLM-4.7, Qwen3-Coder, DeepSeek-V3.2's DSML), raw text for the parameters the parser
reads as text:

- a parameter whose schema allows only strings (`server.typed_arguments.is_string_parameter`, the parsers' own
  test; DSML writes these with `string="true"`) is its text: one of its `enum`/`const` values, its `pattern`'s
  language, or free text: any text without the parameter's end tag, or with a `maxLength` any characters but `<`
  (with which every end tag starts), the first `minLength` of them neither whitespace nor `<`, so the newline that
  GLM's and MiniMax's parsers trim from either end never shortens it below `minLength`; `format` is an
  annotation, as jsonschema's default reading has it;
- any other parameter is the JSON of its schema (the parsers take JSON text of a type the schema allows).

The arguments are written in the schema's `properties` order, each at most once, the required ones always: an
object schema with anything else at its top (`anyOf`, `minProperties`, ...) cannot be written so in those formats,
and is a 400 naming the tool. Strings inside JSON values are not kept from containing the format's end tag
(xgrammar drops their length bounds where it excludes a substring): a model that writes `</tool_call>` inside a
JSON string value of a call ends the call there.
"""

from __future__ import annotations

import json
import re

from hybrid.guided import SURROGATES, json_schema_grammar
from hybrid.sampling import GuidedSpec
from server import harmony
from server.deepseek_v32 import CALLS_END, INVOKE_END, PARAMETER_END, PARAMETER_START
from server.errors import APIError
from server.tool_parsers import (
    DS_CALL_END,
    DS_CALLS_END,
    KIMI_ARGUMENTS,
    KIMI_CALL_END,
    KIMI_SECTION_END,
    MINIMAX_END,
)
from server.typed_arguments import is_string_parameter

# what a forced call's arguments object may have at its top in the formats that write each argument as text
OBJECT_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                             "title", "description", "$schema", "$id", "default", "examples", "strict"})
TEXT_KEYWORDS = frozenset({"type", "enum", "const", "pattern", "minLength", "maxLength", "format", "title",
                           "description", "default", "examples"})
KIMI_CALL_INDEX = "(0|[1-9][0-9]{0,3})"  # Kimi's call id ends with the call's index in the conversation
UNSAFE_NAME = re.compile(r"[\s\"'<>]")  # what no format's parser reads in a function or parameter name


def tool_call_spec(parser_name: str, tools: list[dict], function_name: str | None) -> GuidedSpec:
    """The grammar of a forced call's output after `forced_prefix(function_name)` (None: a call of any of `tools`,
    OpenAI tool dicts); a 400 naming `tools` where the format cannot write a tool's call."""
    functions = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}
                 for tool in tools}
    if function_name is not None:
        functions = {function_name: functions[function_name]}
    build = FORMATS.get(parser_name)
    if build is None:
        raise APIError(400, f"tool_choice: forced calls are not built for the {parser_name} tool-call format",
                       param="tool_choice")
    calls = []
    for name, schema in functions.items():
        try:
            if parser_name != "hermes":  # Hermes writes the name as JSON
                _checked_name(name)
            calls.append(build(name, schema, function_name is not None))
        except ValueError as exc:
            raise APIError(400, f"tools: function {name!r} cannot be called in the {parser_name} tool-call format "
                                f"(tool_choice forces a call): {exc}", param="tools") from None
    return GuidedSpec("structural_tag", json.dumps({"type": "structural_tag", "format": _or(calls)},
                                                   ensure_ascii=False))


# ---- the formats: one call of `name` (`is_named`: its name is in the prefix already), as the format writes it ----

def _hermes(name: str, schema, is_named: bool) -> dict:
    head = "" if is_named else '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    return _seq(head, json_value(schema), "}\n</tool_call>")


def _deepseek_v3(name: str, schema, is_named: bool) -> dict:
    head = "" if is_named else name + "\n```json\n"
    return _seq(head, json_value(schema), "\n```" + DS_CALL_END + DS_CALLS_END)


def _kimi_k2(name: str, schema, is_named: bool) -> dict:
    head = "" if is_named else name + ":"
    return _seq(head, {"type": "regex", "pattern": KIMI_CALL_INDEX}, KIMI_ARGUMENTS, json_value(schema),
                KIMI_CALL_END + KIMI_SECTION_END)


def _harmony(name: str, schema, is_named: bool) -> dict:
    # the message ends with <|call|>, a stop token: the grammar ends with the arguments
    head = "" if is_named else name + " " + harmony.CONSTRAIN + "json" + harmony.MESSAGE
    return _seq(head, json_value(schema))


def _minimax_m2(name: str, schema, is_named: bool) -> dict:
    def parameter(key: str, value_schema) -> dict:
        value = text_or_json(value_schema, ("</parameter>", "</invoke>"), is_trimmed=True)
        return _seq(f'<parameter name="{key}">', value, "</parameter>\n")
    head = "" if is_named else name + '">\n'
    return _seq(head, arguments(schema, parameter), "</invoke>\n" + MINIMAX_END)


def _glm47(name: str, schema, is_named: bool) -> dict:
    def parameter(key: str, value_schema) -> dict:
        return _seq(f"<arg_key>{key}</arg_key><arg_value>",
                    text_or_json(value_schema, ("</arg_value>", "</tool_call>"), is_trimmed=True), "</arg_value>")
    head = "" if is_named else name
    return _seq(head, arguments(schema, parameter), "</tool_call>")


def _qwen3_coder(name: str, schema, is_named: bool) -> dict:
    def parameter(key: str, value_schema) -> dict:
        # the parser takes one newline either side of a value as the template's
        return _seq(f"<parameter={key}>\n", text_or_json(value_schema, ("</parameter>",), is_trimmed=False),
                    "\n</parameter>\n")
    head = "" if is_named else name + ">\n"
    return _seq(head, arguments(schema, parameter), "</function>\n</tool_call>")


def _deepseek_v32(name: str, schema, is_named: bool) -> dict:
    def parameter(key: str, value_schema) -> dict:
        is_text = is_string_parameter(value_schema)
        return _seq(f'{PARAMETER_START} name="{key}" string="{"true" if is_text else "false"}">',
                    text_or_json(value_schema, (PARAMETER_END,), is_trimmed=False), PARAMETER_END + "\n")
    head = "" if is_named else name + '">\n'
    return _seq(head, arguments(schema, parameter), INVOKE_END + "\n" + CALLS_END)


FORMATS = {"hermes": _hermes, "deepseek_v3": _deepseek_v3, "kimi_k2": _kimi_k2, harmony.TOOL_PARSER_NAME: _harmony,
           "minimax_m2": _minimax_m2, "glm47": _glm47, "qwen3_coder": _qwen3_coder, "deepseek_v32": _deepseek_v32}


# ---- pieces ----

def json_value(schema) -> dict:
    """Compact JSON valid against `schema`."""
    return {"type": "grammar", "grammar": json_schema_grammar(json.dumps(schema))}


def arguments(schema, parameter) -> dict:
    """The arguments of a format that writes each as text: `parameter(key, schema)` per property, in order, the
    optional ones optional. Each parameter's schema carries the root's definitions, which its `$ref`s name."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or set(schema) - OBJECT_KEYWORDS:
        raise ValueError("its parameters must be an object schema of properties (without "
                         f"{', '.join(sorted(set(schema) - OBJECT_KEYWORDS)) or 'another type'} at the top) to be "
                         "written one argument at a time" if isinstance(schema, dict) else
                         "its parameters must be an object schema")
    properties = dict(schema.get("properties") or {})
    required = [key for key in schema.get("required") or () if isinstance(key, str)]
    properties.update({key: {} for key in required if key not in properties})
    definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    parts = []
    for key, value_schema in properties.items():
        _checked_name(key)
        if definitions and isinstance(value_schema, dict):
            value_schema = {**definitions, **value_schema}
        part = parameter(key, value_schema)
        parts.append(part if key in required else {"type": "optional", "content": part})
    return _seq(*parts)


def text_or_json(schema, end_tags: tuple[str, ...], is_trimmed: bool) -> dict:
    """A parameter's value: its text where the parsers read it as text (`is_string_parameter`), else its JSON.
    `end_tags`: what the text must not hold (the value's end tag first). `is_trimmed`: the parser drops one
    newline from either end of the text."""
    return text_value(schema, end_tags, is_trimmed) if is_string_parameter(schema) else json_value(schema)


def text_value(schema: dict, end_tags: tuple[str, ...], is_trimmed: bool) -> dict:
    """Text that is a string valid against `schema` (which allows only strings), without `end_tags`."""
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches and set(schema) <= TEXT_KEYWORDS | {"anyOf", "oneOf"}:
        return _or([text_value(branch, end_tags, is_trimmed) for branch in branches])
    if set(schema) - TEXT_KEYWORDS:
        raise ValueError(f"a string parameter's {', '.join(sorted(set(schema) - TEXT_KEYWORDS))} cannot be written "
                         "as its text")
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        texts = [_trim_proof(value, is_trimmed) for value in values
                 if isinstance(value, str) and not any(tag in value for tag in end_tags)]
        if not texts:
            raise ValueError(f"no value of a string parameter's enum can be written before {end_tags[0]}")
        return _or([_seq(text) for text in texts])
    if "pattern" in schema:
        return {"type": "regex", "pattern": schema["pattern"]}
    min_length, max_length = schema.get("minLength", 0), schema.get("maxLength")
    # the first minLength characters neither whitespace nor '<': trimming never shortens the text below it
    head = f"[^\\s<{SURROGATES}]{{{min_length}}}" if min_length else ""
    if max_length is not None:  # any character but '<', with which every end tag starts
        return {"type": "regex", "pattern": head + f"[^<{SURROGATES}]{{0,{max(max_length - min_length, 0)}}}"}
    rest = {"type": "grammar", "grammar": text_without(end_tags)}
    return _seq({"type": "regex", "pattern": head}, rest) if head else rest


def text_without(tags: tuple[str, ...]) -> str:
    """The EBNF grammar of any text in which none of `tags` occurs: a state per start of a tag that the text may
    end with (Aho-Corasick), and no transition by a character that would complete a tag."""
    starts = sorted({tag[:k] for tag in tags for k in range(len(tag))}, key=lambda p: (len(p), p))
    state = {start: i for i, start in enumerate(starts)}
    alphabet = sorted(set("".join(tags)))
    rules = []
    for start in starts:
        targets = {}
        for c in alphabet:
            text = start + c
            if not any(text.endswith(tag) for tag in tags):  # to the longest start it now ends with
                targets[c] = state[next(s for s in reversed(starts) if text.endswith(s))]
        special = [c for c in alphabet if targets.get(c) != 0]  # the others go back to the empty start
        options = ['""', f"[^{''.join(_class_char(c) for c in special)}{SURROGATES}] s0"] + [
            f"{json.dumps(c, ensure_ascii=False)} s{targets[c]}" for c in special if c in targets]
        rules.append(f"s{state[start]} ::= " + " | ".join(options))
    return "root ::= s0\n" + "\n".join(rules)


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]-^" else c


def _trim_proof(text: str, is_trimmed: bool) -> str:
    """`text` as written where the parser trims one newline from either end."""
    if not is_trimmed:
        return text
    return ("\n" if text.startswith("\n") else "") + text + ("\n" if text.endswith("\n") else "")


def _checked_name(name: str) -> str:
    if not name or UNSAFE_NAME.search(name):
        raise ValueError(f"the name {name!r} has characters the format's parser does not read in a name")
    return name


def _seq(*parts) -> dict:
    """A sequence of structural-tag formats (strings: constant text), adjacent texts joined."""
    elements: list[dict] = []
    for part in parts:
        if isinstance(part, str):
            if not part:
                continue
            if elements and elements[-1]["type"] == "const_string":
                elements[-1] = {"type": "const_string", "value": elements[-1]["value"] + part}
                continue
            part = {"type": "const_string", "value": part}
        elements.append(part)
    if not elements:
        return {"type": "const_string", "value": ""}
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _or(options: list[dict]) -> dict:
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}
