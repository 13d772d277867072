"""The CPU side of the CUDA-graph hand-off (`cpu_experts.flag_worker`), with a Python thread playing the GPU's part
of the protocol (copy in, post the layer, wait for done, clear it, copy out): every layer is served once, in order,
on the armed rows; a compute error or a layer never posted surfaces at `finish_step` and the worker serves the next
step normally."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from handoff_support import play_gpu

from cpu_experts.executor import AsyncExperts, CpuExpertsError
from cpu_experts.flag_worker import DONE, REQUEST, FlagWorker, spin_until_nonzero

HIDDEN, TOP_K = 6, 2


def compute(layer, hidden, topk_ids, topk_weights, out):
    """A stand-in for the experts: depends on the layer, the rows and their ids (-1 rows give zero)."""
    routed = (topk_ids >= 0).to(hidden.dtype) * topk_weights
    out.copy_(hidden * (layer + 1) * routed.sum(dim=1, keepdim=True))


def make_worker(fn=compute, max_tokens=4) -> FlagWorker:
    executor = AsyncExperts(fn, max_tokens=8, hidden_size=HIDDEN, top_k=TOP_K, pin_memory=False)
    return FlagWorker(executor, max_tokens=max_tokens, pin_memory=False)


@pytest.fixture
def worker():
    w = make_worker()
    yield w
    w.close()
    w.executor.close()


def inputs(num_tokens: int):
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.randint(0, 8, (num_tokens, TOP_K), generator=g)
    ids[-1, 0] = -1  # a row's expert computed elsewhere
    return hidden, ids, torch.rand(num_tokens, TOP_K, generator=g)


def expected(layer, hidden, ids, weights):
    out = torch.empty_like(hidden)
    compute(layer, hidden * (layer + 1), ids, weights, out)
    return out


def test_spin_reads_the_flag_without_the_gil():
    flag = torch.zeros(1, dtype=torch.int32)
    assert spin_until_nonzero(flag.data_ptr(), 1000) == 0
    threading.Timer(0.05, lambda: flag.fill_(7)).start()
    value = 0
    while value == 0:
        value = spin_until_nonzero(flag.data_ptr(), 1 << 20)
    assert value == 7


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_every_layer_served_in_order_for_several_steps(worker, num_tokens):
    hidden, ids, weights = inputs(num_tokens)
    layers = [1, 2, 5, 7]
    for _ in range(3):
        worker.arm(num_tokens, len(layers))
        outputs = play_gpu(worker, layers, hidden, ids, weights)
        worker.finish_step()
        for layer, out in zip(layers, outputs, strict=True):
            torch.testing.assert_close(out, expected(layer, hidden, ids, weights), rtol=0, atol=0)
        assert int(worker.flags[REQUEST]) == 0 and int(worker.flags[DONE]) == 0


def test_compute_error_reported_then_next_step_works():
    failing = {"layer": 2}

    def flaky(layer, *args):
        if layer == failing["layer"]:
            raise ValueError("bad expert weights")
        compute(layer, *args)

    w = make_worker(flaky, max_tokens=2)
    try:
        hidden, ids, weights = inputs(2)
        w.arm(2, 3)
        play_gpu(w, [1, 2, 3], hidden, ids, weights)  # the GPU is never left waiting
        with pytest.raises(CpuExpertsError, match="bad expert weights"):
            w.finish_step()
        failing["layer"] = None
        w.arm(2, 3)
        outputs = play_gpu(w, [1, 2, 3], hidden, ids, weights)
        w.finish_step()
        torch.testing.assert_close(outputs[1], expected(2, hidden, ids, weights))
    finally:
        w.close()
        w.executor.close()


def test_step_time_split_into_waiting_and_computing(worker):
    """The worker's wait for the device to reach a layer and its compute time, summed over steps."""

    def slow(layer, *args):
        time.sleep(0.02)
        compute(layer, *args)

    worker.compute = slow
    hidden, ids, weights = inputs(1)
    worker.arm(1, 2)
    time.sleep(0.05)  # the device's work before the first MoE layer
    play_gpu(worker, [0, 1], hidden, ids, weights)
    worker.finish_step()
    assert worker.wait_seconds >= 0.05 and worker.compute_seconds >= 0.04
    assert worker.wait_seconds < 0.5 and worker.compute_seconds < 0.5


def test_one_thread_launches_every_kernel(worker):
    """Submits and graph steps run compute on the executor's one thread (one OpenMP pool of kernel threads)."""
    threads = set()
    executor = worker.executor
    plain = executor.compute

    def recording(*args):
        threads.add(threading.get_ident())
        plain(*args)

    executor.compute = worker.compute = recording
    hidden, ids, weights = inputs(2)
    executor.submit(3, hidden, ids, weights)
    executor.sync()
    worker.arm(2, 2)
    play_gpu(worker, [0, 1], hidden, ids, weights)
    worker.finish_step()
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_layer_never_posted_times_out_then_next_step_works(worker):
    hidden, ids, weights = inputs(2)
    worker.arm(2, 3)
    play_gpu(worker, [1, 2], hidden, ids, weights)
    with pytest.raises(CpuExpertsError, match="served 2 of 3"):
        worker.finish_step(timeout=0.3)
    time.sleep(0.05)
    worker.arm(2, 2)
    outputs = play_gpu(worker, [4, 6], hidden, ids, weights)
    worker.finish_step()
    torch.testing.assert_close(outputs[1], expected(6, hidden, ids, weights))


def test_arm_checks_its_arguments(worker):
    with pytest.raises(ValueError, match="num_tokens"):
        worker.arm(5, 1)
    worker.arm(1, 1)
    with pytest.raises(RuntimeError, match="finish_step"):
        worker.arm(1, 1)
