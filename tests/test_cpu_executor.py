"""AsyncExperts / SyncExperts: results, overlap, error reporting, misuse and shutdown without hangs."""

import os
import threading
import time

import pytest
import torch

from cpu_experts.executor import AsyncExperts, CpuExpertsError, SyncExperts
from cpu_experts.reference import moe_reference

MAX_T, H, INTER, E, K = 8, 16, 8, 4, 2
EXECUTORS = [AsyncExperts, SyncExperts]


def _layer_weights(num_layers=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(E, INTER, H, generator=gen),
            torch.randn(E, INTER, H, generator=gen),
            torch.randn(E, H, INTER, generator=gen),
        )
        for _ in range(num_layers)
    ]


def _reference_compute(weights):
    def compute(layer, hidden, topk_ids, topk_weights, out):
        out.copy_(moe_reference(hidden, *weights[layer], topk_ids, topk_weights))

    return compute


def _inputs(num_tokens, gen):
    hidden = torch.randn(num_tokens, H, generator=gen)
    ids = torch.randint(-1, E, (num_tokens, K), generator=gen)
    weights = torch.rand(num_tokens, K, generator=gen)
    return hidden, ids, weights


def _call_with_timeout(fn, timeout=3.0):
    """Run fn in a thread; fail if it does not finish in time; return what it raised (or None)."""
    outcome = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"call did not return within {timeout} s"
    return outcome.get("error")


def _blocking_compute():
    """A compute that waits until the test releases it (bounded, so a failing test cannot leak a stuck thread)."""
    release = threading.Event()

    def compute(layer, hidden, topk_ids, topk_weights, out):
        release.wait(5.0)

    return compute, release


@pytest.mark.parametrize("executor_cls", EXECUTORS)
def test_results_match_direct_compute(executor_cls):
    weights = _layer_weights()
    compute = _reference_compute(weights)
    gen = torch.Generator().manual_seed(1)
    with executor_cls(compute, MAX_T, H, K) as ex:
        for step, num_tokens in enumerate([1, 3, MAX_T, 3, 1, MAX_T]):
            layer = step % len(weights)
            hidden, ids, topk_weights = _inputs(num_tokens, gen)
            expected = torch.empty(num_tokens, H)
            compute(layer, hidden, ids, topk_weights, expected)
            ex.submit(layer, hidden, ids, topk_weights)
            result = ex.sync()
            assert result.shape == (num_tokens, H)
            assert result.data_ptr() == ex.out_buffer.data_ptr()  # a view of the fixed buffer, not a copy
            torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_async_and_sync_executors_agree():
    compute = _reference_compute(_layer_weights(seed=3))
    gen = torch.Generator().manual_seed(4)
    with AsyncExperts(compute, MAX_T, H, K) as fast, SyncExperts(compute, MAX_T, H, K) as slow:
        for layer in range(3):
            args = _inputs(5, gen)
            fast.submit(layer, *args)
            slow.submit(layer, *args)
            torch.testing.assert_close(fast.sync(), slow.sync(), rtol=0, atol=0)


def test_submit_returns_before_slow_compute_finishes():
    def slow(layer, hidden, topk_ids, topk_weights, out):
        time.sleep(0.2)
        out.copy_(hidden * 2)

    gen = torch.Generator().manual_seed(0)
    hidden, ids, weights = _inputs(3, gen)
    with AsyncExperts(slow, MAX_T, H, K) as ex:
        start = time.perf_counter()
        ex.submit(0, hidden, ids, weights)
        assert time.perf_counter() - start < 0.05
        torch.testing.assert_close(ex.sync(), hidden * 2)
        assert time.perf_counter() - start >= 0.2


@pytest.mark.parametrize("executor_cls", EXECUTORS)
def test_compute_error_surfaces_at_sync_and_executor_recovers(executor_cls):
    cause = ValueError("bad expert id 99")

    def compute(layer, hidden, topk_ids, topk_weights, out):
        if layer == 5:
            raise cause
        out.copy_(hidden + layer)

    gen = torch.Generator().manual_seed(0)
    hidden, ids, weights = _inputs(2, gen)
    with executor_cls(compute, MAX_T, H, K) as ex:
        ex.submit(5, hidden, ids, weights)
        with pytest.raises(CpuExpertsError, match=r"layer 5: ValueError: bad expert id 99") as info:
            ex.sync()
        assert info.value.__cause__ is cause
        ex.submit(6, hidden, ids, weights)
        torch.testing.assert_close(ex.sync(), hidden + 6)


