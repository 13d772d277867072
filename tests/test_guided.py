"""Grammar-constrained decoding (xgrammar): the tiny demo model has random weights, so without the grammar its
output is noise and every structured output below is the grammar's doing. Seeds: one request with n=20 and a seed
runs seeds seed..seed+19, batched."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
import torch
from server_support import API_KEY, TINY, chat_choices, engine_server

from hybrid.engine import Engine
from hybrid.guided import GrammarCache, GuidedRequests
from hybrid.llm import LLM
from hybrid.sampling import GuidedSpec, RowInputs, SamplingParams, TokenMask, apply_token_mask, sample_batch
from server.app import load_tokenizer
from server.demo import demo_model

MAX_MODEL_LEN = 1024
NUM_SEEDS = 20
USER = [{"role": "user", "content": "Answer in JSON."}]

SCHEMAS = {
    "object_enum_bounds": {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                       "count": {"type": "integer", "minimum": 3, "maximum": 42},
                       "ok": {"type": "boolean"}},
        "required": ["unit", "count", "ok"], "additionalProperties": False},
    "nested_array": {
        "type": "object",
        "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object",
                                            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                           "tag": {"enum": ["a", "b"]}},
                                            "required": ["x", "tag"], "additionalProperties": False}}},
        "required": ["points"], "additionalProperties": False},
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                           {"type": "null"}]},
                       "kind": {"const": "v1"}},
        "required": ["value", "kind"], "additionalProperties": False},
    "numbers_and_strings": {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
                       "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}},
                                 "required": ["flag"], "additionalProperties": False}},
        "required": ["ratio", "name", "inner"], "additionalProperties": False},
    "bounded_strings": {  # xgrammar's own grammar lets these hold raw control characters and surrogates
        "type": "object",
        "properties": {"note": {"type": "string", "minLength": 1, "maxLength": 6},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
        "required": ["note", "tags"], "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a longer context than tiny_model's: the tools' prompt is ~470 tokens of this byte-level tokenizer
    return demo_model(tmp_path_factory.mktemp("tiny") / "model", replace(TINY, max_position_embeddings=MAX_MODEL_LEN))


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


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield Engine(llm, max_num_batched_tokens=256, max_num_seqs=16, tokenizer=tokenizer)
    llm.close()


def chat(client, stream: bool, max_tokens: int = 120, **kwargs) -> list[tuple[str, str | None, list]]:
    """(content, finish_reason, tool calls as (name, arguments)) per choice of n=NUM_SEEDS seeded choices."""
    return chat_choices(client, stream, model="tiny", messages=USER, n=NUM_SEEDS, seed=1234, temperature=1.0,
                        max_tokens=max_tokens, **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(client, name, stream):
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for content, reason, _ in chat(client, stream, response_format=response_format):
        assert reason == "stop", content
        jsonschema.validate(json.loads(content), schema)


def test_unconstrained_output_is_noise(client):
    """The control: the same request without the grammar does not give JSON of the schema."""
    outputs = chat(client, False, max_tokens=30)
    assert sum(_is_json(content) for content, _, _ in outputs) == 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_guided_json_and_json_object(client):
    schema = SCHEMAS["object_enum_bounds"]
    for content, reason, _ in chat(client, False, extra_body={"guided_json": schema}):
        assert reason == "stop"
        jsonschema.validate(json.loads(content), schema)
    for content, reason, _ in chat(client, False, max_tokens=200, response_format={"type": "json_object"}):
        if reason == "stop":  # an object of random content may run past max_tokens: then its start is JSON's
            assert isinstance(json.loads(content), dict)
        else:
            assert content.startswith("{")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_guided_choice_and_regex(client, stream):
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    for content, reason, _ in chat(client, stream, extra_body={"guided_choice": choices}):
        assert content in choices and reason == "stop"
    pattern = r"[a-c]{2,4}-\d{1,3}"
    for content, reason, _ in chat(client, stream, extra_body={"guided_regex": pattern}):
        assert re.fullmatch(pattern, content) and reason == "stop", content


def test_guided_grammar(client):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    for content, reason, _ in chat(client, False, max_tokens=60, extra_body={"guided_grammar": grammar}):
        assert reason == "stop" and re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))*\)", content), content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structural_tag_segments_validate(client, stream):
    """xgrammar's structural tag: a fixed lead, then a tagged JSON segment of the schema."""
    schema = SCHEMAS["object_enum_bounds"]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Result: "},
        {"type": "tag", "begin": "<data>", "content": {"type": "json_schema", "json_schema": schema},
         "end": "</data>"}]}}
    for content, reason, _ in chat(client, stream, max_tokens=150, response_format=tag):
        match = re.fullmatch(r"Result: <data>(.*)</data>", content, re.DOTALL)
        assert match and reason == "stop", content
        jsonschema.validate(json.loads(match.group(1)), schema)


