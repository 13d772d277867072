"""Forced tool calls (`tool_choice` "required" and a named function) in every tool-call format the server parses,
with the demo model's random weights: each call the server returns (required: whole, named: streamed), over
several seeds, is one its own parser read into a declared tool whose arguments validate against the tool's JSON
schema (jsonschema); random walks through each grammar check many more paths without the model.
The demo model gets every format's tags as special tokens (as the real tokenizers have most of them) and each
format's published chat template where tests/fixtures has one."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from server_support import TINY, chat_choices, engine_server

from hybrid.guided import GrammarCache
from server import harmony
from server.app import load_tokenizer
from server.deepseek_v32 import ASSISTANT, BOS, EOS, USER
from server.demo import demo_model
from server.tool_grammars import tool_call_spec
from server.tool_parsers import TOOL_PARSERS, KimiK2ToolParser, MiniMaxM2ToolParser

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
MAX_MODEL_LEN = 4096  # the tiny vocabulary makes long prompts
NUM_SEEDS = 6
SPECIAL_TAGS = (*KimiK2ToolParser.tags, *MiniMaxM2ToolParser.tags, "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", BOS, EOS, USER, ASSISTANT, *harmony.TAGS)
FORMATS = {  # server options, chat template (None: the demo's, or the format's own rendering)
    "hermes": ({"tool_call_parser": "hermes"}, None),
    "deepseek_v3": ({"tool_call_parser": "deepseek_v3"}, None),
    "kimi_k2": ({"tool_call_parser": "kimi_k2"}, "moonshotai-Kimi-K2-Thinking.jinja"),
    "minimax_m2": ({"tool_call_parser": "minimax_m2"}, "MiniMax-M2.jinja"),
    "glm47": ({"tool_call_parser": "glm47"}, "zai-org-GLM-4.7-Flash.jinja"),
    "qwen3_coder": ({"tool_call_parser": "qwen3_coder"}, "qwen3.5-reduced.jinja"),
    "deepseek_v32": ({"chat_format": "deepseek_v32"}, None),
    "openai": ({"tool_call_parser": "openai"}, None),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 2, "maxLength": 8},  # free text
        "code": {"type": "string", "pattern": "^[a-z]{1,3}$"},
        "limit": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        "filters": {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]}}, "required": ["lang"],
                    "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "exact": {"type": "boolean"}},
    "required": ["query", "code"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
USER_MESSAGES = [{"role": "user", "content": "Search for the weather."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    size = replace(TINY, max_position_embeddings=MAX_MODEL_LEN, special_tags=SPECIAL_TAGS)
    return demo_model(tmp_path_factory.mktemp("tiny-tools") / "model", size)


@pytest.fixture(scope="module", params=list(FORMATS))
def client(request, model_dir):
    options, template = FORMATS[request.param]
    if template is not None:
        options = {**options, "chat_template": str(TEMPLATES / template)}
    running, llm = engine_server(model_dir, MAX_MODEL_LEN, served_model_name="tiny", **options)
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    running.stop()
    llm.close()


def chat(client, stream: bool, tool_choice) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """(content, finish_reason, calls as (name, arguments)) of each of NUM_SEEDS seeded choices."""
    return chat_choices(client, stream, model="tiny", messages=USER_MESSAGES, n=NUM_SEEDS, seed=99,
                        temperature=1.0, max_tokens=400, tools=TOOLS, tool_choice=tool_choice)


def check_call(name: str, arguments: str) -> dict:
    assert name in SCHEMAS, name
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


def test_required_tool_choice_is_a_valid_call(client):
    for content, reason, calls in chat(client, False, "required"):
        assert len(calls) == 1 and reason == "tool_calls", (content, reason, calls)
        check_call(*calls[0])
        assert not content.strip(), content


def test_named_tool_choice_is_a_valid_call(client):
    """Streamed (the required choice's test reads whole responses; test_guided reads Hermes' both ways)."""
    choice = {"type": "function", "function": {"name": "search"}}
    optional = set()
    for content, reason, calls in chat(client, True, choice):
        assert len(calls) == 1 and calls[0][0] == "search" and reason == "stop", (content, reason, calls)
        optional |= set(check_call(*calls[0])) - {"query", "code"}
        assert not content.strip(), content
    assert optional  # the optional arguments are written too


def parsed_calls(parser: str, function_name: str | None, text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls as (name, arguments)) of the server's parser for `parser` reading a forced call's output."""
    if parser == "openai":
        harmony_parser = harmony.HarmonyParser(harmony.forced_prefix(function_name))
        delta, rest = harmony_parser.feed(text), harmony_parser.finish()
        return delta.content + rest.content, [(c.name, c.arguments) for c in harmony_parser.calls]
    cls = TOOL_PARSERS[parser]
    tool_parser = cls(cls.forced_prefix(function_name), TOOLS)
    delta, rest = tool_parser.feed(text), tool_parser.finish()
    calls = tool_parser.streamed_calls() if cls.is_streaming else delta.tool_calls + rest.tool_calls
    return delta.content + rest.content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("function_name", [None, "search"], ids=["required", "named"])
@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_random_walks_through_the_grammar_are_valid_calls(model_dir, parser, function_name):
    """Any path through a forced call's grammar is a valid call: tokens drawn at random among those the mask
    allows (what a model of random weights does, many more times than the server test can afford)."""
    import xgrammar

    tokenizer = load_tokenizer(model_dir)
    grammar = GrammarCache(len(tokenizer), tokenizer).get(tool_call_spec(parser, TOOLS, function_name))
    rng, names = random.Random(0), set()
    for _ in range(25):
        matcher = xgrammar.GrammarMatcher(grammar, override_stop_tokens=[tokenizer.eos_token_id])
        bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
        ids = []
        while len(ids) < 500:
            matcher.fill_next_token_bitmask(bitmask)
            logits = torch.zeros(1, len(tokenizer))
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            token = rng.choice(torch.nonzero(logits[0] == 0).flatten().tolist())
            if token == tokenizer.eos_token_id:
                break
            assert matcher.accept_token(token)
            ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = parsed_calls(parser, function_name, text)
        assert len(calls) == 1 and not content.strip(), (text, content, calls)
        check_call(*calls[0])
        names.add(calls[0][0])
    assert names == ({function_name} if function_name else set(SCHEMAS))  # "required": the walk picks the tool


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_a_schema_a_format_cannot_write_is_400(parser):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "object"}]}}}
    if parser in ("minimax_m2", "glm47", "qwen3_coder", "deepseek_v32"):  # one argument at a time: no anyOf
        with pytest.raises(Exception, match="anyOf") as error:
            tool_call_spec(parser, [tool], None)
        assert error.value.param == "tools"
    else:
        assert tool_call_spec(parser, [tool], "f").kind == "structural_tag"
    if parser != "hermes":  # a name the parser cannot read back
        bad = {"type": "function", "function": {"name": "two words", "parameters": {"type": "object"}}}
        with pytest.raises(Exception, match="name") as error:
            tool_call_spec(parser, [bad], None)
        assert error.value.status == 400
