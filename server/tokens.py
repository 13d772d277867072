"""vLLM's utility routes: `POST /tokenize` (a text prompt, or chat messages rendered by the model's chat template
exactly as `/v1/chat/completions` renders them), `POST /detokenize`, and `GET /version`. Clients count tokens with
them before they send a request (context budgeting, front-ends' token counters)."""

from __future__ import annotations

from importlib import metadata

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.chat import render_prompt
from server.errors import APIError
from server.prompts import encode
from server.protocol import ChatCompletionRequest, ChatMessage, NonNegInt, Tool
from server.serving import ServerState, check_model, off_loop, require_tokenizer


class TokenizeRequest(BaseModel):
    """vLLM's two shapes in one model: `prompt` (with `add_special_tokens`, default true), or `messages` (with
    `add_generation_prompt`, default true, `tools` and `chat_template_kwargs`)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages'")
        if self.messages is not None and not self.add_generation_prompt:
            raise ValueError("add_generation_prompt false is not supported: the prompt always ends where the "
                             "assistant's reply starts")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[NonNegInt] = Field(min_length=0)


def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    check_model(state, body.model)
    require_tokenizer(state, "/tokenize")
    tokenizer = state.model.tokenizer
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = encode(tokenizer, body.prompt, "prompt", add_special_tokens=add_special)
    else:
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
        text, _ = render_prompt(state, chat)
        ids = encode(tokenizer, text, "messages", add_special_tokens=bool(body.add_special_tokens))
    out = {"count": len(ids), "max_model_len": state.model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    check_model(state, body.model)
    require_tokenizer(state, "/detokenize")
    vocab_size = len(state.model.tokenizer)
    outside = [t for t in body.tokens if t >= vocab_size]
    if outside:
        raise APIError(400, f"token id {outside[0]} is outside the tokenizer's vocabulary [0, {vocab_size})",
                       param="tokens")
    return {"prompt": state.model.tokenizer.decode(body.tokens)}


def version() -> str:
    try:
        return metadata.version("hybrid")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def add_routes(app, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await off_loop(state, _tokenize, state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await off_loop(state, _detokenize, state, body)

    @app.get("/version")
    async def get_version():
        return {"version": version()}
