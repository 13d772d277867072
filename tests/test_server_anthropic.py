"""hybrid-serve's Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official `anthropic`
client: the tiny random-weight demo model on the real engine (greedy decoding makes outputs repeatable, so streams
and stop sequences are checked against plain runs of the same request), and a `ScriptedEngine` whose output is a
known text (a tool call, a think block), everything else the real server."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from server_support import API_KEY, ScriptedEngine, start_server, tiny_model

from hybrid.engine import Engine
from hybrid.llm import LLM
from server.anthropic_protocol import MessagesRequest, to_chat_request
from server.app import load_tokenizer

MAX_MODEL_LEN = 512
SYSTEM = "Be brief."
USER = [{"role": "user", "content": "What is the weather?"}]
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OPENAI_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER_TOOL["input_schema"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny-anthropic") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def real_server(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    running = start_server(Engine(llm, max_num_batched_tokens=256, max_num_seqs=8), model_dir, llm.max_model_len,
                           api_key=API_KEY, served_model_name="tiny")
    yield running
    running.stop()
    llm.close()


@pytest.fixture(scope="module")
def real(real_server):
    return anthropic_client(real_server.url, API_KEY, timeout=120)


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine([])


@pytest.fixture(scope="module")
def server(engine, model_dir):
    running = start_server(engine, model_dir, engine.max_model_len, api_key=API_KEY, served_model_name="hybrid-demo")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server.url, API_KEY, timeout=60)


def anthropic_client(url: str, key: str, **options) -> anthropic.Anthropic:
    """A client sending `key` in x-api-key, as Anthropic's API takes it (this version of the client sends its
    api_key as a Bearer token)."""
    return anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": key}, max_retries=0,
                               **options)


def script(engine, tokenizer, text: str) -> None:
    """Every request now emits `text`'s tokens, then <|im_end|> (which ends the turn)."""
    engine.script = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def events_of(client, **request) -> list:
    with client.messages.create(stream=True, **request) as stream:
        return list(stream)


def test_text_message_and_usage_match_the_tokenizer(engine, tokenizer, client):
    script(engine, tokenizer, "Sunny, as far as I know.")
    response = client.messages.create(model="hybrid-demo", system=SYSTEM, messages=USER, max_tokens=50)
    expected_prompt = prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM}, *USER])
    assert engine.prompts[-1] == expected_prompt
    assert response.id.startswith("msg_") and response.type == "message" and response.role == "assistant"
    assert response.model == "hybrid-demo"
    assert [(block.type, block.text) for block in response.content] == [("text", "Sunny, as far as I know.")]
    assert response.stop_reason == "end_turn" and response.stop_sequence is None
    assert response.usage.input_tokens == len(expected_prompt)
    assert response.usage.output_tokens == len(engine.script)


def test_stream_event_order_and_text_match_the_plain_response(real):
    request = dict(model="tiny", system=SYSTEM, messages=USER, max_tokens=24, extra_body={"temperature": 0})
    plain = real.messages.create(**request)
    (block,) = plain.content
    events = events_of(real, **request)
    kinds = [event.type for event in events]
    num_deltas = kinds.count("content_block_delta")
    assert num_deltas >= 1
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[0].message, events[-2]
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == plain.usage.input_tokens
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert "".join(event.delta.text for event in events[2:2 + num_deltas]) == block.text
    assert delta.delta.stop_reason == plain.stop_reason
    assert delta.usage.output_tokens == plain.usage.output_tokens
    with real.messages.stream(**request) as stream:  # the client's own accumulation of the events
        assert stream.get_final_message().content[0].text == block.text


def test_stop_sequences(real):
    request = dict(model="tiny", messages=USER, max_tokens=40, extra_body={"temperature": 0})
    text = real.messages.create(**request).content[0].text
    assert len(text) > 12, "the greedy output is too short to cut"
    stop = text[8:11]
    expected = text[:text.index(stop)]
    cut = real.messages.create(stop_sequences=["never in the text \u2713", stop], **request)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(block.text for block in cut.content) == expected
    events = events_of(real, stop_sequences=[stop], **request)
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == expected


def test_tool_use_round_trip(engine, tokenizer, client):
    script(engine, tokenizer, "I will look it up.\n" + CALL_TEXT)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    response = client.messages.create(model="hybrid-demo", max_tokens=100, messages=messages, tools=[WEATHER_TOOL])
    assert response.stop_reason == "tool_use"
    text, call = response.content
    assert text.type == "text" and text.text == "I will look it up.\n"
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    assert engine.prompts[-1] == prompt_ids(tokenizer, messages, [OPENAI_WEATHER_TOOL])
    # the client sends its turn back with the tool's result; the template renders both
    script(engine, tokenizer, "It is sunny in Paris.")
    messages += [{"role": "assistant", "content": response.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": '{"sky": "sunny"}'}]}]}]
    answer = client.messages.create(model="hybrid-demo", max_tokens=100, messages=messages, tools=[WEATHER_TOOL])
    prompt = tokenizer.decode(engine.prompts[-1])
    assert 'I will look it up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt
    assert [block.text for block in answer.content] == ["It is sunny in Paris."]
    assert answer.stop_reason == "end_turn"


def test_tool_use_streamed_and_forced(engine, tokenizer, client):
    script(engine, tokenizer, "Checking. " + CALL_TEXT)
    request = dict(model="hybrid-demo", max_tokens=100, messages=USER, tools=[WEATHER_TOOL])
    events = events_of(client, **request)
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    assert [block.type for block in starts] == ["text", "tool_use"]
    assert starts[1].id.startswith("toolu_") and starts[1].name == "get_weather" and starts[1].input == {}
    arguments = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == 1)
    assert json.loads(arguments) == {"city": "Paris"}
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**request) as stream:
        assert stream.get_final_message().content[1].input == {"city": "Paris"}
    script(engine, tokenizer, '{"city": "Rome"}}\n</tool_call>')
    forced = client.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **request)
    assert tokenizer.decode(engine.prompts[-1]).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert [(block.type, block.input) for block in forced.content] == [("tool_use", {"city": "Rome"})]
    assert forced.stop_reason == "tool_use"
    script(engine, tokenizer, CALL_TEXT)
    refused = client.messages.create(tool_choice={"type": "none"}, **request)
    assert "get_weather" not in tokenizer.decode(engine.prompts[-1])
    assert [block.type for block in refused.content] == ["text"] and refused.stop_reason == "end_turn"


