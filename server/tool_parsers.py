"""Tool calls in model output: the text a model writes for a call becomes OpenAI `tool_calls`.

One parser class per format, chosen from the chat template and vocabulary (`choose_tool_parser`):

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one tag per call;
- DeepSeek-V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- Kimi-K2 / K2.5: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>` (`functions.NAME:IDX` is the call's id, as Kimi's template
  writes it back);
- MiniMax-M2: `<minimax:tool_call><invoke name="NAME"><parameter name="P">VALUE</parameter>...</invoke>...
  </minimax:tool_call>`;
- GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME<arg_key>P</arg_key><arg_value>VALUE</arg_value>...</tool_call>` (4.5 and 4.6
  put newlines between the parts).

The last two write each argument as text: a string parameter's value as it is, any other as JSON; the request's
tools tell which is which (`typed_value`).

A parser is fed the output text piece by piece (`feed`, then `finish` once) and returns content and whole tool
calls: the text before the first call tag is content, streamed as it comes except for a tail that could still
become the tag; from the tag on, each call is handed out once it is complete. What is not a call (a malformed
call, text between or after the calls other than whitespace, a call still unfinished at the end) is returned as
content, so nothing the model wrote is lost. The work per piece is linear in the piece, however long the call it
belongs to grows: a call is parsed once, when its end tag arrives. `forced_prefix` is the text that starts a call
(any, or a named one) for `tool_choice` "required" or a named function: appended to the prompt, and fed to the
parser first.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from server.reasoning import partial_tag_length


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ToolDelta:
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    name = ""
    marker = ""  # text of the template or vocabulary that tells the format apart (`choose_tool_parser`); "": start_tag
    start_tag = ""  # opens the tool-call section
    end_tag = ""  # closes it, where the format has one
    section_tags: tuple[str, ...] = ()  # tags around the calls that are not part of one
    call_end_tag = ""  # ends one call
    call_pattern: re.Pattern  # one whole call
    tags: tuple[str, ...] = ()  # every tag the parser reads: decoding must keep them (`tags_are_special`)

    def __init__(self, forced_prefix: str = "", tools: list[dict] | None = None):
        """`tools`: the request's tools (OpenAI `{"type": "function", "function": {...}}` dicts), whose parameter
        schemas type the arguments of the formats that write them as text."""
        self._parameters = _parameter_schemas(tools)
        # Before the section only a tail that could become the start tag is kept; in it, the text after the last
        # whole call is kept as pieces, each searched once for the call end tag (with the tag's length - 1
        # characters before it), and joined and parsed once a call is whole.
        self._held = ""  # before the section: the end of the text that could still be the start tag
        self._is_in_section = False
        self._pending: list[str] = []  # in the section: the text after the last whole call
        self._pending_tail = ""  # its last len(call_end_tag) - 1 characters, where a tag split across pieces starts
        self.num_calls = 0
        if forced_prefix:
            self.feed(forced_prefix)

    def feed(self, text: str) -> ToolDelta:
        content = ""
        if not self._is_in_section:
            text = self._held + text
            index = text.find(self.start_tag)
            if index < 0:
                end = len(text) - partial_tag_length(text, self.start_tag)
                self._held = text[end:]
                return ToolDelta(content=text[:end])
            content, text, self._held, self._is_in_section = text[:index], text[index:], "", True
        window = self._pending_tail + text
        self._pending.append(text)
        end = window.rfind(self.call_end_tag)
        if end < 0:
            self._pending_tail = window[max(len(window) - len(self.call_end_tag) + 1, 0):]
            return ToolDelta(content=content)
        pending = "".join(self._pending)
        split = len(pending) - len(window) + end + len(self.call_end_tag)  # after the last call end tag
        rest = pending[split:]
        self._pending, self._pending_tail = [rest], rest[max(len(rest) - len(self.call_end_tag) + 1, 0):]
        more, calls = self._parse_calls(pending[:split])
        self.num_calls += len(calls)
        return ToolDelta(content=content + more, tool_calls=calls)

    def _parse_calls(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The calls in `text` (which ends with a call end tag) and what of it is not a call but text: a malformed
        call, or anything but whitespace (and the section's end tag) outside the calls."""
        content, calls, position = "", [], 0
        for match in self.call_pattern.finditer(text):
            content += self._stray(text[position:match.start()])
            position = match.end()
            call = self.parse_call(match)
            if call is None:
                content += match.group(0)  # a malformed call stays text
            else:
                calls.append(call)
        return content + self._stray(text[position:]), tuple(calls)

    def _stray(self, text: str) -> str:
        for tag in self.section_tags:
            text = text.replace(tag, "")
        return text if text.strip() else ""

    def finish(self) -> ToolDelta:
        if not self._is_in_section:
            rest, self._held = self._held, ""
            return ToolDelta(content=rest)
        rest, self._pending, self._pending_tail = "".join(self._pending), [], ""
        if self.end_tag:
            rest = rest.replace(self.end_tag, "")
        return ToolDelta(content=rest if rest.strip() else "")

    def parse_call(self, match: re.Match) -> ToolCall | None:
        raise NotImplementedError

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        """Text that opens a call of `function_name` (None: of any function)."""
        raise NotImplementedError


