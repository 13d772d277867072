"""`POST /v1/chat/completions`: messages -> the model's chat template -> token ids -> engine -> text, split by the
reasoning parser (`<think>` -> reasoning_content) and then the tool-call parser (-> tool_calls), streamed as
`chat.completion.chunk` events or returned as one `chat.completion`.

`tool_choice` "none" leaves the tools out of the prompt; "auto" lets the model choose; "required" and a named
function append the text that opens a call (`forced_prefix`) to the prompt, so the model continues a call,
constrained to a valid call of the tools in the parser's format (`server.tool_grammars`; harmony's too); a think
block the prompt opened is closed first. `response_format` and vLLM's `guided_*` fields constrain the output too.
`chat_template_kwargs` go to the template as they are (`{"thinking": false}` for Kimi-K2.5,
`{"enable_thinking": false}` for GLM and Qwen3), and the reasoning parser starts where the rendered prompt leaves
the output: inside a think block or not. DeepSeek-V3.2 has no template: `server.deepseek_v32` writes its prompt
(thinking mode for `{"thinking": true}`).

gpt-oss's harmony format takes the place of all three: `server.harmony` renders the prompt and one parser splits
the output into reasoning, content and calls, the calls' arguments streamed as they come.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from functools import partial

from fastapi.responses import JSONResponse
from starlette.requests import Request

from hybrid.sampling import GuidedSpec
from server import deepseek_v32, harmony
from server.errors import APIError, error_body
from server.prompts import check_encodable, check_prompt_bytes, encode
from server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from server.reasoning import THINK_END, ReasoningParser
from server.serving import (
    SSE_DONE,
    Generation,
    GenerationStream,
    ResponseInfo,
    ServerState,
    check_model,
    collect_unless_disconnected,
    finite_logprob,
    off_loop,
    require_tokenizer,
    resolve_max_tokens,
    response_info,
    sse,
    token_text,
    usage,
)
from server.structured import compile_spec, request_spec
from server.tool_calls import CallDelta, ToolCall, ToolCallParser, ToolDelta
from server.tool_grammars import tool_call_spec


class ChatChoice:
    """One choice's output text through the parsers; accumulates what a non-streaming response returns."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 harmony_parser: harmony.HarmonyParser | None = None):
        """`harmony_parser`: gpt-oss's output, in place of the other two."""
        self.reasoning_parser, self.tool_parser, self.harmony_parser = reasoning, tools, harmony_parser
        self.reasoning, self.content = "", ""
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> dict:
        if self.harmony_parser is not None:
            return self._harmony_delta(self.harmony_parser.feed(text))
        reasoning, content = "", text
        if self.reasoning_parser is not None and text:
            parsed = self.reasoning_parser.feed(text)
            reasoning, content = parsed.reasoning, parsed.content
        parsed = ToolDelta(content)
        if self.tool_parser is not None and content:
            parsed = self.tool_parser.feed(content)
        return self._delta(reasoning, parsed.content, parsed.tool_calls, parsed.call_deltas)

    def flush(self) -> dict:
        """The delta of what the parsers still hold at the end of the output."""
        if self.harmony_parser is not None:
            return self._harmony_delta(self.harmony_parser.finish())
        reasoning, content = "", ""
        if self.reasoning_parser is not None:
            parsed = self.reasoning_parser.finish()
            reasoning, content = parsed.reasoning, parsed.content
        calls, call_deltas = (), ()
        if self.tool_parser is not None:
            fed = self.tool_parser.feed(content) if content else ToolDelta()
            rest = self.tool_parser.finish()
            content = fed.content + rest.content
            calls, call_deltas = fed.tool_calls + rest.tool_calls, fed.call_deltas + rest.call_deltas
            if self.tool_parser.is_streaming:
                self.tool_calls = self.tool_parser.streamed_calls()
        return self._delta(reasoning, content, calls, call_deltas)

    def _delta(self, reasoning: str, content: str, calls: tuple[ToolCall, ...],
               call_deltas: tuple[CallDelta, ...] = ()) -> dict:
        """`calls`: whole ones (their index: how many came before); `call_deltas`: pieces of streamed ones."""
        if self.reasoning_parser is not None and self.reasoning_parser.keeps_think_in_content:
            # the think block precedes the content, and the tool parser never sees it
            reasoning, content = "", reasoning + content
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
            self.reasoning += reasoning
        if content:
            delta["content"] = content
            self.content += content
        if calls:
            delta["tool_calls"] = [_tool_call(call, len(self.tool_calls) + k) for k, call in enumerate(calls)]
            self.tool_calls.extend(calls)
        if call_deltas:
            delta["tool_calls"] = [_call_delta(call) for call in call_deltas]
        return delta

    def _harmony_delta(self, parsed: harmony.HarmonyDelta) -> dict:
        """Reasoning and content as the other parsers', calls as they stream: a call's first delta has its id and
        name, the next ones more of its arguments."""
        delta = self._delta(parsed.reasoning, parsed.content, (), parsed.calls)
        if parsed.calls:
            self.tool_calls = [ToolCall(call.id, call.name, call.arguments) for call in self.harmony_parser.calls]
        return delta

    def finish_reason(self, engine_reason: str, is_named_choice: bool) -> str:
        # OpenAI answers a forced (named) function call with "stop", a call the model chose with "tool_calls".
        if self.tool_calls and engine_reason == "stop" and not is_named_choice:
            return "tool_calls"
        return engine_reason


