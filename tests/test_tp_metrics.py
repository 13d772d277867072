"""The server's per-rank metrics (`hybrid.rank_stats`, `server.metrics`): a tp=2 server on the CPU (gloo, float32,
the tiny demo model with its experts on the CPU operator) shows each rank's series after some requests, with the
engine-wide series unlabelled; a scrape answers while a worker is stopped mid-step (it waits for neither the engine
nor the workers) and tells a dead worker; the CPU experts' seconds are counted once per source however many runners
read them. One tensor-parallel LLM for the module: spawning ranks is the slow part."""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch
from server_support import start_server, tiny_model

from hybrid import LLM
from hybrid.engine import Engine
from hybrid.rank_stats import RankCounters, RankTable

MAX_MODEL_LEN = 256
NUM_REQUESTS, MAX_TOKENS = 3, 4


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    """The real app over an engine at tp=2 -> (server, llm, the time it started)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank computes on one thread of the 2 cores, as in test_tensor_parallel
    model_dir = tiny_model(tmp_path_factory.mktemp("tiny"))
    started = time.monotonic()
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, tensor_parallel_size=2,
              expert_placement="cpu")
    server = start_server(Engine(llm, max_num_batched_tokens=64, max_num_seqs=4), model_dir, llm.max_model_len)
    yield server, llm, started
    server.stop()
    llm.close()
    torch.set_num_threads(previous)


def complete(server, prompt: str) -> None:
    response = httpx.post(server.url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text


def scrape(server, timeout: float = 10.0) -> str:
    response = httpx.get(server.url + "/metrics", timeout=timeout)
    assert response.status_code == 200
    return response.text


def per_rank(text: str, name: str) -> dict[int, float]:
    return {int(rank): float(value) for rank, value in re.findall(rf'^{name}\{{rank="(\d+)"\}} (\S+)$', text, re.M)}


def test_each_rank_has_its_series(tp_server):
    server, llm, started = tp_server
    before = per_rank(scrape(server), "hybrid_rank_steps_total")
    for n in range(NUM_REQUESTS):
        complete(server, f"count {n} " * (n + 2))
    deadline = time.monotonic() + 10  # a worker publishes just after rank 0's step ends
    while True:
        text = scrape(server)
        steps = per_rank(text, "hybrid_rank_steps_total")
        if steps[0] == steps[1] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert per_rank(text, "hybrid_rank_alive") == {0: 1.0, 1: 1.0}
    assert steps[0] == steps[1] == llm.counters.num_steps  # every step reaches every rank
    assert steps[0] - before[0] >= NUM_REQUESTS * MAX_TOKENS  # a prefill and 3 decodes each, at least
    seconds = per_rank(text, "hybrid_rank_cpu_experts_seconds_total")
    assert set(seconds) == {0, 1}
    for rank in (0, 1):  # each rank's own slice of the CPU experts, timed on that rank
        assert 0 < seconds[rank] < time.monotonic() - started
    assert "hybrid_rank_gpu_memory" not in text  # a CPU engine has no GPU memory to report
    # the engine-wide series stay unlabelled
    assert re.search(r"^hybrid_kv_cache_usage_ratio \S+$", text, re.M)
    assert re.search(r"^hybrid_generation_tokens_total \S+$", text, re.M)


def test_a_scrape_waits_for_no_rank(tp_server):
    """A worker stopped (SIGSTOP) mid-step holds the engine in its step's collective; a scrape still answers at
    once, with the rank alive and its last published numbers."""
    server, llm, _ = tp_server
    worker = llm.workers.processes[0]
    before = per_rank(scrape(server), "hybrid_rank_steps_total")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        request = threading.Thread(target=complete, args=(server, "held up"))
        request.start()
        deadline = time.monotonic() + 30
        while not llm.engine.scheduler.running:  # until the engine thread is in the step, waiting for rank 1
            assert time.monotonic() < deadline, "the request's step did not start"
            time.sleep(0.01)
        start = time.monotonic()
        text = scrape(server, timeout=5.0)
        assert time.monotonic() - start < 2.0
        assert request.is_alive()  # the engine is still held in the step
        assert per_rank(text, "hybrid_rank_alive") == {0: 1.0, 1: 1.0}
        assert per_rank(text, "hybrid_rank_steps_total") == before  # the last published numbers
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    request.join(timeout=60)
    assert not request.is_alive()


def test_a_dead_rank_is_reported(tp_server):
    """Last in the module: the worker is killed; the scrape says so without a step."""
    server, llm, _ = tp_server
    worker = llm.workers.processes[0]
    worker.kill()
    worker.join()
    text = scrape(server, timeout=5.0)
    assert per_rank(text, "hybrid_rank_alive") == {0: 1.0, 1: 0.0}


class Source:
    def __init__(self):
        self.compute_seconds = 0.0


def test_cpu_seconds_count_each_source_once():
    """The executor is shared by the model's runners; a graph runner's worker and pool are its own; a pool adds its
    last layer's seconds just after its step: counted at the next look, and at the runner's close."""
    counters = RankCounters(RankTable(1, is_shared=False), 0, "cpu")
    executor, worker, pool = Source(), Source(), Source()
    executor.compute_seconds = 1.0
    counters.add_cpu_seconds([executor])  # an eager runner's step
    worker.compute_seconds, pool.compute_seconds = 0.5, 0.25
    counters.add_cpu_seconds([executor, worker, pool])  # a graph runner's step: the executor did nothing new
    assert counters.cpu_experts_seconds == 1.75
    pool.compute_seconds += 0.125  # late
    executor.compute_seconds += 2.0
    counters.add_cpu_seconds([executor])
    assert counters.cpu_experts_seconds == 3.75
    counters.forget([worker, pool])
    assert counters.cpu_experts_seconds == 3.875
    counters.publish()
    [stats] = [counters.table.read(0, True)]
    assert stats.cpu_experts_seconds == 3.875 and stats.gpu_allocated_bytes is None
    assert math.isnan(counters.table._values[2])  # a CPU device: no memory, rendered as no series
