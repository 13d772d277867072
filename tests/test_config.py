"""Config parsing of released models' config.json files (as published), checked by building each model on the
meta device and counting parameters against the published totals; and the errors for unusable configs."""

import json

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.models import load_model_config

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "vocab_size": 129280, "num_nextn_predict_layers": 1, "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
KIMI_K2 = DEEPSEEK_V3 | {
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.827, "vocab_size": 163840,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 50000.0,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "norm_topk_prob": False, "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "vocab_size": 102400,
}
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "vocab_size": 151936, "attention_bias": False,
}
QWEN3_235B = QWEN3_30B | {"hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                          "num_hidden_layers": 94, "num_attention_heads": 64}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}
GLM_45 = {
    "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "partial_rotary_factor": 0.5, "use_qk_norm": True, "attention_bias": True, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "tie_word_embeddings": False,
    "vocab_size": 151552, "num_nextn_predict_layers": 1,
}
# As published (zai-org/GLM-4.7-Flash): MLA with nope 192 / v 256, dense layer 0 by first_k_dense_replace (no
# mlp_layer_types), an MTP layer.
GLM_47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "vocab_size": 154880,
    "hidden_size": 2048, "intermediate_size": 10240, "moe_intermediate_size": 1536, "num_hidden_layers": 47,
    "num_attention_heads": 20, "num_key_value_heads": 20, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0, "attention_bias": False, "max_position_embeddings": 202752, "rope_theta": 1000000.0,
    "rope_scaling": None, "partial_rotary_factor": 1.0, "q_lora_rank": 768, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64,
    "n_shared_experts": 1, "num_experts_per_tok": 4, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
    "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "dtype": "bfloat16", "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
}

# Published totals (billions); MTP layers are not counted since inference does not build them.
PUBLISHED = [
    ("deepseek-v3", DEEPSEEK_V3, 671.0),
    ("kimi-k2", KIMI_K2, 1026.0),
    ("deepseek-v2-lite", DEEPSEEK_V2_LITE, 15.7),
    ("qwen3-30b-a3b", QWEN3_30B, 30.5),
    ("qwen3-235b-a22b", QWEN3_235B, 235.1),
    ("mixtral-8x7b", MIXTRAL_8X7B, 46.7),
    ("glm-4.5", GLM_45, 352.8),
]


