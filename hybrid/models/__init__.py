"""Architecture registry: `config.json["architectures"][0]` -> model class (one file per family).

Each class parses its own config (`parse_config`) into a `ModelConfig` and builds itself from the shared layers.
"""

from __future__ import annotations

from pathlib import Path

from hybrid.config import ModelConfig, architecture_of, read_config_json
from hybrid.errors import ConfigError
from hybrid.models.base import MoECausalLM
from hybrid.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from hybrid.models.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from hybrid.models.glm4_moe import Glm4MoeForCausalLM
from hybrid.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from hybrid.models.gpt_oss import GptOssForCausalLM
from hybrid.models.kimi import KimiK25ForConditionalGeneration
from hybrid.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from hybrid.models.minimax import MiniMaxM2ForCausalLM
from hybrid.models.mixtral import MixtralForCausalLM
from hybrid.models.qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)
from hybrid.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[MoECausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # also Kimi-K2
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,  # DeepSeek-V3.2-Exp, V3.2, V3.2-Speciale
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,  # GLM-5, 5.1, 5.2
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,  # GLM-4.7-Flash
    "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,  # Kimi-K2.5 / K2.6 (the Hub's spelling)
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,  # MiniMax-M2, M2.1, M2.5, M2.7
    "GptOssForCausalLM": GptOssForCausalLM,  # gpt-oss-20b, gpt-oss-120b
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,  # MiMo-V2-Flash
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # Qwen3-Next-80B-A3B
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,  # Qwen3.5/3.6-MoE as released
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,  # Qwen3.5-MoE, text only
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,  # dense Qwen3.5 as released (no experts)
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,  # dense Qwen3.5, text only
}
SUPPORTED_ARCHITECTURES = tuple(sorted(MODEL_REGISTRY))


def model_class(architecture: str, source: str = "config.json") -> type[MoECausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"{source}: architecture '{architecture}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def load_model_config(checkpoint_dir: str | Path) -> tuple[type[MoECausalLM], ModelConfig]:
    """Reads config.json once and returns the model class and its parsed, validated config."""
    raw = read_config_json(checkpoint_dir)
    cls = model_class(architecture_of(raw), raw.source)
    config = cls.parse_config(raw, Path(checkpoint_dir) if Path(checkpoint_dir).is_dir() else None)
    validate(config, raw.source)
    return cls, config


def validate(config: ModelConfig, source: str) -> None:
    checks = [
        (config.moe is not None or not any(config.moe_layers), "routed-expert layers without a MoE config"),
        (len(config.layers) == config.num_layers,
         f"{len(config.layers)} layer specs for num_hidden_layers {config.num_layers}"),
        (all((spec.mlp == "moe") == is_moe for spec, is_moe in zip(config.layers, config.moe_layers, strict=False)),
         "the layers' MLP kinds disagree with their MoE layers"),
        (all(spec.attention.num_heads % spec.attention.num_kv_heads == 0 for spec in config.layers),
         "num_attention_heads must be a multiple of num_key_value_heads"),
    ]
    moe = config.moe
    if moe is not None:
        checks += [
            (moe.top_k <= moe.num_experts, f"num_experts_per_tok {moe.top_k} exceeds the {moe.num_experts} experts"),
            (moe.num_experts % moe.num_groups == 0,
             f"n_group {moe.num_groups} does not divide {moe.num_experts} experts"),
            (moe.topk_group <= moe.num_groups, f"topk_group {moe.topk_group} exceeds n_group {moe.num_groups}"),
            (moe.group_score != "top2_sum" or moe.num_experts // moe.num_groups >= 2,
             "grouped routing needs at least 2 experts per group"),
        ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"{source}: {message}")