def test_thinking_blocks(engine, tokenizer, client):
    script(engine, tokenizer, "<think>\nThe user greets me.\n</think>\n\nHello!")
    request = dict(model="hybrid-demo", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    thinking = {"type": "enabled", "budget_tokens": 1024}
    response = client.messages.create(thinking=thinking, **request)
    assert [block.type for block in response.content] == ["thinking", "text"]
    assert response.content[0].thinking == "\nThe user greets me.\n" and response.content[1].text == "Hello!"
    events = events_of(client, thinking=thinking, **request)
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "text"]
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == "\nThe user greets me.\n"
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    plain = client.messages.create(thinking={"type": "disabled"}, **request)
    assert [(block.type, block.text) for block in plain.content] == [("text", "Hello!")]
    # a thinking block sent back is the assistant turn's reasoning; the template leaves it out
    script(engine, tokenizer, "ok")
    client.messages.create(model="hybrid-demo", max_tokens=10, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": response.content},
        {"role": "user", "content": "and?"}])
    assert "<|im_start|>assistant\nHello!<|im_end|>" in tokenizer.decode(engine.prompts[-1])


def test_thinking_switches_the_template():
    body = {"model": "m", "max_tokens": 5, "messages": USER}
    assert to_chat_request(MessagesRequest(**body)).chat_template_kwargs is None
    off = to_chat_request(MessagesRequest(**body, thinking={"type": "disabled"}))
    assert off.chat_template_kwargs == {"enable_thinking": False, "thinking": False}


def test_count_tokens_is_the_rendered_prompt(engine, tokenizer, client):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                             {"type": "text", "text": "So?"}]}]
    counted = client.messages.count_tokens(model="hybrid-demo", system=SYSTEM, messages=messages,
                                           tools=[WEATHER_TOOL])
    chat = [{"role": "system", "content": SYSTEM}, messages[0],
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}, {"role": "user", "content": "So?"}]
    assert counted.input_tokens == len(prompt_ids(tokenizer, chat, [OPENAI_WEATHER_TOOL]))
    script(engine, tokenizer, "ok")
    used = client.messages.create(model="hybrid-demo", system=SYSTEM, messages=messages, tools=[WEATHER_TOOL],
                                  max_tokens=5)
    assert used.usage.input_tokens == counted.input_tokens
    assert engine.prompts[-1] == prompt_ids(tokenizer, chat, [OPENAI_WEATHER_TOOL])


def error_of(raised) -> dict:
    body = raised.value.body
    assert body["type"] == "error"
    return body["error"]


def test_errors(engine, tokenizer, server, client):
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="hybrid-demo", max_tokens=0, messages=USER)
    assert error_of(raised)["type"] == "invalid_request_error" and "max_tokens" in error_of(raised)["message"]
    with pytest.raises(anthropic.BadRequestError) as raised:  # past the context length
        client.messages.create(model="hybrid-demo", max_tokens=10_000, messages=USER)
    assert "max_tokens" in error_of(raised)["message"]
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="hybrid-demo", max_tokens=5, messages=USER, tools=[WEATHER_TOOL],
                               tool_choice={"type": "tool", "name": "get_time"})
    assert "get_time" in error_of(raised)["message"]
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-nonesuch", max_tokens=5, messages=USER)
    assert error_of(raised)["type"] == "not_found_error" and "claude-nonesuch" in error_of(raised)["message"]
    for wrong in (anthropic_client(server.url, "wrong"), anthropic.Anthropic(base_url=server.url, api_key="wrong",
                                                                              max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as raised:
            wrong.messages.count_tokens(model="hybrid-demo", messages=USER)
        assert error_of(raised)["type"] == "authentication_error"
    script(engine, tokenizer, "ok")
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.create(model="hybrid-demo", max_tokens=5, messages=USER).content[0].text == "ok"
    # the OpenAI routes keep OpenAI's shape, and take the key in x-api-key too
    refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    accepted = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER}, timeout=30,
                          headers={"x-api-key": API_KEY})
    assert accepted.json()["choices"][0]["message"]["content"] == "ok"


def test_engine_failure_mid_stream_is_an_error_event(engine, tokenizer, server):
    script(engine, tokenizer, "fine")
    engine.fail_steps = 1
    body = {"model": "hybrid-demo", "max_tokens": 5, "messages": USER, "stream": True}
    text = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30).text
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "error"]
    error = json.loads([line for line in text.splitlines() if line.startswith("data: ")][-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert not engine._live()
