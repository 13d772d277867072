"""`build_app(config, engine_loop)`: the FastAPI app. Routes validate (pydantic, `server.protocol`), hand the
request to `server.chat` / `server.completions`, which enqueue into the engine loop and stream back. The app
starts the engine loop's thread when it starts up and stops it when it shuts down; its tokenizer is its own
instance (the engine thread decodes with another), loaded from the model directory's files only; with
`--skip-tokenizer-init` there is none (token-id prompts only).

Before a route reads any of a request's body, `_RequestAccounting` checks the API key (401) and the body's size
(413, by Content-Length or while it streams in, however it is framed). `GracefulServer` serves the app with
uvicorn and tells it when a graceful shutdown starts, so that its requests end cleanly within the grace period
(`server.serving.drain`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid.config import read_config_json
from hybrid.errors import ConfigError
from server import anthropic_api, deepseek_v32, harmony, tokens
from server.anthropic_protocol import CountTokensRequest, MessagesRequest
from server.chat import create_chat_completion
from server.completions import create_completion
from server.config import ServerConfig
from server.engine_loop import EngineLoop
from server.errors import APIError, error_response
from server.metrics import Metrics
from server.prompts import token_byte_bound
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.reasoning import THINK_END, THINK_START, choose_reasoning_parser
from server.serving import ServedModel, ServerState, drain, sampling_defaults
from server.tool_parsers import choose_tool_parser

MAX_BODY_BYTES = 64 * 1024 * 1024  # far above any context length's worth of text; bigger bodies get 413
ROUTES = ("/v1/chat/completions", "/v1/completions", anthropic_api.MESSAGES_PATH, anthropic_api.COUNT_TOKENS_PATH,
          "/v1/models", "/tokenize", "/detokenize", "/version", "/health", "/metrics")
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key; every other path needs it


TOKENIZER_FILES_HINT = ("the server needs the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json), "
                        "or --skip-tokenizer-init to serve token-id prompts only")


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    """The model directory's tokenizer (and chat template), from local files only, checked against the model's
    vocabulary (`check_tokenizer_size`). `trust_remote_code`: a tokenizer class defined by code in the directory
    (`auto_map`) may be loaded, which runs that code."""
    from transformers import AutoTokenizer

    code = _tokenizer_code(model_dir)
    if code and not trust_remote_code:
        raise ConfigError(f"{model_dir}: its tokenizer is Python code shipped with the checkpoint ({code}, "
                          "tokenizer_config.json auto_map); pass --trust-remote-code to load it (this runs that code)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"{model_dir}: cannot load its tokenizer ({exc}); {TOKENIZER_FILES_HINT}") from None
    vocab_size = read_config_json(model_dir).get("vocab_size") if (Path(model_dir) / "config.json").is_file() else None
    if isinstance(vocab_size, int):
        check_tokenizer_size(len(tokenizer), vocab_size, model_dir)
    return tokenizer


def _tokenizer_code(model_dir: str | Path) -> str | None:
    """The code module tokenizer_config.json's auto_map names for AutoTokenizer (e.g. Kimi-K2's
    'tokenization_kimi.TikTokenTokenizer'), or None."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        entry = json.loads(path.read_text()).get("auto_map", {}).get("AutoTokenizer")
    except (OSError, ValueError, AttributeError):
        return None  # unreadable or odd: transformers' own load reports it
    names = [name for name in (entry if isinstance(entry, list) else [entry]) if isinstance(name, str)]
    return names[0] if names else None


def check_tokenizer_size(num_tokens: int, vocab_size: int, model_dir: str | Path) -> None:
    """A tokenizer with fewer than half the model's vocabulary (config.json vocab_size) is not this model's.
    Embeddings are padded past the tokenizer by a few percent at most (Qwen3: 151,669 tokens for 151,936 rows,
    DeepSeek-V3: 128,815 for 129,280), while a directory without tokenizer files loads in transformers 5 as a
    tokenizer of one token instead of failing. A tokenizer larger than the vocabulary is left alone: prompts with
    ids outside it are refused per request."""
    if num_tokens < vocab_size / 2:
        raise ConfigError(f"{model_dir}: its tokenizer has {num_tokens} token(s) for a model vocabulary of "
                          f"{vocab_size} (config.json vocab_size): the tokenizer files are missing or not this "
                          f"model's; {TOKENIZER_FILES_HINT}")