@pytest.mark.parametrize("executor_cls", EXECUTORS)
def test_misuse_double_submit_and_sync_without_submit(executor_cls):
    gen = torch.Generator().manual_seed(0)
    args = _inputs(2, gen)
    with executor_cls(lambda *a: None, MAX_T, H, K) as ex:
        with pytest.raises(RuntimeError, match="without a pending submit"):
            ex.sync()
        ex.submit(0, *args)
        with pytest.raises(RuntimeError, match="layer 0 is still in flight: call sync"):
            ex.submit(1, *args)
        ex.sync()
        with pytest.raises(RuntimeError, match="without a pending submit"):
            ex.sync()


def _bad_inputs():
    ok = dict(hidden=torch.zeros(2, H), topk_ids=torch.zeros(2, K, dtype=torch.int64), topk_weights=torch.zeros(2, K))
    cases = [
        ("hidden", dict(hidden=torch.zeros(MAX_T + 1, H))),
        ("hidden", dict(hidden=torch.zeros(2, H + 1))),
        ("hidden", dict(hidden=torch.zeros(2 * H))),
        ("hidden", dict(hidden=torch.zeros(2, H, dtype=torch.bfloat16))),
        ("topk_ids", dict(topk_ids=torch.zeros(2, K + 1, dtype=torch.int64))),
        ("topk_ids", dict(topk_ids=torch.zeros(3, K, dtype=torch.int64))),
        ("topk_ids", dict(topk_ids=torch.zeros(2, K, dtype=torch.int32))),
        ("topk_weights", dict(topk_weights=torch.zeros(2, K, dtype=torch.float64))),
        ("topk_weights", dict(topk_weights=torch.zeros(1, K))),
    ]
    return [pytest.param(name, {**ok, **change}, id=f"{name}-{i}") for i, (name, change) in enumerate(cases)]


@pytest.mark.parametrize("executor_cls", EXECUTORS)
@pytest.mark.parametrize("name,kwargs", _bad_inputs())
def test_submit_validates_shapes_and_dtypes(executor_cls, name, kwargs):
    with executor_cls(lambda *a: None, MAX_T, H, K) as ex:
        with pytest.raises(ValueError, match=name):
            ex.submit(0, **kwargs)
        # A rejected submit leaves nothing in flight.
        ex.submit(0, torch.zeros(2, H), torch.zeros(2, K, dtype=torch.int64), torch.zeros(2, K))
        ex.sync()


def test_constructor_validation_and_buffers():
    with pytest.raises(ValueError, match="max_tokens"):
        SyncExperts(lambda *a: None, 0, H, K)
    with pytest.raises(ValueError, match="dtype"):
        SyncExperts(lambda *a: None, MAX_T, H, K, dtype=torch.int32)
    with AsyncExperts(lambda *a: None, MAX_T, H, K, dtype=torch.bfloat16) as ex:
        assert ex.pin_memory == torch.cuda.is_available()
        assert ex.hidden_buffer.shape == ex.out_buffer.shape == (MAX_T, H)
        assert ex.hidden_buffer.dtype == ex.out_buffer.dtype == torch.bfloat16
        assert ex.ids_buffer.shape == ex.weights_buffer.shape == (MAX_T, K)
        assert (ex.ids_buffer.dtype, ex.weights_buffer.dtype) == (torch.int64, torch.float32)


def test_sync_after_close_raises_without_hanging():
    compute, release = _blocking_compute()
    try:
        ex = AsyncExperts(compute, MAX_T, H, K)
        ex.submit(3, *_inputs(1, torch.Generator().manual_seed(0)))
        ex.close(timeout=0.1)  # the compute is still blocked
        ex.close()  # idempotent
        error = _call_with_timeout(ex.sync)
        assert isinstance(error, CpuExpertsError) and "closed" in str(error)
        with pytest.raises(CpuExpertsError, match="closed"):
            ex.submit(4, *_inputs(1, torch.Generator().manual_seed(0)))
    finally:
        release.set()


def test_close_from_another_thread_wakes_a_waiting_sync():
    compute, release = _blocking_compute()
    try:
        ex = AsyncExperts(compute, MAX_T, H, K)
        ex.submit(0, *_inputs(1, torch.Generator().manual_seed(0)))
        threading.Timer(0.1, ex.close, kwargs={"timeout": 0.0}).start()
        error = _call_with_timeout(ex.sync)
        assert isinstance(error, CpuExpertsError) and "closed while layer 0" in str(error)
    finally:
        release.set()


