"""DeepSeek-V3.2 in hybrid-serve: its chat encoding (no Jinja template: `server.deepseek_v32`) against exact prompts,
its DSML tool calls (`server.dsml`) fed whole, split at every character, a character at a time and in the tiny
tokenizer's tokens, and both through the server with the official `openai` client: a tiny checkpoint whose
config.json names DeepseekV32ForCausalLM and whose tokenizer has no chat template, a `ScriptedEngine` writing the
model's side. Also `auto` choosing the formats for DeepSeek-V3.2 and GLM-5 (GLM-4.7's formats)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from server_support import ScriptedEngine, start_server, tiny_model

from hybrid.detokenizer import IncrementalDetokenizer
from server.app import load_tokenizer, served_model
from server.chat import ChatChoice
from server.cli import build_parser
from server.config import ServerConfig
from server.deepseek_v32 import render_prompt
from server.demo import build_tokenizer
from server.dsml import DeepSeekV32ToolParser
from server.errors import APIError
from server.protocol import ChatMessage
from server.reasoning import ReasoningParser
from server.tool_parsers import DeepSeekV3ToolParser, Glm47ToolParser, HermesToolParser, choose_tool_parser

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
BOS, EOS, USER_TAG, ASSISTANT_TAG = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
# the official encoding's tools prompt, written out: the module's own constant is what is under test
TOOLS_PROMPT = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<｜DSML｜function_calls>
...
</｜DSML｜function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
{"name": "get_time", "parameters": {"type": "object", "properties": {}}}
</functions>
"""  # noqa: E501
WEATHER_BLOCK = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                 '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                 '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
                 '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "days": 2}'}}
CONVERSATION = [{"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
                 "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def encode(messages, tools=TOOLS, **kwargs) -> str:
    return render_prompt([ChatMessage(**m) for m in messages], tools, kwargs)


# ---- the encoding ----

def test_a_tool_call_and_its_result_thinking_on_and_off():
    system = BOS + "You are a weather bot.\n\n" + TOOLS_PROMPT + USER_TAG + "Weather in Paris?" + ASSISTANT_TAG
    results = "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n"
    assert encode(CONVERSATION, thinking=True) == (
        system + "<think>Need the tool.</think>Checking.\n\n" + WEATHER_BLOCK + EOS + results + "<think>")
    # off (the default): no think block in the assistant's turn, which starts after </think>
    off = system + "</think>Checking.\n\n" + WEATHER_BLOCK + EOS + results + "</think>"
    assert encode(CONVERSATION) == off
    assert encode(CONVERSATION, thinking=False, enable_thinking=False) == off
    assert encode(CONVERSATION, enable_thinking=True) == encode(CONVERSATION, thinking=True)  # vLLM reads both


def test_a_new_user_turn_drops_the_earlier_reasoning():
    messages = CONVERSATION + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Got it."},
                               {"role": "user", "content": "Thanks!"}]
    assert encode(messages, thinking=True) == (
        BOS + "You are a weather bot.\n\n" + TOOLS_PROMPT + USER_TAG + "Weather in Paris?" + ASSISTANT_TAG
        + "</think>Checking.\n\n" + WEATHER_BLOCK + EOS
        + "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>Sunny." + EOS
        + USER_TAG + "Thanks!" + ASSISTANT_TAG + "<think>")


def test_tools_without_a_system_message_and_several_results():
    second = {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "noon"}]
    assert encode(messages[1:], tools=[TIME_TOOL]) == (
        BOS + "\n\n" + TOOLS_PROMPT.replace(TOOLS_PROMPT.splitlines()[-3] + "\n", "") + USER_TAG + "Hi"
        + ASSISTANT_TAG + "</think>\n\n" + WEATHER_BLOCK.removesuffix("\n</｜DSML｜function_calls>")
        + '\n<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n</｜DSML｜function_calls>' + EOS
        + "\n\n<function_results>\n<result>sunny</result>\n<result>noon</result>\n</function_results>\n\n</think>")
    # the developer message is the system prompt; no tools, no tools prompt
    assert encode(messages[:2], tools=None, thinking=True) == (
        BOS + "Be brief." + USER_TAG + "Hi" + ASSISTANT_TAG + "<think>")