def test_legacy_structural_tag_segments_validate(client):
    """vLLM's older form: free text, and after a trigger one of the structures, its schema between begin and end."""
    structures = {"a": SCHEMAS["object_enum_bounds"], "b": SCHEMAS["any_of"]}
    tag = {"type": "structural_tag", "triggers": ["<"],
           "structures": [{"begin": f"<{name}>", "schema": schema, "end": f"</{name}>"}
                          for name, schema in structures.items()]}
    num_segments = 0
    for content, reason, _ in chat(client, False, max_tokens=150, response_format=tag):
        for match in re.finditer(r"<(a|b)>(.*?)</\1>", content, re.DOTALL):
            jsonschema.validate(json.loads(match.group(2)), structures[match.group(1)])
            num_segments += 1
        # a trigger always opens a structure: outside the whole segments, only one cut off by max_tokens
        rest = re.sub(r"<(a|b)>(.*?)</\1>", "", content, flags=re.DOTALL)
        tail = rest[rest.find("<"):] if "<" in rest else ""
        assert not tail or (rest.count("<") == 1 and reason == "length"
                            and (tail.startswith(("<a>", "<b>")) or tail in ("<", "<a", "<b"))), content
    assert num_segments  # some outputs have segments: the checks above are not vacuous


def _check_call(name: str, arguments: str) -> None:
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_is_a_valid_call(client, stream):
    for content, reason, calls in chat(client, stream, max_tokens=100, tools=TOOLS, tool_choice="required"):
        assert len(calls) == 1 and reason == "tool_calls", (content, calls)
        _check_call(*calls[0])
        assert not content.strip()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice_is_a_valid_call(client, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for _, reason, calls in chat(client, stream, max_tokens=60, tools=TOOLS, tool_choice=choice):
        assert len(calls) == 1 and calls[0][0] == "get_time" and reason == "stop", calls
        _check_call(*calls[0])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar"),
])
def test_invalid_specs_are_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": USER, "max_tokens": 4, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    completion = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"prompt": "x", "max_tokens": 4, "guided_regex": "a(b"}, timeout=30)
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "guided_regex"


def test_completions_take_guided_fields(client):
    response = client.completions.create(model="tiny", prompt="The answer:", n=5, seed=3, max_tokens=20,
                                         temperature=1.0, extra_body={"guided_choice": ["left", "right"]})
    assert {c.text for c in response.choices} <= {"left", "right"}


def test_constrained_and_unconstrained_batched_give_the_solo_tokens(engine, tokenizer):
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("Hello there", "Numbers: 1 2", "def")]
    free = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_k=20,
                                                                                         seed=9)]
    solo = [engine.generate([p], params, max_tokens=12, ignore_eos=True)[0] for p, params in zip(prompts, free,
                                                                                                 strict=True)]
    schema = json.dumps(SCHEMAS["nested_array"])
    guided = SamplingParams(temperature=1.0, seed=5, guided=GuidedSpec("json_schema", schema))
    ids = []
    for p, params in zip(prompts, free, strict=True):
        ids.append(engine.add_request(p, params, max_tokens=12, ignore_eos=True))
        engine.add_request(p, guided, max_tokens=150)
    constrained = [engine.add_request(prompts[0], guided, max_tokens=150) for _ in range(2)]
    while engine.has_work():
        engine.step()
    assert [engine.requests.pop(i).output_ids for i in ids] == solo
    for i in constrained:
        request = engine.requests[i]
        assert request.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(request.output_ids, skip_special_tokens=True)),
                            SCHEMAS["nested_array"])


def test_a_grammar_that_ends_finishes_the_request_with_stop(engine, tokenizer):
    """With ignore_eos there is no stop token: the grammar's end is the request's."""
    params = SamplingParams(temperature=1.0, seed=1, guided=GuidedSpec("choice", json.dumps(["abc", "de"])))
    request_id = engine.add_request(tokenizer.encode("x"), params, max_tokens=50, ignore_eos=True)
    while engine.has_work():
        engine.step()
    request = engine.requests.pop(request_id)
    assert request.finish_reason == "stop" and tokenizer.decode(request.output_ids) in ("abc", "de")


def test_engine_refuses_invalid_specs_and_caches_grammars(engine, tokenizer):
    with pytest.raises(ValueError, match="invalid regex"):
        engine.add_request([1, 2], SamplingParams(guided=GuidedSpec("regex", "(")))
    assert not engine.has_work()
    cache = GrammarCache(512, tokenizer, max_entries=2)
    specs = [GuidedSpec("regex", f"a{{{k}}}") for k in range(1, 4)]
    first = cache.get(specs[0])
    assert cache.get(specs[0]) is first
    cache.get(specs[1])
    cache.get(specs[2])
    assert len(cache) == 2 and cache.get(specs[0]) is not first  # the least recently used was dropped
    with pytest.raises(ValueError, match="needs a tokenizer"):
        GrammarCache(512).get(specs[0])


