"""A streamed prefill step split between the CPU operator and the streamed experts (`hybrid.prefill_split`): the
planner's choice, and a MoE layer's output at every split (all streamed, some experts each side, all on the CPU,
balanced) against the all-CPU path, the GPU-resident experts beside them. The "device" is the CPU here, the
kernels under Triton's interpreter, as in tests/test_streaming.py."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from checkpoints import SEEDS, VARIANTS, make_checkpoint, prompt
from experts_support import random_experts
from gpu_support import DEVICE, equal_but_rare_flips

from cpu_experts.packed import PackedLayer
from hybrid import LLM
from hybrid.cli_args import add_arguments, from_namespace
from hybrid.cpu_handoff import CpuHandoff
from hybrid.engine_config import EngineConfig
from hybrid.errors import ConfigError
from hybrid.placement import ExpertPlacement
from hybrid.prefill_split import LINK_BYTES_PER_S, PrefillRates, plan_cpu_experts
from hybrid.routed_experts import cpu_experts_factory
from hybrid.streaming import ExpertStream

E, H, INTER, K = 7, 64, 96, 2
# one FLOP a second and one byte a second on each side: seconds are FLOPs and bytes, easy to reckon by hand
UNIT_RATES = PrefillRates(cpu_flops=1, cpu_read_bytes_per_s=1e30, link_bytes_per_s=1, gpu_flops=1e30)


def plan(tokens, expert_bytes=10, rates=UNIT_RATES, share=None) -> list[int]:
    return plan_cpu_experts(np.array(tokens), 1, expert_bytes, rates, share).tolist()


def test_no_routed_experts_plan_nothing():
    assert plan([0] * 5) == [] and plan([0] * 5, share=1) == [] and plan([]) == []


def test_the_cpu_takes_the_fewest_tokens_until_both_sides_finish_together():
    # a copy costs 10 whatever the tokens; the CPU costs the tokens: 1 + 2 + 3 (6) on the CPU beside 20 streamed
    # (two experts) beats 1 + 2 (3) beside 30 and 1 + 2 + 3 + 20 (26) beside 10
    assert plan([20, 3, 0, 1, 30, 2]) == [1, 3, 5]


def test_all_on_one_side_when_the_other_is_far_slower():
    tokens = [5, 1, 7, 3]
    assert plan(tokens, rates=PrefillRates(cpu_flops=1e-9)) == []  # a CPU this slow takes nothing
    assert plan(tokens, rates=PrefillRates(link_bytes_per_s=1e-9)) == [0, 1, 2, 3]  # nor a link this slow


def test_ties_go_by_expert_id_and_to_the_fewer_cpu_experts():
    # equal tokens: the lower ids first; 3 on the CPU (6) beside one copy (4) beats 2 (4) beside two (8)
    assert plan([2, 2, 2, 2], expert_bytes=4) == [0, 1, 2]
    # k = 0: max(0, 4) = 4; k = 1: max(4, 0) = 4: tied, the CPU takes nothing
    assert plan([4], expert_bytes=4) == []


@pytest.mark.parametrize("share,want", [(0, []), (0.5, [1, 3]), (1, [0, 1, 3, 4]), (0.25, [3])])
def test_a_fixed_share_gives_the_cpu_that_fraction_fewest_tokens_first(share, want):
    assert plan([9, 4, 0, 1, 9], share=share) == want


def test_prefill_cpu_share_is_a_fraction_or_auto():
    assert EngineConfig().cpu_share == 0.0  # stream all, until the split has been measured on a GPU
    assert EngineConfig(prefill_cpu_share="auto").cpu_share is None
    assert EngineConfig(prefill_cpu_share=0.25).cpu_share == 0.25
    for bad in (-0.1, 1.5, "half"):
        with pytest.raises(ConfigError, match="prefill_cpu_share"):
            EngineConfig(prefill_cpu_share=bad)
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    for text, want in (("0.5", 0.5), ("auto", None), ("1", 1.0)):
        assert from_namespace(EngineConfig, parser.parse_args(["--prefill-cpu-share", text])).cpu_share == want


def split_layer(share: float | None, min_tokens: int, is_gpt_oss: bool = False, seed: int = 0, dtype: str = "int8",
                group_size: int = 0, gpu_ids: tuple[int, ...] = (2,), is_w8a8: bool = False):
    """A MoE layer: expert 2 GPU-resident (here: this CPU), the others int8 on the CPU operator (float activations,
    exact to the stored weights; `is_w8a8`: int8 activation rows) in two partitions; `min_tokens` > 0: steps that
    long stream them in units of 3 experts (partition 0: [0, 3), [3, 6), [6, 7)) but for `share` of them."""
    gate, up, down, extra = random_experts(torch.Generator().manual_seed(seed), E, H, INTER, is_gpt_oss)
    moe = types.SimpleNamespace(num_experts=E, intermediate_size=INTER,
                                expert_proj_names=("gate_proj", "up_proj", "down_proj"))
    config = types.SimpleNamespace(moe=moe, hidden_size=H)
    placement = ExpertPlacement({0: gpu_ids}) if gpu_ids else None
    module = cpu_experts_factory(0, config, CpuHandoff(), placement, int8_activations=is_w8a8,
                                 min_streamed_tokens=min_tokens, device=DEVICE, prefill_cpu_share=share)
    module.cpu_experts.load(PackedLayer.from_float(gate, up, down, dtype, group_size, num_partitions=2, **extra))
    for slot, expert in enumerate(gpu_ids):
        for name, stacked in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            getattr(module, name).data[slot] = stacked[expert]
    if min_tokens:
        layer = module.cpu_experts.op.layer
        assert module.streamed.attach(ExpertStream(DEVICE), chunk_bytes=3 * layer.expert_bytes(), pin=False) > 0
    return module


def routed(num_tokens: int = 23, seed: int = 1):
    """Tokens routed unevenly (expert 0 the most, 6 the fewest), expert 5 not at all."""
    g = torch.Generator().manual_seed(seed)
    popular = torch.tensor([0, 0, 0, 1, 1, 3, 4, 6, 2, 2])
    ids = torch.stack([popular[torch.randperm(len(popular), generator=g)[:K]] for _ in range(num_tokens)])
    ids[ids[:, 0] == ids[:, 1], 1] = -1  # a token routed twice to one expert: once
    return torch.randn(num_tokens, H, generator=g), ids, torch.rand(num_tokens, K, generator=g)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """tests/test_streaming.py's bound: the streamed experts compute on bf16 tables and activations."""
    return float((got - want).norm() / want.norm()) < 1e-2


