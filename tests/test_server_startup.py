"""`hybrid-serve`'s start-up: the tokenizer check and --skip-tokenizer-init, the context length against the model's
positions, one-line failures (device, port, host, cache, permissions, the unforeseen), stale demo build
directories, the warm-up request, the load progress bars and the engine's throughput log. The CLI runs in-process
(`main([...])`); where it serves, uvicorn runs on its socket in a thread while the test talks to it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from server_support import TINY, ScriptedEngine, serve_in_process, tiny_model

import server.startup
from hybrid import loader
from hybrid.config import resolve_max_model_len
from hybrid.engine import EngineStats
from hybrid.errors import ConfigError
from hybrid.llm import LLM
from hybrid.models import load_model_config
from server import demo
from server.app import check_tokenizer_size
from server.cli import main
from server.engine_loop import EngineLoop, GenerateJob, Output, StatsLogger

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def untokenized_dir(model_dir, tmp_path_factory):
    """The tiny model without its tokenizer files."""
    target = tmp_path_factory.mktemp("untokenized") / "model"
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    return target


@pytest.fixture(autouse=True)
def never_serve(monkeypatch):
    """A start that should fail but gets as far as serving fails the test instead of serving for ever."""
    monkeypatch.setattr(server.startup, "run_uvicorn", lambda *a: pytest.fail("hybrid-serve started serving"))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert lines and lines[-1].startswith("hybrid-serve: error: "), err
    assert "Traceback" not in err, err
    return lines[-1]


# --- 1. the tokenizer ---------------------------------------------------------------------------------------------

def test_model_without_tokenizer_files_is_a_start_up_error(untokenized_dir, capsys, monkeypatch):
    monkeypatch.setattr("hybrid.llm.LLM", lambda *a, **k: pytest.fail("loaded the model after a tokenizer error"))
    assert main(["--model", str(untokenized_dir), "--port", "0"]) == 1
    line = one_line_error(capsys)
    assert str(untokenized_dir) in line and "tokenizer" in line and "--skip-tokenizer-init" in line


def test_tokenizer_size_rule():
    check_tokenizer_size(151_669, 151_936, "qwen3")  # a padded embedding is fine
    check_tokenizer_size(600, 1024, "m")
    check_tokenizer_size(2000, 1024, "m")  # a larger tokenizer too: its extra ids are refused per request
    with pytest.raises(ConfigError, match="1 token.* vocabulary of 151936"):
        check_tokenizer_size(1, 151_936, "m")
    with pytest.raises(ConfigError, match="vocabulary of 1024"):
        check_tokenizer_size(511, 1024, "m")


def test_skip_tokenizer_init_serves_token_ids(untokenized_dir, monkeypatch):
    """No tokenizer files needed; completions take token ids and return them (empty text), as vLLM does; chat,
    text prompts, stop strings and echo are refused with a 400 naming the flag."""
    def check(app, url):
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 1, "ignore_eos": True}
        choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        stream = httpx.post(url + "/v1/completions", json={**body, "stream": True, "logprobs": None},
                            timeout=60).text
        streamed = [line for line in stream.splitlines() if line.startswith("data: {")]
        assert len(streamed) == 4 and all('"token_ids":[' in line for line in streamed)
        refused = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                   ("/v1/completions", {"prompt": "hi"}), ("/v1/completions", {"prompt": [1], "stop": ["x"]}),
                   ("/v1/completions", {"prompt": [1], "echo": True})]
        for path, request in refused:
            response = httpx.post(url + path, json=request, timeout=60)
            assert response.status_code == 400 and "--skip-tokenizer-init" in response.json()["error"]["message"]

    argv = ["--model", str(untokenized_dir), "--port", "0", "--skip-tokenizer-init", "--dtype", "float32"]
    assert serve_in_process(monkeypatch, argv, check) == 0


def test_engine_loop_without_tokenizer():
    engine = ScriptedEngine([5, 6, 7])
    loop = EngineLoop(engine, None, 512)
    events = []
    loop.start()
    try:
        loop.submit(GenerateJob([1, 2], None, 8, events.append))
        deadline = time.monotonic() + 10
        while not (events and isinstance(events[-1], Output) and events[-1].finish_reason):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        loop.stop()
    outputs = [e for e in events if isinstance(e, Output)]
    assert [(o.text, o.token_id) for o in outputs] == [("", 5), ("", 6), ("", 7)]


def test_engine_loop_idles_once_when_the_work_runs_out():
    """`engine.idle()` (where the hot experts move: `Engine.idle`) runs once each time the work runs out, before the
    loop sleeps on its queue: never while a request runs or waits, not again when the stats logger's interval wakes
    the loop, and not while a command is queued (a request sent as the last one ends starts without it)."""
    engine = ScriptedEngine([5, 6, 7], max_num_seqs=1)  # one request at a time: the second waits
    loop = EngineLoop(engine, None, 512, stats_log_interval=0.02)
    events = []

    def num_done() -> int:
        return sum(isinstance(e, Output) and e.finish_reason is not None for e in events)

    def wait_until(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def send_another(event) -> None:  # called on the engine's thread as the request's events come
        events.append(event)
        if isinstance(event, Output) and event.finish_reason is not None:
            loop.submit(GenerateJob([3], None, 8, events.append))

    loop.start()
    try:
        engine.gate.clear()  # the first step waits: both requests are in before any finishes
        for _ in range(2):
            loop.submit(GenerateJob([1, 2], None, 8, events.append))
        time.sleep(0.05)
        assert engine.idle_calls == []  # a new engine had nothing to catch up on
        engine.gate.set()
        wait_until(lambda: engine.idle_calls)
        assert num_done() == 2
        time.sleep(0.1)  # the stats line's interval ends meanwhile: the loop wakes, logs, sleeps again
        assert engine.idle_calls == [False]
        loop.submit(GenerateJob([1, 2], None, 8, send_another))
        wait_until(lambda: num_done() == 4 and len(engine.idle_calls) >= 2)
        time.sleep(0.1)
        assert engine.idle_calls == [False, False]  # [False] * 3: idle between the two, with a request queued
    finally:
        loop.stop()


# --- 2. the context length -----------------------------------------------------------------------------------------

def test_context_length_above_the_model_limit(model_dir, capsys):
    with pytest.raises(ConfigError, match="513.*limit of 512 tokens.*max_position_embeddings"):
        LLM(model_dir, device="cpu", dtype="float32", max_model_len=513)
    assert main(["--model", str(model_dir), "--port", "0", "--context-length", "100000"]) == 1
    line = one_line_error(capsys)
    assert "100000" in line and "512" in line


def test_context_limit_with_rope_scaling(model_dir):
    _, config = load_model_config(model_dir)
    assert (config.max_context_length, resolve_max_model_len(None, config)) == (512, 512)
    # YaRN: the original length times the factor, whether max_position_embeddings says so (DeepSeek-V3) or not
    yarn = replace(config, max_position_embeddings=40960,
                   rope=replace(config.rope, scaling_type="yarn", original_max_position=32768, factor=4.0))
    assert yarn.max_context_length == 131072 and resolve_max_model_len(131072, yarn) == 131072
    assert resolve_max_model_len(None, yarn) == 4096
    with pytest.raises(ConfigError, match=r"131073 .* 131072 tokens \(yarn rope: original_max_position_embeddings "
                                          r"32768 x factor 4\)"):
        resolve_max_model_len(131073, yarn)
    linear = replace(config, rope=replace(config.rope, scaling_type="linear", factor=2.0))
    assert linear.max_context_length == 1024


# --- 3. one-line start-up failures --------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda(model_dir, capsys):
    assert main(["--model", str(model_dir), "--port", "0", "--device", "cuda"]) == 1
    assert "--device cuda: CUDA is not available" in one_line_error(capsys)


def test_port_in_use_fails_before_the_model_loads(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("server.app.load_tokenizer", lambda *a: pytest.fail("loaded the tokenizer"))
    monkeypatch.setattr("hybrid.llm.LLM", lambda *a, **k: pytest.fail("loaded the model"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--model", str(model_dir), "--port", str(port)]) == 1
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in one_line_error(capsys)
    assert main(["--model", str(model_dir), "--host", "256.0.0.1", "--port", "0"]) == 1
    assert "--host 256.0.0.1: cannot listen" in one_line_error(capsys)


def test_demo_cache_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("a file where the cache's parent directory should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    assert main(["--port", "0"]) == 1
    line = one_line_error(capsys)
    assert "cannot build the demo model in" in line and "XDG_CACHE_HOME" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory; the unwritable-path case "
                                              "above covers the same error path")
def test_demo_cache_read_only(tmp_path, capsys, monkeypatch):
    (tmp_path / "ro").mkdir(mode=0o555)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    assert main(["--port", "0"]) == 1
    assert "Permission denied" in one_line_error(capsys)


@contextmanager
def unprivileged():
    """As root (who reads any file), the test's checks run with the effective user 'nobody'."""
    if os.geteuid() != 0:
        yield
        return
    try:
        os.seteuid(65534)
    except OSError as exc:
        pytest.skip(f"cannot drop root privileges to test permissions: {exc}")
    try:
        yield
    finally:
        os.seteuid(0)