def test_sync_notices_a_dead_worker():
    compute, release = _blocking_compute()
    try:
        ex = AsyncExperts(compute, MAX_T, H, K)
        ex.submit(7, *_inputs(1, torch.Generator().manual_seed(0)))
        dead = threading.Thread(target=lambda: None)
        dead.start()
        dead.join()
        ex._thread = dead  # simulate a worker that vanished without reporting
        error = _call_with_timeout(ex.sync)
        assert isinstance(error, CpuExpertsError) and "died while running layer 7" in str(error)
    finally:
        release.set()


def test_worker_stops_after_a_fatal_base_exception():
    def compute(layer, hidden, topk_ids, topk_weights, out):
        raise SystemExit("fatal")

    args = _inputs(1, torch.Generator().manual_seed(0))
    with AsyncExperts(compute, MAX_T, H, K) as ex:
        ex.submit(2, *args)
        with pytest.raises(CpuExpertsError, match="layer 2: SystemExit") as info:
            ex.sync()
        assert isinstance(info.value.__cause__, SystemExit)
        ex._thread.join(2.0)
        with pytest.raises(CpuExpertsError, match="not running"):
            ex.submit(3, *args)


def test_context_manager_stops_the_worker():
    with AsyncExperts(lambda *a: None, MAX_T, H, K, name="test-worker") as ex:
        assert ex._thread.is_alive() and ex._thread.daemon and ex._thread.name == "test-worker"
    assert not ex._thread.is_alive()
    ex.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity")
def test_worker_is_pinned_to_worker_cpus():
    cpu = min(os.sched_getaffinity(0))
    seen = {}

    def compute(layer, hidden, topk_ids, topk_weights, out):
        seen["affinity"] = os.sched_getaffinity(0)

    with AsyncExperts(compute, MAX_T, H, K, worker_cpus=(cpu,)) as ex:
        ex.submit(0, *_inputs(1, torch.Generator().manual_seed(0)))
        ex.sync()
    assert seen["affinity"] == {cpu}
    assert len(os.sched_getaffinity(0)) >= 1  # the caller's own affinity is untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_memory", [True, False])
def test_cuda_inputs_are_staged_before_compute(pin_memory):
    weights = _layer_weights()
    compute = _reference_compute(weights)
    gen = torch.Generator().manual_seed(2)
    with AsyncExperts(compute, MAX_T, H, K, pin_memory=pin_memory) as ex:
        assert ex.hidden_buffer.is_pinned() == pin_memory
        for step in range(20):
            hidden, ids, topk_weights = _inputs(MAX_T, gen)
            expected = torch.empty(MAX_T, H)
            compute(step % 3, hidden, ids, topk_weights, expected)
            hidden_gpu, ids_gpu, weights_gpu = hidden.cuda(), ids.cuda(), topk_weights.cuda()
            # Make the inputs depend on slow GPU work, so the device-to-host copies are still pending at submit
            # (removing the event wait makes this test fail).
            big = torch.randn(4096, 4096, device="cuda")
            for _ in range(5):
                big = big @ big / 4096
            zero = big[0, 0] * 0
            hidden_gpu, ids_gpu, weights_gpu = hidden_gpu + zero, ids_gpu + zero.long(), weights_gpu + zero
            ex.submit(step % 3, hidden_gpu, ids_gpu, weights_gpu)
            torch.testing.assert_close(ex.sync(), expected, rtol=0, atol=0)


def test_worker_computes_into_buffers_made_in_inference_mode():
    """A tensor-parallel worker builds its graph runner (and the buffers its CPU side writes) inside
    `torch.inference_mode()`: the executor's thread computes in inference mode too, or an in-place write into such a
    buffer fails there (the device's batch-16 capture at tp=2 failed so on rank 1)."""
    compute = _reference_compute(_layer_weights(seed=5))
    gen = torch.Generator().manual_seed(6)
    hidden, ids, topk_weights = _inputs(3, gen)
    expected = torch.empty(3, H)
    compute(0, hidden, ids, topk_weights, expected)
    with torch.inference_mode(), AsyncExperts(compute, MAX_T, H, K) as ex:  # the worker's serving loop: all of it
        ex.submit(0, hidden, ids, topk_weights)
        torch.testing.assert_close(ex.sync(), expected, rtol=0, atol=0)