@torch.no_grad()
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0, None])
@pytest.mark.parametrize("is_gpt_oss", [False, True])
def test_every_split_gives_the_all_cpu_layer(share, is_gpt_oss):
    hidden, ids, weights = routed()
    want = split_layer(share, 0, is_gpt_oss)(hidden, ids, weights)  # nothing streamed
    module = split_layer(share, 1, is_gpt_oss)
    assert module.streamed.takes(hidden)
    on_cpu, streamed, experts = module.streamed.split(module._split(ids)[1])
    if share == 0.5:  # some experts each side, over several units with gaps: of 5 routed CPU-resident experts,
        # the 2 (2.5 rounded to even) with the fewest tokens on the CPU
        cpu_set, streamed_set = set(on_cpu[on_cpu >= 0].tolist()), set(streamed[streamed >= 0].tolist())
        assert len(cpu_set) == 2 and cpu_set | streamed_set == {0, 1, 3, 4, 6} and experts.tolist() == \
            sorted(streamed_set)
        counts = torch.bincount(ids[ids >= 0], minlength=E)
        assert max(counts[list(cpu_set)]) <= min(counts[list(streamed_set)])
        assert module.streamed.num_split_experts == [2, 3]
    got = module(hidden, ids, weights)
    assert close(got, want)
    if share == 1:  # the CPU operator itself, nothing streamed
        assert torch.equal(got, want)
    if share == 0.5:  # other weights split alike: far off, so the check can fail
        assert not close(split_layer(share, 1, is_gpt_oss, seed=5)(hidden, ids, weights), want)


