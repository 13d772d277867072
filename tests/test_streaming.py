"""Large prefill steps of CPU-resident experts on the GPU (`hybrid.streaming`): the streamed weights, dequantized on
the device and run through gpu_layers.fused_moe, give the CPU operator's output (float activations, exact to the
stored weights) within bf16 rounding, for per-row and grouped int8 scales, bf16 experts, two partitions and
units of a few experts, through a ring of two device slots over several layers and steps; int4 stays on the
CPU. Runs under Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, make_checkpoint, prompt
from gpu_support import DEVICE, poisoned

from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from gpu_layers.dequant import dequantize_int8, dequantize_int8_reference
from hybrid import LLM
from hybrid.engine_config import EngineConfig
from hybrid.streaming import ExpertStream, StreamedExperts, min_streamed_tokens


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(VARIANTS["qwen3_moe"](), path, seed=SEEDS["qwen3_moe"])
    return path


def converted(source, tmp_path, *args):
    from convert.cli import main

    assert main([str(source), str(tmp_path / "dst"), *args]) == 0
    return tmp_path / "dst"


def cpu_layer(seed: int, dtype: str, group_size: int, num_experts=7, hidden_size=64, inter=96) -> CpuExperts:
    """A CpuExperts over random experts in two partitions, computing in float (exact to the stored weights)."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(num_experts, inter, hidden_size, generator=g) / 8 for _ in range(2))
    down = torch.randn(num_experts, hidden_size, inter, generator=g) / 8
    module = CpuExperts(0, int8_activations=False)
    module.load(PackedLayer.from_float(gate, up, down, dtype, group_size, num_partitions=2))
    assert len(module.op.layer.partitions) == 2
    return module


def routed(num_tokens: int, num_experts: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, 64, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(num_tokens)])
    ids[3, 1] = -1  # an expert computed elsewhere
    return hidden, ids, torch.rand(num_tokens, 2, generator=g)


def on_device(streamed: StreamedExperts, hidden, ids, weights) -> torch.Tensor:
    got = streamed.compute_on_gpu(hidden.to(DEVICE, torch.bfloat16), ids.to(DEVICE), weights.to(DEVICE))
    assert got.dtype == torch.bfloat16
    return got.float().cpu()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int8", 32), ("bf16", 0)])
def test_streamed_layer_matches_the_cpu_operator(dtype, group_size):
    module = cpu_layer(0, dtype, group_size)
    hidden, ids, weights = routed(19)
    streamed = StreamedExperts(module, min_tokens=1, device=DEVICE)
    stream = ExpertStream(DEVICE)
    part = module.op.layer.partitions[0]  # the larger partition (I 96 = 64 + 32)
    per_expert = sum(a.nbytes for a in part.arrays()) // 7
    assert streamed.attach(stream, chunk_bytes=3 * per_expert, pin=False) > 0
    for p in (0, 1):  # each partition's experts in consecutive units of at most chunk_bytes
        units = [u for u in stream.units if u.partition == p]
        assert [u.first for u in units] == [0] + [u.last for u in units[:-1]] and units[-1].last == 7
        assert all(sum(a.nbytes for a in u.arrays().values()) <= 3 * per_expert for u in units)
    assert [u.last for u in stream.units if u.partition == 0] == [3, 6, 7]
    assert close(on_device(streamed, hidden, ids, weights), module.op(hidden, ids, weights))


def test_a_ring_of_two_slots_serves_every_layer_every_step():
    """Three layers of three units each through two slots, two steps: each layer reads its own weights, also when
    a slot still holds a unit from the step before (reused, not re-copied) or another layer's."""
    modules = [cpu_layer(seed, "int8", 0) for seed in range(3)]
    stream = ExpertStream(DEVICE)
    streamed = [StreamedExperts(m, min_tokens=1, device=DEVICE) for m in modules]
    for s in streamed:
        s.attach(stream, chunk_bytes=4 * s.cpu_experts.op.layer.expert_bytes(), pin=False)  # 2 units a layer
    assert len(stream.units) == 3 * 3  # a layer: partition 0 in two units, 1 in one; an odd count shifts the slots
    for step in range(2):
        hidden, ids, weights = routed(11 + step, seed=step)
        for s in streamed:
            assert close(on_device(s, hidden, ids, weights), s.cpu_experts.op(hidden, ids, weights))


def test_dequantize_int8_matches_its_reference_into_a_strided_table():
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (3, 5, 96), generator=g, dtype=torch.int8)
    for groups in (1, 3):
        scales = torch.rand(3, 5, groups, generator=g)
        table = poisoned(3, 10, 96, dtype=torch.bfloat16)
        dequantize_int8(w.to(DEVICE), scales.to(DEVICE), table[:, 5:])  # the up half of a gate_up table
        assert torch.equal(table[:, 5:].cpu(), dequantize_int8_reference(w, scales))
        assert table[:, :5].isnan().all()  # the other half untouched
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_int8(w.to(DEVICE), torch.rand(3, 5, 7).to(DEVICE))


def test_small_steps_go_to_the_cpu_experts():
    module = cpu_layer(0, "int8", 0)
    streamed = StreamedExperts(module, min_tokens=16, device=DEVICE)
    streamed.attach(ExpertStream(DEVICE), pin=False)
    hidden, ids, weights = routed(8)
    assert not streamed._uses_gpu(hidden.to(DEVICE))
    assert streamed._uses_gpu(torch.cat([hidden] * 2).to(DEVICE))


def test_the_auto_threshold_gives_each_expert_16_tokens_on_cuda_only():
    assert min_streamed_tokens(EngineConfig(device="cuda"), 128, 8) == 256  # Qwen3-30B-A3B
    assert min_streamed_tokens(EngineConfig(device="cuda"), 256, 8) == 512  # DeepSeek-V3
    assert min_streamed_tokens(EngineConfig(device="cuda"), 8, 2) == 64  # Mixtral
    assert min_streamed_tokens(EngineConfig(device="cuda", max_graph_batch=64), 8, 2) == 65  # above the graphs
    assert min_streamed_tokens(EngineConfig(device="cuda", gpu_prefill_tokens=100), 8, 2) == 100
    assert min_streamed_tokens(EngineConfig(device="cpu"), 128, 8) == 0


def test_int4_experts_stay_on_the_cpu(source, tmp_path):
    llm = LLM(converted(source, tmp_path, "--expert-dtype", "int4", "--group-size", "32"), device="cpu",
              dtype="float32")
    module = next(m for m in llm.model.modules() if isinstance(m, CpuExperts))
    assert not StreamedExperts(module, min_tokens=1, device="cpu").is_streamable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine streams experts on CUDA only")
def test_prefill_through_streamed_experts_matches_cpu_experts(source, tmp_path):
    path = converted(source, tmp_path, "--expert-dtype", "int8")
    args = dict(device="cuda", dtype="bfloat16", expert_activations="float")
    streamed = LLM(path, gpu_prefill_tokens=33, **args)
    assert streamed.num_pinned_bytes > 0
    cpu = LLM(path, gpu_prefill_tokens=0, **args)
    ids = prompt(40, seed=2)
    got, want = streamed.prefill_logits(ids), cpu.prefill_logits(ids)
    assert float((got - want).norm() / want.norm()) < 2e-2
    streamed.close()  # stops its executor and unpins the weights
    cpu.close()
