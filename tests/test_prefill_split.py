"""A streamed prefill step split between the CPU operator and the streamed experts (`hybrid.prefill_split`): the
planner's choice, and a MoE layer's output at every split (all streamed, some experts each side, all on the CPU,
balanced) against the all-CPU path, the GPU-resident experts beside them. The "device" is the CPU here, the
kernels under Triton's interpreter, as in tests/test_streaming.py."""

from __future__ import annotations

import types
from dataclasses import replace

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
from hybrid.prefill_split import LINK_BYTES_PER_S, PrefillRates, may_split, plan_cpu_experts
from hybrid.routed_experts import cpu_experts_factory
from hybrid.streaming import ExpertStream

E, H, INTER, K = 7, 64, 96, 2
# a second a token on the CPU (1 at 1 token, 2 at 2, in proportion beyond), a second a byte over the link, the GPU's
# FLOPs free, the two sides overlapping perfectly and a split costing nothing: seconds easy to reckon by hand
UNIT_RATES = PrefillRates(cpu_expert_seconds=((1, 1.0), (2, 2.0)), link_bytes_per_s=1, gpu_flops=1e30,
                          overlap_loss=0, split_seconds=0, min_gain=0)
# the H200 host: a Qwen3-30B-A3B layer (128 experts of 4.7 MB int8, 9.4 MFLOP a pair, top-8), the CPU operator's
# times of docs/benchmarks.md, the fitted split costs
QWEN3_E, QWEN3_K, QWEN3_BYTES, QWEN3_FLOPS = 128, 8, 604_000_000 // 128, 6 * 2048 * 768
# the CPU side as the device's split steps took it (3.68 ms for the 27% of a 512-token step's experts with the
# fewest tokens, 6.12 for 50%, 18.5 for 37% at 2048), the split costs the defaults
DEVICE_RATES = PrefillRates(cpu_expert_seconds=((4, 50e-6), (16, 65e-6), (64, 170e-6)), cpu_token_seconds=1.3e-6)


# a CPU costing next to nothing: "auto" reads every step's routing and takes every routed expert
FREE_CPU = PrefillRates(cpu_expert_seconds=((1, 1e-12),), link_bytes_per_s=1.0, split_seconds=0)


def plan(tokens, expert_bytes=10, rates=UNIT_RATES, share=None, num_tokens=0) -> list[int]:
    return plan_cpu_experts(np.array(tokens), 1, expert_bytes, rates, share, num_tokens).tolist()


def test_no_routed_experts_plan_nothing():
    # every expert GPU-resident (or routed elsewhere): zero counts, whatever the rates or the share
    for rates in (UNIT_RATES, PrefillRates(link_bytes_per_s=1e-9)):
        assert plan([0] * 5, rates=rates) == [] and plan([0] * 5, share=1) == [] and plan([], rates=rates) == []
        assert rates.step_seconds(np.array([], dtype=np.int64), 9, 1, 10).tolist() == [0.0]


def test_the_cpu_takes_the_fewest_tokens_until_both_sides_finish_together():
    # a copy costs 10 whatever the tokens; the CPU costs the tokens: 1 + 2 + 3 (6) on the CPU beside 20 streamed
    # (two experts) beats 1 + 2 (3) beside 30 and 1 + 2 + 3 + 20 (26) beside 10
    assert plan([20, 3, 0, 1, 30, 2]) == [1, 3, 5]


def test_all_on_one_side_when_the_other_is_far_slower():
    tokens = [5, 1, 7, 3]
    slow_cpu = replace(UNIT_RATES, cpu_expert_seconds=((1, 1e9),))
    assert plan(tokens, rates=slow_cpu) == []  # a CPU this slow takes nothing
    assert plan(tokens, rates=replace(UNIT_RATES, link_bytes_per_s=1e-9)) == [0, 1, 2, 3]  # nor a link this slow
    assert plan(tokens, rates=PrefillRates(link_bytes_per_s=1e-9)) == [0, 1, 2, 3]  # with the split's costs too


def test_ties_go_by_expert_id_and_a_tie_with_streaming_all_streams():
    # equal tokens: the lower ids first; 3 on the CPU (6) beside one copy (4) beats 2 (4) beside two (8)
    assert plan([2, 2, 2, 2], expert_bytes=4) == [0, 1, 2]
    # k = 0: 4 streamed; k = 1: 4 on the CPU: no gain, nothing split
    assert plan([4], expert_bytes=4) == []


