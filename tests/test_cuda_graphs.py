"""Decode as CUDA graphs with the CPU experts' hand-off inside them (device only): a replayed step, its CPU experts
served by the decode pool, gives exactly the logits of the same step launched op by op with the executor's worker
serving them, for 100 steps, with routed tokens crossing to the CPU experts and back inside the graph; the graph
engine generates what the eager engine generates; padded buckets and mixed steps (prefill chunks, which run
eagerly) keep every request's output."""

from __future__ import annotations

import pytest
import torch
from checkpoints import SEEDS, kernel_config, make_checkpoint, prompt

from cpu_experts.module import CpuExperts
from hybrid import LLM
from hybrid.engine import Engine
from hybrid.forward_batch import SequenceSlice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def converted(request, tmp_path_factory):
    from convert.cli import main

    root = tmp_path_factory.mktemp(request.param)
    make_checkpoint(kernel_config(request.param), root / "src", seed=SEEDS[request.param])
    assert main([str(root / "src"), str(root / "dst"), "--expert-dtype", "int8"]) == 0
    return root / "dst"


@pytest.fixture(scope="module", params=["gpt_oss", "mimo"])
def mixed_layers(request, tmp_path_factory):
    """Models of windowed and full layers (two cache groups, sinks) served from their plain checkpoints with CPU
    experts: gpt-oss's published MXFP4 experts (its clamped, biased activation in the decode pool), MiMo's bf16
    ones quantized at load."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        from test_gpt_oss import _write_mxfp4, make_gpt_oss

        _write_mxfp4(root, make_gpt_oss(root, head_dim=64))
    else:
        from test_mimo_v2_flash import make_mimo

        make_mimo(root)
    return root


def test_replay_equals_the_same_step_launched_eagerly_for_100_steps(converted):
    check_replay_equals_eager(converted)


def test_mixed_layers_replay_equals_eager_for_100_steps(mixed_layers):
    check_replay_equals_eager(mixed_layers)


def test_mixed_layers_graph_engine_generates_what_the_eager_engine_generates(mixed_layers):
    test_graph_engine_generates_what_the_eager_engine_generates(mixed_layers)


def check_replay_equals_eager(path):
    llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=256)
    engine = Engine(llm, max_num_seqs=4)
    runner = engine.runner.graphs
    assert runner is not None and sorted(runner.graphs) == [1, 2, 4]
    pool = runner.pool  # serves the replays; the eager steps go through the executor's worker and CpuMoE
    assert pool is not None
    assert any(isinstance(m, CpuExperts) for m in llm.model.modules())
    prompts = [prompt(n, seed=n) for n in (5, 17, 30)]  # 3 sequences: the bucket of 4 has a padding row
    tables = [llm.blocks.new_tables() for _ in prompts]
    for table in tables:
        llm.blocks.allocate(table, 30 + 100)  # every cache group's pages for the prompt and 100 steps
    computed = [0] * len(prompts)
    for p, table, i in zip(prompts, tables, range(3), strict=True):  # the prompts' KV, eagerly
        llm.runner.execute([SequenceSlice(0, len(p) - 1, table)], p[:-1])
        computed[i] = len(p) - 1
    tokens = [p[-1] for p in prompts]
    for step in range(100):
        inputs = engine.runner.prepare([SequenceSlice(computed[i], 1, tables[i]) for i in range(3)])
        runner.pool = None
        eager = runner.run_eagerly(inputs, tokens).clone()
        torch.cuda.synchronize()
        runner.finish_step()
        runner.pool = pool
        replayed = runner.run(inputs, tokens)
        torch.cuda.synchronize()
        runner.finish_step()
        assert torch.equal(replayed, eager), f"step {step}"
        tokens = replayed.argmax(dim=-1).tolist()
        computed = [c + 1 for c in computed]
    engine.close()


def test_graph_engine_generates_what_the_eager_engine_generates(converted):
    prompts = [prompt(n, seed=40 + n) for n in (3, 16, 21, 9, 40)]
    outputs = {}
    for is_graph in (False, True):
        llm = LLM(converted, device="cuda", dtype="float32", max_model_len=256, cuda_graph=is_graph)
        engine = Engine(llm, max_num_batched_tokens=32, max_num_seqs=4)  # chunked prefill beside decodes
        assert (engine.runner.graphs is not None) == is_graph
        outputs[is_graph] = engine.generate(prompts, max_tokens=24, ignore_eos=True)
        engine.close()
    assert outputs[True] == outputs[False]


def test_eager_decode_sized_steps_run_on_the_pool(converted):
    """Steps the graphs do not take but the pool serves (a prompt of a few tokens, alone or beside decodes) run
    their CPU layers on the decode pool through the executor (`DecodePool.call`): the same tokens as the engine
    whose eager steps run `CpuMoE` (no pool at all), and layers served beyond the replays' own."""
    prompts = [prompt(n, seed=60 + n) for n in (2, 3, 1, 4, 3)]
    outputs = {}
    for is_pool in (False, True):
        llm = LLM(converted, device="cuda", dtype="float32", max_model_len=256, cpu_decode_pool=is_pool)
        engine = Engine(llm, max_num_batched_tokens=4, max_num_seqs=4)
        outputs[is_pool] = engine.generate(prompts, max_tokens=12, ignore_eos=True)
        runner = engine.runner.graphs
        if is_pool:
            assert runner.pool is not None and llm.cpu_executor.decode_pool is runner.pool
            eager_layers = runner.pool.layers_served - runner.num_replays * runner.num_requests
            assert eager_layers >= runner.num_requests, (runner.pool.layers_served, runner.num_replays)
        engine.close()
    assert outputs[True] == outputs[False]


def test_graph_step_error_surfaces_and_engine_recovers(converted):
    # the executor's worker serves the graph steps here (the decode pool's errors: tests/test_decode_pool.py)
    llm = LLM(converted, device="cuda", dtype="bfloat16", max_model_len=128, cpu_decode_pool=False)
    engine = Engine(llm, max_num_seqs=2)
    module = next(m for m in llm.model.modules() if isinstance(m, CpuExperts))
    compute = module.compute
    request_id = engine.add_request(prompt(6, seed=1), max_tokens=8, ignore_eos=True)
    engine.step()  # the prompt, eagerly
    module.compute = lambda *args: (_ for _ in ()).throw(RuntimeError("expert file gone"))
    with pytest.raises(Exception, match="expert file gone"):
        engine.step()
    module.compute = compute
    engine.cancel(request_id)
    assert engine.generate([prompt(6, seed=1)], max_tokens=4, ignore_eos=True)[0]
    engine.close()


def test_deferred_experts_inside_the_graph(converted):
    """defer_experts=1: two CPU requests per deferring layer inside the graph, same tokens as eager."""
    outputs = {}
    for is_graph in (False, True):
        llm = LLM(converted, device="cuda", dtype="float32", max_model_len=128, cuda_graph=is_graph,
                  defer_experts=1)
        engine = Engine(llm, max_num_seqs=2)
        if is_graph:
            assert engine.runner.graphs.num_requests > len(engine.runner.graphs.cpu_modules)
        outputs[is_graph] = engine.generate([prompt(7, seed=3), prompt(12, seed=4)], max_tokens=16, ignore_eos=True)
        engine.close()
    assert outputs[True] == outputs[False]