def test_what_the_encoding_cannot_write_is_a_400():
    with pytest.raises(APIError, match="messages.1: .*last message is a assistant") as caught:
        encode(CONVERSATION[1:3])
    assert caught.value.status == 400
    bad = {**CALL, "function": {"name": "get_weather", "arguments": "[1, 2]"}}
    messages = CONVERSATION[1:2] + [{"role": "assistant", "tool_calls": [CALL, bad]}, CONVERSATION[3]]
    with pytest.raises(APIError, match="must be a JSON object") as caught:
        encode(messages)
    assert caught.value.param == "messages.1.tool_calls.1.function.arguments"


# ---- the DSML parser ----

CODE = 'if a < b:\n    print("<｜DSML｜")\n'  # a string value with newlines, quotes, `<`, part of a tag
BLOCK = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="write_file">\n'
         '<｜DSML｜parameter name="path" string="true">/tmp/a.py</｜DSML｜parameter>\n'
         f'<｜DSML｜parameter name="content" string="true">{CODE}</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="mode" string="false">644</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="meta" string="false">{"a": [1, null], "b": "x"}</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="label" string="false">7</｜DSML｜parameter>\n'
         '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
WRITE_TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "meta": {"type": "object"}, "label": {"type": "string"}}}}}
TEXT = "I will write it.\n\n" + BLOCK
# string="false" values are JSON; one the schema says is a string stays the text
EXPECTED = ("I will write it.", [("write_file", {"path": "/tmp/a.py", "content": CODE, "mode": 644,
                                                 "meta": {"a": [1, None], "b": "x"}, "label": "7"}),
                                 ("get_time", {})])


def run(parser: DeepSeekV32ToolParser, pieces, forbidden=("<｜DSML", "</｜DSML", "\n\n")):
    """Feeds `pieces`, checks the streamed calls (each call's first delta has its id and name, no content holds part
    of a tag from `forbidden`, the arguments' deltas join into the whole call's) -> (content, [(name, arguments)])."""
    content, streamed = "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        assert not any(tag in delta.content for tag in forbidden), delta.content
        assert not delta.tool_calls
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


def token_pieces(text: str) -> list[str]:
    """The text as the server's detokenizer hands it out, token by token (the tiny byte-level tokenizer cuts the
    full-width bars of the tags into several tokens)."""
    tokenizer = build_tokenizer(512)
    detokenizer, pieces = IncrementalDetokenizer(tokenizer, []), []
    ids = tokenizer.encode(text, add_special_tokens=False)
    for index, token in enumerate(ids):
        detokenizer.add_token(token)
        pieces.append(detokenizer.take_delta(is_finished=index == len(ids) - 1))
    assert "".join(pieces) == text
    return pieces


def test_whole_in_tokens_and_one_character_at_a_time():
    pieces = token_pieces(TEXT)
    assert len(pieces) > 100
    for split in ([TEXT], pieces, list(TEXT)):
        assert run(DeepSeekV32ToolParser(tools=[WRITE_TOOL, TIME_TOOL]), split) == EXPECTED


def test_split_at_every_character_boundary():
    for cut in range(len(TEXT) + 1):
        assert run(DeepSeekV32ToolParser(tools=[WRITE_TOOL, TIME_TOOL]), [TEXT[:cut], TEXT[cut:]]) == EXPECTED, cut


