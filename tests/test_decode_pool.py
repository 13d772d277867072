"""The decode pool (`cpu_experts.decode_pool`) against the operator it replaces in graph steps (`CpuMoE`, integer
kernels), with a Python thread playing the GPU's side of the flags: outputs equal bit for bit over several steps
and layers (per-channel and grouped int8, 1 and 3 partitions, 1 to 7 tokens, -1 ids, a token routed nowhere,
consecutive requests of one layer as deferral posts them), on 1 to 3 threads; a bad expert id and a layer never
posted surface at `finish_step` and the next step is served; an idle pool sleeps and wakes for the next step."""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch
from cpu_features import features
from handoff_support import play_gpu as play_gpu_within

from cpu_experts.decode_pool import DecodePool, supports
from cpu_experts.executor import AsyncExperts, CpuExpertsError
from cpu_experts.expert_file import SWIGLU_OAI
from cpu_experts.flag_worker import REQUEST, FlagWorker
from cpu_experts.operator import CpuMoE
from cpu_experts.packed import PackedLayer

play_gpu = functools.partial(play_gpu_within, timeout_s=30)  # a first call compiles the pool's kernels

E, H, I, TOP_K = 8, 160, 200, 3  # noqa: E741 (the shape letters of the project); H: five 32-byte blocks, I: tails


def make_ops(group: int, partitions: int, layers=(0, 2, 3), dtype: str = "int8",
             is_gpt_oss: bool = False, rank: int = 0, num_ranks: int = 1) -> dict[int, CpuMoE]:
    """dtype "int8", "int4", "int4 bf16" (int4 with bfloat16 scales, as Kimi-K2's checkpoints store them), "fp8",
    "mxfp4" or "nvfp4". `is_gpt_oss`: gpt-oss's activation with random biases, gate/up past its clamp. `rank` of
    `num_ranks`: that tensor-parallel rank's slice of I."""
    ops = {}
    for layer in layers:
        gen = torch.Generator().manual_seed(layer)
        gain = 0.6 if is_gpt_oss else 0.1
        ws = [torch.randn(shape, generator=gen) * g for shape, g in (((E, I, H), gain), ((E, I, H), gain),
                                                                     ((E, H, I), 0.1))]
        extra = {}
        if is_gpt_oss:
            extra = dict(activation=SWIGLU_OAI, biases=(torch.randn(E, I, generator=gen),
                                                        torch.randn(E, I, generator=gen),
                                                        torch.randn(E, H, generator=gen)))
        packed = PackedLayer.from_float(*ws, dtype.split()[0], group, partitions, rank=rank, num_ranks=num_ranks,
                                        **extra)
        if dtype == "int4 bf16":
            packed = _bf16_scales(packed, group, partitions)
        # the integer kernels (their generic form on a CPU without VNNI)
        ops[layer] = CpuMoE(packed, prefill_min_tokens=8, features=features(has_vnni=True))
    return ops


def _bf16_scales(packed: PackedLayer, group: int, partitions: int) -> PackedLayer:
    """The same codes with their scales rounded to bfloat16 and stored so."""
    assert len(packed.partitions) == 1
    spec = dataclasses.replace(packed.spec, scale_dtype="bfloat16")
    tensors = {}
    for role in ("gate", "up", "down"):
        part = packed.partitions[0]
        tensors[f"{role}.weight"] = torch.from_numpy(getattr(part, role))
        tensors[f"{role}.scales"] = torch.from_numpy(getattr(part, f"{role}_scales")).to(torch.bfloat16)
    return PackedLayer.from_file_tensors(tensors, spec, partitions)


def make_pool(ops, num_threads: int, max_tokens: int = 8):
    executor = AsyncExperts(lambda *a: None, max_tokens=max_tokens, hidden_size=H, top_k=TOP_K, pin_memory=False)
    worker = FlagWorker(executor, max_tokens=max_tokens, pin_memory=False)
    return DecodePool(worker, ops, cpus=[0] * num_threads), executor


def inputs(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.25] = -1  # experts computed elsewhere (on the GPU)
    if num_tokens > 1:
        ids[0] = -1  # a token with nothing to compute on the CPU
    return hidden, ids, torch.rand(num_tokens, TOP_K, generator=gen)


