"""Tiny random checkpoints of every registered architecture, written by transformers itself.

Weights are redrawn with a larger spread than the library's initialiser so that logits and router scores are well
separated: greedy tokens and expert choices then do not hinge on last-bit rounding, and a wrong layer shows.
"""

from __future__ import annotations

import torch
import transformers as T

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
DEEPSEEK = dict(COMMON, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                n_shared_experts=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

VARIANTS = {
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[0, 2], norm_topk_prob=True),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(
        **COMMON, num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=4, decoder_sparse_step=2),
    "mixtral": lambda: T.MixtralConfig(
        **(COMMON | {"intermediate_size": 48}), num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=2),
    "deepseek_v3_yarn": lambda: T.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN,
        max_position_embeddings=256),
    "kimi_k2": lambda: T.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=48, n_group=1, topk_group=1, routed_scaling_factor=2.827),
    "deepseek_v2_lite": lambda: T.DeepseekV2Config(
        **DEEPSEEK, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
    "deepseek_v2_grouped": lambda: T.DeepseekV2Config(
        **DEEPSEEK, q_lora_rank=32, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0),
    "glm4_moe": lambda: T.Glm4MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, use_qk_norm=True,
        attention_bias=True, routed_scaling_factor=1.5),
}


def build_reference(name: str, seed: int = 0) -> T.PreTrainedModel:
    """The transformers model with redrawn weights (float32, eager attention, eval mode)."""
    torch.manual_seed(seed)
    config = VARIANTS[name]()
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn_like(buf))
    return model
