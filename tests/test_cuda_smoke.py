"""The plain-PyTorch path on CUDA: float32 against transformers on the same device, and a bf16 sampling run.
Skipped where no GPU is present (CI); run on the device machine."""

import pytest
import torch
from checkpoints import SEEDS, VARIANTS, hf_generate, hf_logits, make_checkpoint, prompt

from hybrid import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_cuda_float32_matches_transformers(tmp_path, name):
    model = make_checkpoint(VARIANTS[name](), tmp_path, seed=SEEDS[name]).cuda()
    ids = prompt(9, seed=5)
    llm = LLM(tmp_path, device="cuda", dtype="float32", expert_placement="device")
    ref, ours = hf_logits(model, ids), llm.prefill_logits(ids)
    assert ours.device.type == "cuda"
    assert (ours - ref.to(ours.device)).abs().max() <= 1e-4 * ref.abs().max()
    assert llm.generate(ids, 16, ignore_eos=True) == hf_generate(model, ids, 16)
    bf16 = LLM(tmp_path, device="cuda", dtype="bfloat16", expert_placement="device")
    assert len(bf16.generate(ids, 8, temperature=0.8, seed=1, ignore_eos=True)) == 8


@pytest.mark.parametrize("expert_dtype", ["int8", "int4", "bf16"])
def test_cuda_loads_a_converted_model(tmp_path, expert_dtype):
    """A hybrid-convert output loads on the GPU and computes what it computes on the CPU."""
    from convert.cli import main

    make_checkpoint(VARIANTS["deepseek_v3"](), tmp_path / "src", seed=SEEDS["deepseek_v3"], dtype=torch.bfloat16)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--expert-dtype", expert_dtype]) == 0
    ids = prompt(33, seed=6)
    cpu = LLM(tmp_path / "dst", device="cpu", dtype="float32").prefill_logits(ids)
    gpu = LLM(tmp_path / "dst", device="cuda", dtype="float32").prefill_logits(ids)
    assert gpu.device.type == "cuda"
    assert (gpu.cpu() - cpu).abs().max() <= 1e-4 * cpu.abs().max()