async def parse_output(choice: ChatChoice, text: str | None) -> dict:
    """`choice.feed(text)`, or `choice.flush()` for None: in a worker thread where a tool-call parser reads the text
    (it parses each finished call whole, however long)."""
    work = choice.flush if text is None else partial(choice.feed, text)
    return await asyncio.to_thread(work) if choice.tool_parser is not None else work()


def _tool_call(call: ToolCall, index: int | None = None) -> dict:
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def _call_delta(call: CallDelta) -> dict:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _message_dict(message: ChatMessage) -> dict:
    # Templates know system/user/assistant/tool; OpenAI's newer "developer" role is the system prompt.
    out = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [_call_dict(call) for call in message.tool_calls]
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def _call_dict(call) -> dict:
    """A call the client sends back, its arguments an object: OpenAI clients send JSON text, and templates that
    write each argument (MiniMax-M2, GLM) iterate over them (those that write JSON text take both)."""
    out = call.model_dump(exclude_none=True)
    arguments = out["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            out["function"]["arguments"] = parsed
    return out


def render_prompt(state: ServerState, request: ChatCompletionRequest) -> tuple[str, type[ToolCallParser] | None]:
    """The prompt text (chat template, plus the opening of a call when the tool choice forces one) and the
    tool-call parser this request's output goes through."""
    use_tools = bool(request.tools) and request.tool_choice != "none"
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if use_tools else None
    if state.model.is_harmony:
        text = harmony.render_prompt(request.messages, tools, request.reasoning_effort)
        return text + _harmony_forced_prefix(request), None
    if state.model.is_deepseek_v32:
        text = deepseek_v32.render_prompt(request.messages, tools, request.chat_template_kwargs)
    else:
        text = _template_prompt(state.model.tokenizer, request, tools)
    parser = state.model.tool_parser if use_tools else None
    prefix = _forced_prefix(parser, request)
    if prefix and ReasoningParser.prompt_opens_thinking(text):
        text += THINK_END  # the forced call is the answer, after an empty think block
    return text + prefix, parser


def _template_prompt(tokenizer, request: ChatCompletionRequest, tools: list[dict] | None) -> str:
    """The prompt text of the checkpoint's chat template, with the request's `chat_template_kwargs`."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) & set(kwargs)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                       param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template([_message_dict(m) for m in request.messages], tools=tools,
                                             add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # a template raises whatever it likes (e.g. "roles must alternate")
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None


def prepare_chat(state: ServerState, request: ChatCompletionRequest, route: str = "/v1/chat/completions",
                 ) -> tuple[str, list[int], type[ToolCallParser] | None, GuidedSpec | None]:
    """The prompt text, its token ids, the tool-call parser and the output's grammar, compiled (run `off_loop`)."""
    check_encodable(request)
    check_model(state, request.model)
    require_tokenizer(state, route)
    spec, param = request_spec(request)
    prompt_text, parser = render_prompt(state, request)
    is_harmony_call = state.model.is_harmony and _harmony_forced_prefix(request)
    if is_harmony_call or _forced_prefix(parser, request):
        name = request.tool_choice.function.name if isinstance(request.tool_choice, NamedToolChoice) else None
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        spec = tool_call_spec(harmony.TOOL_PARSER_NAME if is_harmony_call else parser.name, tools, name)
        param = "tools"
    compile_spec(state, spec, param)
    check_prompt_bytes(prompt_text, state.model.max_token_bytes, state.model.max_model_len, "messages")
    ids = encode(state.model.tokenizer, prompt_text, "messages", add_special_tokens=False)
    return prompt_text, ids, parser, spec


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest, raw: Request):
    request, generation, choices, info = await start_chat(state, request)
    if request.stream:
        return GenerationStream(_stream(state, request, generation, choices, info), generation)
    return await collect_unless_disconnected(
        raw, generation, lambda: _collect(state, request, generation, choices, info))


