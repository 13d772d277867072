"""Dynamic hot experts (`hybrid.hot_experts`) on the CPU (float32, the tiny DeepSeek-V3 checkpoint converted to
int8, float activations; the engine's device stands in for the GPU): the policy's hysteresis, the swapped-in
weights equal to the loader's, the slot table consistent after every step, and decode with a swap every step giving
the tokens of a fixed placement."""

from __future__ import annotations

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, make_checkpoint, prompt
from hot_experts_support import EverySwap, check_slot_table, decode_swapping

from hybrid import LLM
from hybrid.engine import Engine
from hybrid.errors import ConfigError
from hybrid.hot_experts import SwapPolicy, dequantize_expert, dequantize_staged
from hybrid.routed_experts import RoutedExperts

PROMPTS = [prompt(n, seed=700 + n) for n in (3, 9, 17)]
ARGS = dict(device="cpu", dtype="float32", expert_activations="float")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from convert.cli import main

    path = tmp_path_factory.mktemp("hot")
    make_checkpoint(VARIANTS["deepseek_v3"](), path / "src", seed=SEEDS["deepseek_v3"])  # 8 experts, top-3
    assert main([str(path / "src"), str(path / "dst"), "--expert-dtype", "int8"]) == 0
    return path / "dst"


def routed(llm) -> list[RoutedExperts]:
    return [m for m in llm.model.modules() if isinstance(m, RoutedExperts)]


def test_policy_swaps_the_hottest_absent_for_the_coldest_resident_with_hysteresis():
    policy = SwapPolicy(max_swaps=2, min_ratio=1.5)
    scores = [10, 0, 1, 30, 2, 16, 0, 0]
    assert policy.swaps(scores, (0, 1, 2)) == [(1, 3), (2, 5)]  # 30 > 1.5 x 0, 16 > 1.5 x 1
    assert policy.swaps(scores, (3, 5, 0)) == []  # 2 is not 1.5 x 10: no thrash between near-equal experts
    assert SwapPolicy(max_swaps=1).swaps(scores, (0, 1, 2)) == [(1, 3)]
    assert policy.score([4.0, 2.0], [1, 0]) == [3.0, 1.0]  # older windows decay
    with pytest.raises(ConfigError, match="hot_experts_swaps must be >= 1"):
        SwapPolicy(max_swaps=0)


def test_swapped_in_weights_are_the_loaders(converted):
    """A converted directory's resident experts, as the loader filled their slots, equal `dequantize_expert` of
    the CPU operator's copy bit for bit."""
    llm = LLM(converted, gpu_experts=3, **ARGS)
    for module in routed(llm):
        packed = module.cpu_experts.op.layer
        for slot, expert in enumerate(module.slot_experts):
            for name, weight in zip(module.proj_names, dequantize_expert(packed, expert), strict=True):
                assert torch.equal(getattr(module, name).data[slot], weight), (module.layer_idx, expert, name)


@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int4", 32), ("bf16", 0), ("fp8", 32), ("mxfp4", 32),
                                              ("nvfp4", 16)])
def test_an_expert_is_joined_over_the_partitions(dtype, group_size):
    """Partitions split I: the expert dequantized from them is the whole stored matrix's dequantization."""
    from cpu_experts.expert_file import dequantize_matrix
    from cpu_experts.packed import PackedLayer, quantize_layer

    g = torch.Generator().manual_seed(5)
    num_experts, inter, hidden = 3, 96, 64
    gate, up = (torch.randn(num_experts, inter, hidden, generator=g) for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=g)
    tensors, spec = quantize_layer(gate, up, down, dtype, group_size)
    packed = PackedLayer.from_file_tensors(tensors, spec, num_partitions=2)
    assert len(packed.partitions) == 2
    for expert in range(num_experts):
        for role, got in zip(("gate", "up", "down"), dequantize_expert(packed, expert), strict=True):
            scales, tensor_scale = tensors.get(f"{role}.scales"), tensors.get(f"{role}.tensor_scale")
            want = dequantize_matrix(tensors[f"{role}.weight"][expert], None if scales is None else scales[expert],
                                     role, spec, None if tensor_scale is None else tensor_scale[expert])
            assert torch.equal(got, want), (dtype, expert, role)


