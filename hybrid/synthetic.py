"""Synthetic checkpoints of released models' shapes, for benchmarks: a real config.json (from the model's own
transformers config class) with fewer layers, and random bf16 weights written tensor by tensor, one shard per
layer, so a checkpoint larger than memory can be made. The values are Gaussian (std 0.02), tiled from one random
pool: benchmarks of bandwidth and arithmetic do not depend on them, and generating fresh values would dominate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from hybrid.models import load_model_config
from hybrid.safetensors_io import SafetensorsWriter, TensorSpec

SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu"),
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu"),
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=163840, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
        scoring_func="sigmoid", topk_method="noaux_tc"),
}
POOL_ELEMENTS = 1 << 24  # 32 MiB of bf16 random values, tiled


def write_synthetic_checkpoint(path: str | Path, shape: str, num_layers: int, seed: int = 0) -> int:
    """Writes config.json and the weights of `shape` with `num_layers` decoder layers; returns the bytes written."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape '{shape}'; known: {', '.join(SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape], num_hidden_layers=num_layers)
    if "first_k_dense_replace" in config:
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"], num_layers - 1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    cls, model_config = load_model_config(path)
    with torch.device("meta"):
        model = cls(model_config)
    shards: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, target in model.checkpoint_targets().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        shard = f"model-layer-{int(layer):03d}.safetensors" if layer is not None else "model-other.safetensors"
        shards.setdefault(shard, []).append((name, tuple(target.shape)))
    pool = (torch.randn(POOL_ELEMENTS, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    weight_map, total = {}, 0
    for shard, tensors in sorted(shards.items()):
        writer = SafetensorsWriter(path / shard, [TensorSpec(n, torch.bfloat16, s) for n, s in tensors])
        for offset, (name, shape_) in enumerate(tensors):
            writer.write(name, _tile(pool, shape_, offset))
            weight_map[name] = shard
        writer.close()
        total += writer.size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _tile(pool: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    numel = math.prod(shape)
    start = (offset * 7919) % pool.numel()  # a different phase per tensor, so tensors are not identical
    reps = -(-(start + numel) // pool.numel())
    source = pool.repeat(reps) if reps > 1 else pool
    return source[start:start + numel].reshape(shape)