def _mask_of(allowed: list[list[int] | None], vocab_size: int) -> torch.Tensor:
    """The bitmask [rows, ceil(V / 32)] int32 allowing each row's tokens (None: every token)."""
    words = torch.zeros(len(allowed), (vocab_size + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in range(vocab_size) if tokens is None else tokens:
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def test_sample_batch_never_samples_a_masked_token():
    vocab = 100
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * 3
    allowed = [[5, 31, 32, 63, 99], None, [0, 1], None]  # word edges (bit 31 is the int32's sign)
    rows = [RowInputs(SamplingParams(temperature=2.0, presence_penalty=1.0), output_ids=[5]),
            RowInputs(SamplingParams()), RowInputs(SamplingParams(temperature=1.0, logprobs=3)),
            RowInputs(SamplingParams(logit_bias=((7, 100.0),)))]
    mask = TokenMask(_mask_of(allowed, vocab))
    generator = torch.Generator().manual_seed(1)
    seen: list[set[int]] = [set(), set()]
    for _ in range(200):
        result = sample_batch(logits, rows, generator, mask=mask)
        assert result.errors == [None] * 4  # the masked -inf are not errors
        seen[0].add(result.token_ids[0])
        seen[1].add(result.token_ids[2])
        assert result.token_ids[1] == logits[1].argmax().item() and result.token_ids[3] == 7
        assert all(t in allowed[2] for t, _ in result.top_logprobs[2][:2])
    assert seen[0] <= set(allowed[0]) and len(seen[0]) > 1
    assert seen[1] <= set(allowed[2])


def test_no_mask_means_no_work():
    logits = torch.randn(3, 40)
    assert apply_token_mask(logits, None) == (logits, None)  # the logits themselves: nothing copied or computed
    rows = [RowInputs(SamplingParams(temperature=1.0, seed=3))] * 3
    every_token = TokenMask(_mask_of([None] * 3, 40))
    plain = sample_batch(logits, rows, torch.Generator().manual_seed(2))
    masked = sample_batch(logits, rows, torch.Generator().manual_seed(2), mask=every_token)
    assert plain == masked


@pytest.mark.parametrize("shape", [(1, 1), (1, 33), (3, 100), (2, 151_936)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_apply_token_mask_matches_bit_by_bit_and_xgrammar(shape):
    """Against a loop over every (row, token) bit and against xgrammar's own kernel: random words (every bit of
    the int32, the sign included), V not a multiple of 32 (the last word's spare bits ignored)."""
    import xgrammar

    num_rows, vocab = shape
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows, vocab, generator=generator)
    words = torch.randint(-2 ** 31, 2 ** 31, (num_rows, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    masked, disallowed = apply_token_mask(logits, TokenMask(words))
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, words)
    assert torch.equal(masked, expected) and torch.equal(disallowed, expected == float("-inf"))
    if vocab <= 100:  # the loop: each bit read as Python reads an int32's bits (arithmetic shift)
        for row in range(num_rows):
            for token in range(vocab):
                is_allowed = (int(words[row, token // 32]) >> (token % 32)) & 1
                assert masked[row, token].item() == (logits[row, token].item() if is_allowed else float("-inf"))
    with pytest.raises(ValueError, match="one row of ceil"):
        apply_token_mask(logits, TokenMask(words[:, 1:]))


def test_fill_reuses_one_buffer_and_leaves_unconstrained_rows_open(engine):
    """`GuidedRequests.fill`: the constrained rows equal xgrammar's mask filled alone, the others all ones, in
    whatever rows a step puts them; a step after a larger one reuses the buffer without its stale rows; a step
    without constrained rows gets no mask."""
    import xgrammar

    guided = GuidedRequests(engine.grammars)
    spec = GuidedSpec("json_schema", json.dumps(SCHEMAS["object_enum_bounds"]))
    for request_id in (10, 11):
        guided.add(request_id, spec, frozenset({0}))
    alone = xgrammar.allocate_token_bitmask(1, engine.grammars.vocab_size)
    xgrammar.GrammarMatcher(engine.grammars.get(spec), override_stop_tokens=[0]).fill_next_token_bitmask(alone)
    assert not alone.eq(-1).all()  # a real constraint: the rows below tell constrained from open
    assert guided.fill([1, 2]) is None
    first = guided.fill([10, 1, 11]).bitmask  # [3, W]: the batched fill
    assert torch.equal(first[0], alone[0]) and torch.equal(first[2], alone[0]) and first[1].eq(-1).all()
    second = guided.fill([2, 11]).bitmask  # row 0 was constrained last step: open now
    assert second.data_ptr() == first.data_ptr() and second.shape[0] == 2
    assert second[0].eq(-1).all() and torch.equal(second[1], alone[0])
    assert torch.equal(guided.fill([11]).bitmask, alone)  # one matcher alone
    assert len(guided.fill([1, 2, 3, 4, 10]).bitmask) == 5  # more rows than the buffer had: a larger one
