"""Layer-wise prefill (`layerwise_prefill_tokens`): where routed experts stream to the GPU, a prompt's chunk grows
past `max_num_batched_tokens` to what the GPU memory holds, so every layer runs it whole and each streamed expert
crosses PCIe once a chunk instead of once per `max_num_batched_tokens` tokens.

On the CPU nothing streams, so "auto" keeps the step budget; a count sets it anywhere, which is how the engine side
is tested here: the scheduler's budget, the windowed cache group sized for the larger step (a tiny gpt-oss, window
12, pages of 4, on the CPU reference path, free windowed pages poisoned with NaN after every step), the tokens equal
to the chunked engine's. The memory planner that sizes "auto" is tested as the pure function it is; the CUDA build
that calls it runs on the device (`.dev/layerwise.sh`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cache_groups_support import BLOCK, make_llm, poison_free_windowed_pages
from checkpoints import prompt
from test_cache_groups import WINDOW, gpt_oss_path  # noqa: F401

from hybrid import parallel
from hybrid.cache_groups import windowed_blocks
from hybrid.engine_config import EngineConfig
from hybrid.errors import ConfigError
from hybrid.placement import layerwise_step_tokens

GiB = 1 << 30


def test_planner_takes_the_largest_step_every_budget_holds():
    def step_bytes(tokens):  # 10 GiB of weights and cache, 1 MiB a token
        return 10 * GiB + tokens * (1 << 20)

    assert layerwise_step_tokens(20 * GiB, step_bytes, 512, 100_000) == 10 * 1024  # exactly full
    assert layerwise_step_tokens(20 * GiB - 1, step_bytes, 512, 100_000) == 10 * 1024 - 1
    assert layerwise_step_tokens([30 * GiB, 14 * GiB], step_bytes, 512, 100_000) == 4 * 1024  # the smaller GPU
    assert layerwise_step_tokens(200 * GiB, step_bytes, 512, 8192) == 8192  # at most max_model_len
    assert layerwise_step_tokens(10 * GiB, step_bytes, 512, 8192) == 512  # none fits: the chunked budget


def test_scheduler_grows_only_the_steps_without_decodes():
    """Budget 4, layer-wise 16: a prompt alone runs 16 tokens a step; once a request decodes, every step keeps to 4
    (a decode waits for no long step), the decode first; then 16 again when none decodes."""
    from test_cache_groups import request, two_groups

    from hybrid.scheduler import Scheduler

    scheduler = Scheduler(two_groups(num_windowed=400, num_full=400), 4, 8, max_prefill_tokens=16)
    first, second = request(0, 20, max_tokens=2), request(1, 40, max_tokens=2)
    scheduler.add(first)

    def step():
        chunks = scheduler.schedule()
        for chunk in chunks:
            is_last = chunk.is_last
            scheduler.advance(chunk.request, chunk.num_new)
            if is_last:  # its logits sampled a token
                chunk.request.output_ids.append(7)
        return [(c.request.request_id, c.num_new) for c in chunks]

    assert step() == [(0, 16)]
    assert step() == [(0, 4)]  # the prompt's end; its first token sampled: it decodes from now on
    scheduler.add(second)
    assert step() == [(0, 1), (1, 3)]  # beside a decode: the budget of 4
    scheduler.finish(first, "stop")
    assert step() == [(1, 16)]  # none decodes: layer-wise again
    assert Scheduler(two_groups(), 4, 8, max_prefill_tokens=2).max_prefill_tokens == 4  # never below the budget


@pytest.mark.parametrize("value", [-1, "all", 1.5])
def test_bad_values_name_the_setting(value):
    with pytest.raises(ConfigError, match="layerwise_prefill_tokens"):
        EngineConfig(layerwise_prefill_tokens=value)


def test_budget_resolution_on_the_cpu(gpt_oss_path):  # noqa: F811
    """auto and 0 keep max_num_batched_tokens (nothing streams on the CPU), a count below it too; above
    max_model_len is a one-line error naming the setting."""
    for value in ("auto", 0, 8):
        assert make_llm(gpt_oss_path, max_model_len=128, max_num_batched_tokens=16,
                        layerwise_prefill_tokens=value).max_step_tokens == 16
    with pytest.raises(ConfigError, match="layerwise_prefill_tokens 200 exceeds max_model_len 128"):
        make_llm(gpt_oss_path, max_model_len=128, layerwise_prefill_tokens=200)


def run_engine(llm, prompts, max_tokens):
    """Every request's tokens and each step's token count (free windowed pages poisoned after every step)."""
    from hybrid.engine import Engine

    engine = Engine(llm)
    ids = [engine.add_request(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    steps = []
    while engine.has_work():
        before = sum(r.num_computed for r in engine.requests.values())
        engine.step()
        steps.append(sum(r.num_computed for r in engine.requests.values()) - before)
        poison_free_windowed_pages(llm)
    outputs = [engine.requests[i].output_ids for i in ids]
    assert llm.blocks.num_free == llm.blocks.num_blocks
    engine.close()
    return outputs, steps


def test_a_layerwise_step_takes_the_whole_prompt_with_the_chunked_tokens(gpt_oss_path):  # noqa: F811
    """Budget 16, layer-wise 96: a 90-token prompt is one step (six chunks without), beside a second request; the
    windowed pool is sized for 96-token steps; both requests get the chunked engine's tokens."""
    prompts = [prompt(90, seed=31), prompt(21, seed=32)]
    options = dict(max_model_len=256, max_num_batched_tokens=16, max_num_seqs=2, enable_prefix_caching=False)
    chunked = make_llm(gpt_oss_path, layerwise_prefill_tokens=0, **options)
    expected, chunked_steps = run_engine(chunked, prompts, 6)
    assert chunked_steps[:6] == [16] * 6  # the two prompts in 16-token chunks
    llm = make_llm(gpt_oss_path, layerwise_prefill_tokens=96, **options)
    assert llm.max_step_tokens == 96
    sizes = [next(g for g in m.blocks.groups if g.is_windowed).num_blocks for m in (chunked, llm)]
    assert sizes == [windowed_blocks(WINDOW, BLOCK, 2, 16), windowed_blocks(WINDOW, BLOCK, 2, 96)]
    outputs, steps = run_engine(llm, prompts, 6)
    assert steps[0] == 96 and steps[1] == 90 + 21 - 96 + 1  # the first prompt whole, the rest of the second
    assert outputs == expected


