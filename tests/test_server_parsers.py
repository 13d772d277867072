"""The server's pure pieces: the incremental detokenizer (UTF-8 across tokens, stop strings across tokens), the
tool-call parsers (Hermes, DeepSeek-V3; all of them for linear time: the other formats against their models' chat
templates are in test_chat_formats.py) and the reasoning parser, each fed whole and piece by piece."""

from __future__ import annotations

import json
import time

import pytest

from hybrid.detokenizer import IncrementalDetokenizer
from server.demo import build_tokenizer
from server.reasoning import ReasoningParser, partial_tag_length
from server.tool_parsers import (
    DeepSeekV3ToolParser,
    Glm47ToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    MiniMaxM2ToolParser,
    ToolDelta,
    choose_tool_parser,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def stream(tokenizer, prompt: str, output: str, stop=()):
    """Feeds `output`'s tokens one by one -> (deltas, detokenizer)."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), tuple(stop))
    deltas, ids = [], tokenizer.encode(output)
    for k, token in enumerate(ids):
        is_stopped = detokenizer.add_token(token)
        deltas.append(detokenizer.take_delta(is_finished=is_stopped or k == len(ids) - 1))
        if is_stopped:
            break
    return deltas, detokenizer


def test_detokenizer_multibyte_characters_across_tokens(tokenizer):
    text = "héllo wörld — 日本語 ünïcödé 🙂 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 2  # characters outside the corpus are split into byte tokens
    deltas, _ = stream(tokenizer, "Hello", text)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_stop_string_spanning_tokens_is_never_streamed(tokenizer):
    output = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(output)
    stop = "fox jum"
    # the stop string covers parts of several tokens
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    deltas, detokenizer = stream(tokenizer, "Hi", output, stop=[stop, "never"])
    assert "".join(deltas) == "The quick brown "
    assert detokenizer.stop_string == stop
    for k in range(1, len(deltas) + 1):  # no prefix of what was streamed reaches into the stop string
        assert stop[:2] not in "".join(deltas[:k])


def test_detokenizer_holds_back_only_a_possible_stop_prefix(tokenizer):
    deltas, detokenizer = stream(tokenizer, "Hi", "Hello! How are you today?", stop=["xyz!"])
    assert "".join(deltas) == "Hello! How are you today?"
    assert detokenizer.stop_string is None
    # while running, the last len("xyz!") - 1 characters wait
    running = IncrementalDetokenizer(tokenizer, [], ("xyz!",))
    for token in tokenizer.encode("Hello there"):
        running.add_token(token)
    assert running.take_delta(is_finished=False) == "Hello th"
    assert running.take_delta(is_finished=True) == "ere"


def test_detokenizer_stop_at_start_gives_empty_text(tokenizer):
    deltas, detokenizer = stream(tokenizer, "Hi", "Hello world", stop=["Hel"])
    assert "".join(deltas) == ""
    assert detokenizer.text == ""


CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
HERMES_TEXT = ("Let me check. <tool_call>\n" + json.dumps(CALL) + "\n</tool_call>\n<tool_call>\n"
               + json.dumps({"name": "get_time", "arguments": {}}) + "\n</tool_call>")


def run_parser(parser, text: str, piece: int, forbidden=("<tool", "<｜")):
    """Feeds `text` in pieces; no content delta may hold (part of) a tag from `forbidden`."""
    content, calls = "", []
    for start in range(0, len(text), piece):
        delta = parser.feed(text[start:start + piece])
        assert not any(tag in delta.content for tag in forbidden), delta.content
        content += delta.content
        calls += delta.tool_calls
    delta = parser.finish()
    return content + delta.content, calls + list(delta.tool_calls)


@pytest.mark.parametrize("piece", [1, 3, 7, 10_000])
def test_hermes_parser_whole_and_streamed(piece):
    content, calls = run_parser(HermesToolParser(), HERMES_TEXT, piece)
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", CALL["arguments"]), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_hermes_parser_plain_text_and_partial_tags(piece):
    text = "a < b and <tool is not a tag, <tool_cal neither"
    assert run_parser(HermesToolParser(), text, piece, forbidden=()) == (text, [])
    # a partial tag at the very end is text once the output ends
    parser = HermesToolParser()
    assert parser.feed("see <tool_ca").content == "see "
    assert parser.finish().content == "<tool_ca"


def test_hermes_parser_malformed_and_unfinished_calls_stay_text():
    bad = "<tool_call>{not json}</tool_call>"
    assert run_parser(HermesToolParser(), bad, 5, forbidden=()) == (bad, [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert run_parser(HermesToolParser(), no_name, 5, forbidden=()) == (no_name, [])
    unfinished = '<tool_call>{"name": "f", "argum'
    assert run_parser(HermesToolParser(), unfinished, 3, forbidden=()) == (unfinished, [])
    # text between calls is text too
    between = HERMES_TEXT.replace("</tool_call>\n<tool_call>", "</tool_call> and then <tool_call>")
    content, calls = run_parser(HermesToolParser(), between, 3, forbidden=())
    assert content == "Let me check.  and then " and [c.name for c in calls] == ["get_weather", "get_time"]


def feed_time(parser: HermesToolParser, num_pieces: int) -> float:
    """CPU seconds of this thread (not wall time: a test beside others on two cores is descheduled for stretches
    longer than the runs; one CI run measured 4x the deltas at 15.8x by the wall clock)."""
    started = time.thread_time()
    for _ in range(num_pieces):
        assert parser.feed("abcd") == ToolDelta()
    return time.thread_time() - started


LONG_CALLS = {
    "hermes": (HermesToolParser, '<tool_call>\n{"name": "save", "arguments": {"text": "', '"}}\n</tool_call>'),
    "deepseek_v3": (DeepSeekV3ToolParser, DeepSeekV3ToolParser.forced_prefix("save") + '{"text": "',
                    '"}\n```<｜tool▁call▁end｜>'),
    "kimi_k2": (KimiK2ToolParser, KimiK2ToolParser.forced_prefix("save") + '0<|tool_call_argument_begin|>{"text": "',
                '"}<|tool_call_end|><|tool_calls_section_end|>'),
    "minimax_m2": (MiniMaxM2ToolParser, MiniMaxM2ToolParser.forced_prefix("save") + '<parameter name="text">',
                   "</parameter>\n</invoke>\n</minimax:tool_call>"),
    "glm47": (Glm47ToolParser, "<tool_call>save<arg_key>text</arg_key><arg_value>", "</arg_value></tool_call>"),
}


@pytest.mark.parametrize("parser_class, opening, closing", LONG_CALLS.values(), ids=LONG_CALLS.keys())
def test_tool_parsers_are_linear_in_an_unfinished_call(parser_class, opening, closing):
    """A long call streamed in many small deltas: the work per delta does not grow with the call, so 4x the
    deltas take about 4x the time (rescanning the unfinished call at every delta: 16x)."""
    def run(num_pieces: int) -> tuple[float, HermesToolParser]:
        parser = parser_class()
        parser.feed(opening)
        return feed_time(parser, num_pieces), parser

    small = min(run(5000)[0] for _ in range(3))
    for _ in range(2):  # a second chance for a machine that was busy elsewhere
        large, parser = run(20_000)
        if large < 8 * small:
            break
    assert large < 8 * small, (small, large)
    calls = parser.feed(closing).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("save", {"text": "abcd" * 20_000})]


def test_hermes_forced_prefix_named_function():
    prefix = HermesToolParser.forced_prefix("get_weather")
    parser = HermesToolParser(prefix)
    content, calls = run_parser(parser, '{"city": "Paris"}}\n</tool_call>', 2)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


DS_TEXT = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
           "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.mark.parametrize("piece", [1, 5, 10_000])
def test_deepseek_v3_parser(piece):
    content, calls = run_parser(DeepSeekV3ToolParser(), DS_TEXT, piece)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]


def test_deepseek_v3_forced_prefix():
    parser = DeepSeekV3ToolParser(DeepSeekV3ToolParser.forced_prefix("get_time"))
    content, calls = run_parser(parser, '{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', 4)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]


def test_choose_tool_parser():
    assert choose_tool_parser("auto", "{{ '<tool_call>' }}", {}) is HermesToolParser
    assert choose_tool_parser("auto", "", {"<｜tool▁calls▁begin｜>": 5, "<tool_call>": 6}) is DeepSeekV3ToolParser
    assert choose_tool_parser("auto", "plain", {"a": 1}) is None
    assert choose_tool_parser("none", "<tool_call>", {}) is None
    assert choose_tool_parser("deepseek_v3", "", {}) is DeepSeekV3ToolParser


def run_reasoning(parser: ReasoningParser, text: str, piece: int, is_tagged: bool = True) -> tuple[str, str]:
    """Feeds `text` in pieces; where its tags are real, no delta may hold part of one."""
    reasoning, content = "", ""
    for start in range(0, len(text), piece):
        delta = parser.feed(text[start:start + piece])
        if is_tagged:
            assert "<th" not in delta.content + delta.reasoning and "</" not in delta.content + delta.reasoning
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content


@pytest.mark.parametrize("piece", [1, 2, 6, 10_000])
def test_reasoning_parser(piece):
    text = "<think>\nThe user says hi. I should greet.\n</think>\n\nHello there!"
    assert run_reasoning(ReasoningParser(), text, piece) == ("\nThe user says hi. I should greet.\n", "Hello there!")
    plain = "Hello <think> is text here"
    assert run_reasoning(ReasoningParser(), plain, piece, is_tagged=False) == ("", plain)
    # DeepSeek-R1 templates open the block in the prompt: the output starts inside it
    opened = ReasoningParser(ReasoningParser.prompt_opens_thinking("<|Assistant|><think>\n"))
    assert run_reasoning(opened, "plan</think>answer", piece) == ("plan", "answer")
    # cut off while thinking: all reasoning
    assert run_reasoning(ReasoningParser(), "<think>still going", piece) == ("still going", "")


def test_partial_tag_length():
    assert partial_tag_length("abc<thi", "<think>") == 4
    assert partial_tag_length("abc<think>", "<think>") == 0
    assert partial_tag_length("abc", "<think>") == 0
