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
  put newlines between the parts);
- Qwen3-Coder / Qwen3.5 / Qwen3-Coder-Next: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>
  \\n...</function>\\n</tool_call>` (`server.qwen3_coder`);
- DeepSeek-V3.2: `<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="P"
  string="true">VALUE</｜DSML｜parameter>\\n...</｜DSML｜invoke>...</｜DSML｜function_calls>` (`server.dsml`).

The last two stream their calls as they are written (`is_streaming`). MiniMax-M2, GLM and Qwen3-Coder write each
argument as text: a string parameter's value as it is, any other as JSON; the request's tools tell which is which
(`typed_value`). DeepSeek-V3.2 marks which is which itself (`string="true"`).

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

from server.dsml import DeepSeekV32ToolParser
from server.qwen3_coder import Qwen3CoderToolParser
from server.tool_calls import CallDelta as CallDelta
from server.tool_calls import ToolCall as ToolCall
from server.tool_calls import ToolCallParser as ToolCallParser
from server.tool_calls import ToolDelta as ToolDelta
from server.tool_calls import new_call_id as new_call_id
from server.typed_arguments import typed_value


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
    architectures = ("GlmMoeDsaForCausalLM",)  # GLM-5 / 5.1 / 5.2 write GLM-4.7's calls

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        return "<tool_call>" if function_name is None else "<tool_call>" + function_name

    @classmethod
    def matches(cls, chat_template: str, vocab: dict[str, int], architectures) -> bool:
        return super().matches(chat_template, vocab, architectures) or \
            any(a in cls.architectures for a in architectures or ())


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


TOOL_PARSERS = {parser.name: parser for parser in (HermesToolParser, DeepSeekV3ToolParser, DeepSeekV32ToolParser,
                                                   KimiK2ToolParser, MiniMaxM2ToolParser, Glm47ToolParser,
                                                   Qwen3CoderToolParser)}
# openai: gpt-oss's harmony format, which `server.harmony` renders and parses whole (reasoning too)
TOOL_PARSER_CHOICES = ("auto", "none", *TOOL_PARSERS, "openai")
# `auto` tries these in order: GLM's and Qwen3-Coder's templates and vocabularies have Hermes' <tool_call> too,
# DeepSeek-V3.2's vocabulary V3's tool-call tokens
AUTO_ORDER = (DeepSeekV32ToolParser, DeepSeekV3ToolParser, KimiK2ToolParser, MiniMaxM2ToolParser, Glm47ToolParser,
              Qwen3CoderToolParser, HermesToolParser)


def choose_tool_parser(choice: str, chat_template: str, vocab: dict[str, int],
                       architectures=()) -> type[ToolCallParser] | None:
    """The parser class for `--tool-call-parser` (`auto`: the format the chat template, vocabulary or config.json
    `architectures` know)."""
    if choice in ("none", "openai"):
        return None
    if choice != "auto":
        return TOOL_PARSERS[choice]
    return next((parser for parser in AUTO_ORDER if parser.matches(chat_template, vocab, architectures)), None)
