"""Synthetic checkpoints of released models' shapes, for benchmarks: a real config.json (the released model's keys,
in a wrapper's `text_config` where it has one) with fewer layers, and random bf16 weights under the published
names, written tensor by tensor, one shard per layer, so a checkpoint larger than memory can be made. The values
are Gaussian (std 0.02), tiled from one random pool: benchmarks of bandwidth and arithmetic do not depend on them,
and generating fresh values would dominate.

With `fp8=True` the checkpoint is in DeepSeek-V3's published FP8 layout: every Linear weight of attention, dense MLPs,
shared and routed experts as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (embeddings,
lm_head, norms and routers stay bf16), and the released `quantization_config`. The codes are tiled random bytes
(no NaN codes) and the scales one constant giving weights of std ~0.02: quantizing gigabytes would dominate.

`write_synthetic_converted` skips the source: it writes a `hybrid-convert` output directory directly, for shapes
whose bf16 source and converted copy would not fit the disk (or a RAM disk) side by side.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from cpu_experts.expert_file import ALLOWED_SCALES, FIXED_GROUP, ROLES, ExpertLayerSpec
from hybrid.checkpoint import published_name
from hybrid.converted import MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION
from hybrid.models import load_model_config
from hybrid.safetensors_io import SafetensorsWriter, TensorSpec
from hybrid.synthetic_routing import SkewedRouting

_QWEN3_5_TEXT = dict(  # Qwen3.6-35B-A3B's text model; Qwen3.5-397B-A17B changes the sizes
    model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts=256, num_experts_per_tok=8, linear_num_value_heads=32, linear_num_key_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                         mrope_interleaved=True))

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
    # DeepSeek-V3.2: DeepSeek-V3 with the DSA indexer (64 heads x 128, top 2048) and YaRN to 160K (the release)
    "deepseek-v3.2": dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        index_topk=2048, index_head_dim=128, index_n_heads=64, tie_word_embeddings=False, hidden_act="silu",
        scoring_func="sigmoid", topk_method="noaux_tc"),
    # GLM-5 (744B-A40B): DSA with a 32-head indexer, qk_nope 192 / v 256, one expert group, 3 dense layers
    "glm-5": dict(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
        intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=3, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, rms_norm_eps=1e-5,
        max_position_embeddings=202752, rope_theta=1e6, index_topk=2048, index_head_dim=128, index_n_heads=32,
        tie_word_embeddings=False, hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc"),
    # Kimi-K2.5 / K2.6: the Kimi-K2 text model (DeepSeek-V3 with 384 experts, 64 heads, one expert group, one dense
    # layer) under the vision-language wrapper; the vision tower is not part of the synthetic checkpoint.
    "kimi-k2.5": dict(
        architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", tie_word_embeddings=False,
        text_config=dict(
            model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1,
            topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, first_k_dense_replace=1,
            num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=262144,
            rope_theta=50000.0, rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                                                  beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
            tie_word_embeddings=False, hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc",
            num_nextn_predict_layers=0),
        vision_config=dict(model_type="kimi_k25_vision", num_hidden_layers=27, hidden_size=1152,
                           intermediate_size=4304, num_attention_heads=16, patch_size=14)),
    "minimax-m2": dict(
        architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
        intermediate_size=1536, num_local_experts=256, num_experts_per_tok=8, num_attention_heads=48,
        num_key_value_heads=8, head_dim=128, rotary_dim=64, rope_theta=5e6, max_position_embeddings=196608,
        rms_norm_eps=1e-6, use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
        tie_word_embeddings=False, hidden_act="silu"),
    "glm-4.7-flash": dict(
        architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048,
        intermediate_size=10240, moe_intermediate_size=1536, n_routed_experts=64, n_shared_experts=1,
        num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        first_k_dense_replace=1, mlp_layer_types=["dense"] + ["sparse"] * 46, num_attention_heads=20,
        num_key_value_heads=20, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, rms_norm_eps=1e-5, max_position_embeddings=202752, rope_theta=1e6,
        tie_word_embeddings=False, hidden_act="silu", topk_method="noaux_tc"),
    # MiMo-V2-Flash's released config.json (the remote code's keys; transformers reads the same model from them)
    "mimo-v2-flash": dict(
        architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash", vocab_size=152576, hidden_size=4096,
        intermediate_size=16384, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=None,
        num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=None, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc", num_attention_heads=64, num_key_value_heads=4, head_dim=192,
        v_head_dim=128, swa_num_attention_heads=64, swa_num_key_value_heads=8, swa_head_dim=192, swa_v_head_dim=128,
        hybrid_layer_pattern=[0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
        moe_layer_freq=[0] + [1] * 47, sliding_window=128, sliding_window_size=128,
        add_full_attention_sink_bias=False, add_swa_attention_sink_bias=True, attention_value_scale=0.707,
        partial_rotary_factor=0.334, rope_theta=5e6, swa_rope_theta=1e4, layernorm_epsilon=1e-5,
        max_position_embeddings=262144, attention_bias=False, tie_word_embeddings=False, hidden_act="silu"),
    # Qwen3-Next / Qwen3.5 / 3.6: Gated DeltaNet on 3 of 4 layers, gated full attention, softmax top-k + gated shared
    # expert; Qwen3.5/3.6 under the multimodal wrapper (the vision tower is not part of the synthetic checkpoint)
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        decoder_sparse_step=1, norm_topk_prob=True, linear_num_value_heads=32, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        partial_rotary_factor=0.25, rope_theta=1e7, max_position_embeddings=262144, rms_norm_eps=1e-6,
        tie_word_embeddings=False, hidden_act="silu"),
    "qwen3.6-35b-a3b": dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", tie_word_embeddings=False,
        text_config=dict(_QWEN3_5_TEXT),
        vision_config=dict(model_type="qwen3_5_moe", depth=27, hidden_size=1152)),
    "qwen3.5-397b-a17b": dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", tie_word_embeddings=False,
        text_config=dict(_QWEN3_5_TEXT, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                         moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=512,
                         num_experts_per_tok=10, linear_num_value_heads=64),
        vision_config=dict(model_type="qwen3_5_moe", depth=27, hidden_size=1152)),
    # gpt-oss: MoE in every layer, sliding (128) and full attention alternating, sinks, q/k/v/o biases, YaRN
    "gpt-oss-120b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, sliding_window=128, attention_bias=True, rms_norm_eps=1e-5,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)],
        max_position_embeddings=131072, rope_theta=150000.0, tie_word_embeddings=False, hidden_act="silu",
        swiglu_limit=7.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                            truncate=False, original_max_position_embeddings=4096)),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, sliding_window=128, attention_bias=True, rms_norm_eps=1e-5,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        max_position_embeddings=131072, rope_theta=150000.0, tie_word_embeddings=False, hidden_act="silu",
        swiglu_limit=7.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                            truncate=False, original_max_position_embeddings=4096)),
}
# Per-layer lists of the released configs, cut to the layer count; the MLP ones with their (dense, MoE) entries
LAYER_LISTS = ("layer_types", "hybrid_layer_pattern")
MLP_LISTS = {"mlp_layer_types": ("dense", "sparse"), "moe_layer_freq": (0, 1)}
POOL_ELEMENTS = 1 << 24  # 32 MiB of bf16 random values, tiled
FP8_BLOCK = 128
# DeepSeek-V3's config.json (the released FP8 checkpoint's)
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
WEIGHT_STD = 0.02


def shape_config(shape: str, num_layers: int, num_dense_layers: int | None = None) -> dict:
    """The config.json of `shape` with `num_layers` decoder layers (in `text_config` for a wrapper), its per-layer
    lists and first dense layers cut to fit (at least one MoE layer), or with `num_dense_layers` dense layers first
    where the shape has dense layers (DeepSeek-V3's 3 of 4 would leave one MoE layer)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape '{shape}'; known: {', '.join(SHAPES)}")
    config = copy.deepcopy(SHAPES[shape])
    text = config.get("text_config", config)
    text["num_hidden_layers"] = num_layers
    for key in (*LAYER_LISTS, *MLP_LISTS):
        if key in text:
            text[key] = text[key][:num_layers]
    if num_dense_layers is None:
        if "first_k_dense_replace" in text:
            text["first_k_dense_replace"] = min(text["first_k_dense_replace"], num_layers - 1)
        return config
    if num_dense_layers and not has_dense_layers(shape):
        raise ValueError(f"shape '{shape}' has no dense layers: its dense layer count must be 0")
    if not 0 <= num_dense_layers <= num_layers:
        raise ValueError(f"dense layer count {num_dense_layers} must be in 0..{num_layers} (the layer count)")
    if "first_k_dense_replace" in text:
        text["first_k_dense_replace"] = num_dense_layers
    for key, (dense, moe) in MLP_LISTS.items():
        if key in text:
            text[key] = [dense] * num_dense_layers + [moe] * (num_layers - num_dense_layers)
    return config


def has_dense_layers(shape: str) -> bool:
    """Whether `shape`'s released model starts with dense (non-MoE) layers."""
    text = SHAPES[shape].get("text_config", SHAPES[shape])
    return bool(text.get("first_k_dense_replace")) or any(
        text.get(key, [moe])[0] == dense for key, (dense, moe) in MLP_LISTS.items())


def write_synthetic_checkpoint(path: str | Path, shape: str, num_layers: int, seed: int = 0, fp8: bool = False,
                               num_dense_layers: int | None = None, skew: SkewedRouting | None = None) -> int:
    """Writes config.json and the weights of `shape` with `num_layers` decoder layers (`num_dense_layers`: see
    `shape_config`), under the published names, bf16 or in the FP8 layout (module docstring); `skew`: skewed,
    drifting routing (`hybrid.synthetic_routing`); returns the bytes written."""
    path = Path(path)
    quantization = {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)} if fp8 else {}
    model = _write_config(path, shape, num_layers, num_dense_layers, quantization)
    rename = lambda name: published_name(name, type(model).checkpoint_prefixes)  # noqa: E731
    return _write_weights(path, model, _pool(seed), skip=set(), rename=rename,
                          codes=_fp8_codes(seed) if fp8 else None, values=_skewed(model, skew, rename))


