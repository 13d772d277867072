"""Reasoning models' `<think>...</think>`: the text inside is `reasoning_content`, the text after it `content`.

`ReasoningParser` is fed the output text piece by piece (`feed`, then `finish` once at the end) and returns what
each piece adds to the reasoning and to the content. It never hands out part of a tag: a tail that could still
become `<think>` or `</think>` waits for the next piece. A model whose chat template opens the think block itself
(DeepSeek-R1; the prompt ends with `<think>`) starts inside it; otherwise a think block counts only at the start of
the output, and an output that does not start with one is all content.
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
    def __init__(self, is_thinking_at_start: bool = False):
        self._state = "reasoning" if is_thinking_at_start else "start"  # start -> reasoning -> after_think -> content
        self._pending = ""

    @staticmethod
    def prompt_opens_thinking(prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(THINK_START)

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
