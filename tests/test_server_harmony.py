"""gpt-oss's harmony format (`server.harmony`): prompts rendered as openai-harmony renders them, output parsed as
openai-harmony parses it (both the oracle, `harmony_support`), the parser fed the output split at every
boundary, and hybrid-serve end to end with the official `openai` client against a `ScriptedEngine` on a tiny
checkpoint whose tokenizer has harmony's special tokens and whose config.json says GptOssForCausalLM."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from harmony_support import load_encoding
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    SystemContent,
    ToolDescription,
)
from server_support import ScriptedEngine, start_server, tiny_model

from server import harmony
from server.app import load_tokenizer
from server.protocol import ChatCompletionRequest

DATE = "2025-01-02"
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather\nof a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city", "default": "Paris"},
        "days": {"type": "integer", "default": 3},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "tags": {"type": "array", "items": {"type": "string"}, "default": ["a", "b"]}}, "required": ["city"]}}}
SCHEMAS = [
    None,
    {"type": "object", "properties": {}},
    {"type": "object", "description": "Options", "properties": {
        "z_first": {"type": ["string", "null"], "title": "Z", "examples": ["x", "y"]},
        "flag": {"type": "boolean", "nullable": True}, "ratio": {"type": "number", "default": 0.5},
        "any": {}, "choice": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "nested": {"type": "object", "description": "Inner", "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}},
                                                  "required": ["id"]}}}}},
     "required": ["nested"]},
    {"type": "object", "properties": {
        "same": {"description": "A or B", "default": "a", "oneOf": [
            {"type": "string", "description": "A or B"}, {"type": "integer", "nullable": True, "default": 1}]},
        "other": {"description": "Mode", "oneOf": [
            {"type": "string", "enum": ["x"], "description": "the x", "default": "x"}, {"type": "boolean"}]}}},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "description": "first"},
               {"type": "string", "enum": ["k"], "default": "k"}]},
]


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    return load_encoding(tmp_path_factory.mktemp("o200k"))


def request(messages, tools=None, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=messages, tools=tools, **fields)


def ours(body: ChatCompletionRequest) -> str:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    return harmony.render_prompt(body.messages, tools, body.reasoning_effort, DATE)


def oracle(encoding, messages: list[Message], effort: str = "medium", instructions: str | None = None,
           tools: list[dict] | None = None) -> str:
    system = SystemContent.new().with_reasoning_effort(EFFORTS[effort]).with_conversation_start_date(DATE)
    head = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([ToolDescription.new(
                t["function"]["name"], t["function"].get("description", ""), parameters=t["function"].get(
                    "parameters")) for t in tools])
        head.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    tokens = encoding.render_conversation_for_completion(
        Conversation.from_messages(head + messages), Role.ASSISTANT, RenderConversationConfig(auto_drop_analysis=False))
    return encoding.decode_utf8(tokens)


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def call(name: str, arguments: str) -> Message:
    return assistant(arguments, "commentary").with_recipient("functions." + name).with_content_type(
        "<|constrain|>json")


def result(name: str, text: str) -> Message:
    return Message.from_author_and_content(Author.new(Role.TOOL, "functions." + name), text).with_recipient(
        "assistant").with_channel("commentary")


@pytest.mark.parametrize("effort", ["low", "medium", "high", None])
def test_plain_prompt_matches_openai_harmony(encoding, effort):
    body = request([{"role": "user", "content": "Hi there, ünïcode ✓"}], reasoning_effort=effort)
    assert ours(body) == oracle(encoding, [user("Hi there, ünïcode ✓")], effort or "medium")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_tools_render_as_openai_harmony_renders_them(encoding, index):
    tool = {"type": "function", "function": {"name": "f", "description": "Does f"}}
    if SCHEMAS[index] is not None:
        tool["function"]["parameters"] = SCHEMAS[index]
    tools = [WEATHER, tool]
    body = request([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], tools)
    assert ours(body) == oracle(encoding, [user("Weather?")], instructions="Be brief.", tools=tools)


def test_history_with_calls_matches_openai_harmony(encoding):
    """The earlier turn's reasoning is left out; the current turn's reasoning, preamble, call and its result stay."""
    messages = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    expected = oracle(encoding, [
        user("Hi"), assistant("Hello!", "final"), user("Weather in Paris?"), assistant("Call the tool.", "analysis"),
        assistant("Checking.", "commentary"), call("get_weather", '{"city": "Paris"}'),
        result("get_weather", '{"sky": "sunny"}')], instructions="Use tools.", tools=[WEATHER])
    assert ours(request(messages, [WEATHER])) == expected


# ---- parsing ----

OUTPUTS = {
    "answer": "<|channel|>analysis<|message|>User says hi. Reply.<|end|><|start|>assistant<|channel|>final"
              "<|message|>Hello — how can I help? ✓<|return|>",
    "call": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>",
    "recipient first": " to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
    "preamble": "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.get_weather"
                "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>",
}


def expected_parse(encoding, text: str) -> tuple[str, str, list[tuple[str, str]]]:
    """openai-harmony's reading of an output that continues `<|start|>assistant`."""
    tokens = encoding.encode("<|start|>assistant" + text, allowed_special="all")
    reasoning, content, calls = "", "", []
    for message in encoding.parse_messages_from_completion_tokens(tokens[1:], Role.ASSISTANT):
        body = "".join(part.text for part in message.content)
        if message.recipient:
            calls.append((message.recipient.removeprefix("functions."), body))
        elif message.channel == "analysis":
            reasoning += body
        else:
            content += body
    return reasoning, content, calls