def served_model(config: ServerConfig, tokenizer, max_model_len: int) -> ServedModel:
    """What the handlers serve; `tokenizer` None (--skip-tokenizer-init): no chat template, parsers or text."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    architectures = _architectures(config.model)
    is_deepseek_v32 = tokenizer is not None and deepseek_v32.is_selected(config.chat_format, template, architectures)
    if is_deepseek_v32:  # the encoding's formats are V3.2's, whatever the checkpoint: `auto` picks them
        template, architectures = "", [deepseek_v32.ARCHITECTURE]
    elif tokenizer is not None and harmony.is_selected(config.reasoning_parser, config.tool_call_parser,
                                                       architectures, template):
        # gpt-oss: the format renders the prompt and parses reasoning and calls; its turn ends at <|return|>/<|call|>
        stops = tuple(vocab[tag] for tag in harmony.STOP_TAGS if tag in vocab)
        return ServedModel(config.model_name, tokenizer, max_model_len, None, None,
                           sampling_defaults(config.generation_config_dir),
                           has_special_tags=tags_are_special(tokenizer, vocab, harmony.TAGS), is_harmony=True,
                           stop_token_ids=stops, other_names=config.model_names[1:])
    tool_parser = choose_tool_parser(config.tool_call_parser, template, vocab, architectures)
    reasoning_parser = choose_reasoning_parser(config.reasoning_parser, template, vocab, architectures)
    tags = (tool_parser.tags if tool_parser else ()) + ((THINK_START, THINK_END) if reasoning_parser else ())
    return ServedModel(config.model_name, tokenizer, max_model_len, tool_parser, reasoning_parser,
                       sampling_defaults(config.generation_config_dir),
                       has_special_tags=tags_are_special(tokenizer, vocab, tags), is_deepseek_v32=is_deepseek_v32,
                       other_names=config.model_names[1:])


def _architectures(model_dir: str | None) -> list:
    """config.json's `architectures` (empty where there is none to read)."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return []
    try:
        architectures = read_config_json(model_dir).get("architectures")
    except ConfigError:
        return []  # the engine reports a broken config.json; the format is only chosen here
    return architectures if isinstance(architectures, list) else []


def tags_are_special(tokenizer, vocab: dict[str, int], tags: tuple[str, ...]) -> bool:
    """Whether decoding that skips special tokens (a request's default) drops one of `tags`: a tag that is one
    token of the vocabulary, marked special."""
    return any(tag in vocab and not tokenizer.decode([vocab[tag]], skip_special_tokens=True) for tag in tags)


