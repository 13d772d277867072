"""Large prefill steps of CPU-resident experts on the GPU (`hybrid.streaming`). W8A8 layers (the CPU operator's
default for int8/int4 experts) run the stored codes through gpu_layers.w8a8_moe and give the CPU operator's prefill
output to float32 summation order (the same int8 rows, exact integer sums per group); layers computing in float
and bf16 experts are dequantized on the device and run through gpu_layers.fused_moe, within bf16 rounding of the
CPU's float output. For per-row and grouped int8 scales, int4 with float32 and bfloat16 scales (the -8 code in
use), gpt-oss's activation and biases, two partitions and units of a few experts, through a ring of two device
slots over several layers and steps. Runs under Triton's interpreter without a GPU (the whole-model tests need
CUDA)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, kimi_k2_config, make_checkpoint, prompt
from experts_support import random_experts
from gpu_support import DEVICE, equal_but_rare_flips, poisoned

from cpu_experts import formats
from cpu_experts.expert_file import ExpertLayerSpec
from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from gpu_layers.dequant import dequantize_int4, dequantize_int4_reference, dequantize_int8, dequantize_int8_reference
from hybrid import LLM
from hybrid.engine_config import EngineConfig
from hybrid.streaming import ExpertStream, StreamedPrefill, layer_units, min_streamed_tokens


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(VARIANTS["qwen3_moe"](), path, seed=SEEDS["qwen3_moe"])
    return path


def converted(source, tmp_path, *args):
    from convert.cli import main

    assert main([str(source), str(tmp_path / "dst"), *args]) == 0
    return tmp_path / "dst"


def cpu_layer(seed: int, dtype: str, group_size: int, num_experts=7, hidden_size=64, inter=96,
              is_gpt_oss: bool = False, rank: int = 0, num_ranks: int = 1, is_w8a8: bool = False) -> CpuExperts:
    """A CpuExperts over random experts in two partitions, computing in float (exact to the stored weights), or
    `is_w8a8` on int8 activation rows through its prefill path at any token count; `is_gpt_oss`: gpt-oss's
    clamped activation with random biases, gate/up large enough to reach the clamp; `rank` of `num_ranks`: that
    tensor-parallel rank's slice of I."""
    gate, up, down, extra = random_experts(torch.Generator().manual_seed(seed), num_experts, hidden_size, inter,
                                           is_gpt_oss)
    module = CpuExperts(0, prefill_min_tokens=1, int8_activations=True) if is_w8a8 else \
        CpuExperts(0, int8_activations=False)
    module.load(PackedLayer.from_float(gate, up, down, dtype, group_size, num_partitions=2, rank=rank,
                                       num_ranks=num_ranks, **extra))
    assert len(module.op.layer.partitions) == 2
    return module


def int4_codes(*shape, generator) -> torch.Tensor:
    """Random int4 codes over the whole range, -8 included, packed as the CPU experts store them."""
    q = torch.randint(-8, 8, shape, generator=generator, dtype=torch.int8)
    return torch.stack([formats.pack_int4(m) for m in q.flatten(0, -3)]).view(*shape[:-1], -(-shape[-1] // 2))


def int4_layer(seed: int, scale_dtype: str, num_experts=7, hidden_size=64, inter=96, group=32,
               is_w8a8: bool = False) -> CpuExperts:
    """Like `cpu_layer` for int4 experts, with every code in use (the -8 the converter's quantizer never writes)
    and the scales in `scale_dtype` (bfloat16: as the INT4 passthrough copies Kimi's)."""
    g = torch.Generator().manual_seed(seed)
    spec = ExpertLayerSpec(num_experts, hidden_size, inter, "int4", group, scale_dtype)
    tensors = {}
    for name, (shape, dtype) in spec.tensor_shapes().items():
        if name.endswith(".weight"):
            n, k = spec.matrix_shape(name.split(".")[0])
            tensors[name] = int4_codes(num_experts, n, k, generator=g)
        else:
            tensors[name] = (torch.rand(shape, generator=g) / 32 / shape[1] ** 0.5 * 8 + 1e-3).to(dtype)
    module = CpuExperts(0, prefill_min_tokens=1, int8_activations=True) if is_w8a8 else \
        CpuExperts(0, int8_activations=False)
    module.load(PackedLayer.from_file_tensors(tensors, spec, num_partitions=2))
    assert len(module.op.layer.partitions) == 2
    return module


def routed(num_tokens: int, num_experts: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, 64, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(num_tokens)])
    ids[3, 1] = -1  # an expert computed elsewhere
    return hidden, ids, torch.rand(num_tokens, 2, generator=g)


def on_device(streamed: StreamedPrefill, hidden, ids, weights, dtype=torch.bfloat16) -> torch.Tensor:
    got = streamed.compute_on_gpu(hidden.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE))
    assert got.dtype == dtype
    return got.float().cpu()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).norm() / want.norm()) < 1e-2