def test_the_shorter_side_counts_by_the_overlap_it_loses():
    rates = replace(UNIT_RATES, overlap_loss=0.5, split_seconds=2)
    # fewest first [1, 2, 20, 30]; the CPU side 1, 3, 23, 53; the streamed rest 40 (all), 30, 20, 10, 0
    want = [40, 30 + 0.5 + 2, 20 + 1.5 + 2, 23 + 5 + 2, 53 + 2]
    assert rates.step_seconds(np.array([1, 2, 20, 30]), 0, 1, 10).tolist() == want
    assert plan([20, 1, 30, 2], rates=rates) == [1, 3]
    # one after the other (loss 1): each expert on its cheaper side, less a split's cost
    serial = replace(UNIT_RATES, overlap_loss=1, split_seconds=2)
    assert plan([20, 1, 30, 2, 9], rates=serial) == [1, 3, 4]
    assert plan([20, 9, 30], rates=serial) == []  # 1 saved, 2 spent


def test_the_cpu_s_per_token_work_and_the_margin_keep_a_small_gain_streamed():
    # [1, 2] on the CPU (3) beside 20 streamed: 20 against 40 streaming all
    assert plan([20, 1, 30, 2]) == [1, 3]
    assert plan([20, 1, 30, 2], num_tokens=50, rates=replace(UNIT_RATES, cpu_token_seconds=1)) == []  # 53 > 40
    assert plan([20, 1, 30, 2], rates=replace(UNIT_RATES, min_gain=0.4)) == [1, 3]  # 20 <= 60% of 40
    assert plan([20, 1, 30, 2], rates=replace(UNIT_RATES, min_gain=0.5)) == []  # 20 is not under 50% of 40


def test_one_token():
    """A one-token step (K experts of one token each): the CPU takes them where its call beats their copies by
    the margin, not where the split's fixed cost eats the gain."""
    tokens = np.zeros(QWEN3_E, dtype=np.int64)
    tokens[[3, 70, 9, 120, 5, 6, 7, 8]] = 1
    fast = replace(PrefillRates(), split_seconds=0)
    # 70 us an expert on the CPU, 87 us a copy: 5 on the CPU (the lowest ids, ties) beside 3 streamed
    assert plan_cpu_experts(tokens, QWEN3_FLOPS, QWEN3_BYTES, fast, num_tokens=1).tolist() == [3, 5, 6, 7, 8]
    assert plan_cpu_experts(tokens, QWEN3_FLOPS, QWEN3_BYTES, PrefillRates(), num_tokens=1).size == 0  # +1 ms
    assert not may_split(1, QWEN3_E, QWEN3_K, QWEN3_FLOPS, QWEN3_BYTES, PrefillRates())
    assert may_split(1, QWEN3_E, QWEN3_K, QWEN3_FLOPS, QWEN3_BYTES, fast)


def test_the_cpu_s_time_per_expert_is_interpolated_flat_below_and_proportional_above():
    rates = PrefillRates(cpu_expert_seconds=((16, 1.0), (32, 1.5), (64, 4.0)))
    assert rates.cpu_seconds(np.array([1, 16, 24, 32, 48, 64, 128])).tolist() == [1.0, 1.0, 1.25, 1.5, 2.75, 4.0, 8.0]


@pytest.mark.parametrize("bad", [dict(cpu_expert_seconds=()), dict(cpu_expert_seconds=((0, 1.0),)),
                                 dict(cpu_expert_seconds=((4, 1.0), (4, 2.0))),
                                 dict(cpu_expert_seconds=((4, 0.0),)), dict(link_bytes_per_s=0),
                                 dict(overlap_loss=1.5), dict(min_gain=-0.1), dict(split_seconds=-1),
                                 dict(cpu_token_seconds=float("nan"))])
def test_rates_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match=f"PrefillRates.{next(iter(bad))}"):
        PrefillRates(**bad)


def routed_counts(num_tokens: int, seed: int = 0) -> np.ndarray:
    """A near-even routing of `num_tokens` over Qwen3's 128 experts (the synthetic bench model's)."""
    ids = np.random.default_rng(seed).integers(0, QWEN3_E, num_tokens * QWEN3_K)
    return np.bincount(ids, minlength=QWEN3_E)