def test_the_name_and_a_string_argument_stream_before_the_call_ends():
    parser = DeepSeekV32ToolParser(tools=[WRITE_TOOL])
    assert parser.feed("Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"write_fi").content == "Sure."
    (head,) = parser.feed('le">\n').call_deltas
    assert (head.index, head.name, head.arguments) == (0, "write_file", "{")
    (piece,) = parser.feed('<｜DSML｜parameter name="content" string="true">line "one"\nline two</｜DS').call_deltas
    assert piece.arguments == '"content": "line \\"one\\"\\nline two'  # the tag's start waits
    assert parser.feed("ML｜parameter>").call_deltas[0].arguments == '"'
    assert parser.feed('\n<｜DSML｜parameter name="mode" string="false">6').call_deltas[0].arguments == ', "mode": '
    assert parser.feed("44</｜DSML｜parameter>\n</｜DSML｜invoke>").call_deltas[0].arguments == "644}"
    assert json.loads(parser.streamed_calls()[0].arguments) == {"content": 'line "one"\nline two', "mode": 644}


@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_what_is_not_a_call_is_content(piece):
    def pieces(text):
        return [text[k:k + piece] for k in range(0, len(text), piece)]

    def parse(text, **forbidden):
        return run(DeepSeekV32ToolParser(tools=[TIME_TOOL]), pieces(text), **forbidden)

    time_call = '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>'
    # text that only looks like the format, a block without an invoke, an invoke whose name is not one
    for text in ("a <｜DSML｜function_calls b </｜DSML｜invoke> c", "Hi\n\n<｜DSML｜function_calls>\nno calls here\n",
                 "<｜DSML｜function_calls>\n<｜DSML｜invoke name=get_time>\n</｜DSML｜invoke>\n"
                 "</｜DSML｜function_calls>", "x\n<｜DSML｜function_calls>\n</｜DSML｜function_calls>"):
        assert parse(text, forbidden=()) == (text, []), text
    # text in a block or a call other than its tags, and text after the block
    stray = ("<｜DSML｜function_calls>\n" + time_call + "\noops\n" + time_call.replace(">\n<", ">junk<")
             + "\n</｜DSML｜function_calls>\n\n and then")
    assert parse(stray, forbidden=()) == ("oops\njunk\n\n and then", [("get_time", {}), ("get_time", {})])
    # an argument opening that is not one: its text is content, the call still parses
    odd = ("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter>1</｜DSML｜parameter>\n"
           "<｜DSML｜parameter name=\"tz\">\"UTC\"</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    assert parse(odd, forbidden=()) == ("<｜DSML｜parameter>1</｜DSML｜parameter>\n", [("get_time", {"tz": "UTC"})])
    # whitespace after a block is dropped, but not whitespace before text that follows it
    assert parse("<｜DSML｜function_calls>\n" + time_call + "\n</｜DSML｜function_calls>\n") == ("", [("get_time", {})])


def test_a_call_cut_off_keeps_what_it_had():
    parser = DeepSeekV32ToolParser(tools=[WRITE_TOOL])
    parser.feed('<｜DSML｜function_calls>\n<｜DSML｜invoke name="write_file">\n<｜DSML｜parameter name="path" '
                'string="true">/tmp/a</｜DSML｜parameter>\n<｜DSML｜parameter name="content" string="true">half</｜')
    assert parser.finish().call_deltas[0].arguments == "</｜"  # held back for the end tag, which never came
    assert parser.streamed_calls()[0].arguments == '{"path": "/tmp/a", "content": "half</｜'


def test_forced_prefixes():
    named = DeepSeekV32ToolParser.forced_prefix("get_time")
    assert named == '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n'
    assert run(DeepSeekV32ToolParser(named, TOOLS), ["</｜DSML｜invoke>\n</｜DSML｜function_calls>"]) == (
        "", [("get_time", {})])
    required = DeepSeekV32ToolParser(DeepSeekV32ToolParser.forced_prefix(None), TOOLS)
    assert run(required, ['get_time">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>']) == ("", [("get_time", {})])


def test_reasoning_then_calls_as_the_server_splits_them():
    """The prompt of thinking mode ends inside the think block: the output's reasoning, content and calls."""
    prompt = encode(CONVERSATION[:2], thinking=True)
    output = "Need the tool.</think>Checking.\n\n" + WEATHER_BLOCK
    for pieces in ([output], token_pieces(output)):
        choice = ChatChoice(ReasoningParser.for_prompt(prompt), DeepSeekV32ToolParser("", TOOLS))
        for piece in pieces:
            choice.feed(piece)
        choice.flush()
        assert (choice.reasoning, choice.content) == ("Need the tool.", "Checking.")
        assert [(c.name, json.loads(c.arguments)) for c in choice.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 2})]


# ---- `auto` ----