def write_config(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("name,data,billions", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_released_configs_build_with_published_size(tmp_path, name, data, billions):
    cls, config = load_model_config(write_config(tmp_path, data))
    with torch.device("meta"):
        model = cls(config)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(total - billions) / billions < 0.015, f"{name}: {total:.2f}B parameters, published {billions}B"


def test_deepseek_v3_details(tmp_path):
    _, config = load_model_config(write_config(tmp_path, DEEPSEEK_V3))
    assert config.fp8_block_size == (128, 128)
    assert config.moe_layers == (False,) * 3 + (True,) * 58
    assert config.rope.scaling_type == "yarn" and config.rope.rotary_dim == 64 and config.rope.is_interleaved
    # YaRN mscale folded into the softmax scale: (0.1 * ln 40 + 1)^2 / sqrt(192)
    assert config.attention.scale == pytest.approx((0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2 / 192**0.5)
    assert config.moe.shared_intermediate_size == 2048 and config.moe.routed_scaling_factor == 2.5
    assert config.eos_token_ids == (1,)


def test_glm_partial_rotary_and_qwen_dense_layers(tmp_path):
    _, glm = load_model_config(write_config(tmp_path, GLM_45))
    assert glm.rope.rotary_dim == 64 and not glm.rope.is_interleaved
    assert glm.attention.has_qkv_bias and glm.attention.qk_norm == "per_head" and not glm.attention.has_o_bias
    _, qwen = load_model_config(write_config(tmp_path, QWEN3_30B | {"mlp_only_layers": [0, 5]}))
    assert [i for i, is_moe in enumerate(qwen.moe_layers) if not is_moe] == [0, 5]


def test_glm_4_7_flash_details(tmp_path):
    from hybrid.layers.backends import TritonAttentionBackend
    from hybrid.models.glm4_moe_lite import Glm4MoeLiteForCausalLM

    cls, config = load_model_config(write_config(tmp_path, GLM_47_FLASH))
    assert cls is Glm4MoeLiteForCausalLM and config.moe_layers == (False,) + (True,) * 46
    attn, moe = config.attention, config.moe
    assert (attn.kind, attn.num_heads, attn.q_lora_rank, attn.kv_lora_rank) == ("mla", 20, 768, 512)
    assert (attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim) == (192, 64, 256)
    assert attn.scale == 256**-0.5 and not attn.has_qkv_bias
    assert config.rope.rotary_dim == 64 and config.rope.is_interleaved and config.rope.theta == 1e6
    assert (moe.num_experts, moe.top_k, moe.scoring, moe.num_groups, moe.group_score) == (64, 4, "sigmoid", 1,
                                                                                          "top2_sum")
    assert moe.has_correction_bias and moe.norm_topk_prob and moe.routed_scaling_factor == 1.8
    assert moe.shared_intermediate_size == 1536 and moe.router_in_fp32
    assert config.eos_token_ids == (154820, 154827, 154829)
    assert TritonAttentionBackend.supports(attn, 16)  # nope 192 is padded inside the MLA kernels
    with torch.device("meta"):
        model = cls(config)
    assert model.is_ignored_tensor("model.layers.47.mlp.experts.0.gate_proj.weight")  # the MTP layer
    assert not model.is_ignored_tensor("model.layers.46.mlp.experts.0.gate_proj.weight")


def test_mlp_layer_types_decide_dense_layers(tmp_path):
    """A transformers-5 config lists each layer's MLP; the list wins over first_k_dense_replace, and a config with
    only the list (no first_k_dense_replace) still gets its dense layers."""
    types = ["dense"] * 3 + ["sparse"] * 58
    only_list = {k: v for k, v in DEEPSEEK_V3.items() if k != "first_k_dense_replace"} | {"mlp_layer_types": types}
    _, config = load_model_config(write_config(tmp_path, only_list))
    assert config.moe_layers == (False,) * 3 + (True,) * 58
    glm_types = ["dense", "sparse", "sparse", "dense"] + ["sparse"] * 43
    _, glm = load_model_config(write_config(tmp_path, GLM_47_FLASH | {"mlp_layer_types": glm_types}))
    assert [i for i, is_moe in enumerate(glm.moe_layers) if not is_moe] == [0, 3]
    no_key = {k: v for k, v in GLM_47_FLASH.items() if k != "first_k_dense_replace"}
    _, glm = load_model_config(write_config(tmp_path, no_key))  # transformers' default: layer 0 dense
    assert glm.moe_layers == (False,) + (True,) * 46


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "'LlamaForCausalLM' is not supported; supported: Deepseek"),
        ({"architectures": None}, "missing 'architectures'"),
        ({"hidden_size": None}, "missing required key 'hidden_size'"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok 300 exceeds the 256 experts"),
        ({"n_group": 7}, "n_group 7 does not divide 256 experts"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope type 'llama3' is not supported"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not supported"),
        ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "group_0": {"weights": {"num_bits": 8, "symmetric": True, "group_size": 32}}}}},
         "pack-quantized weights of 8 bits are not supported"),
        ({"num_hidden_layers": "61"}, "'num_hidden_layers' must be an integer"),
        ({"mlp_layer_types": ["dense"] * 3}, "'mlp_layer_types' must be a list of 61 entries (one per layer), got 3"),
        ({"mlp_layer_types": "dense"}, "'mlp_layer_types' must be a list of 61 entries (one per layer), got str"),
        ({"mlp_layer_types": ["dense"] * 60 + ["moe"]}, "'mlp_layer_types' entry 60 is 'moe'; supported: 'dense'"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, change, fragment):
    data = DEEPSEEK_V3 | change
    with pytest.raises(ConfigError) as info:
        load_model_config(write_config(tmp_path, data))
    message = str(info.value)
    assert fragment in message and "config.json" in message and "\n" not in message


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(tmp_path / "missing")


def test_engine_flags_generated_from_engine_config():
    """The engine's CLI comes from EngineConfig: `--gpu-experts` takes a count or 'auto', booleans get --no-,
    and validation names the field to change."""
    import argparse

    from hybrid.cli_args import add_arguments, from_namespace
    from hybrid.engine_config import EngineConfig
    from hybrid.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    parse = lambda *argv: from_namespace(EngineConfig, parser.parse_args(list(argv)))  # noqa: E731
    assert parse().gpu_experts == 0 and parse().cuda_graph
    assert parse("--gpu-experts", "auto").gpu_experts == "auto"
    assert parse("--gpu-experts", "16", "--no-cuda-graph", "--defer-experts", "2").gpu_experts == 16
    assert not parse("--no-cuda-graph").cuda_graph
    with pytest.raises(ConfigError, match="gpu_experts must be a count >= 0 or 'auto', got 'most'"):
        parse("--gpu-experts", "most")
    with pytest.raises(ConfigError, match="defer_experts must be >= 0"):
        parse("--defer-experts", "-1")
    with pytest.raises(ConfigError, match="kv_cache_tokens must be >= 1"):
        parse("--kv-cache-tokens", "0")
    with pytest.raises(ConfigError, match="state_snapshots must be >= 0"):
        parse("--state-snapshots", "-1")
    assert parse().state_snapshots is None and parse("--state-snapshots", "0").state_snapshots == 0
    assert parse().gpu_prefill_tokens == "auto" and parse("--gpu-prefill-tokens", "0").gpu_prefill_tokens == 0
    assert parse("--gpu-prefill-tokens", "16", "--no-cuda-graph").gpu_prefill_tokens == 16
    with pytest.raises(ConfigError, match="gpu_prefill_tokens 16 must be above max_graph_batch 32"):
        parse("--gpu-prefill-tokens", "16")  # graph steps must hand their experts to the CPU
    with pytest.raises(ConfigError, match="gpu_prefill_tokens must be a count >= 0 or 'auto', got 'some'"):
        parse("--gpu-prefill-tokens", "some")
