"""The routed experts split over tensor-parallel ranks (issue 25): rank r of n keeps its slice of every CPU expert's
intermediate dimension I (`cpu_experts.packed.rank_slice`, split into its partitions), the GPU-resident experts are
dealt over the ranks' GPUs (`hybrid.placement.ExpertPlacement`), and the ranks' outputs add up to the one-rank
output (the block's all-reduce). Checked against the one-rank layer: the slices tile it bit for bit; the operators'
outputs summed over 2 and 3 ranks equal its output for every format, decode and prefill, with I = 165 (five
32-row blocks and a tail, so a rank's last partition is 5 rows, and FP8's 128 groups leave a third rank empty), the
down bias once (gpt-oss); and whole models loaded per rank from a converted directory and a plain checkpoint.
"""

from __future__ import annotations

import functools
import types
from functools import partial

import numpy as np
import pytest
import torch
from checkpoints import SEEDS, make_checkpoint, qwen3_moe_config
from gpu_support import DEVICE

from cpu_experts.expert_file import SWIGLU_OAI
from cpu_experts.operator import CpuMoE
from cpu_experts.packed import PackedLayer, quantize_layer, rank_slice
from hybrid.cpu_handoff import CpuHandoff
from hybrid.engine_config import EngineConfig
from hybrid.layers.backends import Backends
from hybrid.llm import build_model
from hybrid.loader import load_weights
from hybrid.models import load_model_config
from hybrid.placement import ExpertPlacement, RoutingStats, auto_gpu_experts
from hybrid.routed_experts import RoutedExperts, cpu_experts_factory

E, H, I, TOP_K = 8, 80, 165, 2  # noqa: E741 (the shape letters of the project)
FORMATS = [("int8", 0), ("int8", 32), ("int4", 32), ("bf16", 0), ("fp8", 128), ("mxfp4", 32), ("nvfp4", 16)]
PARTITIONS = 2  # per rank
REL_TOL = 1e-5  # float32 summation order only


def _weights():
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(E, I, H, generator=gen) * 0.3 for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) * 0.1
    biases = (torch.randn(E, I, generator=gen), torch.randn(E, I, generator=gen), torch.randn(E, H, generator=gen))
    return (gate, up, down), biases


WEIGHTS, BIASES = _weights()


@functools.cache
def quantized(dtype: str, group: int, has_bias: bool = False):
    """The layer as an expert file's tensors and spec, quantized once per format for every rank count."""
    extra = dict(activation=SWIGLU_OAI, biases=BIASES) if has_bias else {}
    return quantize_layer(*WEIGHTS, dtype, group, **extra)


def packed(dtype, group, num_partitions=PARTITIONS, rank=0, num_ranks=1, has_bias=False) -> PackedLayer:
    return PackedLayer.from_file_tensors(*quantized(dtype, group, has_bias), num_partitions, rank, num_ranks)


def ranks(dtype, group, num_ranks, has_bias=False) -> list[PackedLayer]:
    return [packed(dtype, group, PARTITIONS, r, num_ranks, has_bias) for r in range(num_ranks)]


def routed(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1  # experts computed elsewhere
    return hidden, ids, torch.rand(num_tokens, TOP_K, generator=gen)


def assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=REL_TOL * float(want.detach().abs().max()))


@pytest.mark.parametrize("dtype,group", FORMATS)
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_rank_slices_tile_the_layer(dtype, group, num_ranks):
    """The ranks' partitions, in rank order, cover [0, I) once, and their arrays are the one-partition layer's,
    bit for bit: gate/up rows, down columns (two int4/FP4 codes a byte) and the scales of each."""
    whole = packed(dtype, group, 1).partitions[0]
    layers = ranks(dtype, group, num_ranks)
    parts = [p for layer in layers for p in layer.partitions]
    starts, ends = [p.start for p in parts], [p.end for p in parts]
    assert starts == [0, *ends[:-1]] and ends[-1] == I and all(p.size > 0 for p in parts)  # [0, I), in order
    assert [rank_slice(layers[0].spec, r, num_ranks) for r in range(num_ranks)] == [
        (layer.partitions[0].start, layer.partitions[-1].end) if layer.partitions else (I, I) for layer in layers]
    for role, axis in (("gate", 1), ("up", 1), ("down", 2), ("gate_scales", 1), ("up_scales", 1)):
        if getattr(whole, role) is None:  # bf16: no scales
            continue
        np.testing.assert_array_equal(np.concatenate([getattr(p, role) for p in parts], axis), getattr(whole, role))
    if whole.down_scales is not None:
        down_scales = [p.down_scales for p in parts]
        if group:  # groups along I: each partition's own
            np.testing.assert_array_equal(np.concatenate(down_scales, 2), whole.down_scales)
        else:  # one scale per output row, over all of I: every partition has it
            assert all(np.array_equal(s, whole.down_scales) for s in down_scales)
    # a rank holds its slice only: together the ranks hold the layer's weights once
    weight_bytes = sum(getattr(p, role).nbytes for p in parts for role in ("gate", "up", "down"))
    assert weight_bytes == sum(getattr(whole, role).nbytes for role in ("gate", "up", "down"))