def parse(pieces: list[str], prefix: str = "") -> tuple[str, str, list[tuple[str, str]]]:
    parser = harmony.HarmonyParser(prefix)
    reasoning, content, calls = "", "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        reasoning, content = reasoning + delta.reasoning, content + delta.content
        for part in delta.calls:
            if part.id is not None:
                assert part.index not in calls and part.id.startswith("call_")
                calls[part.index] = [part.name, ""]
            else:
                assert part.index in calls and part.name is None
            calls[part.index][1] += part.arguments
    assert [(c.name, c.arguments) for c in parser.calls] == [tuple(c) for c in calls.values()]
    return reasoning, content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("name", OUTPUTS)
def test_parser_matches_openai_harmony_at_every_split(encoding, name):
    text = OUTPUTS[name]
    expected = expected_parse(encoding, text)
    assert expected[0] or expected[1] or expected[2]
    assert parse([text]) == expected
    assert parse(list(text)) == expected, "one character at a time"
    for split in range(1, len(text)):
        assert parse([text[:split], text[split:]]) == expected, f"split at {split}: {text[:split]!r}"


def test_parser_reads_text_without_harmony_as_content():
    assert parse(list("just words")) == ("", "just words", [])


def test_forced_call_prefix_is_parsed_as_a_call():
    prefix = harmony.forced_prefix("get_weather")
    assert parse(list('{"city": "Rome"}<|call|>'), prefix) == ("", "", [("get_weather", '{"city": "Rome"}')])
    assert parse(list('get_time <|constrain|>json<|message|>{}<|call|>'), harmony.forced_prefix(None)) == (
        "", "", [("get_time", "{}")])


@pytest.mark.parametrize(("reasoning", "tools", "architectures", "template", "selected"), [
    ("auto", "auto", ["GptOssForCausalLM"], "", True),
    ("auto", "auto", ["Qwen3MoeForCausalLM"], "{{ '<|channel|>' }}", True),
    ("auto", "auto", ["Qwen3MoeForCausalLM"], "", False),
    ("openai_gptoss", "none", [], "", True),
    ("none", "openai", [], "", True),
    ("none", "none", ["GptOssForCausalLM"], "", False),
    ("qwen3", "hermes", ["GptOssForCausalLM"], "", False),
])
def test_selection(reasoning, tools, architectures, template, selected):
    assert harmony.is_selected(reasoning, tools, architectures, template) is selected


# ---- end to end ----