@pytest.mark.parametrize("group,partitions,num_threads,dtype", [
    (0, 1, 2, "int8"), (64, 3, 3, "int8"), (0, 3, 1, "int8"), (32, 1, 3, "int4 bf16"), (64, 3, 2, "int4"),
    (32, 3, 2, "int4"), (32, 1, 2, "fp8"), (64, 3, 3, "fp8"), (32, 3, 2, "mxfp4"), (16, 1, 3, "nvfp4"),
    (16, 3, 2, "nvfp4")])
def test_steps_equal_the_operator(group, partitions, num_threads, dtype):
    """int4: group 32 (its several-groups-a-vector loop) with bfloat16 scales, and group 64; I = 200 leaves a last
    group that fills no vector unit (the byte-at-a-time tail). The float formats (bf16 activations) on their decode
    kernels' work ranges, with a barrier between partitions (down reads the act rows the next gate/up writes)."""
    ops = make_ops(group, partitions, dtype=dtype)
    pool, executor = make_pool(ops, num_threads)
    try:
        for step, num_tokens in enumerate([1, 7, 2, 1]):
            hidden, ids, weights = inputs(num_tokens, step)
            requests = [0, 2, 2, 3]  # layer 2 twice in a row: a deferring layer's second request
            pool.arm(num_tokens, len(requests))
            outputs = play_gpu(pool.worker, requests, hidden, ids, weights)
            pool.finish_step()
            for layer, got in zip(requests, outputs, strict=True):
                want = ops[layer](hidden * (layer + 1), ids, weights)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step} layer {layer}")
            assert outputs[1][-1].abs().sum() > 0 and (num_tokens == 1 or not outputs[0][0].any())
    finally:
        pool.close()
        executor.close()


@pytest.mark.parametrize("group,partitions,dtype", [
    (0, 1, "int8"), (0, 3, "int8"), (32, 1, "int4"), (32, 3, "int4"), (32, 1, "fp8"), (32, 3, "mxfp4"),
    (16, 3, "nvfp4")])
def test_gpt_oss_steps_equal_the_operator(group, partitions, dtype):
    """gpt-oss's layers (clamped activation, gate/up/down biases) served by the pool equal the operator's bit for
    bit: the slot table's epilogue and the down bias over each thread's columns. W8A8 steps of 5 and 7 tokens have
    enough pairs for the operator's parallel loops, where LLVM once contracted the dot's scaling into the bias add
    (`kernels.fence`): an act value 1-2 ulps off moved its row's int8 scale."""
    ops = make_ops(group, partitions, dtype=dtype, is_gpt_oss=True)
    assert all(supports(op) for op in ops.values())
    pool, executor = make_pool(ops, 2)
    try:
        for step, num_tokens in enumerate([1, 5, 7]):
            hidden, ids, weights = inputs(num_tokens, step)
            requests = [0, 2, 3]
            pool.arm(num_tokens, len(requests))
            outputs = play_gpu(pool.worker, requests, hidden, ids, weights)
            pool.finish_step()
            for layer, got in zip(requests, outputs, strict=True):
                want = ops[layer](hidden * (layer + 1), ids, weights)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step} layer {layer}")
    finally:
        pool.close()
        executor.close()


@pytest.mark.parametrize("rank,num_ranks,group,dtype,is_gpt_oss", [
    (1, 2, 0, "int8", True), (2, 3, 32, "int4", False), (1, 3, 64, "int8", False), (1, 2, 32, "mxfp4", True)])
