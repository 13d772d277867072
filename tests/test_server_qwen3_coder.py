"""The qwen3_coder tool-call parser (Qwen3-Coder / Qwen3.5 / Qwen3-Coder-Next), fed whole, split at every character
boundary and one character at a time: its calls stream (name first, then the arguments' JSON text as it grows),
typed by the tools' schemas; and `auto` choosing it. The format through the server is in
test_server_chat_formats.py."""

from __future__ import annotations

import json
import time

import pytest

from server.tool_parsers import (
    Glm47ToolParser,
    HermesToolParser,
    Qwen3CoderToolParser,
    ToolDelta,
    choose_tool_parser,
)
from server.typed_arguments import typed_value

WRITE_TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "ratio": {"type": "number"}, "force": {"type": "boolean"}, "meta": {"type": "object"},
    "tags": {"type": "array", "items": {"type": "string"}}, "owner": {"type": ["string", "null"]}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WRITE_TOOL, TIME_TOOL]
CODE = "if a < b and c <= d:\n    print('<tool_call>')\n\n"  # newlines, `<`, even a tag, in a string value
WRITE_CALL = ("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
              f"<parameter=content>\n{CODE}\n</parameter>\n<parameter=mode>\n644\n</parameter>\n"
              "<parameter=ratio>\n0.5\n</parameter>\n<parameter=force>\ntrue\n</parameter>\n"
              '<parameter=meta>\n{"a": [1, {"b": null}]}\n</parameter>\n<parameter=tags>\n["x", "y"]\n</parameter>\n'
              "<parameter=owner>\nNone\n</parameter>\n</function>\n</tool_call>")
WRITE_ARGUMENTS = {"path": "/tmp/a.py", "content": CODE, "mode": 644, "ratio": 0.5, "force": True,
                   "meta": {"a": [1, {"b": None}]}, "tags": ["x", "y"], "owner": None}
TIME_CALL = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
TEXT = "I will write the file.\n\n" + WRITE_CALL + "\n" + TIME_CALL


def run(parser: Qwen3CoderToolParser, pieces, forbidden=("<tool_call", "<function", "<parameter", "</")):
    """Feeds `pieces`, checks the streamed calls (each call's first delta has its id and name, no content holds part
    of a tag from `forbidden`, the arguments' deltas join into the whole call's) -> (content, [(name, arguments)])."""
    content, streamed = "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        assert not any(tag in delta.content for tag in forbidden), delta.content
        assert not delta.tool_calls  # whole calls are the other parsers'
        content += delta.content
        for call in delta.call_deltas:
            if call.index not in streamed:
                assert call.index == len(streamed) and call.id.startswith("call_") and call.name
                streamed[call.index] = [call.id, call.name, ""]
            else:
                assert call.id is None and call.name is None
            streamed[call.index][2] += call.arguments
    calls = parser.streamed_calls()
    assert [(c.id, c.name, c.arguments) for c in calls] == [tuple(s) for s in streamed.values()]
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


EXPECTED = ("I will write the file.\n\n", [("write_file", WRITE_ARGUMENTS), ("get_time", {})])


def test_whole_and_one_character_at_a_time():
    assert run(Qwen3CoderToolParser(tools=TOOLS), [TEXT]) == EXPECTED
    assert run(Qwen3CoderToolParser(tools=TOOLS), list(TEXT)) == EXPECTED


def test_split_at_every_character_boundary():
    for split in range(len(TEXT) + 1):
        assert run(Qwen3CoderToolParser(tools=TOOLS), [TEXT[:split], TEXT[split:]]) == EXPECTED, split


def test_the_name_and_a_string_argument_stream_before_the_call_ends():
    parser = Qwen3CoderToolParser(tools=TOOLS)
    assert parser.feed("Sure. <tool_call>\n<function=write_fi") == ToolDelta(content="Sure. ")
    (header,) = parser.feed("le>\n").call_deltas
    assert (header.index, header.name, header.arguments) == (0, "write_file", "{")
    (piece,) = parser.feed("<parameter=content>\nline one\nline two\n").call_deltas
    # the last newline waits: it is the template's when </parameter> follows
    assert piece.arguments == '"content": "line one\\nline two'
    assert parser.feed("</param").call_deltas == ()
    assert parser.feed("eter>\n").call_deltas[0].arguments == '"'
    assert parser.feed("<parameter=mode>\n6").call_deltas[0].arguments == ', "mode": '  # typed once it is whole
    assert parser.feed("44\n</parameter>\n</function>").call_deltas[0].arguments == "644}"
    assert json.loads(parser.streamed_calls()[0].arguments) == {"content": "line one\nline two", "mode": 644}


@pytest.mark.parametrize("text, schema, expected", [
    ("line 1\n  <b>x</b> < 3", {"type": "string"}, "line 1\n  <b>x</b> < 3"),
    ("42", {"type": "string"}, "42"), ("null", {"type": "string"}, "null"),
    ("42", {"type": "integer"}, 42), ("-1.5e3", {"type": "number"}, -1500.0), ("7", {"type": "number"}, 7),
    ("true", {"type": "boolean"}, True), ("False", {"type": "boolean"}, False),  # Jinja's `string` writes False
    ('{"k": [1, "v"]}', {"type": "object"}, {"k": [1, "v"]}), ("[1, 2]", {"type": "array"}, [1, 2]),
    ("None", {"type": ["string", "null"]}, None), ("null", {"type": "null"}, None),
    ("3", None, 3), ("[1]", {}, [1]), ("seven", None, "seven"),  # no schema: JSON if it is JSON
    ("{'a': 1}", {"type": "object"}, "{'a': 1}"), ("abc", {"type": "integer"}, "abc"),  # not the type: text
])
def test_values_typed_by_the_schema(text, schema, expected):
    value = typed_value(text, schema, has_python_literals=True)
    assert value == expected and type(value) is type(expected)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": schema}}}} if schema is not None else None
    call = f"<tool_call>\n<function=f>\n<parameter=p>\n{text}\n</parameter>\n</function>\n</tool_call>"
    for pieces in ([call], list(call)):
        parser = Qwen3CoderToolParser(tools=[tool] if tool else None)
        assert run(parser, pieces) == ("", [("f", {"p": expected})])


