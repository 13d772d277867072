"""What chat and completions share: the served model, sampling parameters from a request, the context-length
check, the engine requests of one HTTP request (`Generation`), SSE framing and disconnect handling.

A `Generation` submits its n engine requests to the engine loop, waits until each is accepted (or refused: a 4xx
before anything is streamed), then yields `(choice index, Output)` as tokens arrive, timing them for the metrics.
`close()` cancels whatever has not finished (a client gone, an error) and is called on every path out, so every
engine request ends in a finish or a cancel.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from starlette.requests import Request
from starlette.responses import StreamingResponse

from hybrid.sampling import GuidedSpec, SamplingParams
from server.config import ServerConfig
from server.engine_loop import NO_TOKENIZER, Accepted, EngineLoop, Failure, GenerateJob, Output
from server.errors import APIError
from server.metrics import Metrics
from server.reasoning import ReasoningParser
from server.structured import request_spec
from server.tool_parsers import ToolCallParser

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SEED_MODULUS = 2 ** 64  # torch generators take seeds in [0, 2**64)
SHUTDOWN_FLUSH_SECONDS = 1.0  # of the shutdown grace period, kept for ending the requests still running
# Threads that template and tokenize prompts, apart from asyncio's default pool (which streams parse tool calls
# in), so that a backlog of huge prompts never holds up a stream.
NUM_PROMPT_THREADS = 4


@dataclass
class ServedModel:
    name: str
    tokenizer: object
    max_model_len: int
    tool_parser: type[ToolCallParser] | None
    reasoning_parser: type[ReasoningParser] | None
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json, as vLLM applies them
    max_token_bytes: int | None = None  # most bytes of text one token stands for (`server.prompts`); None: unknown
    # The parsers' tags are special tokens (Kimi's, GLM's), which decoding drops by default: chat output keeps them.
    has_special_tags: bool = False
    is_harmony: bool = False  # gpt-oss's harmony format (`server.harmony`) instead of the chat template and parsers
    is_deepseek_v32: bool = False  # DeepSeek-V3.2's encoding (`server.deepseek_v32`) instead of the chat template
    stop_token_ids: tuple[int, ...] = ()  # ends of a chat turn besides the tokenizer's EOS (harmony's)
    other_names: tuple[str, ...] = ()  # more names requests may send (--served-model-name a b ...)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.other_names)


@dataclass
class ServerState:
    config: ServerConfig
    loop: EngineLoop
    model: ServedModel
    metrics: Metrics
    num_in_flight: int = 0  # engine requests submitted and not yet ended, over all HTTP requests
    generations: set[Generation] = field(default_factory=set)  # started and not yet closed
    is_shutting_down: bool = False
    prompt_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        NUM_PROMPT_THREADS, thread_name_prefix="hybrid-prompts"))


async def off_loop(state: ServerState, work: Callable, *args):
    """`work(*args)` in the prompt threads: templating and tokenizing take time in proportion to the text, which the
    event loop (every other request's) must not wait for."""
    return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, partial(work, *args))


def sampling_defaults(model_dir: str | None) -> dict:
    """The sampling settings a checkpoint's generation_config.json recommends (used where a request sets none)."""
    path = Path(model_dir or "") / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if model_dir and path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return {key: config[key] for key in SAMPLING_DEFAULT_KEYS if isinstance(config.get(key), int | float)}


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.model.names:
        raise APIError(404, f"model '{name}' does not exist; this server serves '{state.model.name}'",
                       param="model", code="model_not_found")


def require_tokenizer(state: ServerState, what: str, param: str | None = None) -> None:
    if state.model.tokenizer is None:
        raise APIError(400, f"{what} needs the tokenizer; {NO_TOKENIZER}: send token ids to /v1/completions",
                       param=param)