@torch.no_grad()
@pytest.mark.parametrize("dtype,group_size", [("int8", 32), ("int4", 32), ("bf16", 0)])
def test_other_formats_split_alike(dtype, group_size):
    """Grouped int8 scales, packed int4 codes and bf16 experts: each role packs its experts' rows alike."""
    hidden, ids, weights = routed()
    want = split_layer(0.5, 0, dtype=dtype, group_size=group_size)(hidden, ids, weights)
    assert close(split_layer(0.5, 1, dtype=dtype, group_size=group_size)(hidden, ids, weights), want)


@torch.no_grad()
@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int4", 32)])
def test_a_split_w8a8_step_gives_the_all_cpu_layer_to_summation_order(dtype, group_size):
    """W8A8 experts: the streamed ones (packed units, `acquire_rows`) round their rows to int8 as the CPU operator
    does, so the split step's output is the all-CPU layer's to float32 summation order, far inside bf16's bound."""
    hidden, ids, weights = routed()
    want = split_layer(0.5, 0, dtype=dtype, group_size=group_size, is_w8a8=True)(hidden, ids, weights)
    module = split_layer(0.5, 1, dtype=dtype, group_size=group_size, is_w8a8=True)
    assert module.streamed.is_w8a8
    assert equal_but_rare_flips(module(hidden, ids, weights), want)
    assert module.streamed.num_split_experts == [2, 3]


@torch.no_grad()
@pytest.mark.parametrize("share", [0.5, None])
def test_a_split_step_routed_to_no_cpu_resident_expert(share):
    """Every token on the GPU-resident expert 2 (or, with no GPU-resident experts, routed nowhere here): nothing
    for either side of the split, the layer's output all the same."""
    hidden, ids, weights = routed()
    ids[:, 0], ids[:, 1] = 2, -1
    for gpu_ids in ((2,), ()):
        module = split_layer(share, 1, gpu_ids=gpu_ids)
        if not gpu_ids:
            ids[:, 0] = -1
        assert module.streamed.split(module._split(ids)[1])[:2] == (None, None)
        torch.testing.assert_close(module(hidden, ids, weights), split_layer(share, 0, gpu_ids=gpu_ids)(
            hidden, ids, weights), atol=0, rtol=0)