async def start_chat(state: ServerState, request: ChatCompletionRequest, route: str = "/v1/chat/completions",
                     ) -> tuple[ChatCompletionRequest, Generation, list[ChatChoice], ResponseInfo]:
    """The request as the engine runs it, its started generation (which the caller's response must close), a
    `ChatChoice` per choice and what the response repeats; the Anthropic Messages API shares it."""
    start_time = time.perf_counter()
    prompt_text, prompt_ids, parser, guided = await off_loop(state, prepare_chat, state, request, route)
    max_tokens = resolve_max_tokens(request.max_new_tokens, len(prompt_ids), state.model.max_model_len, "messages")
    reasoning = state.model.reasoning_parser
    prefix = _forced_prefix(parser, request)  # the parser reads the opening of a forced call as output
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
    if state.model.is_harmony:
        choices = [ChatChoice(None, None, harmony.HarmonyParser(_harmony_forced_prefix(request)))
                   for _ in range(request.n)]
    else:
        choices = [ChatChoice(reasoning.for_prompt(prompt_text) if reasoning is not None else None,
                              parser(prefix, tools) if parser is not None else None) for _ in range(request.n)]
    if state.model.has_special_tags and "skip_special_tokens" not in request.model_fields_set:
        request = request.model_copy(update={"skip_special_tokens": False})
    is_named = isinstance(request.tool_choice, NamedToolChoice)
    info = response_info("chatcmpl", state.model.name, len(prompt_ids), is_named)
    generation = Generation(state, request, [prompt_ids], [max_tokens], start_time, guided)
    await generation.start()  # from here on, the response (stream or collection) closes the generation
    return request, generation, choices, info


def _forced_prefix(parser: type[ToolCallParser] | None, request: ChatCompletionRequest) -> str:
    if parser is None or request.tool_choice in (None, "auto", "none"):
        return ""
    name = request.tool_choice.function.name if isinstance(request.tool_choice, NamedToolChoice) else None
    return parser.forced_prefix(name)


def _harmony_forced_prefix(request: ChatCompletionRequest) -> str:
    if not request.tools or request.tool_choice in (None, "auto", "none"):
        return ""
    name = request.tool_choice.function.name if isinstance(request.tool_choice, NamedToolChoice) else None
    return harmony.forced_prefix(name)


def _logprob_entry(tokenizer, token_id: int, logprob: float | None, top: tuple | None) -> dict:
    text = token_text(tokenizer, token_id)
    entry = {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8")),
             "top_logprobs": []}
    for top_id, top_logprob in top or ():
        top_text = token_text(tokenizer, top_id)
        entry["top_logprobs"].append({"token": top_text, "logprob": finite_logprob(top_logprob),
                                      "bytes": list(top_text.encode("utf-8"))})
    return entry


def _merge(delta: dict, more: dict) -> dict:
    for key, value in more.items():
        delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
    return delta


async def _stream(state: ServerState, request: ChatCompletionRequest, generation: Generation,
                  choices: list[ChatChoice], info: ResponseInfo):
    base = {"id": info.id, "object": "chat.completion.chunk", "created": info.created, "model": info.model}
    if request.include_usage:
        base["usage"] = None

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        return sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]})

    try:
        for index in range(len(choices)):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, out in generation.events():
            choice = choices[index]
            delta = await parse_output(choice, out.text)
            logprobs = None
            if request.logprobs and out.token_id is not None:
                logprobs = {"content": [_logprob_entry(state.model.tokenizer, out.token_id, out.logprob,
                                                       out.top_logprobs)]}
            reason = None
            if out.finish_reason is not None:
                delta = _merge(delta, await parse_output(choice, None))
                reason = choice.finish_reason(out.finish_reason, info.is_named_tool_choice)
            if delta or logprobs or reason:
                yield chunk(index, delta, logprobs, reason)
        if request.include_usage:
            yield sse({**base, "choices": [], "usage": usage(info.num_prompt_tokens, sum(generation.num_tokens))})
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield SSE_DONE


async def _collect(state: ServerState, request: ChatCompletionRequest, generation: Generation,
                   choices: list[ChatChoice], info: ResponseInfo) -> JSONResponse:
    logprobs: list[list[dict]] = [[] for _ in choices]
    reasons: list[str | None] = [None] * len(choices)
    async for index, out in generation.events():
        await parse_output(choices[index], out.text)
        if request.logprobs and out.token_id is not None:
            logprobs[index].append(_logprob_entry(state.model.tokenizer, out.token_id, out.logprob,
                                                  out.top_logprobs))
        if out.finish_reason is not None:
            await parse_output(choices[index], None)
            reasons[index] = choices[index].finish_reason(out.finish_reason, info.is_named_tool_choice)
    body = []
    for index, choice in enumerate(choices):
        message: dict = {"role": "assistant", "content": choice.content or (None if choice.tool_calls else "")}
        if state.model.reasoning_parser is not None or state.model.is_harmony:
            message["reasoning_content"] = choice.reasoning or None
        if choice.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in choice.tool_calls]
        body.append({"index": index, "message": message,
                     "logprobs": {"content": logprobs[index]} if request.logprobs else None,
                     "finish_reason": reasons[index]})
    return JSONResponse({"id": info.id, "object": "chat.completion", "created": info.created, "model": info.model,
                         "choices": body, "usage": usage(info.num_prompt_tokens, sum(generation.num_tokens))})
