"""Large prefill steps of CPU-resident experts on the GPU (`hybrid.streaming`): the streamed weights, dequantized on
the device and run through gpu_layers.fused_moe, give the CPU operator's output (float activations, exact to the
stored weights) within bf16 rounding, for per-row and grouped int8 scales, bf16 experts, two partitions and
chunks of experts; int4 stays on the CPU. Runs under Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, make_checkpoint, prompt
from gpu_support import DEVICE

from cpu_experts.module import CpuExperts
from cpu_experts.packed import PackedLayer
from hybrid import LLM, streaming
from hybrid.streaming import StreamedExperts


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(VARIANTS["qwen3_moe"](), path, seed=SEEDS["qwen3_moe"])
    return path


def converted(source, tmp_path, *args):
    from convert.cli import main

    assert main([str(source), str(tmp_path / "dst"), *args]) == 0
    return tmp_path / "dst"


@pytest.mark.parametrize("dtype,group_size", [("int8", 0), ("int8", 32), ("bf16", 0)])
def test_streamed_layer_matches_the_cpu_operator(monkeypatch, dtype, group_size):
    num_experts, hidden_size, inter = 7, 64, 96
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(num_experts, inter, hidden_size, generator=g) / 8 for _ in range(2))
    down = torch.randn(num_experts, hidden_size, inter, generator=g) / 8
    module = CpuExperts(0, int8_activations=False)
    module.load(PackedLayer.from_float(gate, up, down, dtype, group_size, num_partitions=2))
    assert len(module.op.layer.partitions) == 2
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 4 * 3 * hidden_size * inter * 3)  # 3 experts per chunk
    num_tokens = 19
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(num_tokens)])
    ids[3, 1] = -1  # an expert computed elsewhere
    weights = torch.rand(num_tokens, 2, generator=g)
    want = module.op(hidden, ids, weights)
    streamed = StreamedExperts(module, min_tokens=1, device=DEVICE)
    got = streamed.compute_on_gpu(hidden.to(DEVICE, torch.bfloat16), ids.to(DEVICE), weights.to(DEVICE))
    assert got.dtype == torch.bfloat16
    assert float((got.float().cpu() - want).norm() / want.norm()) < 1e-2


def test_int4_experts_stay_on_the_cpu(source, tmp_path):
    llm = LLM(converted(source, tmp_path, "--expert-dtype", "int4", "--group-size", "32"), device="cpu",
              dtype="float32")
    module = next(m for m in llm.model.modules() if isinstance(m, CpuExperts))
    assert not StreamedExperts(module, min_tokens=1, device="cpu").is_streamable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine streams experts on CUDA only")
def test_prefill_through_streamed_experts_matches_cpu_experts(source, tmp_path):
    path = converted(source, tmp_path, "--expert-dtype", "int8")
    args = dict(device="cuda", dtype="bfloat16", expert_activations="float")
    streamed = LLM(path, gpu_prefill_tokens=16, **args)
    assert streamed.num_pinned_bytes > 0
    cpu = LLM(path, gpu_prefill_tokens=0, **args)
    ids = prompt(40, seed=2)
    got, want = streamed.prefill_logits(ids), cpu.prefill_logits(ids)
    assert float((got - want).norm() / want.norm()) < 2e-2
    streamed.close()  # stops its executor and unpins the weights
    cpu.close()
