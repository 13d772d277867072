"""Helpers for the server tests (a helper module, not a test module): the demo model at a tiny size, a server
running in a thread on a free loopback port, and `ScriptedEngine`, a stand-in for `hybrid.engine.Engine` that
emits a scripted token sequence, so the server's tool-call and reasoning paths run end to end with a known
output. Nothing is downloaded."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from hybrid.engine import EngineStats, StepOutput
from hybrid.guided import GrammarCache
from server import startup
from server.app import GracefulServer, build_app, load_tokenizer
from server.cli import main as serve_main
from server.config import ServerConfig
from server.demo import DemoSize, demo_model
from server.engine_loop import EngineLoop

TINY = DemoSize(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)
API_KEY = "test-key"


def tiny_model(path: Path) -> Path:
    return demo_model(path, TINY)


class RunningServer:
    """uvicorn (`GracefulServer`, as hybrid-serve runs it) serving `app` in a daemon thread on 127.0.0.1 and a port
    the OS picked; `grace_seconds`: its graceful shutdown's limit (None: none)."""

    def __init__(self, app, grace_seconds: float | None = None):
        self.app = app
        self.server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=grace_seconds))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match.group(1))


def engine_server(model_dir: Path, max_model_len: int, **config):
    """The server over a real engine on the CPU (float32, 256-token steps, 64 requests at once) -> (server, llm);
    `server.engine` is the engine. The caller stops the server, then closes the llm."""
    from hybrid.engine import Engine
    from hybrid.llm import LLM

    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=max_model_len)
    engine = Engine(llm, max_num_batched_tokens=256, max_num_seqs=64)
    running = start_server(engine, model_dir, llm.max_model_len, **config)
    running.engine = engine
    return running, llm


def start_server(engine, model_dir: Path, max_model_len: int, grace_seconds: float | None = None,
                 **config) -> RunningServer:
    config = ServerConfig(model=str(model_dir), **config)
    loop = EngineLoop(engine, load_tokenizer(model_dir), max_model_len)
    return RunningServer(build_app(config, loop), grace_seconds)


@dataclass
class ScriptedRequest:
    request_id: int
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    script: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class ScriptedEngine:
    """`Engine`'s interface; every request emits `script` (then stops at its last token or max_tokens).
    `gate` blocks `step` while cleared; `fail_steps` makes that many steps raise; `step_seconds` paces the steps;
    `max_num_seqs` requests run at once, in the order they came, the others wait (emit nothing); `idle_calls`
    records each `idle()` call."""

    device = "cpu"
    llm = None  # no model: no per-rank metrics

    def __init__(self, script: list[int], max_model_len: int = 512, num_blocks: int = 64,
                 max_num_seqs: int | None = None):
        self.script = list(script)
        self.max_model_len, self.num_blocks, self.max_num_seqs = max_model_len, num_blocks, max_num_seqs
        self.step_seconds = 0.0
        self.requests: dict[int, ScriptedRequest] = {}
        self.prompts: list[list[int]] = []
        self.finished: list[tuple[int, str]] = []  # (request id, reason) of finish/cancel calls
        self.gate = threading.Event()
        self.gate.set()
        self.fail_steps = 0
        self.idle_calls: list[bool] = []  # one entry per `idle()` call
        self.logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None  # (logprob, top) of every token
        self._next_id = 0
        # grammars compile as with the real engine (an invalid one is the server's 400); the script ignores them
        self.grammars = GrammarCache(TINY.vocab_size)

    def add_request(self, prompt_ids, params=None, max_tokens=16, stop_token_ids=None, ignore_eos=False) -> int:
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")
        request = ScriptedRequest(self._next_id, list(prompt_ids), max_tokens, frozenset(stop_token_ids or ()),
                                  list(self.script))
        self._next_id += 1
        self.requests[request.request_id] = request
        self.prompts.append(list(prompt_ids))
        return request.request_id

    def _live(self) -> list[ScriptedRequest]:
        return [r for r in self.requests.values() if r.finish_reason is None]

    def has_work(self) -> bool:
        return bool(self._live())

    def idle(self) -> None:
        self.idle_calls.append(bool(self._live()))  # whether requests were still running (never, if all is well)

    def step(self) -> list[StepOutput]:
        self.gate.wait()
        time.sleep(self.step_seconds)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("scripted step failure")
        outputs = []
        for r in self._live()[:self.max_num_seqs]:
            token = r.script[len(r.output_ids)]
            r.output_ids.append(token)
            is_last = len(r.output_ids) == len(r.script)
            reason = "stop" if token in r.stop_token_ids or is_last else \
                "length" if len(r.output_ids) >= r.max_tokens else None
            r.finish_reason = reason
            outputs.append(StepOutput(r.request_id, token, reason, *(self.logprobs or (None, None))))
        return outputs

    def finish(self, request_id: int, reason: str = "stop") -> None:
        request = self.requests.get(request_id)
        if request is not None and request.finish_reason is None:
            request.finish_reason = reason
            self.finished.append((request_id, reason))

    def cancel(self, request_id: int) -> None:
        self.finish(request_id, "cancelled")

    def stats(self) -> EngineStats:
        live = len(self._live())
        return EngineStats(live, 0, self.num_blocks, self.num_blocks - live)


def serve_in_process(monkeypatch, argv: list[str], check) -> int:
    """`main(argv)`, with uvicorn serving its app on its socket in a thread while `check(app, url)` runs;
    whatever `check` raises is raised here."""
    failures = []

    def run(app, sock, log_level, graceful_shutdown_seconds, ready_message):
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        try:
            check(app, startup.url_of(sock).removesuffix("/v1"))
        except BaseException as exc:
            failures.append(exc)
        finally:
            server.should_exit = True
            thread.join(timeout=60)

    monkeypatch.setattr(startup, "run_uvicorn", run)
    code = serve_main(argv)
    if failures:
        raise failures[0]
    return code


def chat_choices(client, stream: bool, **kwargs) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """(content, finish_reason, tool calls as (name, arguments)) of each choice of one chat completion (`kwargs`
    as the `openai` client takes them), in choice order; streamed, the deltas joined (a call's pieces by its
    index), so both ways compare alike."""
    num_choices = kwargs.get("n", 1)
    if not stream:
        response = client.chat.completions.create(**kwargs)
        return [(c.message.content or "", c.finish_reason,
                 [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()])
                for c in sorted(response.choices, key=lambda c: c.index)]
    content, reasons = [""] * num_choices, [None] * num_choices
    calls: list[dict[int, list[str]]] = [{} for _ in range(num_choices)]  # call index -> [name, arguments]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
            for t in c.delta.tool_calls or ():
                call = calls[c.index].setdefault(t.index, ["", ""])
                call[0] += t.function.name or ""
                call[1] += t.function.arguments or ""
    return [(content[i], reasons[i], [tuple(call) for _, call in sorted(calls[i].items())])
            for i in range(num_choices)]
