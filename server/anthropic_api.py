"""`POST /v1/messages` and `/v1/messages/count_tokens`: the Anthropic Messages API over the chat pipeline
(`server.chat.start_chat`: the same template, tokenizer, engine and reasoning / tool-call parsers), its output
returned as Anthropic content blocks (thinking, text, tool_use) or streamed as Anthropic's events: message_start,
then per block content_block_start, its deltas and content_block_stop, then message_delta (stop reason and usage)
and message_stop; an error after the stream started is an `error` event. Errors are Anthropic-shaped
(`{"type": "error", "error": {"type", "message"}}`); `is_anthropic_path` tells the app which shape a path gets.

Ids: messages are "msg_...", tool_use blocks "toolu_..." where the server made the call's id up; an id the model
wrote itself (Kimi's `functions.NAME:IDX`) is kept, since its template reads it back in the next turn.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.requests import Request

from server.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat_request
from server.chat import ChatChoice, parse_output, prepare_chat, start_chat
from server.engine_loop import Output
from server.errors import APIError
from server.serving import Generation, GenerationStream, ServerState, collect_unless_disconnected, off_loop

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def _tool_input(arguments: str) -> dict:
    """A call's arguments (the parsers' JSON text of an object) as tool_use's `input` object."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stop(out: Output | None, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the output ended."""
    if out is not None and out.finish_reason == "length":
        return "max_tokens", None
    if has_calls:  # the client's agent loop must run the calls, whatever else ended the turn
        return "tool_use", None
    if out is not None and out.stop_string is not None:
        return "stop_sequence", out.stop_string
    return "end_turn", None


@dataclass
class _Message:
    """What the response or its events repeat."""

    id: str
    model: str
    num_input_tokens: int
    shows_thinking: bool

    def body(self, content: list, stop: tuple[str | None, str | None], num_output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": self.num_input_tokens, "output_tokens": num_output_tokens}}


async def create_message(state: ServerState, body: MessagesRequest, raw: Request):
    request, generation, choices, info = await start_chat(state, to_chat_request(body), MESSAGES_PATH)
    message = _Message(f"msg_{uuid.uuid4().hex}", info.model, info.num_prompt_tokens, body.shows_thinking)
    if request.stream:
        return GenerationStream(_stream(message, generation, choices[0]), generation)
    return await collect_unless_disconnected(raw, generation, lambda: _collect(message, generation, choices[0]))


async def count_tokens(state: ServerState, body: CountTokensRequest) -> dict:
    _, prompt_ids, _, _ = await off_loop(state, prepare_chat, state, to_chat_request(body), COUNT_TOKENS_PATH)
    return {"input_tokens": len(prompt_ids)}


async def _collect(message: _Message, generation: Generation, choice: ChatChoice) -> JSONResponse:
    last = None
    async for _, out in generation.events():
        await parse_output(choice, out.text)
        if out.finish_reason is not None:
            await parse_output(choice, None)
            last = out
    content: list[dict] = []
    if choice.reasoning and message.shows_thinking:
        content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    content.extend({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                    "input": _tool_input(call.arguments)} for call in choice.tool_calls)
    stop = _stop(last, bool(choice.tool_calls))
    return JSONResponse(message.body(content, stop, sum(generation.num_tokens)))


async def _stream(message: _Message, generation: Generation, choice: ChatChoice):
    yield _event("message_start", {"type": "message_start", "message": message.body([], (None, None), 0)})
    blocks = _Blocks(message.shows_thinking)
    last = None
    try:
        async for _, out in generation.events():
            for event in blocks.events(await parse_output(choice, out.text)):
                yield event
            if out.finish_reason is not None:
                for event in blocks.events(await parse_output(choice, None)):
                    yield event
                last = out
    except APIError as exc:
        yield _event("error", error_body(exc.status, exc.message))
        return
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = _stop(last, bool(choice.tool_calls))
    usage = {"input_tokens": message.num_input_tokens, "output_tokens": sum(generation.num_tokens)}
    yield _event("message_delta", {"type": "message_delta", "usage": usage,
                                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
    yield _event("message_stop", {"type": "message_stop"})


@dataclass
class _Blocks:
    """The content blocks of a stream: a chat delta (reasoning_content, content, tool_calls) -> events, a block
    started when the kind of output changes and stopped before the next one starts."""

    shows_thinking: bool
    num_blocks: int = 0
    open_kind: str | None = None
    pending: list[str] = field(default_factory=list)

    def events(self, delta: dict) -> list[str]:
        self.pending = []
        if delta.get("reasoning_content") and self.shows_thinking:
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            self._open("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call (harmony's later pieces of one carry only more arguments)
                self._open(None, None)
                self._open("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                        "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
        return self.pending

    def close(self) -> list[str]:
        self.pending = []
        self._open(None, None)
        return self.pending

    def _open(self, kind: str | None, block: dict | None) -> None:
        """Makes a block of `kind` the open one (None: none), stopping the one open before."""
        if kind is not None and kind == self.open_kind:
            return
        if self.open_kind is not None:
            self.pending.append(_event("content_block_stop", {"type": "content_block_stop",
                                                              "index": self.num_blocks - 1}))
        self.open_kind = kind
        if kind is not None:
            self.pending.append(_event("content_block_start", {"type": "content_block_start",
                                                               "index": self.num_blocks, "content_block": block}))
            self.num_blocks += 1

    def _delta(self, delta: dict) -> None:
        self.pending.append(_event("content_block_delta", {"type": "content_block_delta",
                                                           "index": self.num_blocks - 1, "delta": delta}))

