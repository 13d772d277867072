"""gpt-oss's harmony chat format, rendered and parsed here as text, tokenized with the checkpoint's own tokenizer.

A prompt: `<|start|>system<|message|>...<|end|>` (model identity, knowledge cutoff, date, `Reasoning: EFFORT`, the
channels), `<|start|>developer<|message|># Instructions ... # Tools ...<|end|>` (the request's system/developer
messages and its functions as a TypeScript namespace), the conversation, then `<|start|>assistant`. The model
answers with messages `<|channel|>analysis<|message|>...<|end|>` (reasoning), `<|start|>assistant<|channel|>final
<|message|>...<|return|>` (the answer), or a call, `<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`; generation stops at `<|return|>` or `<|call|>`.

Why not openai-harmony at run time: its encoding loads the o200k tiktoken vocabulary by downloading it (or from
TIKTOKEN_ENCODINGS_BASE, checked against a fixed hash), which an offline server does not have, while the
checkpoint's tokenizer has the same vocabulary and special tokens. openai-harmony's renderer and parser are the
tests' oracle for this module (tests/test_server_harmony.py).
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass

from server.errors import APIError
from server.reasoning import partial_tag_length
from server.tool_calls import CallDelta, new_call_id

START, MESSAGE, END, CALL, RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
TAGS = (START, MESSAGE, END, CALL, RETURN, CHANNEL, CONSTRAIN)
STOP_TAGS = (RETURN, CALL)  # the assistant's turn ends with an answer or a call
MESSAGE_ENDS = (END, CALL, RETURN)
ARCHITECTURE = "GptOssForCausalLM"
REASONING_PARSER_NAME = "openai_gptoss"  # vLLM's names of the format's parsers
TOOL_PARSER_NAME = "openai"
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_REASONING_EFFORT = "medium"
FUNCTIONS = "functions."
MAX_HEADER_CHARS = 512  # a header longer than this is not one: the text is content
RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def is_selected(reasoning_choice: str, tool_choice: str, architectures, chat_template: str) -> bool:
    """Whether the server speaks harmony: a parser flag names it, or `auto` meets a gpt-oss checkpoint (its
    architecture, or a chat template that writes channels). Both flags pick the one format; `none` for both
    leaves the chat template and no parsing."""
    if reasoning_choice == REASONING_PARSER_NAME or tool_choice == TOOL_PARSER_NAME:
        return True
    if "auto" not in (reasoning_choice, tool_choice):
        return False
    return ARCHITECTURE in (architectures or ()) or CHANNEL in chat_template


# ---- rendering ----

def render_prompt(messages, tools: list[dict] | None, reasoning_effort: str | None,
                  date: str | None = None) -> str:
    """The prompt text of a chat request (`server.protocol.ChatMessage`s; `tools`: OpenAI tool dicts, None when
    the tool choice leaves them out), ending with `<|start|>assistant`."""
    functions = [tool["function"] for tool in tools or ()]
    effort = reasoning_effort or DEFAULT_REASONING_EFFORT
    parts = [render_system(effort, date or datetime.date.today().isoformat(), bool(functions))]
    instructions = "\n\n".join(m.text() for m in messages if m.role in ("system", "developer"))
    if instructions or functions:
        parts.append(message_text("developer", render_developer(instructions, functions)))
    parts.extend(_conversation(messages))
    return "".join(parts) + START + "assistant"


def message_text(author: str, content: str, channel: str | None = None, recipient: str | None = None,
                 content_type: str | None = None, end: str = END) -> str:
    header = author + (f" to={recipient}" if recipient else "") + (CHANNEL + channel if channel else "")
    header += f" {content_type}" if content_type else ""
    return START + header + MESSAGE + content + end


def render_system(effort: str, date: str, has_functions: bool) -> str:
    channels = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    sections = [f"{MODEL_IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}",
                f"Reasoning: {effort}", channels]
    return message_text("system", "\n\n".join(sections))


def render_developer(instructions: str, functions: list[dict]) -> str:
    sections = ["# Instructions", instructions] if instructions else []
    if functions:
        lines = ["## functions\n", "namespace functions {\n"]
        for function in functions:
            lines.extend(f"// {line}" for line in _lines(function.get("description") or ""))
            parameters = function.get("parameters")
            signature = f"(_: {schema_to_typescript(parameters, '')})" if parameters is not None else "()"
            lines.append(f"type {function['name']} = {signature} => any;\n")
        lines.append("} // namespace functions")
        sections.append("# Tools\n\n" + "\n".join(lines))
    return "\n\n".join(sections)


def _conversation(messages) -> list[str]:
    """The user/assistant/tool messages. The reasoning of earlier turns is left out (gpt-oss is trained to see
    only the current turn's); the current turn's (after the last user message) stays, for the calls it made."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    call_names: dict[str, str] = {}
    out = []
    for index, message in enumerate(messages):
        if message.role == "user":
            out.append(message_text("user", message.text()))
        elif message.role == "assistant":
            if message.reasoning_content and index > last_user:
                out.append(message_text("assistant", message.reasoning_content, "analysis"))
            if not message.tool_calls:
                if message.text() or not message.reasoning_content:
                    out.append(message_text("assistant", message.text(), "final"))
                continue
            if message.text():  # a preamble before the calls
                out.append(message_text("assistant", message.text(), "commentary"))
            for call in message.tool_calls:
                arguments = call.function.arguments
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                if call.id:
                    call_names[call.id] = call.function.name
                out.append(message_text("assistant", arguments, "commentary", FUNCTIONS + call.function.name,
                                        CONSTRAIN + "json", CALL))
        elif message.role == "tool":
            name = call_names.get(message.tool_call_id or "", message.name)
            if not name:
                raise APIError(400, f"messages.{index}: a tool message needs the tool_call_id of an earlier "
                                    f"assistant tool call (or its function's name in `name`)", param="messages")
            out.append(message_text(FUNCTIONS + name, message.text(), "commentary", "assistant"))
    return out


def _lines(text: str) -> list[str]:
    """Rust's `str::lines`, as openai-harmony splits descriptions: on "\\n", no last empty line, "\\r" dropped."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _is_enum(schema: dict) -> bool:
    return isinstance(schema.get("enum"), list) and bool(schema["enum"])


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _default(schema: dict, quote_enum: bool = False) -> str:
    """`default: VALUE` as openai-harmony writes it: a string default quoted unless the schema is an enum."""
    value = schema["default"]
    if isinstance(value, str) and not _is_enum(schema):
        return f'default: "{value}"'
    if isinstance(value, str) and not quote_enum:
        return f"default: {value}"
    return f"default: {_json(value)}"


def _with_null(variant, type_text: str) -> str:
    if isinstance(variant, dict) and variant.get("nullable") is True and "null" not in type_text:
        return type_text + " | null"
    return type_text


def schema_to_typescript(schema, indent: str) -> str:
    """A JSON schema as the TypeScript type openai-harmony renders for a function's parameters."""
    if not isinstance(schema, dict):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        out = ""
        for variant in one_of:
            out += f"\n{indent} | " + _with_null(variant, schema_to_typescript(variant, indent + "   "))
            comments = []
            if isinstance(variant, dict) and isinstance(variant.get("description"), str):
                comments.append(variant["description"])
            if isinstance(variant, dict) and "default" in variant:
                comments.append(_default(variant, quote_enum=True))
            if comments:
                out += " // " + " ".join(comments)
        return out
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        return " | ".join(names) if names else "any"
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        values = [f'"{v}"' for v in schema.get("enum") or () if isinstance(v, str)] \
            if isinstance(schema.get("enum"), list) else []
        return " | ".join(values) if values else "string"
    if kind in ("number", "integer", "boolean"):
        return "boolean" if kind == "boolean" else "number"
    if kind == "array":
        return schema_to_typescript(schema["items"], indent) + "[]" if "items" in schema else "Array<any>"
    return "any"


def _object_type(schema: dict, indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    properties = schema.get("properties")
    required = schema.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    for key, value in (properties.items() if isinstance(properties, dict) else ()):
        value = value if isinstance(value, dict) else {}
        optional = "" if key in required else "?"
        if isinstance(value.get("title"), str):
            out += f"{indent}// {value['title']}\n{indent}//\n"
        if "oneOf" not in value and isinstance(value.get("description"), str):
            out += f"{indent}// {value['description']}\n"
        examples = value.get("examples")
        if isinstance(examples, list) and examples:
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
        if isinstance(value.get("oneOf"), list):
            out += _one_of_property(key + optional, value, indent)
            continue
        out += f"{indent}{key}{optional}: " + _with_null(value, schema_to_typescript(value, indent + "    ")) + ","
        if "oneOf" not in value and "default" in value:
            out += " // " + _default(value)
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(name: str, value: dict, indent: str) -> str:
    variants = value["oneOf"]
    description = value.get("description") if isinstance(value.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    is_above = description is not None and first.get("description") != description
    out = f"{indent}// {description}\n" if is_above else ""
    if "default" in value:
        out += f"{indent}// {_default(value)}\n"
    out += f"{indent}{name}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | " + _with_null(variant, schema_to_typescript(variant, indent + "   "))
        variant = variant if isinstance(variant, dict) else {}
        comments = []
        own = variant.get("description")
        if not (i == 0 and is_above) and isinstance(own, str) and own != description:
            comments.append(own)
        if "default" in variant:
            comments.append(_default(variant))
        out += (" // " + " ".join(comments) if comments else "") + "\n"
    return out + f"{indent},\n"


def forced_prefix(function_name: str | None) -> str:
    """The opening of a call (of `function_name`; None: of any function) for a forced tool choice."""
    if function_name is None:
        return CHANNEL + "commentary to=" + FUNCTIONS
    return f"{CHANNEL}commentary to={FUNCTIONS}{function_name} {CONSTRAIN}json{MESSAGE}"


# ---- parsing the output ----

@dataclass(frozen=True)
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


class HarmonyParser:
    """The output text, fed piece by piece (`feed`, then `finish` once): the analysis channel is reasoning, the
    final channel (and commentary without a recipient, a preamble) content, a message to `functions.NAME` a call
    whose arguments stream as they come. The output continues a prompt that ends with `<|start|>assistant`, so it
    starts in a message's header. A tail that could still become a tag waits for the next piece; text that is no
    header (a model that does not write harmony) is content."""

    def __init__(self, forced_prefix: str = ""):
        self._state = "header"  # header -> body -> between (after a message's end) -> header ...
        self._pending = ""  # text not handed out yet
        self._kind = "content"  # of the body: reasoning, content or call
        self.calls: list[_Call] = []
        # A forced call's prefix opens the call in the prompt: its id and name go out with the first piece.
        self._unsent = _Out()
        self._pending = forced_prefix
        while self._step(self._unsent):
            pass

    def feed(self, text: str) -> HarmonyDelta:
        self._pending += text
        out, self._unsent = self._unsent, _Out()
        while self._step(out):
            pass
        return out.delta()

    def finish(self) -> HarmonyDelta:
        out, self._unsent = self._unsent, _Out()
        pending, self._pending = self._pending, ""
        if self._state == "body":
            self._emit(out, pending)
        elif self._state == "header" and pending and not any(tag in pending for tag in TAGS):
            out.content += pending  # text that never became a header
        return out.delta()

    def _step(self, out: _Out) -> bool:
        """Consumes what it can of the pending text; False when it has to wait for more."""
        if self._state == "between":
            stripped = self._pending.lstrip()
            if stripped.startswith(START):
                self._state, self._pending = "header", stripped[len(START):]
                return True
            if START.startswith(stripped):
                return False
            self._state, self._kind = "body", "content"  # text outside a message
            return True
        if self._state == "header":
            return self._header(out)
        end, tag = _first_tag(self._pending, MESSAGE_ENDS)
        if end < 0:
            keep = max(partial_tag_length(self._pending, t) for t in MESSAGE_ENDS)
            self._emit(out, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        self._emit(out, self._pending[:end])
        self._pending, self._state = self._pending[end + len(tag):], "between"
        return True

    def _header(self, out: _Out) -> bool:
        end = self._pending.find(MESSAGE)
        if end < 0:
            if len(self._pending) > MAX_HEADER_CHARS and not any(t in self._pending for t in TAGS):
                self._state, self._kind = "body", "content"
                return True
            return False
        header, self._pending, self._state = self._pending[:end], self._pending[end + len(MESSAGE):], "body"
        recipient = RECIPIENT.search(header.replace(CONSTRAIN, " "))
        channel = CHANNEL_NAME.search(header)
        if recipient is not None and recipient.group(1) != "assistant":
            name = recipient.group(1).removeprefix(FUNCTIONS)
            self.calls.append(_Call(new_call_id(), name))
            out.calls.append(CallDelta(len(self.calls) - 1, self.calls[-1].id, name))
            self._kind = "call"
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
        return True

    def _emit(self, out: _Out, text: str) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "content":
            out.content += text
        else:
            self.calls[-1].arguments += text
            out.calls.append(CallDelta(len(self.calls) - 1, arguments=text))


class _Out:
    def __init__(self):
        self.reasoning, self.content, self.calls = "", "", []

    def delta(self) -> HarmonyDelta:
        merged: list[CallDelta] = []  # one delta per call and feed
        for call in self.calls:
            if merged and merged[-1].index == call.index:
                last = merged.pop()
                call = CallDelta(call.index, last.id, last.name, last.arguments + call.arguments)
            merged.append(call)
        return HarmonyDelta(self.reasoning, self.content, tuple(merged))


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    found = [(text.find(tag), tag) for tag in tags if tag in text]
    return min(found) if found else (-1, "")