def test_config_refuses_hot_experts_without_spare_slots(converted):
    with pytest.raises(ConfigError, match="raise gpu_experts above 1"):
        LLM(converted, gpu_experts=1, hot_experts_interval=4, **ARGS)
    with pytest.raises(ConfigError, match="hot_experts_interval must be >= 0"):
        LLM(converted, hot_experts_interval=-1, **ARGS)
    with pytest.raises(ConfigError, match="no CPU experts .expert_placement device.: set hot_experts_interval 0"):
        LLM(converted.parent / "src", expert_placement="device", hot_experts_interval=4, **ARGS)
    from hybrid.engine_config import EngineConfig
    from hybrid.parallel import check_tensor_parallel

    llm = LLM(converted, **ARGS)
    with pytest.raises(ConfigError, match="not supported with tensor parallelism.*hot_experts_interval 0"):
        check_tensor_parallel(llm.config, EngineConfig(tensor_parallel_size=2, hot_experts_interval=4), True)


def test_a_swap_every_step_gives_the_fixed_placements_tokens(converted):
    """Several requests decoding together while every step flips the last step's swap and starts the next: the
    slot table stays consistent after each step, swaps happen, the tokens equal a fixed placement's, and the moved
    placement's logits equal the same placement installed before any step (bit for bit) and the fixed one's within
    float rounding (the two sides sum their experts separately)."""
    hot = LLM(converted, gpu_experts=4, hot_experts_interval=1, **ARGS)  # 3 resident + 1 spare per layer
    engine, ids, num_steps = decode_swapping(hot, PROMPTS, 8, max_num_batched_tokens=16, max_num_seqs=4)
    layers = routed(hot)
    assert hot.hot_experts.num_swaps >= len(layers) * (num_steps - 1)
    assert any(m.gpu_expert_ids != (0, 1, 2) for m in layers)
    got = [engine.requests[i].output_ids for i in ids]
    fixed = LLM(converted, gpu_experts=3, **ARGS)
    assert Engine(fixed, max_num_batched_tokens=16, max_num_seqs=4).generate(PROMPTS, max_tokens=8,
                                                                           ignore_eos=True) == got
    installed = LLM(converted, gpu_experts=4, hot_experts_interval=1, **ARGS)  # the same swaps, no step between
    installed.hot_experts.policy = EverySwap()
    installed.prefill_logits(PROMPTS[0])  # the routers' counts exist (the policy ignores them)
    for _ in range(num_steps):  # what the engine calls in each step
        installed.hot_experts.during_step()
        installed.hot_experts.after_step()
    assert [m.slot_experts for m in routed(installed)] == [m.slot_experts for m in layers]
    moved = hot.prefill_logits(PROMPTS[2])
    assert torch.equal(moved, installed.prefill_logits(PROMPTS[2]))
    want = fixed.prefill_logits(PROMPTS[2])
    assert (moved - want).abs().max() <= 1e-4 * want.abs().max()