def _parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schemas (`properties`), from the request's tools."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(function.get("name"), str):
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def _arguments_json(arguments) -> str | None:
    """The arguments as JSON text of an object, or None when they are not one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


class HermesToolParser(ToolCallParser):
    name = "hermes"
    start_tag = "<tool_call>"
    call_end_tag = "</tool_call>"
    tags = ("<tool_call>", "</tool_call>")
    call_pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse_call(self, match: re.Match) -> ToolCall | None:
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        arguments = _arguments_json(body.get("arguments", body.get("parameters", {})))
        return None if arguments is None else ToolCall(new_call_id(), body["name"], arguments)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        if function_name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '


DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(ToolCallParser):
    name = "deepseek_v3"
    start_tag = DS_CALLS_BEGIN
    end_tag = DS_CALLS_END
    section_tags = (DS_CALLS_BEGIN, DS_CALLS_END)
    call_end_tag = DS_CALL_END
    tags = (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)
    call_pattern = re.compile(re.escape(DS_CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(DS_SEP) + r"(?P<name>[^\n]*)\n"
                              r"```(?:json)?\n(?P<arguments>.*?)\n?```\s*" + re.escape(DS_CALL_END), re.DOTALL)

    def parse_call(self, match: re.Match) -> ToolCall | None:
        arguments = _arguments_json(match.group("arguments"))
        name = match.group("name").strip()
        return None if arguments is None or not name else ToolCall(new_call_id(), name, arguments)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        prefix = DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP
        return prefix if function_name is None else prefix + function_name + "\n```json\n"


KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
# Kimi's call id: `functions.NAME:IDX`, IDX counting the calls of the conversation
KIMI_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s<>]+):\d+")


class KimiK2ToolParser(ToolCallParser):
    name = "kimi_k2"
    start_tag = KIMI_SECTION_BEGIN
    end_tag = KIMI_SECTION_END
    section_tags = (KIMI_SECTION_BEGIN, KIMI_SECTION_END)
    call_end_tag = KIMI_CALL_END
    tags = (KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGUMENTS, KIMI_CALL_END)
    call_pattern = re.compile(re.escape(KIMI_CALL_BEGIN) + r"(?P<body>.*?)" + re.escape(KIMI_CALL_END), re.DOTALL)

    def parse_call(self, match: re.Match) -> ToolCall | None:
        call_id, has_arguments, arguments = match.group("body").partition(KIMI_ARGUMENTS)
        call_id = call_id.strip()
        id_match = KIMI_CALL_ID.fullmatch(call_id)
        arguments = _arguments_json(arguments) if has_arguments else None
        if id_match is None or arguments is None:
            return None
        return ToolCall(call_id, id_match.group("name"), arguments)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        # The call's index counts the conversation's calls: the model writes it.
        prefix = KIMI_SECTION_BEGIN + KIMI_CALL_BEGIN + "functions."
        return prefix if function_name is None else prefix + function_name + ":"


MINIMAX_BEGIN = "<minimax:tool_call>"
MINIMAX_END = "</minimax:tool_call>"


class _TypedArgumentsParser(ToolCallParser):
    """Formats that write each argument as text (MiniMax-M2's <parameter>, GLM's <arg_key>/<arg_value>): the call's
    body is the function name (`name_pattern`, matched at its start), then its arguments (`argument_pattern`),
    typed by the tool's JSON schema."""

    name_pattern: re.Pattern
    argument_pattern: re.Pattern

    def parse_call(self, match: re.Match) -> ToolCall | None:
        body = match.group("body")
        head = self.name_pattern.match(body)
        if head is None:
            return None
        return _typed_call(head.group("name"), body, head.end(), self.argument_pattern,
                           self._parameters.get(head.group("name"), {}))