@pytest.mark.parametrize("dtype,group", FORMATS)
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_ranks_sum_to_the_layer(dtype, group, num_ranks):
    """Decode (5 tokens) and, for int8 and bf16, prefill (70): the ranks' outputs summed equal one rank's. Float
    activations for int8/int4 (W8A8 rounds each partition's act rows by their own absmax: the next test)."""
    one = CpuMoE(packed(dtype, group), prefill_min_tokens=64, int8_activations=False)
    ops = [CpuMoE(layer, prefill_min_tokens=64, int8_activations=False) for layer in ranks(dtype, group, num_ranks)]
    if dtype == "fp8" and num_ranks == 3:  # I = 165 is one 128-row group and a tail: nothing left for rank 2
        assert not ops[2].layer.partitions
    sizes = [5, 70] if dtype in ("int8", "bf16") else [5]
    for seed, num_tokens in enumerate(sizes):
        hidden, ids, w = routed(num_tokens, seed)
        want = one(hidden, ids, w)
        assert want.abs().max() > 0
        assert_close(sum(op(hidden, ids, w) for op in ops), want)


@pytest.mark.parametrize("dtype,group", [("int8", 0), ("int8", 32), ("int4", 32)])
def test_w8a8_ranks_sum_to_their_partitions(dtype, group):
    """W8A8: the ranks' outputs summed equal one operator over all the ranks' partitions (the same act rows, so
    the same int8 rounding), decode and prefill."""
    layers = ranks(dtype, group, 3)
    joined = CpuMoE(PackedLayer(layers[0].spec, [p for layer in layers for p in layer.partitions]),
                    prefill_min_tokens=64)
    ops = [CpuMoE(layer, prefill_min_tokens=64) for layer in layers]
    for seed, num_tokens in enumerate([3, 70] if group == 0 else [3]):
        hidden, ids, w = routed(num_tokens, seed)
        assert_close(sum(op(hidden, ids, w) for op in ops), joined(hidden, ids, w))


@pytest.mark.parametrize("dtype,group", [("int8", 0), ("mxfp4", 32), ("bf16", 0)])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_down_bias_is_added_once(dtype, group, num_ranks):
    """gpt-oss's biases: gate/up rows go with each slice, the down bias with rank 0 alone (the all-reduce would add
    it n times otherwise)."""
    one = CpuMoE(packed(dtype, group, has_bias=True), int8_activations=False)
    layers = ranks(dtype, group, num_ranks, has_bias=True)
    assert layers[0].down_bias is not None and all(layer.down_bias is None for layer in layers[1:])
    ops = [CpuMoE(layer, int8_activations=False) for layer in layers]
    hidden, ids, w = routed(6, 3)
    assert_close(sum(op(hidden, ids, w) for op in ops), one(hidden, ids, w))


def test_rank_slice_refuses_bad_ranks():
    spec = quantized("int8", 0)[1]
    assert rank_slice(spec) == (0, I)
    for rank, num_ranks in ((2, 2), (-1, 2), (0, 0), (True, 2)):
        with pytest.raises(ValueError, match="rank"):
            rank_slice(spec, rank, num_ranks)


# ---- GPU-resident experts over the ranks (expert parallel) -------------------------------------------------------

@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("num_gpu", [0, 1, 5, E])
def test_placement_deals_the_chosen_experts_over_the_ranks(num_ranks, num_gpu):
    counts = [5, 90, 7, 60, 60, 1, 30, 2]
    stats = RoutingStats({1: counts, 3: counts[::-1]})
    one = ExpertPlacement.choose([1, 3], E, num_gpu, stats)
    spread = ExpertPlacement.choose([1, 3], E, num_gpu, stats, num_ranks=num_ranks)
    assert spread.gpu_experts == one.gpu_experts  # the same experts, on every rank's view
    for layer in (1, 3):
        shares = [spread.on_rank(layer, r) for r in range(num_ranks)]
        held = [e for share in shares for e in share]
        assert sorted(held) == list(one.gpu_experts[layer]) and len(set(held)) == len(held)  # disjoint, covering
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        ranked = sorted(range(E), key=lambda e: (-stats.counts[layer][e], e))
        assert all(ranked[i] in shares[i % num_ranks] for i in range(num_gpu))  # most routed first, round-robin
        assert one.on_rank(layer, 0) == one.gpu_experts[layer]