def test_the_routers_counts_move_the_hottest_expert_in(converted):
    """Counts as the routers record them: every `interval` steps a decision, its copies started while the next step
    runs (`during_step`) and flipped at the next between-steps call; an idle engine decides at once if steps ran
    since the last decision, and starts the copies too."""
    hot = LLM(converted, gpu_experts=4, hot_experts_interval=2, **ARGS)  # residents 0, 1, 2 and a spare slot
    recorder, mover = hot.record_routing(), hot.hot_experts
    layers = routed(hot)
    for module in layers:  # expert 7 hot, 2 cold
        recorder.add(module.layer_idx, torch.tensor([[7, 0, 1]] * 6))
    mover.after_step()
    assert not mover.queued and not mover.pending and mover.num_swaps == 0  # not a decision step
    mover.after_step()
    assert [(evict, admit) for _, evict, admit in mover.queued] == [(2, 7)] * len(layers) and not mover.pending
    mover.during_step()  # the next step: a decision's copies spread over its interval (2 steps)
    assert len(mover.pending) == -(-len(layers) // 2) and mover.num_swaps == 0
    mover.after_step()  # those copies landed (synchronous on the CPU): flipped; step 3 decides nothing
    mover.during_step()
    mover.after_step()  # step 4: the rest flipped, then a decision on an empty window (7's score decays to 3)
    assert mover.num_swaps == len(layers) and all(m.gpu_expert_ids == (0, 1, 7) for m in layers)
    assert not mover.queued and mover.scores[layers[0].layer_idx][7] == 3.0
    for module in layers:
        check_slot_table(module)
        recorder.add(module.layer_idx, torch.tensor([[2, 0, 1]] * 2))  # 2 is not 1.5 x 1.5 (7 decayed): not yet
    mover.at_idle()  # no step since the last decision: nothing to decide
    assert mover.scores[layers[0].layer_idx][2] == 0.0
    mover.after_step()  # step 5: no decision
    mover.at_idle()  # a step ran since the last decision: decided now
    assert not mover.queued and not mover.pending and mover.scores[layers[0].layer_idx][2] == 2.0
    for module in layers:
        recorder.add(module.layer_idx, torch.tensor([[2, 0, 1]] * 20))
    mover.after_step()  # step 6: 21 against 0.75
    assert [(evict, admit) for _, evict, admit in mover.queued] == [(7, 2)] * len(layers)
    mover.at_idle()  # idle: every copy starts at once
    assert not mover.queued and len(mover.pending) == len(layers)
    mover.at_idle()  # landed: flipped
    assert mover.num_swaps == 2 * len(layers) and all(m.gpu_expert_ids == (0, 1, 2) for m in layers)


def test_the_server_loop_moves_experts_when_its_work_runs_out(converted):
    """hybrid-serve's engine loop over an engine whose interval its requests never reach: the decision comes when
    the work runs out (`EngineLoop` -> `Engine.idle` -> `HotExperts.at_idle`), its copies start then (on the CPU,
    done at once), and the next request's first step flips them."""
    import time

    from hybrid.sampling import SamplingParams
    from server.engine_loop import EngineLoop, GenerateJob, Output

    llm = LLM(converted, gpu_experts=4, hot_experts_interval=1000, **ARGS)
    mover, layers = llm.hot_experts, routed(llm)
    mover.policy = EverySwap()
    loop = EngineLoop(Engine(llm, max_num_batched_tokens=16), None, llm.max_model_len)
    events = []

    def wait_until(condition) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def num_done() -> int:
        return sum(isinstance(e, Output) and e.finish_reason is not None for e in events)

    loop.start()
    try:
        for num_requests in (1, 2):
            loop.submit(GenerateJob(PROMPTS[num_requests], SamplingParams(), 4, events.append, ignore_eos=True))
            wait_until(lambda n=num_requests: num_done() == n and len(mover.pending) == len(layers))
            assert mover.num_swaps == (num_requests - 1) * len(layers) and not mover.queued
    finally:
        loop.stop()
    assert [m.gpu_expert_ids for m in layers] == [(1, 2, 6)] * len(layers)  # EverySwap: 0 out, absent[3] in
    for module in layers:
        check_slot_table(module)


@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int8", 32), ("int4", 32), ("bf16", 0), ("fp8", 32),
                                              ("mxfp4", 32), ("nvfp4", 16)])
