"""hybrid-serve's tool-call and reasoning paths end to end, and its failure handling, with the official `openai`
client against a `ScriptedEngine`: the engine's output is a scripted token sequence (a random-weight model would
never write a tool call), everything else (chat template, tokenizer, detokenizer, parsers, engine loop, HTTP) is
the real server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_support import ScriptedEngine, start_server, tiny_model

from server.app import load_tokenizer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny-tools") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine([])


@pytest.fixture(scope="module")
def server(engine, model_dir):
    running = start_server(engine, model_dir, engine.max_model_len, served_model_name="hybrid-demo",
                           max_running_requests=2, max_queued_requests=1)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def script(engine, tokenizer, text: str, end: bool = True) -> None:
    """Every request now emits `text`'s tokens (then <|im_end|>, which ends the turn)."""
    engine.script = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if end else [])


def last_prompt(engine, tokenizer) -> str:
    return tokenizer.decode(engine.prompts[-1])


def test_tool_call_round_trip(engine, tokenizer, client):
    script(engine, tokenizer, "I will look it up.\n" + CALL_TEXT)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    response = client.chat.completions.create(model="hybrid-demo", messages=messages, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in last_prompt(engine, tokenizer)  # the tools reached the template
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert response.usage.completion_tokens == len(engine.script)
    # the client sends the call and its result back; the template renders both
    script(engine, tokenizer, "It is sunny in Paris.")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    answer = client.chat.completions.create(model="hybrid-demo", messages=messages, tools=[WEATHER_TOOL])
    prompt = last_prompt(engine, tokenizer)
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls


def test_tool_call_streamed(engine, tokenizer, client):
    script(engine, tokenizer, "Checking. " + CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Oslo"))
    chunks = list(client.chat.completions.create(model="hybrid-demo", stream=True, tools=[WEATHER_TOOL],
                                                 messages=[{"role": "user", "content": "Paris and Oslo?"}]))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Checking. "  # no part of a tag was ever streamed as content
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [call.index for call in calls] == [0, 1]
    assert [json.loads(call.function.arguments)["city"] for call in calls] == ["Paris", "Oslo"]
    assert all(call.function.name == "get_weather" and call.id for call in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_and_required_tool_choice_open_the_call_in_the_prompt(engine, tokenizer, client):
    script(engine, tokenizer, '{"city": "Rome"}}\n</tool_call>')
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model="hybrid-demo", tools=[WEATHER_TOOL, TIME_TOOL],
                                              tool_choice=named, messages=[{"role": "user", "content": "Rome?"}])
    assert last_prompt(engine, tokenizer).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert response.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function
    script(engine, tokenizer, '{"name": "get_time", "arguments": {}}\n</tool_call>')
    response = client.chat.completions.create(model="hybrid-demo", tools=[WEATHER_TOOL, TIME_TOOL],
                                              tool_choice="required", messages=[{"role": "user", "content": "?"}])
    assert last_prompt(engine, tokenizer).endswith("<|im_start|>assistant\n<tool_call>\n")
    assert response.choices[0].message.tool_calls[0].function.name == "get_time"
    assert response.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError):  # a named function that is not among the tools
        client.chat.completions.create(model="hybrid-demo", tools=[TIME_TOOL], tool_choice=named,
                                       messages=[{"role": "user", "content": "?"}])


def test_tool_choice_none_leaves_tools_out(engine, tokenizer, client):
    script(engine, tokenizer, CALL_TEXT)
    response = client.chat.completions.create(model="hybrid-demo", tools=[WEATHER_TOOL], tool_choice="none",
                                              messages=[{"role": "user", "content": "hi"}])
    assert "get_weather" not in last_prompt(engine, tokenizer)
    assert response.choices[0].message.content == CALL_TEXT and not response.choices[0].message.tool_calls


def test_reasoning_content(engine, tokenizer, client):
    script(engine, tokenizer, "<think>\nThe user greets me.\n</think>\n\nHello!")
    messages = [{"role": "user", "content": "hi"}]
    message = client.chat.completions.create(model="hybrid-demo", messages=messages).choices[0].message
    assert message.content == "Hello!"
    assert message.model_extra["reasoning_content"] == "\nThe user greets me.\n"
    chunks = list(client.chat.completions.create(model="hybrid-demo", messages=messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "\nThe user greets me.\n"
    assert "".join(d.content or "" for d in deltas) == "Hello!"
    assert not any("think>" in (d.content or "") for d in deltas)


def test_stop_string_finishes_the_engine_request(engine, tokenizer, client):
    script(engine, tokenizer, "alpha beta gamma delta epsilon", end=False)
    num_finished = len(engine.finished)
    response = client.completions.create(model="hybrid-demo", prompt="x", max_tokens=50, stop=["gamma"])
    assert response.choices[0].text == "alpha beta " and response.choices[0].finish_reason == "stop"
    # the response may reach the client before the engine thread has ended the request: wait for it (bounded)
    deadline = time.monotonic() + 5
    while len(engine.finished) == num_finished or engine.finished[-1][0] in engine.requests:
        assert time.monotonic() < deadline, "the stop string did not end the engine request"
        time.sleep(0.01)
    request_id, reason = engine.finished[-1]
    assert reason == "stop" and request_id not in engine.requests  # ended in the engine and forgotten


def test_logprobs_out_of_json_range_are_floored(engine, tokenizer, server, client):
    script(engine, tokenizer, "ok")
    engine.logprobs = (float("-inf"), ((5, float("nan")), (6, -1e6)))
    try:
        chat = client.chat.completions.create(model="hybrid-demo", messages=USER, logprobs=True, top_logprobs=2)
        entry = chat.choices[0].logprobs.content[0]
        assert entry.logprob == -9999.0 and [t.logprob for t in entry.top_logprobs] == [-9999.0, -9999.0]
        body = {"prompt": "x", "logprobs": 2, "stream": True}
        events = httpx.post(server.url + "/v1/completions", json=body, timeout=30).text
        assert "Infinity" not in events and "NaN" not in events and "-9999.0" in events
    finally:
        engine.logprobs = None


def test_engine_failure_fails_the_request_and_the_loop_goes_on(engine, tokenizer, server, client):
    script(engine, tokenizer, "fine")
    engine.fail_steps = 1
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="hybrid-demo", prompt="x", max_tokens=5)
    events = httpx.post(server.url + "/v1/completions", timeout=30, json={"prompt": "x", "stream": True}).text
    assert [line for line in events.splitlines() if line][-1] == "data: [DONE]"
    assert client.completions.create(model="hybrid-demo", prompt="x", max_tokens=5).choices[0].text == "fine"
    engine.fail_steps = 1
    body = {"prompt": "x", "max_tokens": 5, "stream": True}
    lines = [line for line in httpx.post(server.url + "/v1/completions", json=body, timeout=30).text.splitlines()
             if line.startswith("data: ")]
    assert json.loads(lines[-2][len("data: "):])["error"]["type"] == "server_error" and lines[-1] == "data: [DONE]"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_full_queue_gets_429(engine, tokenizer, server, client):
    """max_running_requests 2 + max_queued_requests 1: a fourth request at once is refused, not queued."""
    script(engine, tokenizer, "slow answer")
    engine.gate.clear()  # hold the engine so requests pile up
    results = []

    def blocked():
        results.append(client.completions.create(model="hybrid-demo", prompt="x", max_tokens=5).choices[0].text)

    threads = [threading.Thread(target=blocked) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while server.app.state.server.num_in_flight < 3:  # held by the server (the engine thread is blocked)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as refused:
            client.with_options(timeout=10).completions.create(model="hybrid-demo", prompt="x", max_tokens=5)
        assert refused.value.body["code"] == "queue_full"
    finally:
        engine.gate.set()
        for thread in threads:
            thread.join(timeout=30)
    assert results == ["slow answer"] * 3
    assert client.completions.create(model="hybrid-demo", prompt="x", max_tokens=5).choices[0].text == "slow answer"



def test_null_parameters_mean_their_defaults(engine, tokenizer, server):
    script(engine, tokenizer, "ok")
    nulls = dict.fromkeys(["n", "stream", "stream_options", "stop", "seed", "temperature", "top_p", "presence_penalty",
                           "frequency_penalty", "max_tokens", "logit_bias", "logprobs", "top_logprobs", "tools",
                           "tool_choice", "user", "response_format", "ignore_eos", "skip_special_tokens"])
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, **nulls}, timeout=30)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "ok"
    text = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "echo": None, "suffix": None, **nulls},
                      timeout=30)
    assert text.status_code == 200 and text.json()["choices"][0]["text"] == "ok"

GARBAGE = [
    ("/v1/completions", []), ("/v1/completions", None), ("/v1/completions", "just a string"),
    ("/v1/completions", {"prompt": 5}), ("/v1/completions", {"prompt": [[]]}), ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": "x", "stop": 5}), ("/v1/completions", {"prompt": "x", "top_p": 0}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}), ("/v1/completions", {"prompt": "x", "n": 1000}),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}), ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}), ("/v1/completions", {"prompt": "x", "seed": "a"}),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}), ("/v1/completions", {"prompt": [[1, 2], [-3]]}),
    ("/v1/completions", {"prompt": "x", "n": 4}),  # more than the 3 requests this server holds at once
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "sometimes"}),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenize": True}}),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema"}}),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}),
]


@pytest.mark.parametrize("path, body", GARBAGE, ids=[f"{i}" for i in range(len(GARBAGE))])
def test_garbage_gets_400_and_the_server_keeps_answering(engine, tokenizer, server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    script(engine, tokenizer, "ok")
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30).json()["choices"][0][
        "text"] == "ok"
    assert not engine._live()
