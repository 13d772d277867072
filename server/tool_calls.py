"""What the tool-call parsers hand out (`ToolCall`, `CallDelta`, `ToolDelta`) and their base class, `ToolCallParser`:
the formats are in `server.tool_parsers` (and `server.qwen3_coder`), which picks one for a checkpoint."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from server.reasoning import partial_tag_length


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call that streams: its first carries the id and name, every one more of the arguments' text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolDelta:
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # whole calls (the parsers that hand a call out once it is complete)
    call_deltas: tuple[CallDelta, ...] = ()  # pieces of calls (those that stream them: `is_streaming`)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    name = ""
    marker = ""  # text of the template or vocabulary that tells the format apart (`choose_tool_parser`); "": start_tag
    start_tag = ""  # opens the tool-call section
    end_tag = ""  # closes it, where the format has one
    section_tags: tuple[str, ...] = ()  # tags around the calls that are not part of one
    call_end_tag = ""  # ends one call
    call_pattern: re.Pattern  # one whole call
    tags: tuple[str, ...] = ()  # every tag the parser reads: decoding must keep them (`tags_are_special`)
    is_streaming = False  # True: calls come out as `call_deltas`, the whole ones at the end from `streamed_calls`

    def __init__(self, forced_prefix: str = "", tools: list[dict] | None = None):
        """`tools`: the request's tools (OpenAI `{"type": "function", "function": {...}}` dicts), whose parameter
        schemas type the arguments of the formats that write them as text."""
        self._parameters = parameter_schemas(tools)
        # Before the section only a tail that could become the start tag is kept; in it, the text after the last
        # whole call is kept as pieces, each searched once for the call end tag (with the tag's length - 1
        # characters before it), and joined and parsed once a call is whole.
        self._held = ""  # before the section: the end of the text that could still be the start tag
        self._is_in_section = False
        self._pending: list[str] = []  # in the section: the text after the last whole call
        self._pending_tail = ""  # its last len(call_end_tag) - 1 characters, where a tag split across pieces starts
        self.num_calls = 0
        if forced_prefix:
            self.feed(forced_prefix)

    def feed(self, text: str) -> ToolDelta:
        content = ""
        if not self._is_in_section:
            text = self._held + text
            index = text.find(self.start_tag)
            if index < 0:
                end = len(text) - partial_tag_length(text, self.start_tag)
                self._held = text[end:]
                return ToolDelta(content=text[:end])
            content, text, self._held, self._is_in_section = text[:index], text[index:], "", True
        window = self._pending_tail + text
        self._pending.append(text)
        end = window.rfind(self.call_end_tag)
        if end < 0:
            self._pending_tail = window[max(len(window) - len(self.call_end_tag) + 1, 0):]
            return ToolDelta(content=content)
        pending = "".join(self._pending)
        split = len(pending) - len(window) + end + len(self.call_end_tag)  # after the last call end tag
        rest = pending[split:]
        self._pending, self._pending_tail = [rest], rest[max(len(rest) - len(self.call_end_tag) + 1, 0):]
        more, calls = self._parse_calls(pending[:split])
        self.num_calls += len(calls)
        return ToolDelta(content=content + more, tool_calls=calls)

    def _parse_calls(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The calls in `text` (which ends with a call end tag) and what of it is not a call but text: a malformed
        call, or anything but whitespace (and the section's end tag) outside the calls."""
        content, calls, position = "", [], 0
        for match in self.call_pattern.finditer(text):
            content += self._stray(text[position:match.start()])
            position = match.end()
            call = self.parse_call(match)
            if call is None:
                content += match.group(0)  # a malformed call stays text
            else:
                calls.append(call)
        return content + self._stray(text[position:]), tuple(calls)

    def _stray(self, text: str) -> str:
        for tag in self.section_tags:
            text = text.replace(tag, "")
        return text if text.strip() else ""

    def finish(self) -> ToolDelta:
        if not self._is_in_section:
            rest, self._held = self._held, ""
            return ToolDelta(content=rest)
        rest, self._pending, self._pending_tail = "".join(self._pending), [], ""
        if self.end_tag:
            rest = rest.replace(self.end_tag, "")
        return ToolDelta(content=rest if rest.strip() else "")

    def parse_call(self, match: re.Match) -> ToolCall | None:
        raise NotImplementedError

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        """Text that opens a call of `function_name` (None: of any function)."""
        raise NotImplementedError

    @classmethod
    def matches(cls, chat_template: str, vocab: dict[str, int], architectures) -> bool:
        """Whether `auto` picks this format for a checkpoint (tried in `AUTO_ORDER`)."""
        marker = cls.marker or cls.start_tag
        return marker in vocab or marker in chat_template


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schemas (`properties`), from the request's tools."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(function.get("name"), str):
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


@dataclass
class StreamedCall:
    """A call of a parser that streams them (`is_streaming`), as it grows."""

    id: str
    name: str
    pieces: list[str]  # of the arguments' JSON text: joined once, at the end

    def whole(self) -> ToolCall:
        return ToolCall(self.id, self.name, "".join(self.pieces))


def json_string_text(text: str) -> str:
    """`text` as it is inside a JSON string (escaping is per character, so the pieces join into the whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class DeltaPieces:
    """What one `feed` of a streaming parser hands out, the call pieces of one call joined."""

    def __init__(self, unsent: ToolDelta):
        self.content, self.calls = unsent.content, list(unsent.call_deltas)

    def delta(self) -> ToolDelta:
        merged: list[CallDelta] = []
        for call in self.calls:
            if merged and merged[-1].index == call.index:
                last = merged.pop()
                call = CallDelta(call.index, last.id, last.name, last.arguments + call.arguments)
            merged.append(call)
        return ToolDelta(content=self.content, call_deltas=tuple(merged))
