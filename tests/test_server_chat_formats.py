"""The Kimi-K2, MiniMax-M2, GLM-4.7 and Qwen3-Coder / Qwen3.5 chat formats through hybrid-serve, end to end with
the official `openai` client: the tiny demo model gets each model's published chat template (tests/fixtures/templates;
Qwen's a reduction) and the format's tags as special tokens (as the real tokenizers have them: decoding skips them
unless told not to; Qwen's are plain added tokens), and a `ScriptedEngine` writes the model's side of the
conversation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from server_support import ScriptedEngine, start_server, tiny_model

from server.app import load_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
MODELS = {  # model directory name -> (template, the special tokens its tokenizer adds)
    "kimi": ("moonshotai-Kimi-K2-Thinking.jinja",
             ["<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
              "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]),
    "minimax": ("MiniMax-M2.jinja", ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]),
    "glm": ("zai-org-GLM-4.7-Flash.jinja",
            ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>"]),
    # the demo vocabulary has Qwen's <tool_call> and <think> tags, as Qwen's has them: not special
    "qwen": ("qwen3.5-reduced.jinja", []),
}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny-formats") / "model")


class Served:
    """A server for one of `MODELS`, its engine and tokenizer, and an `openai` client."""

    def __init__(self, base_model, directory, name: str, **config):
        template, tags = MODELS[name]
        model_dir = directory / name
        shutil.copytree(base_model, model_dir)
        tokenizer = load_tokenizer(base_model)
        tokenizer.add_tokens(tags, special_tokens=True)
        tokenizer.chat_template = (TEMPLATES / template).read_text()
        tokenizer.save_pretrained(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = ScriptedEngine([], max_model_len=4096)  # the tiny vocabulary makes long prompts
        self.server = start_server(self.engine, model_dir, self.engine.max_model_len, served_model_name=name, **config)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def script(self, text: str) -> None:
        self.engine.script = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]

    def last_prompt(self) -> str:
        return self.tokenizer.decode(self.engine.prompts[-1])


def serve(base_model, tmp_path_factory, name: str, **config):
    served = Served(base_model, tmp_path_factory.mktemp(name), name, **config)
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def kimi(base_model, tmp_path_factory):
    yield from serve(base_model, tmp_path_factory, "kimi")


@pytest.fixture(scope="module")
def minimax(base_model, tmp_path_factory):
    yield from serve(base_model, tmp_path_factory, "minimax")


@pytest.fixture(scope="module")
def glm(base_model, tmp_path_factory):
    yield from serve(base_model, tmp_path_factory, "glm")


@pytest.fixture(scope="module")
def qwen(base_model, tmp_path_factory):
    # the tool-call parser is `auto` (the template writes <function=); the reasoning parser named as vLLM names it
    yield from serve(base_model, tmp_path_factory, "qwen", reasoning_parser="qwen3")


def test_kimi_tool_calls_and_reasoning(kimi):
    served = kimi
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>')
    served.script("<think>The user wants weather.</think>Checking." + call)
    response = served.client.chat.completions.create(model="kimi", messages=USER, tools=[WEATHER_TOOL])
    message = response.choices[0].message
    assert message.content == "Checking." and message.model_extra["reasoning_content"] == "The user wants weather."
    (tool_call,) = message.tool_calls
    assert tool_call.id == "functions.get_weather:0"  # Kimi's id convention, which its template writes back
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 2}
    assert response.choices[0].finish_reason == "tool_calls"
    chunks = list(served.client.chat.completions.create(model="kimi", messages=USER, tools=[WEATHER_TOOL],
                                                        stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.id, c.function.name) for c in streamed] == [("functions.get_weather:0", "get_weather")]
    # the client's own choice still wins: skipping special tokens drops the tags, and no call is read
    response = served.client.chat.completions.create(model="kimi", messages=USER, tools=[WEATHER_TOOL],
                                                     extra_body={"skip_special_tokens": True})
    assert not response.choices[0].message.tool_calls
    # the call and its result go back through Kimi's template, under the call's id
    served.script("Sunny.")
    served.client.chat.completions.create(model="kimi", tools=[WEATHER_TOOL], messages=USER + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"}])
    assert "## Return of functions.get_weather:0\nsunny" in served.last_prompt()
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 2}' \
        in served.last_prompt()


def test_minimax_keeps_the_think_block_in_content(minimax):
    served = minimax
    served.script('The user wants weather.\n</think>\n\nChecking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                  '<parameter name="city">Paris</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n'
                  '</minimax:tool_call>')
    response = served.client.chat.completions.create(model="minimax", messages=USER, tools=[WEATHER_TOOL])
    message = response.choices[0].message
    assert served.last_prompt().endswith("]~b]ai\n<think>\n")
    assert message.content == "<think>\nThe user wants weather.\n</think>\n\nChecking.\n"
    assert message.model_extra["reasoning_content"] is None
    (tool_call,) = message.tool_calls
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 2}  # typed by the schema
    # sent back as OpenAI clients do (arguments as JSON text), the turn renders with its think block
    served.script("Sunny.")
    served.client.chat.completions.create(model="minimax", tools=[WEATHER_TOOL], messages=USER + [
        message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"}])
    prompt = served.last_prompt()
    assert "]~b]ai\n<think>\nThe user wants weather.\n</think>\n\nChecking." in prompt
    assert '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="days">2' \
           '</parameter>' in prompt
    assert "]~b]tool\n<response>sunny</response>" in prompt


def test_glm_thinking_switch_and_forced_call(glm):
    served = glm
    served.script("It is asking about weather.</think>Let me look.")
    response = served.client.chat.completions.create(model="glm", messages=USER)
    assert served.last_prompt().endswith("<|assistant|><think>")
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == "It is asking about weather."
    assert message.content == "Let me look."
    # the template's switch closes the block in the prompt: the output is all content
    served.script("Let me look.")
    response = served.client.chat.completions.create(model="glm", messages=USER,
                                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert served.last_prompt().endswith("<|assistant|></think>")
    message = response.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (None, "Let me look.")
    # a forced call closes the think block the prompt opened, then opens the call
    served.script("<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days</arg_key><arg_value>3"
                  "</arg_value></tool_call>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = served.client.chat.completions.create(model="glm", messages=USER, tools=[WEATHER_TOOL, TIME_TOOL],
                                                     tool_choice=named)
    assert served.last_prompt().endswith("<|assistant|><think></think><tool_call>get_weather")
    (tool_call,) = response.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Rome", "days": 3}
    # the call goes back through the template, its arguments as JSON text
    served.script("Sunny.")
    served.client.chat.completions.create(model="glm", tools=[WEATHER_TOOL], messages=USER + [
        response.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"}])
    assert ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days</arg_key>"
            "<arg_value>3</arg_value></tool_call>") in served.last_prompt()


WRITE_TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "force": {"type": "boolean"}}}}}
QWEN_CODE = "if a < b:\n    print('<done>')\n"
QWEN_WRITE = ("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\n"
              f"{QWEN_CODE}\n</parameter>\n<parameter=mode>\n644\n</parameter>\n<parameter=force>\nTrue\n</parameter>\n"
              "</function>\n</tool_call>")
QWEN_WEATHER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
WRITE_ARGUMENTS = {"path": "/tmp/a.py", "content": QWEN_CODE, "mode": 644, "force": True}


def test_qwen3_coder_tool_calls(qwen):
    served, tools = qwen, [WRITE_TOOL, WEATHER_TOOL]
    served.script("The user wants a file.\n</think>\n\nWriting it.\n\n" + QWEN_WRITE)
    response = served.client.chat.completions.create(model="qwen", messages=USER, tools=tools)
    assert served.last_prompt().endswith("<|im_start|>assistant\n<think>\n")  # the template opened the block
    message = response.choices[0].message
    assert message.content == "Writing it.\n\n"
    assert message.model_extra["reasoning_content"] == "The user wants a file.\n"
    (tool_call,) = message.tool_calls
    assert tool_call.function.name == "write_file" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == WRITE_ARGUMENTS  # typed by the schema
    assert response.choices[0].finish_reason == "tool_calls"
    # the call goes back through the template, which writes the boolean Python's way, as the model learned it
    served.script("Done.")
    served.client.chat.completions.create(model="qwen", tools=tools, messages=USER + [
        message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tool_call.id, "content": "ok"}])
    assert "<|im_start|>assistant\nWriting it.\n\n" + QWEN_WRITE + "<|im_end|>" in served.last_prompt()
    assert "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>" in served.last_prompt()


def test_qwen3_coder_tool_calls_streamed(qwen):
    served, tools = qwen, [WRITE_TOOL, WEATHER_TOOL]
    served.script("Plan.</think>\n\nOn it.\n\n" + QWEN_WRITE + "\n" + QWEN_WEATHER)
    chunks = list(served.client.chat.completions.create(model="qwen", messages=USER, tools=tools, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "On it.\n\n"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Plan."
    pieces = [call for d in deltas for call in d.tool_calls or ()]
    heads = [call for call in pieces if call.id is not None]
    assert [(c.index, c.function.name) for c in heads] == [(0, "write_file"), (1, "get_weather")]
    arguments = ["".join(c.function.arguments or "" for c in pieces if c.index == index) for index in (0, 1)]
    assert [json.loads(a) for a in arguments] == [WRITE_ARGUMENTS, {"city": "Paris"}]
    assert sum(c.index == 0 for c in pieces) > 3  # the arguments came as they were written, not at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_qwen3_thinking_switch_and_forced_call(qwen):
    served = qwen
    # `enable_thinking` false: the template closes an empty think block in the prompt, and the output is content
    served.script("Hello there.")
    response = served.client.chat.completions.create(
        model="qwen", messages=USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert served.last_prompt().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = response.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (None, "Hello there.")
    # a named function: the think block the prompt opened is closed, then the call opened
    served.script("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = served.client.chat.completions.create(model="qwen", messages=USER, tools=[WRITE_TOOL, WEATHER_TOOL],
                                                     tool_choice=named)
    assert served.last_prompt().endswith("<think>\n</think><tool_call>\n<function=get_weather>\n")
    (tool_call,) = response.choices[0].message.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Rome"})
    assert response.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function