def test_python_literals_only_for_this_format():
    assert typed_value("True", {"type": "boolean"}) == "True"  # MiniMax / GLM write JSON
    assert typed_value("True", {"type": "boolean"}, has_python_literals=True) is True


@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_what_is_not_a_call_is_content(piece):
    def pieces(text):
        return [text[k:k + piece] for k in range(0, len(text), piece)]

    plain = "a <tool_cal b <function=x> c </tool_call>"
    assert run(Qwen3CoderToolParser(), pieces(plain), forbidden=()) == (plain, [])
    no_function = "<tool_call>\n" + '{"name": "f"}\n</tool_call>'  # Hermes' call: text to this parser
    assert run(Qwen3CoderToolParser(), pieces(no_function), forbidden=()) == (
        "<tool_call>" + no_function[12:], [])
    # text between or after calls other than whitespace, and text in a function other than arguments
    between = TIME_CALL + "\n\n and then \n" + TIME_CALL + " done"
    assert run(Qwen3CoderToolParser(), pieces(between)) == (
        "\n\n and then \n done", [("get_time", {}), ("get_time", {})])
    stray = "<tool_call><function=get_time>oops<parameter=a>1</parameter></function></tool_call>"
    assert run(Qwen3CoderToolParser(), pieces(stray)) == ("oops", [("get_time", {"a": 1})])


def test_a_call_cut_off_keeps_what_it_had():
    parser = Qwen3CoderToolParser(tools=TOOLS)
    for piece in ("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp", "/a.py\n</parameter>\n",
                  "<parameter=content>\nhalf a file\n</par"):
        parser.feed(piece)
    assert parser.finish().call_deltas[0].arguments == "\\n</par"  # held back for the end tag, which never came
    assert parser.streamed_calls()[0].arguments == '{"path": "/tmp/a.py", "content": "half a file\\n</par'


def test_forced_prefixes():
    named = Qwen3CoderToolParser(Qwen3CoderToolParser.forced_prefix("get_time"), TOOLS)
    assert Qwen3CoderToolParser.forced_prefix("get_time") == "<tool_call>\n<function=get_time>\n"
    assert run(named, ["</function>\n</tool_call>"]) == ("", [("get_time", {})])
    required = Qwen3CoderToolParser(Qwen3CoderToolParser.forced_prefix(None), TOOLS)
    assert run(required, ["get_time>\n</function>\n</tool_call>"]) == ("", [("get_time", {})])


def test_auto_chooses_it_from_the_template_or_the_architecture():
    qwen_template = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    hermes_template = '{{- \'<tool_call>\\n{"name": "\' + tool_call.name }}'
    vocab = {"<tool_call>": 1, "</tool_call>": 2}  # Qwen's vocabulary has Hermes' tags
    assert choose_tool_parser("auto", qwen_template, vocab) is Qwen3CoderToolParser
    assert choose_tool_parser("auto", hermes_template, vocab) is HermesToolParser
    for architecture in Qwen3CoderToolParser.architectures:
        assert choose_tool_parser("auto", "", vocab, [architecture]) is Qwen3CoderToolParser
        # a Qwen3-Next checkpoint whose template writes Hermes' JSON calls (Qwen3-Next-80B-A3B-Instruct)
        assert choose_tool_parser("auto", hermes_template, vocab, [architecture]) is HermesToolParser
    assert choose_tool_parser("auto", "", vocab, ["Qwen3MoeForCausalLM"]) is HermesToolParser
    assert choose_tool_parser("auto", "<arg_key>", vocab, ["Qwen3NextForCausalLM"]) is Glm47ToolParser
    assert choose_tool_parser("qwen3_coder", "", {}) is Qwen3CoderToolParser


def feed_time(parser: Qwen3CoderToolParser, num_pieces: int) -> float:
    """CPU seconds of this thread, not wall time (`test_server_parsers.feed_time` says why)."""
    started = time.thread_time()
    for _ in range(num_pieces):
        parser.feed("ab<d")
    return time.thread_time() - started


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["streamed-string", "held-value"])
def test_linear_in_a_long_argument(tools):
    """A long argument in many small pieces: streamed (a string) or held until it ends (no schema: maybe JSON), the
    work per piece does not grow with it, so 4x the pieces take about 4x the time (rescanning: 16x)."""
    def timed(num_pieces: int) -> tuple[float, Qwen3CoderToolParser]:
        parser = Qwen3CoderToolParser(tools=tools)
        parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\n")
        return feed_time(parser, num_pieces), parser

    small = min(timed(5000)[0] for _ in range(3))
    for _ in range(2):  # a second chance for a machine that was busy elsewhere
        large, parser = timed(20_000)
        if large < 8 * small:
            break
    assert large < 8 * small, (small, large)
    parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(parser.streamed_calls()[0].arguments) == {"content": "ab<d" * 20_000}