@torch.no_grad()
def test_the_packed_experts_give_the_ring_s_output():
    """All routed experts packed (only those copied, a gap at 5 and the GPU-resident 2) against the whole units
    through the ring: the same tables, the same kernel, the same sums."""
    module = split_layer(0.0, 1)
    hidden, ids, weights = routed()
    cpu_ids = module._split(ids)[1]
    ring = module.streamed.compute_on_gpu(hidden, cpu_ids, weights)
    packed = module.streamed.compute_on_gpu(hidden, cpu_ids, weights, experts=np.array([0, 1, 3, 4, 6]))
    torch.testing.assert_close(packed, ring, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine streams experts on CUDA only")
def test_prefill_logits_at_every_split_match_the_all_cpu_path(tmp_path_factory):
    """A tiny Qwen3-MoE converted to int8, prefilled with every split: the CPU operator's logits to float rounding at
    share 1, within bf16 rounding otherwise (every streamed expert computes on bf16 tables and activations)."""
    from convert.cli import main

    source, path = tmp_path_factory.mktemp("qwen3"), tmp_path_factory.mktemp("qwen3_int8") / "out"
    make_checkpoint(VARIANTS["qwen3_moe"](), source, seed=SEEDS["qwen3_moe"])
    assert main([str(source), str(path)]) == 0
    args = dict(device="cuda", dtype="bfloat16", expert_activations="float")
    ids = prompt(40, seed=2)
    cpu = LLM(path, gpu_prefill_tokens=0, **args)
    want = cpu.prefill_logits(ids)
    cpu.close()
    for share in (0, 0.5, 1, "auto"):
        llm = LLM(path, gpu_prefill_tokens=33, prefill_cpu_share=share, **args)
        assert llm.num_pinned_bytes > 0
        got = llm.prefill_logits(ids)
        llm.close()
        error = float((got - want).norm() / want.norm())
        assert error < (1e-6 if share == 1 else 5e-2), f"share {share}: relative error {error:.2e}"


@torch.no_grad()
def test_a_slot_that_held_packed_experts_is_copied_again_for_the_ring():
    """A layer of two units (one a partition) fits the ring's two slots, which keep them between steps; a split step
    packs its streamed experts (3, 4 and 6: over the slots' first rows) into those slots, so the next all-streamed
    step must copy its units again."""
    from hybrid.streaming import StreamedPrefill

    module = split_layer(0.0, 0)
    streamed = StreamedPrefill(module.cpu_experts, 1, DEVICE)
    stream = ExpertStream(DEVICE)
    assert streamed.attach(stream, chunk_bytes=1 << 20, pin=False) > 0 and len(stream.units) == 2
    hidden, ids, weights = routed()
    cpu_ids = module._split(ids)[1]
    ring = streamed.compute_on_gpu(hidden, cpu_ids, weights)
    some = torch.where((cpu_ids == 3) | (cpu_ids == 4) | (cpu_ids == 6), cpu_ids, -1)
    packed = streamed.compute_on_gpu(hidden, some, weights, experts=np.array([3, 4, 6]))
    assert close(packed, module.cpu_experts.op(hidden, some, weights))
    torch.testing.assert_close(streamed.compute_on_gpu(hidden, cpu_ids, weights), ring, atol=0, rtol=0)


def test_the_cpu_rates_are_fitted_from_two_calls(monkeypatch):
    """A stand-in operator taking pairs x FLOPs / 3e12 + bytes / 80e9 seconds on a clock of its own: the fit finds
    both rates; a call whose time does not grow with the tokens (noise) keeps the rates given."""
    from hybrid import prefill_split

    spec = types.SimpleNamespace(num_experts=128, hidden_size=2048)
    layer = types.SimpleNamespace(spec=spec, partitions=[types.SimpleNamespace(size=768)], nbytes=604_000_000)
    clock = [0.0]

    class Operator:
        op = types.SimpleNamespace(layer=layer)
        is_flat = False

        def __call__(self, hidden, ids, weights):
            assert ids.shape == (hidden.shape[0], 8) and (ids.sort(dim=1).values.diff(dim=1) > 0).all()
            pairs = 0 if self.is_flat else ids.numel()
            clock[0] += pairs * 6 * 2048 * 768 / 3e12 + layer.nbytes / 80e9

    monkeypatch.setattr(prefill_split.time, "perf_counter", lambda: clock[0])
    rates = prefill_split.measure_cpu(Operator(), 8, PrefillRates())
    assert rates.cpu_flops == pytest.approx(3e12) and rates.cpu_read_bytes_per_s == pytest.approx(80e9)
    assert rates.link_bytes_per_s == PrefillRates().link_bytes_per_s
    flat = Operator()
    flat.is_flat = True
    assert prefill_split.measure_cpu(flat, 8, UNIT_RATES) == UNIT_RATES


def test_the_cpu_rates_of_a_real_operator_are_rates():
    """The real operator's calls (int8 experts of the tiny layer): whatever the noise, valid positive rates."""
    from hybrid.prefill_split import measure_cpu

    with torch.inference_mode():
        rates = measure_cpu(split_layer(0.0, 0).cpu_experts, K, PrefillRates())
    assert rates.cpu_flops > 0 and rates.cpu_read_bytes_per_s > 0 and rates.link_bytes_per_s == LINK_BYTES_PER_S
