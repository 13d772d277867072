"""DeepSeek-V3.2's tool calls, "DSML" blocks, streamed as they are written:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Hangzhou</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    <｜DSML｜invoke name="...">...</｜DSML｜invoke>
    </｜DSML｜function_calls>

A `string="true"` value is the text as written; any other is JSON (`typed_value`: JSON of a type the tool's schema
allows, else the text). `server.deepseek_v32` renders the prompt that asks for this format.
"""

from __future__ import annotations

import json
import re

from server.deepseek_v32 import (
    ARCHITECTURE,
    CALLS_END,
    CALLS_START,
    DSML,
    INVOKE_END,
    INVOKE_START,
    PARAMETER_END,
    PARAMETER_START,
)
from server.reasoning import partial_tag_length
from server.tool_calls import (
    CallDelta,
    DeltaPieces,
    StreamedCall,
    ToolCall,
    ToolCallParser,
    ToolDelta,
    json_string_text,
    new_call_id,
    parameter_schemas,
)
from server.typed_arguments import typed_value

INVOKE_HEAD = re.compile(re.escape(INVOKE_START) + r'\s+name="(?P<name>[^"<>\s]+)"\s*>')
PARAMETER_HEAD = re.compile(re.escape(PARAMETER_START) + r'\s+name="(?P<key>[^"<>]+)"'
                            r'(?:\s+string="(?P<string>true|false)")?\s*>')
MAX_HEAD_CHARS = 512  # an invoke or parameter opening without its `>` this far in is not one: the text is content


