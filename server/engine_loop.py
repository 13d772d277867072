"""The one thread that owns the engine. `hybrid.engine.Engine` is not thread-safe, so HTTP handlers never touch it:
they `submit` a `GenerateJob` (or `cancel` one) into this thread's queue, and get `Accepted`, `Output` and `Failure`
events back through the job's `sink`, which the handler points at its asyncio queue (through
`loop.call_soon_threadsafe`).

The thread runs commands, then one `engine.step()` while there is work, and sleeps on the queue when there is none;
each time the work runs out and no command is queued, it first calls `engine.idle()` once (the hot experts move
while no step runs), so an idle server does that work once and then holds no CPU.
Per request it detokenizes the new tokens (`hybrid.detokenizer`) and checks stop strings; a stop string ends the
request in the engine at once (`engine.finish`), which frees its KV pages. Without a tokenizer
(`--skip-tokenizer-init`) outputs carry token ids and empty text, and stop strings are refused. Every request
leaves `engine.requests` when it ends, however it ends. An exception in a step fails the requests in flight (500)
and the loop goes on. While requests run, `StatsLogger` logs a throughput / KV-cache line every few seconds (none
while idle).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybrid.detokenizer import IncrementalDetokenizer
from hybrid.engine import EngineStats
from hybrid.rank_stats import RankStats
from hybrid.sampling import SamplingParams

log = logging.getLogger("hybrid.server")


@dataclass(frozen=True)
class Accepted:
    """The engine took the request."""


@dataclass(frozen=True)
class Output:
    """One new token of a request (`token_id` None: only flushed text) and the text it completes."""

    text: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: str | None = None  # "stop", "length", or None while the request goes on
    stop_string: str | None = None  # the stop string that finished it, if one did


@dataclass(frozen=True)
class Failure:
    message: str
    status: int  # 400: the engine refused the request; 500: it failed while running; 503: shutting down
    code: str | None = None  # the OpenAI error's code ("internal_error": the request failed in the engine)


Event = Accepted | Output | Failure


@dataclass(eq=False)
class GenerateJob:
    """One engine request as a handler submits it; `sink` is called from the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    request_id: int | None = None  # set by the engine thread


NO_TOKENIZER = "this server runs with --skip-tokenizer-init (no tokenizer: token-id prompts only)"


@dataclass
class _Active:
    job: GenerateJob
    detokenizer: IncrementalDetokenizer | None  # None: no tokenizer, outputs carry ids only
    num_tokens: int = 0


class StatsLogger:
    """One log line per `interval` seconds while the engine has work, as vLLM prints: prompt and generation
    tokens/s over the interval (a prompt counts when its first token comes out, as in vLLM), running and waiting
    requests, KV-cache usage. Nothing while idle: after the work ends the loop waits at most until the current
    interval is over (`timeout()`), logs it, then sleeps until the next command. `interval` 0: off."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self._clock = clock
        self._start: float | None = None  # start of the interval being counted; None: nothing to report
        self._num_prompt_tokens = self._num_generation_tokens = 0

    def record(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if not self.interval:
            return
        if self._start is None:
            self._start = self._clock()
        self._num_prompt_tokens += num_prompt_tokens
        self._num_generation_tokens += num_generation_tokens

    def timeout(self) -> float | None:
        """How long the idle loop may wait for a command before this interval's line is due; None: for ever."""
        if self._start is None:
            return None
        return max(self._start + self.interval - self._clock(), 0.0)

    def maybe_log(self, stats: EngineStats) -> None:
        if self._start is None:
            return
        now = self._clock()
        elapsed = now - self._start
        if elapsed < self.interval:
            return
        usage = 1 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        log.info("engine: prompt %.1f tokens/s, generation %.1f tokens/s, %d running, %d waiting, KV cache %.1f%% "
                 "used", self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                 stats.num_running, stats.num_waiting, 100 * usage)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._start = now if stats.num_running or stats.num_waiting else None


