"""Qwen3-Coder's tool calls (Qwen3.5 and Qwen3-Coder-Next write them too), streamed as they are written."""

from __future__ import annotations

import json

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
from server.typed_arguments import is_string_parameter, typed_value

QWEN_FUNCTION, QWEN_FUNCTION_END = "<function=", "</function>"
QWEN_PARAMETER, QWEN_PARAMETER_END = "<parameter=", "</parameter>"
MAX_QWEN_NAME_CHARS = 256  # a function or parameter name longer than this is not one: the text is content


class Qwen3CoderToolParser(ToolCallParser):
    """Qwen3-Coder, Qwen3.5, Qwen3-Coder-Next: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>
    \\n</function>\\n</tool_call>` (more functions or parameters in a row), each value as text (`typed_value`;
    Python's True/False/None too, as the template writes them). The calls stream: a call's id and name as soon as
    its `<function=NAME>` is whole, its arguments as JSON text growing one argument at a time, a string argument's
    text as it comes. A call cut off by the end of the output keeps the arguments' text it had (no closing brace:
    not JSON, so it cannot pass for whole). Text before a call is content; so is what is not a call (a
    `<tool_call>` without a function, text in a function other than arguments, text between or after calls other
    than whitespace)."""

    name = "qwen3_coder"
    marker = QWEN_FUNCTION  # Hermes templates have <tool_call> too
    start_tag = "<tool_call>"
    call_end_tag = "</tool_call>"
    tags = ("<tool_call>", "</tool_call>")
    is_streaming = True
    # Their checkpoints write this format; a template that shows Hermes' JSON calls still wins (`matches`).
    architectures = ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")

    def __init__(self, forced_prefix: str = "", tools: list[dict] | None = None):
        self._parameters = parameter_schemas(tools)
        # text -> open (after <tool_call>) -> body (in a function) -> string | value (in an argument) -> body ...
        # -> close (after </function>) -> text
        self._state = "text"
        self._pending = ""  # text not handed out yet
        self._scanned = 0  # in a non-string value: how much of `_pending` has no end tag
        self._is_after_call = False  # in text: whitespace after a call is dropped unless other text follows
        self._held_space = ""
        self._is_value_start = False  # a string value's first newline is the template's
        self._argument_schema = None
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
            out.content += self.start_tag + pending  # never became a call
        elif self._state == "close":
            out.content += pending if pending.strip() else ""
        elif self._state == "string":
            self._emit(out, json_string_text(pending))
        return out.delta()

    def _step(self, out: DeltaPieces) -> bool:
        """Consumes what it can of the pending text; False when it has to wait for more."""
        if self._state == "text":
            start = self._pending.find(self.start_tag)
            if start < 0:
                end = len(self._pending) - partial_tag_length(self._pending, self.start_tag)
                self._text(out, self._pending[:end])
                self._pending = self._pending[end:]
                return False
            self._text(out, self._pending[:start])
            self._pending, self._state, self._held_space = self._pending[start + len(self.start_tag):], "open", ""
            return True
        if self._state in ("open", "close"):
            return self._between(out)
        if self._state == "body":
            return self._body(out)
        if self._state == "string":
            return self._string(out)
        end = self._pending.find(QWEN_PARAMETER_END, max(self._scanned - len(QWEN_PARAMETER_END) + 1, 0))
        if end < 0:
            self._scanned = len(self._pending)
            return False
        value = typed_value(self._pending[:end], self._argument_schema, has_python_literals=True)
        self._emit(out, json.dumps(value, ensure_ascii=False))
        self._pending, self._state = self._pending[end + len(QWEN_PARAMETER_END):], "body"
        return True

    def _text(self, out: DeltaPieces, text: str) -> None:
        if not self._is_after_call:
            out.content += text
        elif text.strip():
            out.content, self._held_space, self._is_after_call = out.content + self._held_space + text, "", False
        else:
            self._held_space += text

    def _between(self, out: DeltaPieces) -> bool:
        """After <tool_call> (`open`) or a function (`close`): a function's opening, or the call's end."""
        self._pending = self._pending.lstrip()
        if self._pending.startswith(QWEN_FUNCTION):
            name_end = self._pending.find(">", len(QWEN_FUNCTION), len(QWEN_FUNCTION) + MAX_QWEN_NAME_CHARS)
            name = self._pending[len(QWEN_FUNCTION):name_end].strip()
            if name_end >= 0 and name and not any(c.isspace() or c == "<" for c in name):
                self._open_call(out, name)
                self._pending, self._state = self._pending[name_end + 1:], "body"
                return True
            if name_end < 0 and len(self._pending) <= len(QWEN_FUNCTION) + MAX_QWEN_NAME_CHARS:
                return False
        elif self._state == "close" and self._pending.startswith(self.call_end_tag):
            self._pending, self._state, self._is_after_call = self._pending[len(self.call_end_tag):], "text", True
            return True
        elif any(tag.startswith(self._pending) for tag in (QWEN_FUNCTION, self.call_end_tag)):
            return False
        if self._state == "open":  # <tool_call> and no function: text
            out.content += self.start_tag
        self._state, self._is_after_call = "text", self._state == "close"
        return True

    def _open_call(self, out: DeltaPieces, name: str) -> None:
        self._calls.append(StreamedCall(new_call_id(), name, []))
        out.calls.append(CallDelta(len(self._calls) - 1, self._calls[-1].id, name))
        self._num_arguments = 0
        self._emit(out, "{")

    def _body(self, out: DeltaPieces) -> bool:
        """In a function: an argument's opening, or the function's end."""
        self._pending = self._pending.lstrip()
        if self._pending.startswith(QWEN_PARAMETER):
            key_end = self._pending.find(">", len(QWEN_PARAMETER), len(QWEN_PARAMETER) + MAX_QWEN_NAME_CHARS)
            if key_end < 0:
                if len(self._pending) <= len(QWEN_PARAMETER) + MAX_QWEN_NAME_CHARS:
                    return False
                return self._stray(out)
            key = self._pending[len(QWEN_PARAMETER):key_end].strip()
            self._argument_schema = self._parameters.get(self._calls[-1].name, {}).get(key)
            is_string = is_string_parameter(self._argument_schema)
            self._emit(out, (", " if self._num_arguments else "") + json.dumps(key, ensure_ascii=False) + ": "
                       + ('"' if is_string else ""))
            self._num_arguments += 1
            self._pending, self._scanned = self._pending[key_end + 1:], 0
            self._state, self._is_value_start = ("string" if is_string else "value"), True
            return True
        for tag, state in ((QWEN_FUNCTION_END, "close"), (self.call_end_tag, "text")):
            if self._pending.startswith(tag):
                self._emit(out, "}")
                self._pending, self._state = self._pending[len(tag):], state
                self._is_after_call = state == "text"
                return True
        if any(tag.startswith(self._pending) for tag in (QWEN_PARAMETER, QWEN_FUNCTION_END, self.call_end_tag)):
            return False
        return self._stray(out)

    def _stray(self, out: DeltaPieces) -> bool:
        """Text in a function that is no argument: content, up to the next tag."""
        end = self._pending.find("<", 1)
        end = len(self._pending) if end < 0 else end
        out.content += self._pending[:end]
        self._pending = self._pending[end:]
        return True

    def _string(self, out: DeltaPieces) -> bool:
        """A string argument's text, streamed but for a tail that could be the newline and tag that end it."""
        if self._is_value_start:
            if not self._pending:
                return False
            self._pending, self._is_value_start = self._pending.removeprefix("\n"), False
        end = self._pending.find(QWEN_PARAMETER_END)
        if end >= 0:
            self._emit(out, json_string_text(self._pending[:end].removesuffix("\n")) + '"')
            self._pending, self._state = self._pending[end + len(QWEN_PARAMETER_END):], "body"
            return True
        send = self._pending[:len(self._pending) - partial_tag_length(self._pending, QWEN_PARAMETER_END)]
        send = send.removesuffix("\n")
        self._emit(out, json_string_text(send))
        self._pending = self._pending[len(send):]
        return False

    def _emit(self, out: DeltaPieces, arguments: str) -> None:
        if arguments:
            self._calls[-1].pieces.append(arguments)
            out.calls.append(CallDelta(len(self._calls) - 1, arguments=arguments))

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        return "<tool_call>\n<function=" + (f"{function_name}>\n" if function_name is not None else "")

    @classmethod
    def matches(cls, chat_template: str, vocab: dict[str, int], architectures) -> bool:
        if cls.marker in chat_template:
            return True
        return any(a in cls.architectures for a in architectures or ()) and cls.start_tag not in chat_template