class MiniMaxM2ToolParser(_TypedArgumentsParser):
    name = "minimax_m2"
    start_tag = MINIMAX_BEGIN
    end_tag = MINIMAX_END
    section_tags = (MINIMAX_BEGIN, MINIMAX_END)
    call_end_tag = "</invoke>"
    tags = (MINIMAX_BEGIN, MINIMAX_END)
    call_pattern = re.compile(r"<invoke(?P<body>.*?)</invoke>", re.DOTALL)
    name_pattern = re.compile(r"\s+name=(?P<quote>[\"']?)(?P<name>[^\"'<>\s]+)(?P=quote)>")
    argument_pattern = re.compile(r"\s*<parameter\s+name=(?P<quote>[\"']?)(?P<key>[^\"'<>]+)(?P=quote)>"
                                  r"(?P<value>.*?)</parameter>", re.DOTALL)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        prefix = MINIMAX_BEGIN + "\n<invoke name=\""
        return prefix if function_name is None else prefix + function_name + "\">\n"


class Glm47ToolParser(_TypedArgumentsParser):
    name = "glm47"
    marker = "<arg_key>"  # Hermes templates have <tool_call> too
    start_tag = "<tool_call>"
    call_end_tag = "</tool_call>"
    tags = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    call_pattern = re.compile(r"<tool_call>(?P<body>.*?)</tool_call>", re.DOTALL)
    name_pattern = re.compile(r"\s*(?P<name>[^\s<>]+)")
    argument_pattern = re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>",
                                  re.DOTALL)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        return "<tool_call>" if function_name is None else "<tool_call>" + function_name


def _typed_call(name: str, body: str, start: int, argument_pattern: re.Pattern, schemas: dict) -> ToolCall | None:
    """The call whose arguments (`argument_pattern` matches, one after the other, from `start` of `body`, then only
    whitespace) are text, typed by the parameters' schemas; None when the body is anything else."""
    arguments, position = {}, start
    while (argument := argument_pattern.match(body, position)) is not None:
        key = argument.group("key").strip()
        arguments[key] = typed_value(argument.group("value"), schemas.get(key))
        position = argument.end()
    if body[position:].strip():
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


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


def typed_value(text: str, schema):
    """An argument written as text: a string parameter's value as written (less one newline either side, which
    models put around long values), any other parsed as JSON when it is the JSON of a type the schema allows;
    text that is not keeps being text, so a wrong type reaches the client to complain about, never an error here.
    A parameter the schema does not know takes the JSON value when the text is JSON."""
    types = _schema_types(schema)
    text = text.removeprefix("\n").removesuffix("\n")
    if types == {"string"}:
        return text
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return text
    if types and _json_type(value) not in types and not (_json_type(value) == "integer" and "number" in types):
        return text
    return value


TOOL_PARSERS = {parser.name: parser for parser in (HermesToolParser, DeepSeekV3ToolParser, KimiK2ToolParser,
                                                   MiniMaxM2ToolParser, Glm47ToolParser)}
# openai: gpt-oss's harmony format, which `server.harmony` renders and parses whole (reasoning too)
TOOL_PARSER_CHOICES = ("auto", "none", *TOOL_PARSERS, "openai")
# `auto` tries these in order: GLM's template and vocabulary have Hermes' <tool_call> too
AUTO_ORDER = (DeepSeekV3ToolParser, KimiK2ToolParser, MiniMaxM2ToolParser, Glm47ToolParser, HermesToolParser)


def choose_tool_parser(choice: str, chat_template: str, vocab: dict[str, int]) -> type[ToolCallParser] | None:
    """The parser class for `--tool-call-parser` (`auto`: the format the chat template or vocabulary knows)."""
    if choice in ("none", "openai"):
        return None
    if choice != "auto":
        return TOOL_PARSERS[choice]
    for parser in AUTO_ORDER:
        marker = parser.marker or parser.start_tag
        if marker in vocab or marker in chat_template:
            return parser
    return None