def build_app(config: ServerConfig, engine_loop: EngineLoop) -> FastAPI:
    if config.model is None:
        raise ConfigError("build_app needs config.model, the directory of the model the engine runs")
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model, config.trust_remote_code)
    template = config.chat_template_text()
    if tokenizer is not None and template is not None:
        tokenizer.chat_template = template  # --chat-template: before the formats are chosen from it
    model = served_model(config, tokenizer, engine_loop.max_model_len)
    if tokenizer is not None:
        # Requests are tokenized in worker threads, concurrently: the first encode may reset the tokenizer's
        # truncation and padding settings, a change that must not race with another encode.
        tokenizer.encode("", add_special_tokens=False)
        model = replace(model, max_token_bytes=token_byte_bound(tokenizer))
    state = ServerState(config, engine_loop, model, Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()
            state.prompt_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hybrid-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(_RequestAccounting, metrics=state.metrics, api_key=config.api_key)
    if config.allowed_origins:  # added last, so outermost: a preflight is answered before the API key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    _add_error_handlers(app)
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @app.post(anthropic_api.MESSAGES_PATH)
    async def messages(body: MessagesRequest, request: Request):
        return await anthropic_api.create_message(state, body, request)

    @app.post(anthropic_api.COUNT_TOKENS_PATH)
    async def count_tokens(body: CountTokensRequest):
        return await anthropic_api.count_tokens(state, body)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "hybrid",
                "max_model_len": state.model.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state.model.names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in state.model.names:
            raise APIError(404, f"model '{name}' does not exist", param="model", code="model_not_found")
        return model_card(name)

    tokens.add_routes(app, state)

    @app.get("/health")
    async def health():
        if not engine_loop.is_alive():
            return error_response(503, "the engine loop is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(engine_loop.stats(), engine_loop.rank_stats()),
                        media_type="text/plain; version=0.0.4")

    return app


def shaped_error(path: str, status: int, message: str, param: str | None = None, code: str | None = None):
    """The error response in the shape of the API `path` belongs to: Anthropic's or OpenAI's."""
    if anthropic_api.is_anthropic_path(path):
        return anthropic_api.error_response(status, message)
    return error_response(status, message, param, code)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return shaped_error(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        path = request.url.path
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return shaped_error(path, 400, f"the request body is not valid JSON: {first.get('msg')}")
        param = ".".join(str(part) for part in first.get("loc", ()) if not _is_loc_noise(part)) or None
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return shaped_error(path, 400, f"{param}: {message}" if param else message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return shaped_error(request.url.path, exc.status_code, f"{message}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        return shaped_error(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")


def _is_loc_noise(part) -> bool:
    """Parts of a pydantic error location that are not the client's parameter names: the request body, and the
    member tags of union types (`str`, `list[int]`, `NamedToolChoice`, `function-after[...]`)."""
    if isinstance(part, int):
        return False
    return part == "body" or part in ("str", "int", "float", "bool", "dict", "list") or part[:1].isupper() \
        or "[" in part


class _ClientGone(Exception):
    pass


class _RequestAccounting:
    """ASGI middleware: refuses a missing or wrong API key (401) before anything else, then bodies over
    MAX_BODY_BYTES (413): at once by their Content-Length, or, whatever the framing (chunked too), as soon as the
    bytes received pass the limit, without reading the rest. It reads the body itself and hands it to the app
    whole (the routes parse it whole anyway), so a refused body is dropped here at once. Counts responses by
    route and status."""

    def __init__(self, app, metrics: Metrics, api_key: str | None = None):
        self.app, self.metrics = app, metrics
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what a response that never started counts as
        endpoint = scope["path"] if scope["path"] in ROUTES else "other"

        async def record_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal, body = self._refusal(scope), None
            if refusal is None:
                body = await _read_body(receive)
                if body is None:
                    refusal = shaped_error(scope["path"], 413, f"request body over {MAX_BODY_BYTES} bytes")
            if refusal is not None:
                refusal.headers["connection"] = "close"  # the rest of the body is never read
                await refusal(scope, receive, record_status)
            else:
                await self.app(scope, _replay(body, receive), record_status)
        except _ClientGone:
            status = 499
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    def _refusal(self, scope):
        """The response that refuses the request from its headers alone, or None."""
        headers, path = dict(scope["headers"]), scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not self._has_key(headers):
            refusal = shaped_error(path, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' or "
                                              "'x-api-key: <key>'", code="invalid_api_key")
            refusal.headers["WWW-Authenticate"] = "Bearer"
            return refusal
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            length = -1
        if length < 0:
            return shaped_error(path, 400, "invalid Content-Length header")
        if length > MAX_BODY_BYTES:
            return shaped_error(path, 413, f"request body over {MAX_BODY_BYTES} bytes")
        return None

    def _has_key(self, headers: dict) -> bool:
        """OpenAI clients send the key as a Bearer token, Anthropic's in x-api-key (or as a Bearer token too)."""
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(bearer.strip(), self.api_key):
            return True
        return b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), self.api_key)


async def _read_body(receive) -> bytes | None:
    """The whole request body, or None as soon as it passes MAX_BODY_BYTES (the rest is not read)."""
    chunks, num_bytes = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """`receive` for the app: the body read, in one message, then the connection's own messages (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed_receive():
        return pending.pop() if pending else await receive()

    return replayed_receive


class GracefulServer(uvicorn.Server):
    """uvicorn's server serving `build_app`'s app, telling it when a graceful shutdown starts. uvicorn itself only
    waits for open connections (up to `timeout_graceful_shutdown`) and then cuts them, and stops the engine loop
    after that: streams would be cut mid-way. The app ends its requests itself (`server.serving.drain`)."""

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "server", None)
        draining = asyncio.ensure_future(drain(state, self.config.timeout_graceful_shutdown)) \
            if isinstance(state, ServerState) else None
        try:
            await super().shutdown(sockets)
        finally:
            if draining is not None:
                draining.cancel()