def test_a_staged_copy_fills_the_slot_as_the_loader_does(dtype, group_size):
    """The CUDA copy's path (`stage` into a byte buffer, `dequantize_staged` through the streamed prefill's
    kernels; here the Triton interpreter on the CPU) gives, in a bf16 slot, the loader's float32 dequantization
    rounded to bf16, bit for bit: an expert split over two partitions (gate and up rows, down columns), in a
    fused gate/up layout's slot between two others that stay untouched."""
    from types import SimpleNamespace

    from cpu_experts.packed import PackedLayer
    from hybrid.hot_experts import stage, staged_bytes

    g = torch.Generator().manual_seed(11)
    num_experts, inter, hidden = 3, 96, 64
    gate, up = (torch.randn(num_experts, inter, hidden, generator=g) for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=g)
    layer = PackedLayer.from_float(gate, up, down, dtype, group_size, num_partitions=2)
    assert len(layer.partitions) == 2
    num_slots = 3
    gate_up = torch.full((num_slots, 2 * inter, hidden), float("nan"), dtype=torch.bfloat16)  # fused layout
    module = SimpleNamespace(proj_names=("w1", "w3", "w2"), w1=gate_up[:, :inter], w3=gate_up[:, inter:],
                             w2=torch.full((num_slots, hidden, inter), float("nan"), dtype=torch.bfloat16),
                             cpu_experts=SimpleNamespace(op=SimpleNamespace(layer=layer)))
    for expert, slot in ((2, 1), (0, 1)):
        buffer = torch.empty(staged_bytes(layer), dtype=torch.uint8)
        layout, _ = stage(layer, expert, buffer)
        dequantize_staged(module, slot, layout, buffer)
        for name, want in zip(module.proj_names, dequantize_expert(layer, expert), strict=True):
            assert torch.equal(getattr(module, name)[slot], want.to(torch.bfloat16)), (dtype, expert, name)
    assert gate_up[0].isnan().all() and gate_up[2].isnan().all() and module.w2[0].isnan().all()


def test_the_moe_block_counts_after_handing_off(converted):
    """The routing counts are recorded once the routed experts have their tokens (`SparseMoE` records after
    `submit`, so a graph step's counting kernels run while the CPU computes), every routed id counted once."""
    from hybrid.layers.moe import SparseMoE

    llm = LLM(converted, gpu_experts=3, **ARGS)
    recorder = llm.record_routing()
    order = []
    block = next(m for m in llm.model.modules() if isinstance(m, SparseMoE))
    submit, add = block.experts.submit, recorder.add
    block.experts.submit = lambda *args: (order.append("submit"), submit(*args))[1]
    recorder.add = lambda layer, ids: (order.append(("record", layer)), add(layer, ids))[1]
    llm.prefill_logits(PROMPTS[1])
    assert order.index("submit") < order.index(("record", block.experts.layer_idx))
    counts = recorder.stats().counts
    assert all(sum(c) == len(PROMPTS[1]) * llm.config.moe.top_k for c in counts.values())


def test_skewed_routing_weights_skew_the_routing_per_band(tmp_path):
    """`hybrid.synthetic_routing` on the tiny Qwen3-MoE (its tensors written over the model's, from pool-like tiles
    of std 0.02): a band's tokens route mostly to a few experts, another band's to others, and lm_head favours the
    band of the token it reads (what keeps a sampled decode in its band)."""
    from hybrid.synthetic_routing import SkewedRouting

    make_checkpoint(VARIANTS["qwen3_moe"](), tmp_path, seed=SEEDS["qwen3_moe"])
    llm = LLM(tmp_path, device="cpu", dtype="float32", expert_placement="device")
    skew = SkewedRouting(zipf=2.0, num_phases=2, tokens_per_shift=64, noise=0.5, seed=3)
    targets = llm.model.checkpoint_targets()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, value in skew.tensors(llm.model).items():
            targets[name].copy_(value((torch.randn(targets[name].shape, generator=g) * 0.02).bfloat16()))
    recorder, top = llm.record_routing(), {}
    vocab, top_k = llm.config.vocab_size, llm.config.moe.top_k
    for band in (0, 1):
        recorder.counts.clear()
        ids = list(range(band + 2, vocab, 2))[:48]
        logits = llm.prefill_logits(ids)[-1]
        in_band = logits[band::2].mean() - logits[1 - band::2].mean()
        assert in_band > 2.0, float(in_band)  # ln(64) ~ 4.2 designed
        for layer, counts in recorder.stats().counts.items():
            ranked = sorted(range(len(counts)), key=lambda e: -counts[e])
            assert sum(counts[e] for e in ranked[:top_k]) > 0.6 * sum(counts), (band, layer, counts)
            top[band, layer] = set(ranked[:top_k])
    assert any(top[0, layer] != top[1, layer] for layer in llm.config.moe_layer_indices)
