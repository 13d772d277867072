"""The runtime's kernel path (`kernels="triton"`: gpu_layers' norms, rotary, activation, routers, KV-cache write,
paged GQA and MLA attention) against transformers, on checkpoints whose head shapes the kernels take.

Without a GPU the kernels run under Triton's interpreter on the CPU (tests/conftest.py), on a GPU as compiled:
float32 prefill logits (a prompt crossing a KV page) and greedy generation (decode through the split-K kernels)
for every family against transformers, and bf16 (routed experts through the fused-MoE kernel) against the PyTorch
path's own bf16 error."""

from __future__ import annotations

import pytest
import torch
import transformers
from checkpoints import SEEDS, hf_generate, hf_logits, kernel_config, make_checkpoint, prompt
from gpu_support import DEVICE

from hybrid import LLM
from hybrid.layers.backends import TritonAttentionBackend
from hybrid.routed_experts import RoutedExperts

transformers.logging.set_verbosity_error()
REL_TOL = 1e-4  # float32 end to end (the attention kernels' float32 dots are exact, not tf32)


def _checkpoint(tmp_path, name):
    return make_checkpoint(kernel_config(name), tmp_path, seed=SEEDS[name])


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "glm4_moe_lite"])
def test_prefill_logits_match_transformers(tmp_path, name):
    model = _checkpoint(tmp_path, name).to(DEVICE)
    llm = LLM(tmp_path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    attention = llm.model.model.layers[0].self_attn
    assert isinstance(attention.backend, TritonAttentionBackend)
    if name == "qwen3_moe":  # q, k and v in one GEMV (`fuse_qkv`), QK-norm + rotary + KV write in one kernel
        assert attention.qkv_weight is not None and attention.prepares_in_one_kernel(torch.float32)
    ids = prompt(19, seed=4)  # crosses a KV page of 16
    ref, ours = hf_logits(model, ids), llm.prefill_logits(ids)
    assert (ours - ref.to(ours.device)).abs().max() <= REL_TOL * ref.abs().max()


def test_fused_qkv_projects_as_the_three_checkpoint_projections(tmp_path):
    """`fuse_qkv` concatenates q, k and v (and Qwen2's biases) into one weight: every layer's one product, split,
    equals the checkpoint's three projections (transformers' own modules) on the same rows."""
    model = _checkpoint(tmp_path, "qwen2_moe").to(DEVICE)
    llm = LLM(tmp_path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for ours, theirs in zip(llm.model.model.layers, model.model.layers, strict=True):
        attention, reference = ours.self_attn, theirs.self_attn
        assert attention.qkv_weight is not None and attention.qkv_bias is not None
        with torch.no_grad():
            projected = attention._project(x)
            expected = [proj(x) for proj in (reference.q_proj, reference.k_proj, reference.v_proj)]
        for got, want in zip(projected, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "new_tokens"), [
    ("qwen3_moe", 8), ("qwen2_moe", 8), ("mixtral", 8), ("deepseek_v3", 8), ("deepseek_v2_greedy", 8), ("glm4_moe", 8),
    ("kimi_k25", 24), ("minimax_m2", 24)])
def test_greedy_generation_matches_transformers(tmp_path, name, new_tokens):
    """Prefill then decode steps (the split-K decode kernels), the prompt's last page filled mid-generation (and
    a second page for the 24-token runs, whose last four steps write the third: positions 32-35; Kimi-K2.5 through
    its wrapper's layout, MiniMax-M2's whole-projection QK norm through the RMSNorm kernel on [T, heads * D])."""
    model = _checkpoint(tmp_path, name).to(DEVICE)
    ids = prompt(13, seed=5)
    llm = LLM(tmp_path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    ref, ours = hf_logits(model, ids), llm.prefill_logits(ids)
    assert (ours - ref.to(ours.device)).abs().max() <= REL_TOL * ref.abs().max()
    assert llm.generate(ids, new_tokens, ignore_eos=True) == hf_generate(model, ids, new_tokens)


def test_glm_4_7_flash_odd_mla_dims_generate_through_two_pages(tmp_path):
    """GLM-4.7-Flash's MLA with no power-of-two dim (nope 24, rope 8, v 40, latent 48: padded inside the kernels),
    dense layers from mlp_layer_types: 20 greedy tokens through prefill then the split-K decode kernels, the
    19-token prompt crossing a KV page and the context filling the next (the last steps write positions 32-37)."""
    name = "glm4_moe_lite"
    model = _checkpoint(tmp_path, name).to(DEVICE)
    llm = LLM(tmp_path, device=str(DEVICE), dtype="float32", kernels="triton", expert_placement="device")
    attention = llm.model.model.layers[0].self_attn
    assert isinstance(attention.backend, TritonAttentionBackend) and attention.cfg.qk_nope_head_dim == 24
    ids = prompt(19, seed=4)
    assert llm.generate(ids, 20, ignore_eos=True) == hf_generate(model, ids, 20)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_bf16_kernels_are_as_close_as_the_pytorch_path(tmp_path, name):
    """bf16, where the routed experts run through the fused-MoE kernel: neither path equals the float32 model, and
    the kernels must not be further from it than PyTorch's own bf16 computation is (within 1.5x of its error)."""
    model = _checkpoint(tmp_path, name).to(DEVICE)
    ids = prompt(40, seed=6)
    ref = hf_logits(model, ids).to(DEVICE)

    def error(kernels: str) -> float:
        llm = LLM(tmp_path, device=str(DEVICE), dtype="bfloat16", kernels=kernels, expert_placement="device")
        experts = llm.model.model.layers[1].mlp.experts
        assert isinstance(experts, RoutedExperts) and experts.is_fused == (kernels == "triton")
        logits = llm.prefill_logits(ids)
        return float((logits - ref).norm() / ref.norm())

    ours, plain = error("triton"), error("torch")
    assert ours <= 1.5 * plain + 1e-3, (ours, plain)
