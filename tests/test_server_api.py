"""hybrid-serve end to end with the official `openai` client: a tiny random-weight demo model (built here, converted
to int8 CPU experts), the real engine, uvicorn on a free loopback port. Greedy decoding makes outputs repeatable,
so streaming, stop strings, seeds and concurrency are checked against plain runs of the same request."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from server_support import API_KEY, engine_server, tiny_model

from server import loadtest
from server.app import load_tokenizer

MAX_MODEL_LEN = 512
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    running, llm = engine_server(model_dir, MAX_MODEL_LEN, api_key=API_KEY, served_model_name="tiny")
    yield running
    running.stop()
    llm.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def wait_idle(server, timeout: float = 30.0) -> None:
    """Until the engine has nothing running and every KV page is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("hybrid_num_requests_running") == 0 and server.metric("hybrid_kv_cache_usage_ratio") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not go back to idle")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_usage_matches_the_tokenizer(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, **GREEDY)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == len(prompt_ids) + 7
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and response.id.startswith("chatcmpl-")


def test_chat_stream_invariants_and_usage(server, client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert not chunks[-1].choices and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    # the raw stream ends with [DONE]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "stream": True}
    raw = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    events = [line for line in raw.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and raw.headers["content-type"].startswith("text/event-stream")


def test_completions_stream_matches_whole(client, tokenizer):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, **GREEDY)
    assert whole.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    parts = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, stream=True,
                                           **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10 and whole.object == "text_completion"
    # a batch of prompts (text and token ids), n choices each
    batch = client.completions.create(model="tiny", prompt=["Once upon a time", "Hello"], n=2, max_tokens=10,
                                      **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == whole.choices[0].text
    echo = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("Hello")


def streamed_pieces(client, prompt: str, max_tokens: int) -> list[str]:
    parts = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY)
    return [p.choices[0].text for p in parts if p.choices and p.choices[0].text]


def spanning_stop(pieces: list[str]) -> str:
    """A stop string made of the end of one streamed token's text and the start of the next (plain letters)."""
    text = "".join(pieces)
    for k in range(1, len(pieces) - 1):
        left, right = pieces[k][-2:], pieces[k + 1][:2]
        stop = left + right
        if len(left) == 2 and len(right) == 2 and stop.isascii() and stop.isalpha() \
                and text.find(stop) == len("".join(pieces[:k + 1])) - 2:
            return stop
    raise AssertionError(f"no usable token boundary in {pieces}")


def test_stop_string_spanning_tokens(server, client):
    prompt = "The quick brown fox"
    pieces = streamed_pieces(client, prompt, 40)
    stop = spanning_stop(pieces)
    text = "".join(pieces)
    expected = text[:text.find(stop)]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=[stop, "\x00never"],
                                      **GREEDY)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    # the request ended at the token that completed the stop string
    num_tokens = whole.usage.completion_tokens
    assert stop in client.completions.create(model="tiny", prompt=prompt, max_tokens=num_tokens,
                                             **GREEDY).choices[0].text
    assert stop not in client.completions.create(model="tiny", prompt=prompt, max_tokens=num_tokens - 1,
                                                 **GREEDY).choices[0].text
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=stop, stream=True,
                                              **GREEDY))
    assert "".join(p.choices[0].text for p in streamed) == expected
    assert stop[:2] not in "".join(p.choices[0].text for p in streamed)[len(expected):]
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_idle(server)


def test_seed_reproducibility(client):
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert client.completions.create(seed=1234, **kwargs).choices[0].text == first
    assert client.completions.create(seed=1235, **kwargs).choices[0].text != first
    # n choices use seed, seed + 1, ...
    pair = client.completions.create(seed=1234, n=2, **kwargs)
    assert pair.choices[0].text == first
    assert pair.choices[1].text == client.completions.create(seed=1235, **kwargs).choices[0].text
    # top_k 1 leaves one token to draw: the greedy output, whatever the seed
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=16, **GREEDY).choices[0].text
    one_token = dict(kwargs, extra_body={"ignore_eos": True, "top_k": 1})
    assert client.completions.create(seed=7, **one_token).choices[0].text == greedy