def model_dir(tmp_path: Path, name: str, architecture: str) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return str(path)


def test_auto_picks_the_formats_by_architecture(tmp_path):
    tokenizer = build_tokenizer(512)  # ChatML's <tool_call> and <think> tags, a Hermes chat template
    v32 = model_dir(tmp_path, "v32", "DeepseekV32ForCausalLM")
    glm5 = model_dir(tmp_path, "glm5", "GlmMoeDsaForCausalLM")
    tokenizer.chat_template = None
    model = served_model(ServerConfig(model=v32), tokenizer, 512)
    assert (model.is_deepseek_v32, model.tool_parser, model.reasoning_parser) == (
        True, DeepSeekV32ToolParser, ReasoningParser)
    model = served_model(ServerConfig(model=glm5), tokenizer, 512)  # GLM-5 by its architecture alone
    assert (model.is_deepseek_v32, model.tool_parser, model.reasoning_parser) == (False, Glm47ToolParser,
                                                                                  ReasoningParser)
    # GLM-5's template is GLM-4.7's
    tokenizer.chat_template = (TEMPLATES / "zai-org-GLM-4.7-Flash.jinja").read_text()
    assert served_model(ServerConfig(model=glm5), tokenizer, 512).tool_parser is Glm47ToolParser
    # V3.2-Exp: the same architecture with a template in V3.1's format: that template and V3's parser
    tokenizer.chat_template = "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}"
    model = served_model(ServerConfig(model=v32), tokenizer, 512)
    assert (model.is_deepseek_v32, model.tool_parser) == (False, DeepSeekV3ToolParser)
    # asked for by name (vLLM's --tokenizer-mode deepseek_v32), whatever the checkpoint
    model = served_model(ServerConfig(model=glm5, chat_format="deepseek_v32"), tokenizer, 512)
    assert (model.is_deepseek_v32, model.tool_parser) == (True, DeepSeekV32ToolParser)
    assert choose_tool_parser("auto", "", {"<tool_call>": 1}, ["DeepseekV3ForCausalLM"]) is HermesToolParser
    # V3.2's vocabulary has V3's tool-call tokens
    v3_tokens = {"<｜tool▁calls▁begin｜>": 1, "<think>": 2, "</think>": 3}
    assert choose_tool_parser("auto", "", v3_tokens, ["DeepseekV32ForCausalLM"]) is DeepSeekV32ToolParser
    assert choose_tool_parser("auto", "{{ '<｜DSML｜function_calls>' }}", {}) is DeepSeekV32ToolParser


def test_cli_options():
    args = build_parser().parse_args(["--tool-call-parser", "deepseek_v32", "--reasoning-parser", "deepseek_v3",
                                      "--tokenizer-mode", "deepseek_v32"])
    assert (args.tool_call_parser, args.reasoning_parser, args.chat_format) == (
        "deepseek_v32", "deepseek_v3", "deepseek_v32")
    assert build_parser().parse_args(["--chat-format", "deepseek_v32"]).chat_format == "deepseek_v32"
    with pytest.raises(Exception, match="harmony"):
        ServerConfig(chat_format="deepseek_v32", tool_call_parser="openai")


# ---- through the server ----

SPECIAL_TOKENS = [BOS, EOS, USER_TAG, ASSISTANT_TAG]  # the real tokenizer's; the DSML tags are text there too


class Served:
    def __init__(self, directory: Path):
        model = directory / "v32"
        shutil.copytree(tiny_model(directory / "base"), model)
        (model / "chat_template.jinja").unlink()
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV32ForCausalLM"]}))
        tokenizer = load_tokenizer(model)
        tokenizer.add_tokens(SPECIAL_TOKENS, special_tokens=True)
        tokenizer.chat_template = None
        tokenizer.save_pretrained(model)
        self.tokenizer = load_tokenizer(model)
        assert not self.tokenizer.chat_template
        self.engine = ScriptedEngine([], max_model_len=4096)
        self.server = start_server(self.engine, model, self.engine.max_model_len, served_model_name="v32")
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def script(self, text: str) -> None:
        self.engine.script = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]

    def last_prompt(self) -> str:
        return self.tokenizer.decode(self.engine.prompts[-1])

    def chat(self, messages, **kwargs):
        return self.client.chat.completions.create(model="v32", messages=messages, **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("deepseek-v32"))
    yield served
    served.server.stop()