def test_serve_options_reach_the_engine_config(monkeypatch, tmp_path):
    """hybrid-serve's --max-num-batched-tokens sizes the LLM's step budget and windowed pools (it reached only the
    Engine before), and --layerwise-prefill-tokens is generated from the engine config."""
    import server.cli

    seen = []
    monkeypatch.setattr(server.cli, "serve", lambda config, engine_config: seen.append(engine_config) or 0)
    assert server.cli.main(["--model", str(tmp_path), "--max-num-batched-tokens", "64",
                            "--layerwise-prefill-tokens", "0"]) == 0
    assert (seen[0].max_num_batched_tokens, seen[0].layerwise_prefill_tokens) == (64, 0)
    assert server.cli.main(["--model", str(tmp_path)]) == 0
    assert (seen[1].max_num_batched_tokens, seen[1].layerwise_prefill_tokens) == (None, "auto")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="experts stream on CUDA only")
def test_auto_on_cuda_takes_a_streamed_prompt_in_one_step(tmp_path):
    """On the device, auto grows the step past max_num_batched_tokens (a tiny model: up to max_model_len), a
    200-token prompt is one streamed step instead of thirteen streamed 16-token ones, and the greedy tokens are the
    chunked engine's."""
    from checkpoints import make_checkpoint, qwen3_moe_config
    from test_streaming import converted

    from hybrid import LLM
    from hybrid.engine import Engine

    source = tmp_path / "src"
    make_checkpoint(qwen3_moe_config(), source, seed=0)
    path = converted(source, tmp_path, "--expert-dtype", "int8")
    # float32 and no graphs: every step of 8 tokens or more streams (the chunks too), the rest differs in rounding
    args = dict(device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=16, gpu_prefill_tokens=8,
                cuda_graph=False, expert_activations="float")
    tokens = []
    for layerwise in (0, "auto"):
        llm = LLM(path, layerwise_prefill_tokens=layerwise, **args)
        assert llm.expert_stream is not None and llm.max_step_tokens == (16 if layerwise == 0 else 256)
        engine = Engine(llm)
        request_id = engine.add_request(prompt(200, seed=3), max_tokens=8, ignore_eos=True)
        num_prefill_steps = 0
        while not engine.requests[request_id].output_ids:
            engine.step()
            num_prefill_steps += 1
        assert num_prefill_steps == (13 if layerwise == 0 else 1)
        while engine.has_work():
            engine.step()
        tokens.append(engine.requests[request_id].output_ids)
        engine.close()
        llm.close()
    assert tokens[0] == tokens[1]


def planned_step_tokens(path, gpu_bytes: int, monkeypatch, **options) -> int:
    """`LLM._resolve_step_tokens` as a CUDA build runs it (experts streamed, a GPU of `gpu_bytes`), on the meta
    device: the planner's inputs come from the model's own layers and cache groups."""
    from hybrid.engine_config import EngineConfig
    from hybrid.llm import LLM
    from hybrid.models import load_model_config

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=gpu_bytes))
    llm = LLM.__new__(LLM)
    cls, llm.config = load_model_config(path)
    llm.engine_config = EngineConfig(device="cuda", dtype="bfloat16", block_size=BLOCK, **options)
    llm.tp, llm.max_model_len = parallel.SINGLE, options.get("max_model_len", 4096)
    llm.max_num_batched_tokens, llm.gpu_prefill_tokens = 16, 64  # as if its experts stream
    return llm._resolve_step_tokens(lambda: llm._memory_plan(cls, 4 * llm.max_model_len // BLOCK))


def test_auto_plans_the_step_from_the_gpu_memory(gpt_oss_path, monkeypatch):  # noqa: F811
    """The planned step grows with the GPU's memory up to max_model_len, shrinks with resident experts, and a GPU
    too small for any larger step keeps max_num_batched_tokens."""
    from hybrid.models import load_model_config
    from hybrid.placement import activation_bytes

    def planned(gpu_bytes, **options):
        return planned_step_tokens(gpt_oss_path, gpu_bytes, monkeypatch, max_model_len=4096, **options)

    assert planned(1 << 40) == 4096
    assert planned(1 << 20) == 16  # nothing fits: the chunked budget
    # 90% of this GPU holds 2048 tokens' activations: less the weights and caches, a step a little shorter
    budget = int(activation_bytes(load_model_config(gpt_oss_path)[1], 2048) / 0.9)
    middle = planned(budget)
    assert 16 < middle < 2048
    assert planned(budget, gpu_experts=4) < middle  # resident experts take their share first