def write_synthetic_converted(path: str | Path, shape: str, num_layers: int, expert_dtype: str = "int8",
                              group_size: int = 0, seed: int = 0, skew: SkewedRouting | None = None) -> int:
    """Writes a converted directory of `shape` (hybrid-convert's layout, docs/format.md, the model's own names)
    without a source: the GPU weights as `write_synthetic_checkpoint` makes them, the routed experts as random
    codes whose scales give weights of std ~0.02 (int4: bf16 scales, as the INT4 passthrough keeps them). Every MoE
    layer's manifest entry names one expert file: the runtime copies each layer's experts into memory of its own,
    so the loaded model has its full size while the directory holds one layer's experts. Returns the bytes
    written."""
    path = Path(path)
    model = _write_config(path, shape, num_layers)
    config = model.config
    moe_layers = config.moe_layer_indices
    if hasattr(model, "fused_experts_prefix"):  # gpt-oss: one fused tensor per projection and bias
        routed = {f"{model.fused_experts_prefix(layer)}.{name}" for layer in moe_layers
                  for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    else:
        routed = {model.routed_expert_name(layer, e, role) for layer in moe_layers
                  for e in range(config.moe.num_experts) for role in ROLES}
    pool = _pool(seed)
    total = _write_weights(path, model, pool, skip=routed, rename=lambda name: name,
                           values=_skewed(model, skew, lambda name: name))
    spec = _synthetic_spec(config, expert_dtype, group_size)
    if hasattr(model, "expert_activation"):  # the model's own expert epilogue (gpt-oss: clamped, biased)
        spec = replace(spec, activation=model.expert_activation, has_bias=model.has_expert_bias)
    group_size = spec.group_size
    rel = "experts/shared.safetensors"
    (path / "experts").mkdir(exist_ok=True)
    writer = SafetensorsWriter(path / rel, [TensorSpec(n, d, s) for n, (s, d) in spec.tensor_shapes().items()],
                               metadata=spec.metadata(moe_layers[0]))
    codes = _fp8_codes(seed) if expert_dtype == "fp8" else pool.view(torch.uint8)  # FP4: every nibble is a code
    scales = _synthetic_scales(expert_dtype, codes)
    for offset, (name, (shape_, dtype)) in enumerate(spec.tensor_shapes().items()):
        kind = name.split(".", 1)[1]
        if kind == "bias":
            writer.write(name, torch.zeros(shape_, dtype=dtype))
        elif kind in scales:
            writer.write(name, torch.full(shape_, scales[kind]).to(dtype) if dtype != torch.uint8
                         else torch.full(shape_, scales[kind], dtype=dtype))
        elif dtype == torch.bfloat16:
            writer.write(name, _tile(pool, shape_, offset))
        else:  # the pool's raw bytes: any codes will do for timing, and they are cheap for tens of GB
            writer.write(name, _tile((codes if dtype == torch.uint8 else pool).view(dtype), shape_, offset))
    writer.close()
    manifest = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "converter": "hybrid synthetic",
                "source": {"path": None, "architecture": config.architecture},
                "experts": {"dtype": expert_dtype, "group_size": group_size, "layout": "hybrid-experts v1",
                            "files": {str(layer): rel for layer in moe_layers}},
                "gpu": {"quantization": "none", "method": None, "index": INDEX_FILE}, "files": [],
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks the directory done
    return total + writer.size


INDEX_FILE = "model.safetensors.index.json"
E2M1_CODE_STD = 2.93  # uniform random e2m1 codes: sqrt of the mean of {0, .5, 1, 1.5, 2, 3, 4, 6} squared


def _synthetic_spec(config, expert_dtype: str, group_size: int) -> ExpertLayerSpec:
    """int4 scales as the published INT4 checkpoints store them and the converter passes them through (bf16); the
    float formats' own scale dtypes and groups (FP8: 128 unless asked)."""
    scale_dtype = "bfloat16" if expert_dtype == "int4" else ALLOWED_SCALES[expert_dtype][0]
    group_size = FIXED_GROUP.get(expert_dtype, group_size or (128 if expert_dtype == "fp8" else 0))
    return ExpertLayerSpec(config.moe.num_experts, config.hidden_size, config.moe.intermediate_size, expert_dtype,
                           group_size, scale_dtype)


def _synthetic_scales(expert_dtype: str, codes: torch.Tensor) -> dict[str, float | int]:
    """Scale values (or their stored bits) that give the random codes weights of std ~0.02, by tensor kind."""
    if expert_dtype == "fp8":
        std = float(codes.view(torch.float8_e4m3fn)[: 1 << 20].float().std())
        return {"scales": 0.02 / std}
    if expert_dtype == "mxfp4":
        return {"scales": 127 + round(math.log2(0.02 / E2M1_CODE_STD))}  # E8M0 bits
    if expert_dtype == "nvfp4":
        return {"scales": 0x38, "tensor_scale": 0.02 / E2M1_CODE_STD}  # e4m3 bits of 1.0
    # uniform codes in [-127, 127] have std 127 / sqrt(3); int4 nibbles (codes -8..7) about 4.6
    return {"scales": 0.02 / {"int8": 127 / math.sqrt(3), "int4": 4.61}.get(expert_dtype, 1.0)}


def _write_config(path: Path, shape: str, num_layers: int, num_dense_layers: int | None = None,
                  extra: dict | None = None):
    """config.json of `shape` at `num_layers`, `extra` keys added at its top level; returns the model built on the
    meta device."""
    config = shape_config(shape, num_layers, num_dense_layers) | (extra or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    cls, model_config = load_model_config(path)
    with torch.device("meta"):
        return cls(model_config)


def _pool(seed: int) -> torch.Tensor:
    return (torch.randn(POOL_ELEMENTS, generator=torch.Generator().manual_seed(seed)) * WEIGHT_STD).to(torch.bfloat16)


def _fp8_codes(seed: int) -> torch.Tensor:
    """Random float8_e4m3fn bits as uint8 (tiled like `_pool`): magnitudes 0x00..0x7E, so never the NaN codes 0x7F
    and 0xFF."""
    gen = torch.Generator().manual_seed(seed + 1)
    magnitudes = torch.randint(0, 0x7F, (POOL_ELEMENTS,), generator=gen, dtype=torch.uint8)
    return magnitudes | (torch.randint(0, 2, (POOL_ELEMENTS,), generator=gen, dtype=torch.uint8) << 7)


def is_fp8_stored(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3's FP8 checkpoint stores in FP8: the 2-D Linear weights of the decoder layers
    (attention, dense MLPs, shared and routed experts), not embeddings, lm_head, norms, the router (`*.gate`) or the
    DSA indexer's head weights (`indexer.weights_proj`, 16-bit in DeepSeek-V3.2's release)."""
    return (len(shape) == 2 and name.endswith(".weight") and ".layers." in name and "norm" not in name
            and not name.endswith(".gate.weight") and not name.endswith("indexer.weights_proj.weight"))


def _stored_tensors(name: str, shape: tuple[int, ...], is_fp8: bool) -> list[tuple[str, torch.dtype, tuple]]:
    if not is_fp8:
        return [(name, torch.bfloat16, shape)]
    blocks = tuple(-(-d // FP8_BLOCK) for d in shape)
    return [(name, torch.float8_e4m3fn, shape), (name + "_scale_inv", torch.float32, blocks)]


def _skewed(model, skew: SkewedRouting | None, rename) -> dict:
    return {rename(name): value for name, value in skew.tensors(model).items()} if skew is not None else {}


def _write_weights(path: Path, model, pool: torch.Tensor, skip: set[str], rename,
                   codes: torch.Tensor | None = None, values: dict | None = None) -> int:
    """The model's checkpoint tensors but `skip`, named by `rename`, one shard per layer, and their index: bf16
    tiles of `pool`, or with `codes` (`_fp8_codes`) the FP8 ones as tiles of those with constant block scales;
    `values`: published name -> a function of the bf16 tile giving the tensor written instead."""
    values = values or {}
    shards: dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]] = {}
    for name, target in model.checkpoint_targets().items():
        if name in skip:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        shard = f"model-layer-{int(layer):03d}.safetensors" if layer is not None else "model-other.safetensors"
        published, shape_ = rename(name), tuple(target.shape)
        is_fp8 = codes is not None and is_fp8_stored(published, shape_)
        shards.setdefault(shard, []).extend(_stored_tensors(published, shape_, is_fp8))
    scale_inv = WEIGHT_STD / float(codes.view(torch.float8_e4m3fn).float().std()) if codes is not None else None
    weight_map, total = {}, 0
    for shard, tensors in sorted(shards.items()):
        writer = SafetensorsWriter(path / shard, [TensorSpec(n, d, s) for n, d, s in tensors])
        for offset, (name, dtype, shape_) in enumerate(tensors):
            if dtype == torch.float8_e4m3fn:
                writer.write(name, _tile(codes, shape_, offset).view(dtype))
            elif dtype == torch.float32:
                writer.write(name, torch.full(shape_, scale_inv))
            else:
                tile = _tile(pool, shape_, offset)
                writer.write(name, values[name](tile) if name in values else tile)
            weight_map[name] = shard
        writer.close()
        total += writer.size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return total


def _tile(pool: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    numel = math.prod(shape)
    start = (offset * 7919) % pool.numel()  # a different phase per tensor, so tensors are not identical
    reps = -(-(start + numel) // pool.numel())
    source = pool.repeat(reps) if reps > 1 else pool
    return source[start:start + numel].reshape(shape)