def test_the_device_s_2048_token_step_streams_all():
    """The first device run's auto put 37% of the experts on the CPU at 2048 tokens: 18.5 ms of CPU a layer where
    streaming all took 11.3. Costed at the operator's time per expert at ~128 tokens (~0.38 ms against a copy's
    0.087 ms), no split wins: auto streams as share 0, without even reading the routing."""
    for rates in (PrefillRates(), DEVICE_RATES):
        for seed in range(3):
            counts = routed_counts(2048, seed)
            assert plan_cpu_experts(counts, QWEN3_FLOPS, QWEN3_BYTES, rates, num_tokens=2048).size == 0
        for num_tokens in (512, 1024, 2048, 8192):
            assert not may_split(num_tokens, QWEN3_E, QWEN3_K, QWEN3_FLOPS, QWEN3_BYTES, rates)


def test_the_step_model_against_the_device_s_split_steps():
    """The device's split steps, a layer each (the step over 16 layers): the CPU side as it took, the step within
    15% of what it took (above it at 512 tokens, where a split could win)."""
    for num_tokens, share, cpu_took, took in ((512, 0.27, 3.68e-3, 11.35e-3), (512, 0.5, 6.12e-3, 10.48e-3),
                                              (2048, 0.37, 18.5e-3, 25.9e-3)):
        counts = np.sort(routed_counts(num_tokens))
        num_cpu = round(share * QWEN3_E)
        cpu = num_tokens * DEVICE_RATES.cpu_token_seconds + DEVICE_RATES.cpu_seconds(counts[:num_cpu]).sum()
        assert cpu == pytest.approx(cpu_took, rel=0.1)
        predicted = DEVICE_RATES.step_seconds(counts, num_tokens, QWEN3_FLOPS, QWEN3_BYTES)[num_cpu]
        assert predicted == pytest.approx(took, rel=0.15) and (num_tokens > 512 or predicted > took)


def test_a_cpu_as_fast_as_the_link_per_expert_takes_about_half_where_the_sides_overlap():
    """The 512-token step on the device's CPU (~85 us an expert at ~25 tokens against 87 us a copy): on a host
    whose two sides overlap better than the H200's, about half the experts on the CPU, as the best fixed share was
    there; at the H200's overlap the predicted gain is under the margin: auto keeps share 0 (0.5 won 7% there)."""
    overlapping = replace(DEVICE_RATES, overlap_loss=0.4, split_seconds=0.5e-3)
    on_cpu = plan_cpu_experts(routed_counts(512), QWEN3_FLOPS, QWEN3_BYTES, overlapping, num_tokens=512)
    assert 0.35 * QWEN3_E < on_cpu.size < 0.6 * QWEN3_E
    assert may_split(512, QWEN3_E, QWEN3_K, QWEN3_FLOPS, QWEN3_BYTES, overlapping)
    assert not may_split(4096, QWEN3_E, QWEN3_K, QWEN3_FLOPS, QWEN3_BYTES, overlapping)
    assert plan_cpu_experts(routed_counts(512), QWEN3_FLOPS, QWEN3_BYTES, DEVICE_RATES, num_tokens=512).size == 0