# W8A8: the streamed step and the CPU operator's prefill differ only in float32 summation order and in exp (the
# CPU's polynomial `fast_exp`, 5e-7 relative), which may move an act row's scale by an ulp and, rarely, one act
# code by 1 (`equal_but_rare_flips`). Measured under the interpreter: 9e-8 to 3e-7 of the output's norm, no flip
# (the float path's bf16 output alone is ~2e-3 off, the int8 rounding of the activations ~1e-2).


@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int8", 32), ("int4", "float32"), ("int4", "bfloat16")])
def test_streamed_w8a8_layer_equals_the_cpu_operators_prefill(dtype, group_size):
    """W8A8 layers stream their codes (no bf16 tables: units bounded by stored bytes alone) and round each
    matmul's input rows to int8 as the CPU does; float32 in, float32 out, so nothing rounds to bf16."""
    if dtype == "int4":
        module = int4_layer(0, group_size, is_w8a8=True)
    else:
        module = cpu_layer(0, dtype, group_size, is_w8a8=True)
    hidden, ids, weights = routed(19)
    hidden[5] *= 40  # rows of very different absmax: each its own scale
    streamed = StreamedPrefill(module, min_tokens=1, device=DEVICE)
    assert streamed.is_w8a8
    assert streamed.attach(ExpertStream(DEVICE), chunk_bytes=3 * module.op.layer.expert_bytes(), pin=False) > 0
    want = module.op(hidden, ids, weights)
    assert max(u.last - u.first for u in streamed.stream.units) >= 3  # no bf16 tables bound the units
    assert equal_but_rare_flips(on_device(streamed, hidden, ids, weights, torch.float32), want)
    float_module = int4_layer(0, group_size) if dtype == "int4" else cpu_layer(0, dtype, group_size)
    assert not equal_but_rare_flips(float_module.op(hidden, ids, weights), want)  # the rounding is seen