def test_a_ranks_slice_steps_equal_the_operator(rank, num_ranks, group, dtype, is_gpt_oss):
    """A tensor-parallel rank's slice of I (partitions starting past 0, a short last one; gpt-oss's down bias left
    to rank 0) served by the pool equals the rank's operator bit for bit."""
    ops = make_ops(group, 2, layers=(0, 2), dtype=dtype, is_gpt_oss=is_gpt_oss, rank=rank, num_ranks=num_ranks)
    assert all(supports(op) and op.layer.partitions[0].start > 0 and op.layer.down_bias is None
               for op in ops.values())
    pool, executor = make_pool(ops, 2)
    try:
        for step, num_tokens in enumerate([1, 5]):
            hidden, ids, weights = inputs(num_tokens, step)
            pool.arm(num_tokens, 2)
            outputs = play_gpu(pool.worker, [0, 2], hidden, ids, weights)
            pool.finish_step()
            for layer, got in zip([0, 2], outputs, strict=True):
                want = ops[layer](hidden * (layer + 1), ids, weights)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step} layer {layer}")
    finally:
        pool.close()
        executor.close()


def test_an_empty_rank_is_left_to_the_worker():
    """A rank whose slice of I is empty (I = 200 has 7 blocks of 32: nothing for an eighth rank) computes zeros in
    the operator and is not the pool's."""
    op = make_ops(0, 1, layers=(0,), rank=7, num_ranks=8)[0]
    assert not op.layer.partitions and not supports(op)
    hidden, ids, weights = inputs(3, 0)
    assert torch.equal(op(hidden, ids, weights), torch.zeros(3, H))


def test_bad_id_and_missing_layer_reported_then_next_step_served():
    ops = make_ops(0, 1, layers=(0, 1))
    pool, executor = make_pool(ops, 2)
    try:
        hidden, ids, weights = inputs(2, 0)
        bad = ids.clone()
        bad[1, 1] = E
        pool.arm(2, 2)
        play_gpu(pool.worker, [0], hidden, ids, weights)
        play_gpu(pool.worker, [1], hidden, bad, weights)  # the GPU is never left waiting
        with pytest.raises(CpuExpertsError, match=f"layer 1: topk_ids holds expert {E}"):
            pool.finish_step()
        pool.arm(2, 1)
        play_gpu(pool.worker, [5], hidden, ids, weights)
        with pytest.raises(CpuExpertsError, match="layer 5: no experts in the decode pool"):
            pool.finish_step()
        pool.arm(2, 2)
        play_gpu(pool.worker, [0], hidden, ids, weights)  # the second layer is never posted
        with pytest.raises(CpuExpertsError, match="served 1 of 2"):
            pool.finish_step()
        pool.arm(2, 2)
        got = play_gpu(pool.worker, [0, 1], hidden, ids, weights)
        pool.finish_step()
        torch.testing.assert_close(got[1], ops[1](hidden * 2, ids, weights), rtol=0, atol=0)
    finally:
        pool.close()
        executor.close()


def test_idle_pool_sleeps_and_wakes_skip_and_timing():
    ops = make_ops(0, 1, layers=(0,))
    executor = AsyncExperts(lambda *a: None, max_tokens=4, hidden_size=H, top_k=TOP_K, pin_memory=False)
    worker = FlagWorker(executor, max_tokens=4, pin_memory=False)
    pool = DecodePool(worker, ops, cpus=[0, 0], idle_seconds=0.001)
    try:
        assert pool.serves(1) and pool.serves(4) and not pool.serves(5) and not pool.serves(0)
        hidden, ids, weights = inputs(3, 1)
        for _ in range(2):
            time.sleep(0.05)  # the threads went back to Python and sleep
            pool.arm(3, 1)
            time.sleep(0.05)  # the device's work before the MoE layer
            got = play_gpu(worker, [0], hidden, ids, weights)[0]
            pool.finish_step()
            torch.testing.assert_close(got, ops[0](hidden, ids, weights), rtol=0, atol=0)
        assert 0.05 < pool.wait_seconds < 5 and 0 < pool.compute_seconds < 5  # two steps, each waited ~0.05 s
        pool.skip_compute = True
        pool.arm(3, 1)
        assert not play_gpu(worker, [0], hidden, ids, weights)[0].any()
        pool.finish_step()
        pool.park()
    finally:
        pool.close()
        executor.close()
    assert not any(t.is_alive() for t in pool._threads)