def test_unreadable_model_directory(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    model.chmod(0)
    try:
        with unprivileged():
            code = main(["--model", str(model), "--port", "0"])
    finally:
        model.chmod(0o755)
    assert code == 1
    line = one_line_error(capsys)
    assert f"--model {model}: permission denied" in line


def test_engine_files_are_checked_at_start(model_dir, capsys, tmp_path):
    assert main(["--model", str(model_dir), "--port", "0", "--record-routing", str(tmp_path / "no" / "r.json")]) == 1
    assert "--record-routing" in one_line_error(capsys)
    assert main(["--model", str(model_dir), "--port", "0", "--routing-stats", str(tmp_path / "none.json")]) == 1
    assert "--routing-stats" in one_line_error(capsys)


@pytest.mark.parametrize("error, expected", [
    (RuntimeError("something broke"), "RuntimeError: something broke (run with --log-level debug"),
    (MemoryError(), "out of memory while starting (MemoryError); lower --kv-cache-tokens"),
    (PermissionError(13, "Permission denied", "/m/model.safetensors"), "/m/model.safetensors: Permission denied")])
def test_unforeseen_failures_are_one_line(model_dir, capsys, monkeypatch, error, expected):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("hybrid.llm.LLM", fail)
    assert main(["--model", str(model_dir), "--port", "0"]) == 1
    assert expected in one_line_error(capsys)


# --- 4. stale demo build directories ------------------------------------------------------------------------------

def test_stale_demo_builds_are_removed(tmp_path):
    cache = tmp_path / "hybrid"
    cache.mkdir()
    dead = cache / ".demo-0.1.0-dead"  # its builder was killed: the lock file is there, nobody holds it
    dead.mkdir()
    (dead / demo.LOCK_FILE).touch()
    live = cache / ".demo-0.1.0-live"
    live.mkdir()
    (live / demo.LOCK_FILE).touch()
    fresh = cache / ".demo-0.1.0-fresh"  # a builder between its directory and its lock
    fresh.mkdir()
    old = cache / ".demo-0.0.9-old"  # left by a version without locks
    old.mkdir()
    os.utime(old, (time.time() - 2 * demo.STALE_UNLOCKED_SECONDS,) * 2)
    other = cache / "demo-0.1.0"
    other.mkdir()
    import fcntl

    fd = os.open(live / demo.LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        removed = demo.remove_stale_builds(cache, (demo.DEMO_PREFIX,))
    finally:
        os.close(fd)
    assert sorted(removed) == sorted([dead, old])
    assert sorted(p.name for p in cache.iterdir()) == sorted([live.name, fresh.name, other.name])


def test_killed_demo_build_is_cleaned_by_the_next_start(tmp_path):
    """A build process killed mid-way (SIGKILL) leaves its directory; while it ran, a second start left it alone;
    after, the next start removes it."""
    target = tmp_path / "demo-x"
    script = ("import sys, time; from pathlib import Path; import server.demo as d; "
              "d.build_checkpoint = lambda path, size: time.sleep(60); d.demo_model(Path(sys.argv[1]))")
    builder = subprocess.Popen([sys.executable, "-c", script, str(target)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(f".demo-x-*/{demo.LOCK_FILE}")):
            assert builder.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.05)
        assert demo.remove_stale_builds(tmp_path, (".demo-x-",)) == []  # a concurrent build is left alone
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait(timeout=30)
    [work] = tmp_path.glob(".demo-x-*")
    target.mkdir()
    (target / "hybrid.json").write_text("{}")  # built meanwhile by another start: demo_model returns at once
    assert demo.demo_model(target) == target and not work.exists()


# --- 5. logs, progress, warm-up -----------------------------------------------------------------------------------

def test_warm_up_runs_before_serving_and_leaves_no_trace(model_dir, monkeypatch):
    def check(app, url):
        state = app.state.server
        engine = state.loop.engine
        assert engine.llm.num_forward_tokens >= server.startup.WARM_UP_PROMPT_TOKENS + 1  # a prefill and decodes
        assert engine.requests == {} and not engine.has_work()
        metrics = httpx.get(url + "/metrics").text
        for name in ("hybrid_generation_tokens_total", "hybrid_prompt_tokens_total"):
            assert f"{name} 0.0" in metrics
        assert "hybrid_requests_total{" not in metrics  # no request counted before this one

    argv = ["--model", str(model_dir), "--port", "0", "--dtype", "float32"]
    assert serve_in_process(monkeypatch, argv, check) == 0


def test_stats_logger_lines_only_while_there_is_work(caplog):
    now = [0.0]
    stats = StatsLogger(10.0, clock=lambda: now[0])
    busy, idle = EngineStats(3, 1, 100, 75), EngineStats(0, 0, 100, 100)
    caplog.set_level(logging.INFO, logger="hybrid.server")
    assert stats.timeout() is None
    stats.maybe_log(idle)
    stats.record(100, 1)
    now[0] = 4.0
    stats.record(0, 49)
    stats.maybe_log(busy)
    assert caplog.messages == [] and stats.timeout() == pytest.approx(6.0)
    now[0] = 10.0
    stats.maybe_log(busy)
    assert caplog.messages == ["engine: prompt 10.0 tokens/s, generation 5.0 tokens/s, 3 running, 1 waiting, "
                               "KV cache 25.0% used"]
    now[0] = 20.0
    stats.maybe_log(idle)  # the last interval of the work, then silence
    now[0] = 100.0
    stats.maybe_log(idle)
    assert len(caplog.messages) == 2 and "generation 0.0 tokens/s, 0 running" in caplog.messages[1]
    assert stats.timeout() is None
    assert StatsLogger(0.0).timeout() is None


def test_engine_loop_logs_throughput_then_goes_quiet(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="hybrid.server")
    from server.app import load_tokenizer

    loop = EngineLoop(ScriptedEngine([5, 6, 7]), load_tokenizer(model_dir), 512, stats_log_interval=0.05)
    events = []
    loop.start()
    try:
        loop.submit(GenerateJob([1, 2, 3, 4], None, 8, events.append))
        time.sleep(0.3)  # the request ends at once; its interval's line comes within 0.05 s
        lines = [m for m in caplog.messages if m.startswith("engine:")]
        time.sleep(0.2)
        assert [m for m in caplog.messages if m.startswith("engine:")] == lines  # idle: no more lines
    finally:
        loop.stop()
    assert len(lines) == 1 and "0 running, 0 waiting" in lines[0]
    assert "prompt 0.0" not in lines[0] and "generation 0.0" not in lines[0]


class _Terminal:
    """stderr as a terminal would be (tqdm draws its bars only there)."""

    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass

    def isatty(self):
        return True


def test_weight_loading_shows_progress_on_a_terminal(model_dir, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(loader, "PROGRESS_DELAY_SECONDS", 0.0)  # as if the checkpoint were large
    monkeypatch.setattr(sys, "stderr", terminal)
    LLM(model_dir, device="cpu", dtype="float32", max_model_len=64).close()
    assert "loading weights" in terminal.text and "loading CPU experts" in terminal.text
    assert f"{TINY.num_layers}/{TINY.num_layers}" in terminal.text  # per layer


def test_tokenizer_shipped_as_code_needs_trust_remote_code(model_dir, tmp_path, capsys, monkeypatch):
    """A checkpoint whose tokenizer is a class in its own Python file (Kimi-K2's tiktoken tokenizer, by
    tokenizer_config.json auto_map) is refused with the flag to pass, and loads with --trust-remote-code."""
    from server.app import load_tokenizer

    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    (target / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    is_custom = True\n")
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="CustomTokenizer",
                  auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="--trust-remote-code") as refused:
        load_tokenizer(target)
    assert "tokenization_custom.CustomTokenizer" in str(refused.value)
    assert getattr(load_tokenizer(target, trust_remote_code=True), "is_custom", False)
    monkeypatch.setattr("hybrid.llm.LLM", lambda *a, **k: pytest.fail("loaded the model after a tokenizer error"))
    assert main(["--model", str(target), "--port", "0", "--dtype", "float32"]) == 1
    assert "--trust-remote-code" in capsys.readouterr().err