@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int8", 32), ("bf16", 0), ("int4", "float32"),
                                              ("int4", "bfloat16"), ("fp8", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_streamed_layer_matches_the_cpu_operator(dtype, group_size):
    module = int4_layer(0, group_size) if dtype == "int4" else cpu_layer(0, dtype, group_size)
    hidden, ids, weights = routed(19)
    streamed = StreamedPrefill(module, min_tokens=1, device=DEVICE)
    stream = ExpertStream(DEVICE)
    part = module.op.layer.partitions[0]  # the larger partition (I 96 = 64 + 32)
    # stored bytes an expert, or half its bf16 tables where they are larger (int4's)
    per_expert = max(sum(a.nbytes for a in part.arrays()) // 7, 3 * part.size * 64)
    assert streamed.attach(stream, chunk_bytes=3 * per_expert, pin=False) > 0
    for p in (0, 1):  # each partition's experts in consecutive units of at most chunk_bytes
        units = [u for u in stream.units if u.partition == p]
        assert [u.first for u in units] == [0] + [u.last for u in units[:-1]] and units[-1].last == 7
        assert all(sum(a.nbytes for a in u.arrays().values()) <= 3 * per_expert for u in units)
    assert [u.last for u in stream.units if u.partition == 0] == [3, 6, 7]
    assert close(on_device(streamed, hidden, ids, weights), module.op(hidden, ids, weights))


@pytest.mark.parametrize("dtype,group_size,is_w8a8", [
    ("int8", 0, False), ("int4", 32, False), ("bf16", 0, False), ("fp8", 32, False), ("mxfp4", 32, False),
    ("nvfp4", 16, False), ("int8", 0, True), ("int8", 32, True)])  # mxfp4: as published
def test_streamed_gpt_oss_layer_keeps_its_activation_and_biases(dtype, group_size, is_w8a8):
    """gpt-oss's experts streamed: the clamped activation and the gate/up biases in every unit, the down bias once
    per expert (units of both partitions add up), as the CPU operator computes them (W8A8: to its tolerance)."""
    module = cpu_layer(1, dtype, group_size, is_gpt_oss=True, is_w8a8=is_w8a8)
    hidden, ids, weights = routed(19)
    streamed = StreamedPrefill(module, min_tokens=1, device=DEVICE)
    assert streamed.attach(ExpertStream(DEVICE), chunk_bytes=3 * module.op.layer.expert_bytes(), pin=False) > 0
    want = module.op(hidden, ids, weights)
    if is_w8a8:
        assert equal_but_rare_flips(on_device(streamed, hidden, ids, weights, torch.float32), want)
    else:
        assert close(on_device(streamed, hidden, ids, weights), want)
    plain = cpu_layer(1, dtype, group_size)  # the silu layer of other weights: far off, so the check can fail
    assert not close(plain.op(hidden, ids, weights), want)


def test_streamed_rank_slices_add_up_with_the_down_bias_once():
    """Tensor parallel: each rank streams its slice of I (I = 160: rows [0, 96) and [96, 160), two partitions
    each); the down bias comes with rank 0's units only, so the ranks' outputs add up to the whole layer's."""
    whole = cpu_layer(1, "int8", 0, inter=160, is_gpt_oss=True)
    hidden, ids, weights = routed(19)
    outputs = []
    for rank in (0, 1):
        module = cpu_layer(1, "int8", 0, inter=160, is_gpt_oss=True, rank=rank, num_ranks=2)
        streamed = StreamedPrefill(module, min_tokens=1, device=DEVICE)
        assert streamed.attach(ExpertStream(DEVICE), chunk_bytes=3 * module.op.layer.expert_bytes(), pin=False) > 0
        outputs.append(on_device(streamed, hidden, ids, weights))
    assert close(outputs[0] + outputs[1], whole.op(hidden, ids, weights))


def test_a_ring_of_two_slots_serves_every_layer_every_step():
    """Three layers of three units each through two slots, two steps: each layer reads its own weights, also when
    a slot still holds a unit from the step before (reused, not re-copied) or another layer's."""
    modules = [cpu_layer(seed, "int8", 0) for seed in range(3)]
    stream = ExpertStream(DEVICE)
    streamed = [StreamedPrefill(m, min_tokens=1, device=DEVICE) for m in modules]
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


def test_int4_units_keep_their_bf16_tables_within_twice_the_chunk():
    """int4 expands 4x to bf16: a unit holds at most half the stored bytes an int8 one does, so the bf16 tables
    stay within the device memory `reserve_bytes` sets aside."""
    layer = int4_layer(0, "bfloat16").op.layer
    chunk_bytes = 3 * layer.expert_bytes()
    units = layer_units(layer, chunk_bytes)
    for unit in units:
        stored = sum(a.nbytes for a in unit.arrays().values())
        size = layer.partitions[unit.partition].size
        assert stored <= chunk_bytes and 2 * 3 * size * 64 * (unit.last - unit.first) <= 2 * chunk_bytes
    assert max(u.last - u.first for u in units if u.partition == 0) == 2  # 2 x 3 bytes a bf16 weight vs 1.5 + scales


@pytest.mark.parametrize("num_cols,group", [(97, 32), (96, 64), (33, 128), (64, 64)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_int4_matches_its_reference_into_a_strided_table(num_cols, group, scale_dtype):
    """Odd K (the last byte's high nibble is padding), groups of 32 to 128 and one a row (64 of 64), the -8 code."""
    g = torch.Generator().manual_seed(num_cols)
    w = int4_codes(3, 5, num_cols, generator=g)
    w[0, 0, 0] = 0x80 | (w[0, 0, 0] & 0x0F)  # -8 in a high nibble
    w[0, 0, 1] = 0x00  # -8 in both
    if num_cols % 2:
        w[..., -1] |= 0xF0  # the padding nibble set: read, it would land outside K or be a wrong weight
    scales = (torch.rand(3, 5, -(-num_cols // group), generator=g) + 0.5).to(scale_dtype)
    want = dequantize_int4_reference(w, scales, group, num_cols)
    layout = torch.stack([formats.dequantize_int4(w[e], scales[e], group, num_cols) for e in range(3)])
    assert torch.equal(want, layout.to(torch.bfloat16))  # the CPU experts' format, one expert at a time
    table = poisoned(3, 10, num_cols, dtype=torch.bfloat16)
    dequantize_int4(w.to(DEVICE), scales.to(DEVICE), group, num_cols, table[:, 5:])  # the up half of a table
    assert torch.equal(table[:, 5:].cpu(), want)
    assert table[:, :5].isnan().all()  # the other half untouched


def test_dequantize_int4_refuses_mismatched_inputs():
    w = torch.zeros(3, 5, 49, dtype=torch.uint8, device=DEVICE)
    scales = torch.ones(3, 5, 4, device=DEVICE)
    with pytest.raises(ValueError, match="bytes a row"):
        dequantize_int4(w, scales, 32, 100)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_int4(w, scales[..., :3], 32, 97)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_int4(w, scales.half(), 32, 97)
    with pytest.raises(ValueError, match="w must be"):
        dequantize_int4(w.view(torch.int8), scales, 32, 97)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_int4(w, scales, 32, 97, torch.empty(3, 5, 98, dtype=torch.bfloat16, device=DEVICE))


def test_small_steps_go_to_the_cpu_experts():
    module = cpu_layer(0, "int8", 0)
    streamed = StreamedPrefill(module, min_tokens=16, device=DEVICE)
    streamed.attach(ExpertStream(DEVICE), pin=False)
    hidden, ids, weights = routed(8)
    assert not streamed.takes(hidden.to(DEVICE))
    assert streamed.takes(torch.cat([hidden] * 2).to(DEVICE))


def test_the_auto_threshold_gives_each_expert_16_tokens_on_cuda_only():
    assert min_streamed_tokens(EngineConfig(device="cuda"), 128, 8) == 256  # Qwen3-30B-A3B
    assert min_streamed_tokens(EngineConfig(device="cuda"), 256, 8) == 512  # DeepSeek-V3
    assert min_streamed_tokens(EngineConfig(device="cuda"), 8, 2) == 64  # Mixtral
    assert min_streamed_tokens(EngineConfig(device="cuda", max_graph_batch=64), 8, 2) == 65  # above the graphs
    assert min_streamed_tokens(EngineConfig(device="cuda", gpu_prefill_tokens=100), 8, 2) == 100
    assert min_streamed_tokens(EngineConfig(device="cpu"), 128, 8) == 0


def test_converted_int4_experts_are_streamable(source, tmp_path):
    llm = LLM(converted(source, tmp_path, "--expert-dtype", "int4", "--group-size", "32"), device="cpu",
              dtype="float32")
    module = next(m for m in llm.model.modules() if isinstance(m, CpuExperts))
    assert StreamedPrefill(module, min_tokens=1, device="cpu").is_streamable


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory):
    """Kimi-K2's INT4 experts (group 32, bfloat16 scales, the -8 code) copied as stored by the converter."""
    pytest.importorskip("compressed_tensors")  # packs the source (installed with the test extras, not everywhere)
    from int4_checkpoints import make_int4_checkpoint

    cfg = kimi_k2_config()
    cfg.moe_intermediate_size = 96
    src, dst = tmp_path_factory.mktemp("kimi_int4") / "src", tmp_path_factory.mktemp("kimi_dst") / "out"
    make_int4_checkpoint(cfg, src, seed=SEEDS["kimi_k2"])
    from convert.cli import main

    assert main([str(src), str(dst), "--threads", "2"]) == 0
    return dst


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine streams experts on CUDA only")
@pytest.mark.parametrize("model", ["int8", "int4", "int4 passthrough", "fp8", "mxfp4", "nvfp4"])
def test_prefill_through_streamed_experts_matches_gpu_resident_experts(model, source, tmp_path, request):
    if model == "int4 passthrough":
        path = request.getfixturevalue("kimi_int4")
    else:
        group = ["--group-size", "32"] if model in ("int4", "fp8") else []
        path = converted(source, tmp_path, "--expert-dtype", model, *group)
    args = dict(device="cuda", dtype="bfloat16", expert_activations="float")
    streamed = LLM(path, gpu_prefill_tokens=33, prefill_cpu_share=0, **args)  # every expert streamed
    assert streamed.num_pinned_bytes > 0
    # The same experts resident on the GPU (gpu_experts: dequantized at load by the formats' reference) run the same
    # fused kernel on the same bf16 weights (w * scale rounded once): the streamed step must match it to rounding.
    # Not the CPU operator: every bf16 path of these tiny random models is 4% (qwen3) to 25% (Kimi) from the float32
    # model, each in its own direction (measured on the device), which would hide a wrong dequantization.
    resident = LLM(path, gpu_prefill_tokens=0, gpu_experts=streamed.config.moe.num_experts, **args)
    ids = prompt(40, seed=2)
    got, want = streamed.prefill_logits(ids), resident.prefill_logits(ids)
    assert float((got - want).norm() / want.norm()) < 1e-3
    for llm in (streamed, resident):
        llm.close()  # stops its executor and unpins the weights


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine streams experts on CUDA only")
@pytest.mark.parametrize("model", ["int8", "int4"])
def test_w8a8_prefill_does_not_depend_on_streaming(model, source, tmp_path):
    """The numerics contract end to end: W8A8 experts (the default) give the same prefill logits whether the step's
    experts are streamed to the GPU or computed by the CPU operator, up to float32 summation order inside the
    experts (then the bf16 model's own rounding)."""
    group = ["--group-size", "32"] if model == "int4" else []
    path = converted(source, tmp_path, "--expert-dtype", model, *group)
    args = dict(device="cuda", dtype="bfloat16")
    streamed = LLM(path, gpu_prefill_tokens=33, **args)
    assert streamed.num_pinned_bytes > 0
    cpu = LLM(path, gpu_prefill_tokens=0, **args)
    ids = prompt(40, seed=2)
    got, want = streamed.prefill_logits(ids), cpu.prefill_logits(ids)
    assert float((got - want).norm() / want.norm()) < 5e-3
    for llm in (streamed, cpu):
        llm.close()
