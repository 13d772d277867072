"""The routed-experts protocol (`hybrid.routed_experts`, `hybrid.cpu_handoff`): one module per MoE layer with
submit/collect, placement as data, the step mode set by the runner and nowhere inferred."""

from __future__ import annotations

import types

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, make_checkpoint

from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from cpu_experts.reference import moe_reference
from hybrid import LLM
from hybrid.cpu_handoff import CpuHandoff, StepMode
from hybrid.layers.moe import SparseMoE
from hybrid.placement import ExpertPlacement
from hybrid.routed_experts import RoutedExperts, cpu_experts_factory, device_experts_factory

E, H, INTER, K = 6, 32, 48, 2


def config():
    moe = types.SimpleNamespace(num_experts=E, intermediate_size=INTER, expert_proj_names=("gate_proj", "up_proj",
                                                                                        "down_proj"))
    return types.SimpleNamespace(moe=moe, hidden_size=H)


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, INTER, H, generator=g) / 4 for _ in range(2))
    return gate, up, torch.randn(E, H, INTER, generator=g) / 4


def routed(num_tokens=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)])
    return hidden, ids, torch.rand(num_tokens, K, generator=g)


def split_layer(gpu_ids: tuple[int, ...], handoff: CpuHandoff) -> RoutedExperts:
    """A layer whose `gpu_ids` experts are GPU-resident (here: this CPU) and the rest on the CPU operator."""
    gate, up, down = weights()
    placement = ExpertPlacement({0: gpu_ids}) if gpu_ids else None
    module = cpu_experts_factory(0, config(), handoff, placement, int8_activations=False)
    if module.cpu_experts is not None:
        module.cpu_experts.load(PackedLayer.from_float(gate, up, down, "bf16", 0, num_partitions=2))
    for slot, expert in enumerate(module.gpu_expert_ids):  # as the CPU holds them: bf16 values
        for name, stacked in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            getattr(module, name).data[slot] = stacked[expert].bfloat16().float()
    return module


def expected(hidden, ids, w):
    gate, up, down = (t.bfloat16().float() for t in weights())  # the CPU operator holds bf16 experts
    return moe_reference(hidden, gate, up, down, ids, w)


@pytest.mark.parametrize("gpu_ids", [(), (1, 4), tuple(range(E))])
def test_every_placement_sums_to_the_layer(gpu_ids):
    """All on the CPU, split, all on the device: one module, one protocol, the layer's output."""
    module = split_layer(gpu_ids, CpuHandoff())
    assert module.has_cpu_part == (len(gpu_ids) < E)
    hidden, ids, w = routed()
    module.submit(hidden, ids, w)
    got = module.collect(like=hidden)
    want = expected(hidden, ids, w)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
    torch.testing.assert_close(module(hidden, ids, w), got, atol=0, rtol=0)


def test_one_submit_in_flight_and_no_collect_without_one():
    module = split_layer((1,), CpuHandoff())
    hidden, ids, w = routed()
    with pytest.raises(RuntimeError, match="collect\\(\\) without a pending submit"):
        module.collect(like=hidden)
    module.submit(hidden, ids, w)
    with pytest.raises(RuntimeError, match="submit\\(\\) while a submit is pending"):
        module.submit(hidden, ids, w)


class RecordingGraph:
    """Stands in for the graph hand-off: records what reaches it and answers a marker."""

    dtype = torch.float32

    def __init__(self):
        self.layers = []

    def submit(self, layer, hidden, topk_ids, topk_weights):
        self.layers.append(layer)
        self._out = torch.full_like(hidden, 7.0)

    def sync(self, like):
        return self._out.to(device=like.device, dtype=like.dtype)


class AlwaysStreams:
    """A streamed prefill that would take every step."""

    def takes(self, hidden):
        return True

    def split(self, topk_ids):
        return None, topk_ids, None  # every expert streamed (prefill_cpu_share 0)

    def compute_on_gpu(self, hidden, topk_ids, topk_weights, experts=None):
        return torch.full_like(hidden, 3.0)


def test_the_step_mode_decides_the_cpu_path():
    """Eager steps stream where the streamed prefill takes them; graph steps always go through the graph hand-off;
    the mode is what the runner set, restored after its block."""
    handoff = CpuHandoff()
    module = split_layer((), handoff)
    module.streamed = AlwaysStreams()
    hidden, ids, w = routed()
    assert torch.equal(module(hidden, ids, w), torch.full_like(hidden, 3.0))  # eager: streamed
    with pytest.raises(RuntimeError, match="graph hand-off"), handoff.step_mode(StepMode.GRAPH):
        pass
    handoff.graph = RecordingGraph()
    with handoff.step_mode(StepMode.GRAPH):
        assert torch.equal(module(hidden, ids, w), torch.full_like(hidden, 7.0))
    assert handoff.graph.layers == [0] and handoff.mode is StepMode.EAGER
    module.streamed = None
    torch.testing.assert_close(module(hidden, ids, w), expected(hidden, ids, w), atol=1e-4, rtol=1e-4)  # inline


def test_device_experts_have_no_cpu_part():
    module = device_experts_factory(0, config())
    assert not module.has_cpu_part and module.gpu_expert_ids == tuple(range(E)) and module.handoff is None
    with pytest.raises(ValueError, match="no CPU operator for the rest"):
        RoutedExperts(0, config(), (0, 1))
    with pytest.raises(ValueError, match="CpuHandoff"):
        RoutedExperts(0, config(), (0, 1), cpu=CpuExperts(0))


def test_a_model_has_one_routed_module_per_moe_layer_and_one_handoff(tmp_path):
    """Placement decided once at start-up: every MoE layer's experts are a RoutedExperts sharing the model's one
    CpuHandoff, bound to its one executor."""
    from convert.cli import main

    make_checkpoint(VARIANTS["deepseek_v3"](), tmp_path / "src", seed=SEEDS["deepseek_v3"])
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", "int8"]) == 0
    llm = LLM(tmp_path / "dst", device="cpu", dtype="float32", gpu_experts=2)
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == len(llm.config.moe_layer_indices)
    assert all(isinstance(b.experts, RoutedExperts) and b.experts.handoff is llm.cpu_handoff for b in blocks)
    assert all(len(b.experts.gpu_expert_ids) == 2 and b.experts.has_cpu_part for b in blocks)
    assert llm.cpu_handoff.executor is llm.cpu_executor and llm.cpu_handoff.mode is StepMode.EAGER
    plain = LLM(tmp_path / "src", device="cpu", dtype="float32", expert_placement="device")
    assert plain.cpu_handoff is None
    assert all(isinstance(m.experts, RoutedExperts) and not m.experts.has_cpu_part
               for m in plain.model.modules() if isinstance(m, SparseMoE))


def test_graph_safety_follows_where_the_experts_run():
    """A CUDA graph captures the CPU hand-off and the fused kernel, not the PyTorch reference (it picks the routed
    experts on the host): the runner decodes eagerly where a layer's GPU part has no fused weights."""
    assert split_layer((), CpuHandoff()).is_graph_safe  # CPU only: the graph hand-off
    unfused = split_layer((1, 4), CpuHandoff())
    assert not unfused.is_graph_safe
    unfused.is_fused = True
    unfused.fuse_gate_up()
    assert unfused.is_graph_safe
    assert not device_experts_factory(0, config()).is_graph_safe