class DeepSeekV32ToolParser(ToolCallParser):
    """The calls stream: a call's id and name as soon as its `<｜DSML｜invoke name="NAME">` is whole, its arguments
    as JSON text growing one argument at a time, a `string="true"` argument's text as it comes. Text before the
    block is content, less the blank line the format puts before it; so is what is not a call (a block opening
    without an invoke, text in a block or a call other than its tags, text after the block other than
    whitespace). A call cut off by the end of the output keeps the arguments' text it had (no closing brace: not
    JSON, so it cannot pass for whole)."""

    name = "deepseek_v32"
    marker = DSML
    start_tag = CALLS_START
    end_tag = CALLS_END
    call_end_tag = INVOKE_END
    tags = (DSML, CALLS_START, CALLS_END, INVOKE_END, PARAMETER_END)
    is_streaming = True
    architectures = (ARCHITECTURE,)

    def __init__(self, forced_prefix: str = "", tools: list[dict] | None = None):
        self._parameters = parameter_schemas(tools)
        # text -> open (after the block's opening) -> invoke (in a call) -> string | value (in an argument) ->
        # invoke ... -> between (after a call) -> invoke ... | text (after the block)
        self._state = "text"
        self._pending = ""  # text not handed out yet
        self._opening = ""  # in `open`: the block's opening and the whitespace before it, text if no call follows
        self._scanned = 0  # in a JSON value: how much of `_pending` has no end tag
        self._is_after_block = False  # in text: whitespace after a block is dropped unless other text follows
        self._held_space = ""
        self._is_in_stray = False  # in a block or call: text that is no tag goes on, up to the next `<`
        self._schema = None  # of the argument being read
        self._num_arguments = 0
        self._calls: list[StreamedCall] = []
        self._unsent = ToolDelta()  # what the forced prefix opened, handed out with the first piece
        if forced_prefix:
            self._unsent = self.feed(forced_prefix)

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def streamed_calls(self) -> list[ToolCall]:
        return [call.whole() for call in self._calls]

    def feed(self, text: str) -> ToolDelta:
        out, self._unsent = DeltaPieces(self._unsent), ToolDelta()
        self._pending += text
        while self._step(out):
            pass
        return out.delta()

    def finish(self) -> ToolDelta:
        out, self._unsent = DeltaPieces(self._unsent), ToolDelta()
        pending, self._pending = self._pending, ""
        if self._state == "text":
            self._text(out, pending)
        elif self._state == "open":
            self._text(out, self._opening + pending)  # never became a call
        elif self._state == "string":
            self._emit(out, json_string_text(pending))
        elif self._state == "value":
            self._emit(out, pending)
        elif pending.strip():  # a tag cut off, or stray text
            out.content += pending
        return out.delta()

    def _step(self, out: DeltaPieces) -> bool:
        """Consumes what it can of the pending text; False when it has to wait for more."""
        if self._state == "text":
            return self._before_block(out)
        if self._state in ("open", "between"):
            return self._between(out)
        if self._state == "invoke":
            return self._invoke(out)
        if self._state == "string":
            return self._string(out)
        end = self._pending.find(PARAMETER_END, max(self._scanned - len(PARAMETER_END) + 1, 0))
        if end < 0:
            self._scanned = len(self._pending)
            return False
        self._emit(out, json.dumps(typed_value(self._pending[:end], self._schema), ensure_ascii=False))
        self._pending, self._state = self._pending[end + len(PARAMETER_END):], "invoke"
        return True

    def _before_block(self, out: DeltaPieces) -> bool:
        """Text, up to a block's opening; whitespace waits, since the format writes a blank line before a block."""
        start = self._pending.find(CALLS_START)
        if start < 0:
            end = len(self._pending) - partial_tag_length(self._pending, CALLS_START)
            end = len(self._pending[:end].rstrip())
            self._text(out, self._pending[:end])
            self._pending = self._pending[end:]
            return False
        text = self._pending[:start].rstrip()
        self._text(out, text)
        self._opening = self._pending[len(text):start + len(CALLS_START)]
        self._pending, self._state = self._pending[start + len(CALLS_START):], "open"
        return True

    def _text(self, out: DeltaPieces, text: str) -> None:
        if not self._is_after_block:
            out.content += text
        elif text.strip():
            out.content, self._held_space, self._is_after_block = out.content + self._held_space + text, "", False
        else:
            self._held_space += text

    def _between(self, out: DeltaPieces) -> bool:
        """After the block's opening (`open`) or a call (`between`): a call's opening, or the block's end."""
        if self._is_in_stray:
            return self._stray(out, self._pending, 0)
        stripped = self._pending.lstrip()
        if stripped.startswith(INVOKE_START):
            head = _head(INVOKE_HEAD, stripped)
            if head is None:
                return False
            if head:
                self._open_call(out, head.group("name"))
                self._pending, self._state, self._held_space = stripped[head.end():], "invoke", ""
                return True
        elif self._state == "between" and stripped.startswith(CALLS_END):
            self._pending, self._state, self._is_after_block = stripped[len(CALLS_END):], "text", True
            return True
        elif not stripped or any(tag.startswith(stripped) for tag in (INVOKE_START, CALLS_END)):
            return False
        if self._state == "open":  # no call: the opening is text, and what follows it is read as text again
            self._state = "text"
            self._text(out, self._opening)
            return True
        return self._stray(out, stripped)

    def _open_call(self, out: DeltaPieces, name: str) -> None:
        self._calls.append(StreamedCall(new_call_id(), name, []))
        out.calls.append(CallDelta(len(self._calls) - 1, self._calls[-1].id, name))
        self._num_arguments = 0
        self._emit(out, "{")

    def _invoke(self, out: DeltaPieces) -> bool:
        """In a call: an argument's opening, or the call's end (or the block's, which ends the call too)."""
        if self._is_in_stray:
            return self._stray(out, self._pending, 0)
        self._pending = self._pending.lstrip()
        if self._pending.startswith(PARAMETER_START):
            head = _head(PARAMETER_HEAD, self._pending)
            if head is None:
                return False
            if not head:
                return self._stray(out, self._pending)
            key, is_string = head.group("key"), head.group("string") == "true"
            self._schema = self._parameters.get(self._calls[-1].name, {}).get(key)
            self._emit(out, (", " if self._num_arguments else "") + json.dumps(key, ensure_ascii=False) + ": "
                       + ('"' if is_string else ""))
            self._num_arguments += 1
            self._pending, self._scanned = self._pending[head.end():], 0
            self._state = "string" if is_string else "value"
            return True
        for tag, state in ((INVOKE_END, "between"), (CALLS_END, "text")):
            if self._pending.startswith(tag):
                self._emit(out, "}")
                self._pending, self._state, self._is_after_block = self._pending[len(tag):], state, state == "text"
                return True
        if not self._pending or any(tag.startswith(self._pending) for tag in (PARAMETER_START, INVOKE_END, CALLS_END)):
            return False
        return self._stray(out, self._pending)

    def _stray(self, out: DeltaPieces, text: str, start: int = 1) -> bool:
        """Text in a block or call that is no tag of it: content, up to the next tag (False: none yet, the text
        goes on in the next piece, whitespace and all)."""
        end = text.find("<", start)
        self._is_in_stray = end < 0
        end = len(text) if end < 0 else end
        out.content += text[:end]
        self._pending = text[end:]
        return not self._is_in_stray

    def _string(self, out: DeltaPieces) -> bool:
        """A string argument's text, streamed but for a tail that could be the tag that ends it."""
        end = self._pending.find(PARAMETER_END)
        if end >= 0:
            self._emit(out, json_string_text(self._pending[:end]) + '"')
            self._pending, self._state = self._pending[end + len(PARAMETER_END):], "invoke"
            return True
        send = len(self._pending) - partial_tag_length(self._pending, PARAMETER_END)
        self._emit(out, json_string_text(self._pending[:send]))
        self._pending = self._pending[send:]
        return False

    def _emit(self, out: DeltaPieces, arguments: str) -> None:
        if arguments:
            self._calls[-1].pieces.append(arguments)
            out.calls.append(CallDelta(len(self._calls) - 1, arguments=arguments))

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        # the format puts a blank line before the block, even after an empty answer
        prefix = "\n\n" + CALLS_START + "\n" + INVOKE_START + ' name="'
        return prefix if function_name is None else prefix + function_name + '">\n'

    @classmethod
    def matches(cls, chat_template: str, vocab: dict[str, int], architectures) -> bool:
        """A template that writes DSML, or the architecture without a template (the server renders V3.2's
        encoding then); V3.2-Exp, the same architecture, ships a template in DeepSeek-V3.1's format."""
        if cls.marker in chat_template:
            return True
        return not chat_template and any(a in cls.architectures for a in architectures or ())


def _head(pattern: re.Pattern, text: str) -> re.Match | bool | None:
    """The tag opening at the start of `text`: its match, None while its `>` may still come, False when it is
    not one."""
    close = text.find(">", 0, MAX_HEAD_CHARS)
    if close < 0:
        return None if len(text) < MAX_HEAD_CHARS else False
    return pattern.fullmatch(text, 0, close + 1) or False