def test_placement_refuses_mismatched_ranks():
    with pytest.raises(ValueError, match="expert_ranks"):
        ExpertPlacement({0: (1, 2)}, {0: (0,)})


def moe_config(hidden=H, inter=I):
    moe = types.SimpleNamespace(num_experts=E, intermediate_size=inter, expert_proj_names=("gate_proj", "up_proj",
                                                                                         "down_proj"))
    return types.SimpleNamespace(moe=moe, hidden_size=hidden)


def routed_module(placement, rank, num_ranks, weights=WEIGHTS, is_fused=False) -> RoutedExperts:
    """Rank `rank`'s module: its GPU share (on this CPU unless `is_fused`; bf16 values as the CPU holds them) and
    CPU slice."""
    _, inter, hidden = weights[0].shape
    module = cpu_experts_factory(0, moe_config(hidden, inter), CpuHandoff(), placement, int8_activations=False,
                                 is_fused=is_fused, rank=rank)
    if module.cpu_experts is not None:
        tensors, spec = quantize_layer(*weights, "bf16") if weights is not WEIGHTS else quantized("bf16", 0)
        module.cpu_experts.load(PackedLayer.from_file_tensors(tensors, spec, PARTITIONS, rank, num_ranks))
    for slot, expert in enumerate(module.gpu_expert_ids):
        for name, stacked in zip(("gate_proj", "up_proj", "down_proj"), weights, strict=True):
            getattr(module, name).data[slot] = stacked[expert].bfloat16().float()
    if is_fused:
        module.to(DEVICE, torch.bfloat16)
        module.fuse_gate_up()
    return module


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("num_gpu", [0, 3, E])
def test_routed_experts_over_ranks_sum_to_the_layer(num_ranks, num_gpu):
    """Every rank computes its own GPU experts and its slice of the CPU ones, never another rank's GPU experts on
    its CPU: the ranks' outputs add up to the one-rank module's."""
    stats = RoutingStats({0: [3, 1, 4, 1, 5, 9, 2, 6]})
    one = routed_module(ExpertPlacement.choose([0], E, num_gpu, stats), 0, 1)
    spread = ExpertPlacement.choose([0], E, num_gpu, stats, num_ranks=num_ranks)
    modules = [routed_module(spread, r, num_ranks) for r in range(num_ranks)]
    for r, module in enumerate(modules):
        assert module.gpu_expert_ids == spread.on_rank(0, r)
        assert set(module.other_rank_expert_ids) == set(spread.gpu_experts[0]) - set(module.gpu_expert_ids)
        assert module.has_cpu_part == (num_gpu < E) and module.num_cpu_experts == E - num_gpu
    hidden, ids, w = routed(7, 4)
    for module in modules:  # the sides' contract: a slot or -1, an id or -1 (another rank's experts: -1 on both)
        local, cpu_ids = module._split(ids)
        assert local is None or set(local.flatten().tolist()) <= {-1, *range(len(module.gpu_expert_ids))}
        assert cpu_ids is None or not set(cpu_ids.flatten().tolist()) & {*spread.gpu_experts[0]}
    want = one(hidden, ids, w)
    assert_close(sum(m(hidden, ids, w) for m in modules), want)