def make_params(request, defaults: dict, index: int, guided: GuidedSpec | None = None) -> SamplingParams:
    """The engine's sampling parameters for choice `index` of `request` (seeded requests: seed + index); `guided`:
    the grammar (None: the request's own, `server.structured.request_spec`)."""
    def pick(name, fallback):
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, fallback)

    seed = None if request.seed is None else (request.seed + index) % SEED_MODULUS
    kwargs = dict(temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=max(pick("top_k", 0), 0),
                  min_p=pick("min_p", 0.0), seed=seed, repetition_penalty=pick("repetition_penalty", 1.0),
                  presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                  logit_bias=request.logit_bias_pairs, guided=guided or request_spec(request)[0])
    if request.num_logprobs is not None:
        kwargs["logprobs"] = request.num_logprobs
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int, param: str) -> int:
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"the prompt has {num_prompt_tokens} tokens; the context length is {max_model_len}",
                       param=param, code="context_length_exceeded")
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise APIError(400, f"the prompt's {num_prompt_tokens} tokens + max_tokens {requested} exceed the context "
                            f"length {max_model_len}; lower max_tokens", param="max_tokens",
                       code="context_length_exceeded")
    return requested


def stop_token_ids(state: ServerState, request) -> list[int]:
    """The request's stop ids, plus the tokenizer's EOS (chat templates end turns with it) unless ignore_eos."""
    ids = list(request.stop_token_ids or ())
    eos = getattr(state.model.tokenizer, "eos_token_id", None)
    if eos is not None and not request.ignore_eos:
        ids.append(eos)
    if not request.ignore_eos:
        ids.extend(state.model.stop_token_ids)
    return ids


class Generation:
    def __init__(self, state: ServerState, request, prompts: list[list[int]], max_tokens: list[int],
                 start_time: float, guided: GuidedSpec | None = None):
        """One engine request per (prompt, choice): choice index = prompt index * n + choice; `guided`: see
        `make_params`."""
        self.state = state
        self.start_time = start_time
        self._queue: asyncio.Queue = asyncio.Queue()
        self._early: deque = deque()  # outputs that arrived before every request was accepted
        loop = asyncio.get_running_loop()
        stops = stop_token_ids(state, request)
        self.jobs = [
            GenerateJob(prompt, make_params(request, state.model.sampling_defaults, choice, guided), limit,
                        partial(self._sink, loop, p * request.n + choice), request.stop_strings,
                        stops, request.ignore_eos, request.skip_special_tokens)
            for p, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=True)) for choice in range(request.n)]
        self.is_finished = [False] * len(self.jobs)
        self.num_tokens = [0] * len(self.jobs)
        self._last_token_time: list[float | None] = [None] * len(self.jobs)
        self._is_open = False

    def _sink(self, loop: asyncio.AbstractEventLoop, index: int, event) -> None:
        loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))

    async def start(self) -> None:
        state = self.state
        if state.is_shutting_down:
            raise shutting_down()
        if len(self.jobs) > state.config.max_in_flight:  # would never fit: retrying cannot help
            raise APIError(400, f"{len(self.jobs)} completions (prompts x n) exceed the server's limit of "
                                f"{state.config.max_in_flight} requests at once", param="n")
        if state.num_in_flight + len(self.jobs) > state.config.max_in_flight:
            raise APIError(429, f"the server holds {state.num_in_flight} requests, its limit is "
                                f"{state.config.max_in_flight}; retry later", code="queue_full")
        state.num_in_flight += len(self.jobs)
        self._is_open = True
        state.generations.add(self)
        for job in self.jobs:
            state.loop.submit(job)
        failure, num_answered = None, 0
        try:
            while num_answered < len(self.jobs):
                index, event = await self._queue.get()
                if index is None:  # aborted
                    failure = event
                    break
                if isinstance(event, Output):
                    self._early.append((index, event))
                    continue
                num_answered += 1
                if isinstance(event, Failure):
                    self.is_finished[index] = True
                    failure = failure or event
        finally:
            if failure is not None or num_answered < len(self.jobs):
                self.close()
        if isinstance(failure, APIError):
            raise failure
        if failure is not None:
            code = failure.code or ("context_length_exceeded" if "exceeds max_model_len" in failure.message else None)
            raise APIError(failure.status, failure.message, code=code)

    async def events(self) -> AsyncIterator[tuple[int, Output]]:
        while not all(self.is_finished):
            index, event = self._early.popleft() if self._early else await self._queue.get()
            if index is None:  # aborted
                raise event
            if isinstance(event, Accepted):
                continue
            if isinstance(event, Failure):
                self.is_finished[index] = True
                raise APIError(event.status, event.message, code=event.code)
            if event.token_id is not None:
                self._time_token(index)
            if event.finish_reason is not None:
                self.is_finished[index] = True
            yield index, event

    def _time_token(self, index: int) -> None:
        now = time.perf_counter()
        metrics = self.state.metrics
        last = self._last_token_time[index]
        if last is None:
            metrics.time_to_first_token.observe(now - self.start_time)
        else:
            metrics.inter_token_latency.observe(now - last)
        self._last_token_time[index] = now
        self.num_tokens[index] += 1

    @property
    def has_output(self) -> bool:
        return any(self.num_tokens)

    def abort(self, error: APIError) -> None:
        """Ends the generation with `error` wherever its handler waits (on the event loop's thread)."""
        if self._is_open:
            self._queue.put_nowait((None, error))

    def close(self) -> None:
        """Cancels the unfinished requests and settles the counts; safe to call more than once."""
        if not self._is_open:
            return
        self._is_open = False
        self.state.generations.discard(self)
        for job, is_finished in zip(self.jobs, self.is_finished, strict=True):
            if not is_finished:
                self.state.loop.cancel(job)
        self.state.num_in_flight -= len(self.jobs)
        self.state.metrics.prompt_tokens.inc(sum(len(job.prompt_ids) for job in self.jobs))
        self.state.metrics.generation_tokens.inc(sum(self.num_tokens))


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; send the request again (to another replica)",
                    code="server_shutting_down")