def test_auto_never_predicts_a_step_slower_than_streaming_all():
    """Random rates and routings: a plan is empty, or its predicted layer time is the least over every split and
    beats streaming all by the margin."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        rates = PrefillRates(
            cpu_expert_seconds=tuple(zip((4, 16, 64), np.cumsum(rng.uniform(1e-6, 3e-4, 3)), strict=True)),
            cpu_token_seconds=rng.uniform(0, 3e-6), link_bytes_per_s=rng.uniform(5e9, 200e9),
            overlap_loss=rng.uniform(0, 1), split_seconds=rng.uniform(0, 2e-3), min_gain=rng.uniform(0, 0.2))
        num_tokens = int(rng.integers(1, 4096))
        counts = np.bincount(rng.zipf(1.5, num_tokens * QWEN3_K) % QWEN3_E, minlength=QWEN3_E)
        on_cpu = plan_cpu_experts(counts, QWEN3_FLOPS, QWEN3_BYTES, rates, num_tokens=num_tokens)
        seconds = rates.step_seconds(np.sort(counts[counts > 0]), num_tokens, QWEN3_FLOPS, QWEN3_BYTES)
        if on_cpu.size:
            assert seconds[on_cpu.size] == seconds[1:].min() < (1 - rates.min_gain) * seconds[0]
        else:
            assert seconds[1:].min() >= (1 - rates.min_gain) * seconds[0]


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
    # on the GPU where there is one (inputs and the layer's resident expert): the streamed units' kernel
    hidden, ids, weights = (t.to(DEVICE) for t in routed())
    want = split_layer(0.5, 0, dtype=dtype, group_size=group_size, is_w8a8=True).to(DEVICE)(hidden, ids, weights)
    module = split_layer(0.5, 1, dtype=dtype, group_size=group_size, is_w8a8=True).to(DEVICE)
    assert module.streamed.is_w8a8 and module.streamed.takes(hidden)
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
        module.streamed.rates = FREE_CPU  # "auto" reads the routing
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


def test_the_cpu_s_times_are_measured_per_expert_at_each_density(monkeypatch):
    """A stand-in operator on a clock of its own: 0.5 us a token of the call plus, per routed expert, 60 us for
    each tile of 16 of its tokens begun (AMX pads to tiles): the measured points are the tiles' times at 4, 16 and
    64 tokens an expert, less a share of the one-pair call's expert (which the per-token time takes in)."""
    from hybrid import prefill_split

    spec = types.SimpleNamespace(num_experts=128, hidden_size=2048)
    layer = types.SimpleNamespace(spec=spec, partitions=[types.SimpleNamespace(size=768)], nbytes=604_000_000)
    clock = [0.0]

    class Operator:
        op = types.SimpleNamespace(layer=layer)

        def __call__(self, hidden, ids, weights):
            assert ids.shape == (hidden.shape[0], 8)
            valid = ids[ids >= 0]
            assert (ids.sort(dim=1).values.diff(dim=1)[(ids >= 0).all(dim=1)] > 0).all()  # distinct a token
            counts = torch.bincount(valid, minlength=128)
            clock[0] += 0.5e-6 * hidden.shape[0] + 60e-6 * float((-(-counts // 16)).sum())

    monkeypatch.setattr(prefill_split.time, "perf_counter", lambda: clock[0])
    rates = prefill_split.measure_cpu(Operator(), 8, PrefillRates())
    largest = 64 * 128 // 8
    assert rates.cpu_token_seconds == pytest.approx(0.5e-6 + 60e-6 / largest)
    for (at, seconds), tiles in zip(rates.cpu_expert_seconds, (1, 1, 4), strict=True):
        tokens = at * 128 // 8
        assert seconds == pytest.approx(tiles * 60e-6 - 60e-6 * tokens / largest / 128)
    assert [at for at, _ in rates.cpu_expert_seconds] == [4, 16, 64]
    assert rates.link_bytes_per_s == PrefillRates().link_bytes_per_s


def test_the_cpu_times_of_a_real_operator_are_times():
    """The real operator's calls (int8 experts of the tiny layer): whatever the noise, valid positive times."""
    from hybrid.prefill_split import measure_cpu

    with torch.inference_mode():
        rates = measure_cpu(split_layer(0.0, 0).cpu_experts, K, PrefillRates())
    assert rates.cpu_token_seconds > 0 and all(s > 0 for _, s in rates.cpu_expert_seconds)
    assert rates.link_bytes_per_s == LINK_BYTES_PER_S


@torch.no_grad()
def test_auto_streams_through_the_ring_where_no_split_wins():
    """"auto" on a layer whose CPU is far slower than the link: the step goes through the ring as share 0's, with no
    routing read (no packed experts); on a CPU far faster, the routing is read and the CPU takes experts."""
    hidden, ids, weights = routed()
    module = split_layer(None, 1)
    module.streamed.rates = PrefillRates(cpu_expert_seconds=((1, 1.0),))
    cpu_ids = module._split(ids)[1]
    assert module.streamed.split(cpu_ids) == (None, cpu_ids, None) and module.streamed.num_split_experts == [0, 0]
    module.streamed.rates = FREE_CPU
    on_cpu, streamed, _ = module.streamed.split(cpu_ids)
    assert streamed is None and set(on_cpu[on_cpu >= 0].tolist()) == {0, 1, 3, 4, 6}


def test_the_bench_reports_the_rates_auto_costs_from():
    from dataclasses import asdict

    from hybrid.bench_engine import split_rates

    module = split_layer(None, 1)
    module.streamed.rates = DEVICE_RATES
    model = torch.nn.ModuleList([module])
    assert split_rates(types.SimpleNamespace(engine_config=EngineConfig(prefill_cpu_share="auto"), model=model)) \
        == asdict(DEVICE_RATES)
    assert split_rates(types.SimpleNamespace(engine_config=EngineConfig(prefill_cpu_share=0.5), model=model)) is None