def test_concurrent_streams_match_sequential(server, client):
    prompts = [f"Request number {i}: tell me about {word}" for i, word in
               enumerate(["cats", "the sea", "robots", "Paris"] * 8)]
    sequential = [client.completions.create(model="tiny", prompt=p, max_tokens=12, **GREEDY).choices[0].text
                  for p in prompts]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True, **GREEDY)
        return "".join([part.choices[0].text async for part in stream if part.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(run_all()) == sequential
    wait_idle(server)


def test_disconnect_mid_stream_frees_the_request(server):
    wait_idle(server)
    body = {"model": "tiny", "prompt": "Keep talking", "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    forward_before = server.engine.llm.num_forward_tokens
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        assert server.metric("hybrid_num_requests_running") == 1
        assert server.metric("hybrid_kv_cache_usage_ratio") > 0
    wait_idle(server)  # the client went away: the request was cancelled and its pages freed
    assert_nothing_left(server)
    # the engine stopped computing it: far fewer tokens than its 400 went through the model
    assert server.engine.llm.num_forward_tokens - forward_before < 200
    # the same for a non-streaming request (4 choices of 490 tokens: seconds of work) whose client gives up
    forward_before = server.engine.llm.num_forward_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "n": 4, "max_tokens": 490},
                   headers=headers, timeout=0.3)
    wait_idle(server)
    assert_nothing_left(server)
    assert server.engine.llm.num_forward_tokens - forward_before < 2 * 490


def assert_nothing_left(server) -> None:
    """No request left behind in the engine (ended requests leave `engine.requests`)."""
    deadline = time.monotonic() + 10
    while server.engine.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine.requests


def post(server, path: str, body, key: str | None = API_KEY) -> httpx.Response:
    """POSTs `body` as JSON (a str: sent as is, with the JSON content type)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, str):
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, headers=headers, content=body, timeout=60)
    return httpx.post(server.url + path, headers=headers, json=body, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def test_bad_requests_get_4xx_and_the_server_keeps_answering(server, client):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", "{not json"), 400)
    assert_error(post(server, "/v1/chat/completions", {**chat, "temperature": "hot"}), 400, param="temperature")
    assert_error(post(server, "/v1/chat/completions", {**chat, "messages": "hi"}), 400, param="messages")
    assert_error(post(server, "/v1/chat/completions", {**chat, "max_tokens": -5}), 400, param="max_tokens")
    assert_error(post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}), 400, param="n")
    assert_error(post(server, "/v1/completions", {"model": "tiny", "prompt": [99999]}), 400)
    huge = {"model": "tiny", "prompt": "word " * 5000}
    assert_error(post(server, "/v1/completions", huge), 400, code="context_length_exceeded")
    assert_error(post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10_000}), 400,
                 code="context_length_exceeded")
    assert_error(post(server, "/v1/chat/completions", {**chat, "model": "gpt-4o"}), 404, code="model_not_found")
    assert_error(post(server, "/v1/chat/completions", chat, key=None), 401)
    assert_error(post(server, "/v1/chat/completions", chat, key="wrong"), 401)
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 401)  # no route is shown without the key
    assert_error(httpx.get(server.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}), 404)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 20_000}])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    # still serving
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, **GREEDY).usage.completion_tokens == 2
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server)


def test_metrics_count_requests_and_tokens(server, client):
    before = server.metric("hybrid_generation_tokens_total")
    client.completions.create(model="tiny", prompt="Count me", max_tokens=5, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    assert server.metric("hybrid_generation_tokens_total") == before + 5
    assert 'hybrid_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'hybrid_requests_total{endpoint="/v1/chat/completions",status="401"}' in text
    assert server.metric("hybrid_time_to_first_token_seconds_count") > 0
    assert server.metric("hybrid_inter_token_latency_seconds_count") > 0
    # one process: its own series as rank "0" (tensor parallel: one per rank, tests/test_tp_metrics.py)
    steps = re.findall(r'^hybrid_rank_steps_total\{rank="(\d+)"\} (\S+)$', text, re.MULTILINE)
    assert [rank for rank, _ in steps] == ["0"] and float(steps[0][1]) == server.engine.llm.counters.num_steps > 0
    assert 'hybrid_rank_alive{rank="0"} 1.0' in text


def test_logprobs(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, **GREEDY)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert logprobs.text_offset[0] == 0 and all(len(top) <= 2 for top in logprobs.top_logprobs)
    json.dumps(completion.model_dump())


def test_nan_logits_fail_the_request_with_internal_error(server, client):
    """A request whose logits turn NaN (here: a poisoned embedding row for one of its prompt tokens) fails with 500
    `internal_error` naming the cause, streamed or not, instead of sampling token 0; other requests go on."""
    import torch

    embed = server.engine.llm.model.model.embed_tokens.weight
    token = 77
    saved = embed[token].clone()
    with torch.no_grad():
        embed[token] = float("nan")
    try:
        body = {"model": "tiny", "prompt": [5, token, 9], "max_tokens": 3, "temperature": 0}
        response = post(server, "/v1/completions", body)
        assert_error(response, 500, code="internal_error")
        assert "NaN or inf" in response.json()["error"]["message"]
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=60) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-2] if events[-1] == "[DONE]" else events[-1])["error"]
        assert error["code"] == "internal_error" and "NaN or inf" in error["message"]
        assert client.completions.create(model="tiny", prompt=[5, 6, 9], max_tokens=2, **GREEDY).choices[0].text
    finally:
        with torch.no_grad():
            embed[token] = saved
    for knob, value in (("repetition_penalty", 1e-50), ("repetition_penalty", 1e39), ("temperature", 1e39)):
        response = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", knob: value})
        assert_error(response, 400)  # 0 or inf in float32: refused, not sampled
        assert knob in response.json()["error"]["message"]
    wait_idle(server)


def test_loadtest_reports_throughput(server, capsys):
    assert loadtest.main(["--url", server.url, "--requests", "6", "--concurrency", "3", "--max-tokens", "5",
                          "--duration", "60", "--api-key", API_KEY, "--prompt-words", "8"]) == 0
    out = capsys.readouterr().out
    assert "6 requests ok, 0 failed" in out and "output tokens/s" in out and "time to first token" in out
    wait_idle(server)


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    """OpenAI's logit_bias: +100 on one token makes every sampled token that one; -100 on the greedy first token
    makes the first token another; a token id outside the vocabulary is a 400."""
    forced = tokenizer.encode(" the", add_special_tokens=False)[-1]
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    out = client.completions.create(logit_bias={str(forced): 100}, **kwargs).choices[0].text
    assert tokenizer.encode(out, add_special_tokens=False) == [forced] * 6
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=1, **GREEDY).choices[0].text
    banned = tokenizer.encode(greedy, add_special_tokens=False)[0]
    other = client.completions.create(model="tiny", prompt="Hello", max_tokens=1, logit_bias={str(banned): -100},
                                      **GREEDY).choices[0].text
    assert tokenizer.encode(other, add_special_tokens=False)[0] != banned
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(logit_bias={"99999999": 5}, **kwargs)