def test_supports_and_refuses():
    ops = make_ops(0, 1, layers=(0,))
    assert supports(ops[0])
    ops[0] = CpuMoE(ops[0].layer, features=features(has_vnni=False))  # the float kernels: not the pool's
    assert ops[0].kernels.decode == "int8" and not supports(ops[0])
    executor = AsyncExperts(lambda *a: None, max_tokens=4, hidden_size=H, top_k=TOP_K, pin_memory=False)
    worker = FlagWorker(executor, max_tokens=4, pin_memory=False)
    try:
        with pytest.raises(ValueError, match=r"layers \[0\] are not"):
            DecodePool(worker, ops, cpus=[0])
    finally:
        executor.close()


def test_a_dead_thread_stops_the_pool_and_is_reported(monkeypatch):
    """A thread that fails leaves the others no barrier to wait at forever: they return, `finish_step` names the
    failure, and the pool serves no more steps (the engine's worker takes them)."""
    from cpu_experts import decode_pool

    serve, returned = decode_pool._serve, []

    def failing(tid, *args):
        if tid == 1:
            raise MemoryError("no scratch for thread 1")
        result = serve(tid, *args)
        returned.append(tid)
        return result

    monkeypatch.setattr(decode_pool, "_serve", failing)
    ops = make_ops(0, 1, layers=(0,))
    pool, executor = make_pool(ops, 2)
    returned.clear()  # the pool's start-up call (`_compile`) returned on the constructing thread
    try:
        pool.arm(2, 1)
        pool.worker.flags[REQUEST] = 1  # thread 0 starts the layer and waits for thread 1 at the first barrier
        deadline = time.monotonic() + 10
        while not returned:  # thread 0 left the barrier and the step once thread 1 died
            assert time.monotonic() < deadline, "thread 0 still waits for the dead thread"
            time.sleep(0.01)
        with pytest.raises(CpuExpertsError, match="served 0 of 1.*no scratch for thread 1"):
            pool.finish_step()
        assert not pool.serves(1)
    finally:
        pool.close()
        executor.close()
    assert not any(t.is_alive() for t in pool._threads)


@pytest.mark.parametrize("dtype,group,partitions", [("int8", 0, 1), ("int4", 32, 3), ("fp8", 32, 1), ("nvfp4", 16, 3)])
def test_eager_steps_through_the_executor(dtype, group, partitions):
    """The engine's eager steps: an executor given the pool (`AsyncExperts.decode_pool`) runs the layers of steps
    the pool serves on its threads (`DecodePool.call`), equal to the operator bit for bit; a step of more tokens
    than the pool serves runs `compute`; a bad id fails its layer only, and the next layer is served."""
    ops = make_ops(group, partitions, dtype=dtype)
    computed = []

    def compute(layer, hidden, ids, weights, out):
        computed.append((layer, hidden.shape[0]))
        out.copy_(ops[layer](hidden, ids, weights))

    executor = AsyncExperts(compute, max_tokens=12, hidden_size=H, top_k=TOP_K, pin_memory=False)
    pool = DecodePool(FlagWorker(executor, max_tokens=8, pin_memory=False), ops, cpus=[0, 0])
    executor.decode_pool = pool
    try:
        assert pool.max_tokens == 7  # the layers' prefill threshold (8) - 1
        for step, num_tokens in enumerate([1, 7, 3, 12]):
            hidden, ids, weights = inputs(num_tokens, step)
            for layer in (0, 2, 3):
                executor.submit(layer, hidden * (layer + 1), ids, weights)
                got = executor.sync().clone()
                want = ops[layer](hidden * (layer + 1), ids, weights)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{num_tokens} tokens, layer {layer}")
        assert pool.layers_served == 9 and computed == [(0, 12), (2, 12), (3, 12)]
        hidden, ids, weights = inputs(2, 9)
        ids[1, 0] = E + 3
        executor.submit(2, hidden, ids, weights)
        with pytest.raises(CpuExpertsError, match=f"layer 2: topk_ids holds expert {E + 3}"):
            executor.sync()
        ids[1, 0] = 1
        executor.submit(2, hidden, ids, weights)
        torch.testing.assert_close(executor.sync(), ops[2](hidden, ids, weights), rtol=0, atol=0)
    finally:
        pool.close()
        executor.close()
