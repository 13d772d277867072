"""Reasoning models' `<think>...</think>`: the text inside is `reasoning_content`, the text after it `content`.

`ReasoningParser` is fed the output text piece by piece (`feed`, then `finish` once at the end) and returns what
each piece adds to the reasoning and to the content. It never hands out part of a tag: a tail that could still
become `<think>` or `</think>` waits for the next piece. Where the rendered prompt opens the think block itself
(DeepSeek-R1, DeepSeek-V3.2 in thinking mode, Kimi-K2.5, GLM-4.7 / GLM-5, MiniMax-M2: the prompt ends with
`<think>`) the output starts inside it; where it does not (a template that closed the block for
`chat_template_kwargs` such as `{"thinking": false}` or `{"enable_thinking": false}`, or one that leaves the tag to
the model), a think block counts only at the start of the output, and an output that does not start with one is all
content (`for_prompt`).

`ThinkInContentParser` (`minimax_m2_append_think`) returns the think block, tags and all, as content, in front of
the rest: MiniMax-M2's template reads the reasoning of earlier turns back from `<think>` blocks in the assistant
messages' content, and MiniMax recommends sending it back so (clients drop `reasoning_content`). Tool calls are
still only read after the block.

Every format here uses the same tags; the names (`--reasoning-parser`) are the models' for vLLM compatibility.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag` (and not all of it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    keeps_think_in_content = False  # True: `reasoning` deltas are the think block's raw text, content to the client

    def __init__(self, is_thinking_at_start: bool = False):
        self._state = "reasoning" if is_thinking_at_start else "start"  # start -> reasoning -> after_think -> content
        self._pending = ""  # always the end of the text fed so far: what is not handed out yet

    @staticmethod
    def prompt_opens_thinking(prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK_START)

    @classmethod
    def for_prompt(cls, prompt_text: str) -> ReasoningParser:
        """The parser of an output that continues `prompt_text`."""
        return cls(cls.prompt_opens_thinking(prompt_text))

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        reasoning = ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(THINK_START):
                self._state, self._pending = "reasoning", stripped[len(THINK_START):]
            elif THINK_START.startswith(stripped):
                return ReasoningDelta()  # empty or a partial "<think>": wait
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._pending.find(THINK_END)
            if end < 0:
                keep = partial_tag_length(self._pending, THINK_END)
                reasoning = self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return ReasoningDelta(reasoning=reasoning)
            reasoning, self._pending = self._pending[:end], self._pending[end + len(THINK_END):]
            self._state = "after_think"
        if self._state == "after_think":
            # Templates put a newline or two after the closing tag; the content starts after them.
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return ReasoningDelta(reasoning=reasoning)
            self._state = "content"
        content, self._pending = self._pending, ""
        return ReasoningDelta(reasoning=reasoning, content=content)

    def finish(self) -> ReasoningDelta:
        """What is still held back: an unfinished tag is text like any other at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=pending)
        return ReasoningDelta(content=pending)


class ThinkInContentParser(ReasoningParser):
    """Splits as `ReasoningParser` does, but hands the think block out as it was written, its tags (and the
    newlines after them) included, in `reasoning`, for the caller to put in the content; when the prompt opened the
    block, its opening (`<think>` and what follows it in the prompt) comes first."""

    keeps_think_in_content = True

    def __init__(self, is_thinking_at_start: bool = False, opening: str = THINK_START):
        super().__init__(is_thinking_at_start)
        self._unsent = opening if is_thinking_at_start else ""  # raw text not handed out, `_pending` its end

    @classmethod
    def for_prompt(cls, prompt_text: str) -> ThinkInContentParser:
        if not cls.prompt_opens_thinking(prompt_text):
            return cls()
        return cls(True, prompt_text[prompt_text.rindex(THINK_START):])

    def feed(self, text: str) -> ReasoningDelta:
        self._unsent += text
        return self._raw(super().feed(text))

    def finish(self) -> ReasoningDelta:
        return self._raw(super().finish())

    def _raw(self, delta: ReasoningDelta) -> ReasoningDelta:
        # The content is the end of what the base parser let go of; everything before it is the think block.
        released = self._unsent[:len(self._unsent) - len(self._pending)]
        self._unsent = self._unsent[len(released):]
        return ReasoningDelta(reasoning=released[:len(released) - len(delta.content)], content=delta.content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser, "deepseek_r1": ReasoningParser, "deepseek_v3": ReasoningParser,
    "kimi_k2": ReasoningParser, "glm45": ReasoningParser, "minimax_m2": ReasoningParser,
    "minimax_m2_append_think": ThinkInContentParser}
# openai_gptoss: gpt-oss's harmony format, which `server.harmony` renders and parses whole (tool calls too)
REASONING_PARSER_CHOICES = ("auto", "none", *REASONING_PARSERS, "openai_gptoss")
MINIMAX_MARKER = "<minimax:tool_call>"
# checkpoints whose output is always read for a think block: DeepSeek-V3.2's encoding writes the tags itself
THINKING_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def choose_reasoning_parser(choice: str, chat_template: str, vocab: dict[str, int],
                            architectures=()) -> type[ReasoningParser] | None:
    """The parser class for `--reasoning-parser`. `auto`: none unless the vocabulary has both think tags (or the
    config.json `architectures` are DeepSeek-V3.2's or GLM-5's); MiniMax-M2 (its tool-call tag in the template or
    vocabulary) keeps the think block in the content, as MiniMax recommends for multi-turn use (`minimax_m2`
    splits it out instead); every other model gets `reasoning_content`."""
    if choice in ("none", "openai_gptoss"):
        return None
    if choice != "auto":
        return REASONING_PARSERS[choice]
    if any(a in THINKING_ARCHITECTURES for a in architectures or ()):
        return ReasoningParser
    if THINK_START not in vocab or THINK_END not in vocab:
        return None
    if MINIMAX_MARKER in vocab or MINIMAX_MARKER in chat_template:
        return ThinkInContentParser
    return ReasoningParser