class EngineLoop:
    def __init__(self, engine, tokenizer, max_model_len: int, stats_log_interval: float = 0.0):
        """`engine`: a `hybrid.engine.Engine` (or anything with its add_request/step/finish/cancel/stats/has_work/
        idle, `requests`, `device` and `llm`, None for a stand-in without a model); `tokenizer` decodes its tokens
        (None: outputs carry token ids only); `stats_log_interval`: seconds between `StatsLogger` lines (0: none)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._stats_log = StatsLogger(stats_log_interval)
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[int, _Active] = {}
        self._stats: EngineStats = engine.stats()
        self._has_idled = True  # engine.idle() ran since the last step (a new engine has nothing to catch up on)
        self._thread = threading.Thread(target=self._run, name="hybrid-engine-loop", daemon=True)

    # --- called from other threads ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: GenerateJob) -> None:
        self._inbox.put(("add", job))

    def cancel(self, job: GenerateJob) -> None:
        """Ends the job's request if it still runs (a client gone); its pages are freed. No event follows."""
        self._inbox.put(("cancel", job))

    def stats(self) -> EngineStats:
        """The engine's state after the last step (a snapshot the engine thread publishes)."""
        return self._stats

    def rank_stats(self) -> tuple[RankStats, ...]:
        """Each tensor-parallel rank's numbers as it last published them (`hybrid.rank_stats`: shared memory, read
        without the engine or a collective); none for an engine without a model (`engine.llm` None)."""
        llm = self.engine.llm
        return llm.rank_stats() if llm is not None else ()

    # --- the engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        device = torch.device(self.engine.device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # kernels launch on the thread's current device, as in the main thread
        while True:
            try:
                if not self._run_commands():
                    return
                if self.engine.has_work():
                    self._step()
                    self._has_idled = False
                if not self._has_idled and self._inbox.empty() and not self.engine.has_work():
                    self._has_idled = True  # once per idle stretch, even if it fails
                    self.engine.idle()  # the work ran out: now, before the next iteration sleeps on the queue
                self._stats = self.engine.stats()
                self._stats_log.maybe_log(self._stats)
            except Exception:  # the loop must outlive any one failure; the requests concerned were told
                log.exception("engine loop iteration failed; going on")

    def _run_commands(self) -> bool:
        """Runs the queued commands (waiting for one while the engine is idle); False on "stop"."""
        try:
            is_idle = not self.engine.has_work()
            command = self._inbox.get(block=is_idle, timeout=self._stats_log.timeout() if is_idle else None)
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                self._shutdown()
                return False
            self._handle(*command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: str, job: GenerateJob) -> None:
        if kind == "add":
            self._add(job)
        elif kind == "cancel" and job.request_id in self._active:
            self.engine.cancel(job.request_id)
            self._drop(job.request_id)

    def _add(self, job: GenerateJob) -> None:
        if job.stop and self.tokenizer is None:
            _send(job, Failure(f"stop strings need the tokenizer; {NO_TOKENIZER}", 400))
            return
        try:
            request_id = self.engine.add_request(job.prompt_ids, job.params, job.max_tokens,
                                                 stop_token_ids=job.stop_token_ids, ignore_eos=job.ignore_eos)
        except ValueError as exc:
            _send(job, Failure(str(exc), 400))
            return
        except Exception as exc:  # the engine's fault, not the request's
            log.exception("engine refused a request")
            _send(job, Failure(f"engine error: {exc}", 500))
            return
        job.request_id = request_id
        detokenizer = None if self.tokenizer is None else \
            IncrementalDetokenizer(self.tokenizer, job.prompt_ids, job.stop, job.skip_special_tokens)
        self._active[request_id] = _Active(job, detokenizer)
        _send(job, Accepted())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the %d requests in flight", len(self._active))
            for request_id in list(self._active):
                self._fail(request_id, f"engine error: {exc}")
            return
        for output in outputs:
            if output.request_id not in self._active:
                continue
            try:
                self._emit(output)
            except Exception as exc:
                log.exception("request %d failed while decoding its output", output.request_id)
                self._fail(output.request_id, f"output error: {exc}")

    def _emit(self, output) -> None:
        if output.error is not None:  # the engine ended it (e.g. NaN logits): no token, the client gets the cause
            self._fail(output.request_id, f"the request failed in the engine: {output.error}", 500, "internal_error")
            return
        active = self._active[output.request_id]
        self._stats_log.record(len(active.job.prompt_ids) if active.num_tokens == 0 else 0, 1)
        active.num_tokens += 1
        text, reason, stop_string = "", output.finish_reason, None
        if active.detokenizer is not None:
            text, reason = active.detokenizer.step(output.new_token, output.finish_reason)
            stop_string = active.detokenizer.stop_string
        if reason is not None and output.finish_reason is None:  # a stop string: free its pages now
            self.engine.finish(output.request_id, reason)
        _send(active.job, Output(text, output.new_token, output.logprob, output.top_logprobs, reason, stop_string))
        if reason is not None:
            self._drop(output.request_id)

    def _fail(self, request_id: int, message: str, status: int = 500, code: str | None = None) -> None:
        active = self._active.get(request_id)
        try:
            self.engine.finish(request_id, "error")
        except Exception:
            log.exception("could not end request %d cleanly", request_id)
        self._drop(request_id)
        if active is not None:
            _send(active.job, Failure(message, status, code))

    def _drop(self, request_id: int) -> None:
        self._active.pop(request_id, None)
        self.engine.requests.pop(request_id, None)

    def _shutdown(self) -> None:
        for request_id in list(self._active):
            self._fail(request_id, "the server is shutting down", 503)  # not the request's fault: retry it
        self._stats = self.engine.stats()


def _send(job: GenerateJob, event: Event) -> None:
    with contextlib.suppress(RuntimeError):  # the handler's event loop is closed (shutdown): nobody listens
        job.sink(event)
