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
    llm = LLM(tmp_path, device="cuda", dtype="float32")
    ref, ours = hf_logits(model, ids), llm.prefill_logits(ids)
    assert ours.device.type == "cuda"
    assert (ours - ref.to(ours.device)).abs().max() <= 1e-4 * ref.abs().max()
    assert llm.generate(ids, 16, ignore_eos=True) == hf_generate(model, ids, 16)
    bf16 = LLM(tmp_path, device="cuda", dtype="bfloat16")
    assert len(bf16.generate(ids, 8, temperature=0.8, seed=1, ignore_eos=True)) == 8
