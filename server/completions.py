"""`POST /v1/completions`: prompt text or token ids (one or a batch) -> engine -> text, streamed as
`text_completion` events or returned whole. Choice index = prompt index * n + choice. Without a tokenizer
(`--skip-tokenizer-init`) prompts are token ids, and each choice carries its `token_ids` next to an empty text, as
in vLLM."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from starlette.requests import Request

from server.errors import APIError, error_body
from server.prompts import check_encodable, check_prompt_bytes, encode
from server.protocol import CompletionRequest
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


class _Logprobs:
    """One choice's logprobs in the completions layout (parallel lists, text offsets into the choice's text)."""

    def __init__(self):
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, tokenizer, out, offset: int) -> dict:
        token, logprob = token_text(tokenizer, out.token_id), finite_logprob(out.logprob)
        top = {token_text(tokenizer, token_id): finite_logprob(top_logprob)
               for token_id, top_logprob in out.top_logprobs or ()}
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)
        return {"tokens": [token], "token_logprobs": [logprob], "top_logprobs": [top], "text_offset": [offset]}

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def _prepare(state: ServerState, request: CompletionRequest) -> tuple[list[list[int]], list[int], list[str]]:
    """The prompts' token ids, their max_tokens and each choice's echo (run `off_loop`)."""
    check_encodable(request)
    check_model(state, request.model)
    model = state.model
    if request.echo:
        require_tokenizer(state, "echo", "echo")
    if request.stop_strings:
        require_tokenizer(state, "stop strings", "stop")
    compile_spec(state, *request_spec(request))
    prompts = []
    for prompt in request.prompts:
        if isinstance(prompt, str):
            require_tokenizer(state, "a text prompt", "prompt")
            check_prompt_bytes(prompt, model.max_token_bytes, model.max_model_len, "prompt")
            prompts.append(encode(model.tokenizer, prompt, "prompt", add_special_tokens=True))
        else:
            prompts.append(list(prompt))
    limits = [resolve_max_tokens(request.max_new_tokens, len(p), model.max_model_len, "prompt") for p in prompts]
    echoes = [model.tokenizer.decode(p) if request.echo else "" for p in prompts for _ in range(request.n)]
    return prompts, limits, echoes


def _token_ids(tokenizer, out) -> dict:
    """A chunk's `token_ids` where the server has no tokenizer to give text."""
    if tokenizer is not None:
        return {}
    return {"token_ids": [out.token_id] if out.token_id is not None else []}


async def create_completion(state: ServerState, request: CompletionRequest, raw: Request):
    start_time = time.perf_counter()
    prompts, limits, echoes = await off_loop(state, _prepare, state, request)
    info = response_info("cmpl", state.model.name, sum(len(p) for p in prompts))
    generation = Generation(state, request, prompts, limits, start_time)
    await generation.start()  # from here on, the response (stream or collection) closes the generation
    if request.stream:
        return GenerationStream(_stream(state, request, generation, echoes, info), generation)
    return await collect_unless_disconnected(raw, generation,
                                             lambda: _collect(state, request, generation, echoes, info))


async def _stream(state: ServerState, request: CompletionRequest, generation: Generation, echoes: list[str],
                  info: ResponseInfo):
    base = {"id": info.id, "object": "text_completion", "created": info.created, "model": info.model}
    if request.include_usage:
        base["usage"] = None
    offsets = [len(echo) for echo in echoes]
    logprobs = [_Logprobs() for _ in echoes]

    def chunk(index: int, text: str, choice_logprobs: dict | None = None, finish_reason: str | None = None,
              ids: dict | None = None) -> str:
        return sse({**base, "choices": [{"index": index, "text": text, "logprobs": choice_logprobs,
                                         "finish_reason": finish_reason, **(ids or {})}]})

    try:
        for index, echo in enumerate(echoes):
            if echo:
                yield chunk(index, echo)
        async for index, out in generation.events():
            choice_logprobs = None
            if request.logprobs is not None and out.token_id is not None:
                choice_logprobs = logprobs[index].add(state.model.tokenizer, out, offsets[index])
            offsets[index] += len(out.text)
            ids = _token_ids(state.model.tokenizer, out)
            if out.text or choice_logprobs or out.finish_reason or ids:
                yield chunk(index, out.text, choice_logprobs, out.finish_reason, ids)
        if request.include_usage:
            yield sse({**base, "choices": [], "usage": usage(info.num_prompt_tokens, sum(generation.num_tokens))})
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield SSE_DONE


async def _collect(state: ServerState, request: CompletionRequest, generation: Generation, echoes: list[str],
                   info: ResponseInfo) -> JSONResponse:
    texts = list(echoes)
    ids: list[list[int]] = [[] for _ in echoes]
    reasons: list[str | None] = [None] * len(echoes)
    logprobs = [_Logprobs() for _ in echoes]
    async for index, out in generation.events():
        if request.logprobs is not None and out.token_id is not None:
            logprobs[index].add(state.model.tokenizer, out, len(texts[index]))
        texts[index] += out.text
        if out.token_id is not None:
            ids[index].append(out.token_id)
        if out.finish_reason is not None:
            reasons[index] = out.finish_reason
    has_ids = state.model.tokenizer is None
    choices = [{"index": index, "text": text,
                "logprobs": logprobs[index].as_dict() if request.logprobs is not None else None,
                "finish_reason": reasons[index], **({"token_ids": ids[index]} if has_ids else {})}
               for index, text in enumerate(texts)]
    return JSONResponse({"id": info.id, "object": "text_completion", "created": info.created, "model": info.model,
                         "choices": choices, "usage": usage(info.num_prompt_tokens, sum(generation.num_tokens))})