async def drain(state: ServerState, grace_seconds: float | None) -> None:
    """Graceful shutdown, called as it starts. Requests that have no token yet (queued in the server or the engine,
    or arriving now) get 503 at once, so their clients can retry elsewhere; the running ones may finish until
    SHUTDOWN_FLUSH_SECONDS before the grace period ends and are then ended with 503 (a stream: an error event and
    [DONE]), so that they end cleanly instead of being cut when the grace period is over (None: no limit)."""
    state.is_shutting_down = True
    for generation in list(state.generations):
        if not generation.has_output:
            generation.abort(shutting_down())
    if grace_seconds is None:
        return
    await asyncio.sleep(max(grace_seconds - SHUTDOWN_FLUSH_SECONDS, 0.0))
    for generation in list(state.generations):
        generation.abort(shutting_down())


@dataclass(frozen=True)
class ResponseInfo:
    """What every chunk or response of one HTTP request repeats."""

    id: str
    created: int
    model: str
    num_prompt_tokens: int  # usage counts each prompt once, however many choices it has
    is_named_tool_choice: bool = False


def response_info(prefix: str, model: str, num_prompt_tokens: int, is_named_tool_choice: bool = False):
    return ResponseInfo(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, num_prompt_tokens,
                        is_named_tool_choice)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class GenerationStream(StreamingResponse):
    """An SSE response that closes its generation however the stream ends: finished, failed, or the client gone
    (Starlette cancels the stream on a disconnect, so the body iterator itself may never resume)."""

    def __init__(self, body: AsyncIterator[str], generation: Generation):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_unless_disconnected(request: Request, generation: Generation, collect: Callable[[], Awaitable]):
    """Runs `collect()` (a non-streaming response) unless the client goes away first, which cancels it."""
    work = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        generation.close()
    if not work.done() or work.cancelled():
        raise APIError(499, "the client closed the connection")
    return work.result()


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but rules out


def finite_logprob(logprob: float | None) -> float | None:
    """JSON has no -inf or NaN: a logprob below MIN_LOGPROB, or not a number, is reported as MIN_LOGPROB."""
    if logprob is None:
        return None
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares false too


def token_text(tokenizer, token_id: int) -> str:
    """A token's text in logprobs; without a tokenizer vLLM's `token_id:N` spelling."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)