CALL_OUTPUT = OUTPUTS["call"]
ANSWER_OUTPUT = ("<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Sunny in Paris.<|return|>")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tiny_model(tmp_path_factory.mktemp("tiny-harmony") / "base")
    model_dir = tmp_path_factory.mktemp("gpt-oss") / "model"
    shutil.copytree(base, model_dir)
    tokenizer = load_tokenizer(base)
    tokenizer.add_tokens(list(harmony.TAGS), special_tokens=True)  # special, as in gpt-oss's tokenizer
    tokenizer.save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GptOssForCausalLM"]}))
    tokenizer = load_tokenizer(model_dir)
    engine = ScriptedEngine([], max_model_len=4096)
    server = start_server(engine, model_dir, engine.max_model_len, served_model_name="gpt-oss")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield engine, tokenizer, client
    server.stop()


def script(engine, tokenizer, text: str) -> None:
    engine.script = tokenizer.encode(text, add_special_tokens=False)


def test_call_reaches_the_client(served):
    engine, tokenizer, client = served
    script(engine, tokenizer, CALL_OUTPUT)
    stops, add_request = [], engine.add_request
    engine.add_request = lambda *args, **kwargs: stops.append(set(kwargs["stop_token_ids"])) or add_request(
        *args, **kwargs)
    try:
        response = client.chat.completions.create(model="gpt-oss", tools=[WEATHER], reasoning_effort="high",
                                                  messages=[{"role": "user", "content": "Weather?"}])
    finally:
        del engine.add_request
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "Reasoning: high" in prompt and "type get_weather = (_: {" in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather?<|end|><|start|>assistant")
    assert {tokenizer.convert_tokens_to_ids(tag) for tag in harmony.STOP_TAGS} <= stops[0]
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Need the weather."
    assert not choice.message.content
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 2}


def test_call_streams_to_the_client(served):
    engine, tokenizer, client = served
    script(engine, tokenizer, CALL_OUTPUT)
    stream = client.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=[WEATHER], stream=True)
    reasoning, pieces, names, reasons = "", [], [], []
    for chunk in stream:
        (choice,) = chunk.choices
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        assert not choice.delta.content
        for part in choice.delta.tool_calls or ():
            assert part.index == 0
            if part.id is not None:
                names.append(part.function.name)
            pieces.append(part.function.arguments)
        reasons.append(choice.finish_reason)
    assert reasoning == "Need the weather." and names == ["get_weather"]
    assert len([p for p in pieces if p]) > 1, "the arguments stream"
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 2}
    assert reasons[-1] == "tool_calls"


def test_result_round_trip_and_answer(served):
    engine, tokenizer, client = served
    script(engine, tokenizer, ANSWER_OUTPUT)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
                    {"id": "call_9", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": '{"sky": "sunny"}'}]
    response = client.chat.completions.create(model="gpt-oss", messages=messages, tools=[WEATHER])
    prompt = tokenizer.decode(engine.prompts[-1])
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
        '{"sky": "sunny"}<|end|><|start|>assistant')
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "Sunny in Paris."
    assert choice.message.reasoning_content == "It is sunny." and not choice.message.tool_calls
    stream = client.chat.completions.create(model="gpt-oss", messages=messages, tools=[WEATHER], stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "It is sunny."
    assert "".join(d.content or "" for d in deltas) == "Sunny in Paris."


def test_both_flags_none_leave_the_chat_template(served, tmp_path):
    """A gpt-oss checkpoint with `none` for both parsers renders its own chat template, which gets
    `reasoning_effort` as a variable."""
    engine, tokenizer, _ = served
    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer.name_or_path, model_dir)
    tokenizer.chat_template = "effort={{ reasoning_effort }}:{{ messages[-1]['content'] }}"
    tokenizer.save_pretrained(model_dir)
    engine.script = tokenizer.encode("fine", add_special_tokens=False) + [tokenizer.eos_token_id]
    server = start_server(engine, model_dir, engine.max_model_len, served_model_name="plain",
                          reasoning_parser="none", tool_call_parser="none")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "Hi"}],
                                                  reasoning_effort="low")
    finally:
        server.stop()
    assert tokenizer.decode(engine.prompts[-1]) == "effort=low:Hi"
    assert response.choices[0].message.content == "fine"