THINKING = {"chat_template_kwargs": {"thinking": True}}
TWO_CALLS = ("Checking.\n\n<｜DSML｜function_calls>\n" + WEATHER_BLOCK.split("\n", 1)[1].rsplit("\n", 1)[0]
             + '\n<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')


def test_tool_calls_and_reasoning(served):
    served.script("Need the tool.</think>" + TWO_CALLS)
    response = served.chat(CONVERSATION[:2], tools=TOOLS, extra_body=THINKING)
    assert served.last_prompt() == encode(CONVERSATION[:2], thinking=True)  # the encoding, not a template
    assert served.last_prompt().endswith(ASSISTANT_TAG + "<think>")
    message = response.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Need the tool.", "Checking.")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in message.tool_calls)
    assert response.choices[0].finish_reason == "tool_calls"
    # the turn goes back through the encoding: this turn's reasoning kept, the calls as DSML, the results after
    served.script("It is sunny.")
    results = [{"role": "tool", "tool_call_id": call.id, "content": result}
               for call, result in zip(message.tool_calls, ("sunny", "noon"), strict=True)]
    response = served.chat(CONVERSATION[:2] + [message.model_dump(exclude_none=True)] + results, tools=TOOLS,
                           extra_body=THINKING)
    assert served.last_prompt().endswith(
        ASSISTANT_TAG + "<think>Need the tool.</think>" + TWO_CALLS + EOS + "\n\n<function_results>\n"
        "<result>sunny</result>\n<result>noon</result>\n</function_results>\n\n<think>")
    # no </think> in the output: it was all reasoning, cut off
    assert response.choices[0].message.model_extra["reasoning_content"] == "It is sunny."


def test_tool_calls_streamed(served):
    served.script(TWO_CALLS)
    chunks = list(served.chat(CONVERSATION[:2], tools=TOOLS, stream=True))
    assert served.last_prompt().endswith(ASSISTANT_TAG + "</think>")  # thinking is off by default
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas)
    pieces = [call for d in deltas for call in d.tool_calls or ()]
    heads = [call for call in pieces if call.id is not None]
    assert [(c.index, c.function.name) for c in heads] == [(0, "get_weather"), (1, "get_time")]
    arguments = ["".join(c.function.arguments or "" for c in pieces if c.index == index) for index in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris", "days": 2}, {}]
    assert sum(c.index == 0 for c in pieces) > 3  # the arguments came as they were written, not at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_streamed_and_a_forced_call(served):
    served.script("Thinking hard.</think>The answer is 4.")
    chunks = list(served.chat([{"role": "user", "content": "2+2?"}], stream=True, extra_body=THINKING))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Thinking hard."
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."
    # a named function: the think block the prompt opened is closed, then the call opened
    served.script('<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                  "</｜DSML｜function_calls>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = served.chat(CONVERSATION[:2], tools=TOOLS, tool_choice=named, extra_body=THINKING)
    assert served.last_prompt().endswith(
        ASSISTANT_TAG + '<think></think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n')
    (call,) = response.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    assert response.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function


def test_errors_and_tokenize(served):
    with pytest.raises(openai.BadRequestError, match="last message is a assistant"):
        served.chat(CONVERSATION[1:3])
    bad = {**CALL, "function": {"name": "get_weather", "arguments": "not json"}}
    with pytest.raises(openai.BadRequestError) as caught:
        served.chat(CONVERSATION[1:2] + [{"role": "assistant", "tool_calls": [bad]}, CONVERSATION[3]])
    assert caught.value.body["param"] == "messages.1.tool_calls.0.function.arguments"
    # /tokenize renders chat messages as the chat route does
    body = httpx.post(served.server.url + "/tokenize", json={"messages": CONVERSATION, "tools": TOOLS,
                                                             "chat_template_kwargs": {"thinking": True}}).json()
    assert served.tokenizer.decode(body["tokens"]) == encode(CONVERSATION, thinking=True)