@pytest.mark.parametrize("num_ranks,num_gpu", [(2, 3), (3, E)])
def test_fused_gpu_experts_over_ranks_sum_to_the_layer(num_ranks, num_gpu):
    """The same through the fused-MoE kernel (the GPU, or Triton's interpreter): another rank's experts are -1 to
    it, like the CPU's. Sizes the kernel takes (H 64, I 96); bf16 outputs, so within bf16 rounding."""
    gen = torch.Generator().manual_seed(2)
    weights = (torch.randn(E, 96, 64, generator=gen) / 4, torch.randn(E, 96, 64, generator=gen) / 4,
               torch.randn(E, 64, 96, generator=gen) / 4)
    one = routed_module(ExpertPlacement.choose([0], E, num_gpu), 0, 1, weights, is_fused=True)
    spread = ExpertPlacement.choose([0], E, num_gpu, num_ranks=num_ranks)
    modules = [routed_module(spread, r, num_ranks, weights, is_fused=True) for r in range(num_ranks)]
    assert all(m.is_graph_safe for m in modules)
    hidden = torch.randn(6, 64, generator=gen).to(DEVICE, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)]).to(DEVICE)
    w = torch.rand(6, TOP_K, generator=gen).to(DEVICE)
    want = one(hidden, ids, w).float()
    got = sum(m(hidden, ids, w).float() for m in modules)
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_auto_budget_counts_every_gpu():
    config = types.SimpleNamespace(hidden_size=10, moe=types.SimpleNamespace(num_experts=8, intermediate_size=20),
                                   moe_layers=[False, True, True])
    expert = 3 * 10 * 20 * 2
    room = 10_000 + 2 * 3 * expert  # 3 experts per layer on a GPU, 2 layers
    assert auto_gpu_experts(config, room, 9_000, 1_000, 2) == 3
    assert auto_gpu_experts(config, [room], 9_000, 1_000, 2) == 3
    assert auto_gpu_experts(config, [room, room], 9_000, 1_000, 2) == 6  # per layer over both GPUs
    assert auto_gpu_experts(config, [room, room, room], 9_000, 1_000, 2) == 8  # capped at the layer's experts
    assert auto_gpu_experts(config, [room, room - expert], 9_000, 1_000, 2) == 4  # the fullest GPU bounds each share
    assert auto_gpu_experts(config, [room, 5_000], 9_000, 1_000, 2) == 0
    # the count dealt out: no rank holds more than its own GPU fits
    spread = ExpertPlacement.choose([1, 2], 8, auto_gpu_experts(config, [room] * 3, 9_000, 1_000, 2), num_ranks=3)
    assert max(len(spread.on_rank(1, r)) for r in range(3)) <= 3


# ---- whole models, loaded per rank ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE with I = 96 (three 32-row blocks: one each on 3 ranks), plain and converted to int8."""
    from convert.cli import main

    root = tmp_path_factory.mktemp("ranks")
    cfg = qwen3_moe_config()
    cfg.moe_intermediate_size = 96
    make_checkpoint(cfg, root / "src", seed=SEEDS["qwen3_moe"])
    assert main([str(root / "src"), str(root / "dst"), "--expert-dtype", "int8"]) == 0
    return root


def load_rank(path, num_gpu: int, rank: int, num_ranks: int):
    cls, config = load_model_config(path)
    placement = ExpertPlacement.choose(config.moe_layer_indices, config.moe.num_experts, num_gpu,
                                       num_ranks=num_ranks) if num_gpu else None
    factory = partial(cpu_experts_factory, handoff=CpuHandoff(), placement=placement, int8_activations=False,
                      rank=rank)
    model = build_model(cls, config, EngineConfig(device="cpu", dtype="float32"), Backends(make_experts=factory))
    load_weights(model, path, PARTITIONS, expert_dtype="int8", rank=rank, num_ranks=num_ranks)
    return model


@pytest.mark.parametrize("source", ["dst", "src"])
@pytest.mark.parametrize("num_ranks,num_gpu", [(2, 3), (3, 8), (3, 0)])
def test_models_loaded_per_rank_sum_to_one(checkpoint, source, num_ranks, num_gpu):
    """Each rank loads its slice of the CPU experts and its own GPU experts (none of the others', which its checks
    let pass): per MoE layer the ranks' routed outputs add up to the one-rank model's."""
    path = checkpoint / source
    one = load_rank(path, num_gpu, 0, 1)
    models = [load_rank(path, num_gpu, r, num_ranks) for r in range(num_ranks)]
    layers = [[m for m in model.modules() if isinstance(m, RoutedExperts)] for model in (one, *models)]
    assert len(layers[0]) == len(one.config.moe_layer_indices)
    gen = torch.Generator().manual_seed(5)
    for index, want_module in enumerate(layers[0]):
        hidden = torch.randn(9, one.config.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(9)])
        w = torch.rand(9, 3, generator=gen)
        want = want_module(hidden, ids, w)
        got = sum(rank_layers[index](hidden, ids, w) for rank_layers in layers[1:])
        assert_close(got, want)
        for rank_layers in layers[1:]:  # a rank keeps its slice of the CPU experts only
            module = rank_layers[index]
            if module.has_cpu_part:
                assert module.cpu_experts.op.layer.nbytes < want_module.cpu_experts.op.layer.nbytes
