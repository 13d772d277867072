"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`), as transformers' `modeling_mimo_v2_flash` computes it.

- Two kinds of layer (`layer_types`, or the released config's `hybrid_layer_pattern`, 1 = sliding; default: full
  attention on layer 0 and every sixth layer, sliding elsewhere). A `sliding_attention` layer sees its last
  `sliding_window` positions (itself included), has twice the KV heads of a full one (`swa_num_key_value_heads` where
  the config says) and a learned per-head sink logit (`self_attn.attention_sink_bias`, transformers' `sinks`); a
  full layer has neither window nor sinks (the released `add_*_attention_sink_bias` keys say which kinds have them).
- Q/K heads of `head_dim` (192), V heads of `v_head_dim` (128); V is multiplied by `attention_value_scale` (0.707;
  null: 1) as it is projected, before the cache. The softmax scale is head_dim^-0.5.
- RoPE per kind: NeoX halves over the first int(head_dim x partial_rotary_factor) dims (0.334: 64 of 192), theta
  5e6 for full and 1e4 for sliding layers (`rope_parameters` keyed by layer type, or the released `rope_theta` and
  `swa_rope_theta`).
- Dense MLP on layer 0 (`mlp_layer_types`, or the released `moe_layer_freq` list, 1 = MoE), DeepSeek-V3's router
  elsewhere (sigmoid, groups by their two best biased scores, `e_score_correction_bias`, float32) over routed experts
  only: no shared expert, whatever `n_shared_experts` says.
- The released checkpoint is DeepSeek-style block FP8 (`quantization_config` `fp8`, 128 x 128 `weight_scale_inv`);
  its multi-token-prediction layers (`model.mtp.*`) are not used by inference.
"""

from __future__ import annotations

import re
from dataclasses import replace

from hybrid.config import AttentionConfig, LayerSpec, ModelConfig, RawConfig, RopeConfig, common_fields, parse_rope
from hybrid.models.base import MoECausalLM
from hybrid.models.deepseek import v3_moe_config

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# MiMoV2FlashConfig's defaults
DEFAULT_THETAS = {FULL: 5_000_000.0, SLIDING: 10_000.0}
DEFAULT_PARTIAL_ROTARY = 0.334
DEFAULT_HEAD_DIM, DEFAULT_V_HEAD_DIM = 192, 128
DEFAULT_VALUE_SCALE = 0.707
DEFAULT_WINDOW = 128
DEFAULT_RMS_EPS = 1e-5
FULL_LAYER_PERIOD = 6
# The released config's names for what transformers' config spells per layer kind
RELEASED_PATTERN = {0: FULL, 1: SLIDING}
SINK_KEYS = {FULL: ("add_full_attention_sink_bias", False), SLIDING: ("add_swa_attention_sink_bias", True)}
ROUTER_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _per_layer_list(raw: RawConfig, key: str, num_layers: int, allowed: dict) -> tuple:
    values = raw.get(key)
    if not isinstance(values, list) or len(values) != num_layers:
        raise raw.error(f"'{key}' must list one entry per layer ({num_layers}), got {values!r}")
    unknown = sorted({repr(v) for v in values if isinstance(v, bool) or v not in allowed})
    if unknown:
        raise raw.error(f"'{key}' entries {', '.join(unknown)} are not supported; supported: "
                        f"{', '.join(repr(a) for a in allowed)}")
    return tuple(allowed[v] for v in values)


def parse_layer_types(raw: RawConfig, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind: `layer_types`, else `hybrid_layer_pattern`, else transformers' default."""
    if raw.has("layer_types"):
        return _per_layer_list(raw, "layer_types", num_layers, {t: t for t in LAYER_TYPES})
    if raw.has("hybrid_layer_pattern"):
        return _per_layer_list(raw, "hybrid_layer_pattern", num_layers, RELEASED_PATTERN)
    return tuple(FULL if i == 0 or (i + 1) % FULL_LAYER_PERIOD == 0 else SLIDING for i in range(num_layers))


def parse_moe_layers(raw: RawConfig, num_layers: int) -> tuple[bool, ...]:
    """Per layer, routed experts or a dense MLP: `mlp_layer_types`, else `moe_layer_freq` (0/1 per layer), else a
    dense first layer and MoE after it."""
    if raw.has("mlp_layer_types"):
        return _per_layer_list(raw, "mlp_layer_types", num_layers, {"dense": False, "sparse": True})
    if raw.has("moe_layer_freq"):
        return _per_layer_list(raw, "moe_layer_freq", num_layers, {0: False, 1: True})
    return (False,) + (True,) * (num_layers - 1)


def parse_value_scale(raw: RawConfig) -> float:
    if "attention_value_scale" not in raw.data:
        return DEFAULT_VALUE_SCALE
    if raw.data["attention_value_scale"] is None:  # transformers: no scale
        return 1.0
    return raw.float("attention_value_scale")


def _kind_value(raw: RawConfig, kind: str, key: str, default: int | None = None) -> int:
    """A sliding layer's `swa_<key>` where the released config has one, else the shared `key`."""
    if kind == SLIDING and raw.has(f"swa_{key}"):
        return raw.int(f"swa_{key}")
    return raw.int(key, default)


def parse_attention(raw: RawConfig, kind: str) -> AttentionConfig:
    head_dim = _kind_value(raw, kind, "head_dim", DEFAULT_HEAD_DIM)
    num_kv_heads = raw.int("num_key_value_heads")
    if kind == SLIDING:
        num_kv_heads = raw.int("swa_num_key_value_heads", 2 * num_kv_heads)
    sink_key, sink_default = SINK_KEYS[kind]
    return AttentionConfig(
        kind="gqa",
        num_heads=_kind_value(raw, kind, "num_attention_heads"),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=_kind_value(raw, kind, "v_head_dim", DEFAULT_V_HEAD_DIM),
        scale=head_dim**-0.5,
        has_qkv_bias=raw.bool("attention_bias", False),
        sliding_window=raw.int("sliding_window", raw.get("sliding_window_size", DEFAULT_WINDOW)) if kind == SLIDING
        else None,
        has_sinks=raw.bool(sink_key, sink_default),
        value_scale=parse_value_scale(raw),
    )


def parse_kind_rope(raw: RawConfig, kind: str, head_dim: int) -> RopeConfig:
    """`rope_parameters` keyed by layer type (transformers' config), else the released `rope_theta` /
    `swa_rope_theta` with `partial_rotary_factor` and `rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not isinstance(params.get(kind), dict):
            raise raw.error(f"'rope_parameters' must hold one entry per layer type; it has none for '{kind}'")
        kind_raw = RawConfig({"rope_parameters": params[kind],
                              "max_position_embeddings": raw.get("max_position_embeddings")}, raw.source)
    else:
        theta_key = "swa_rope_theta" if kind == SLIDING else "rope_theta"
        kind_raw = RawConfig({"rope_theta": raw.float(theta_key, DEFAULT_THETAS[kind]),
                              "partial_rotary_factor": raw.get("partial_rotary_factor"),
                              "rope_scaling": raw.get("rope_scaling"),
                              "max_position_embeddings": raw.get("max_position_embeddings")}, raw.source)
    return parse_rope(kind_raw, head_dim, is_interleaved=False, default_theta=DEFAULT_THETAS[kind],
                      default_partial=DEFAULT_PARTIAL_ROTARY)


def _check_router_keys(raw: RawConfig) -> None:
    for key, expected in ROUTER_KEYS.items():
        if raw.get(key, expected) != expected:
            raise raw.error(f"{key} '{raw.get(key)}' is not supported; MiMo-V2-Flash routes with {expected}")


class MiMoV2FlashForCausalLM(MoECausalLM):
    ignored_tensor_patterns = (*MoECausalLM.ignored_tensor_patterns, r"model\.mtp\.")

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        num_layers = raw.int("num_hidden_layers")
        layer_types = parse_layer_types(raw, num_layers)
        moe_layers = parse_moe_layers(raw, num_layers)
        _check_router_keys(raw)
        kinds = {}
        for kind in LAYER_TYPES:
            attention = parse_attention(raw, kind)
            kinds[kind] = (attention, parse_kind_rope(raw, kind, attention.head_dim))
        eps = raw.float("rms_norm_eps", raw.get("layernorm_epsilon", DEFAULT_RMS_EPS))
        return ModelConfig(
            **common_fields(raw, checkpoint_dir) | {"rms_norm_eps": eps},
            attention=kinds[layer_types[0]][0],
            rope=kinds[FULL][1],
            moe=replace(v3_moe_config(raw), shared_intermediate_size=0),
            moe_layers=moe_layers,
            layer_specs=tuple(LayerSpec(*kinds[kind], "moe" if is_moe else "dense")
                              for kind, is_moe in zip(layer_types, moe_layers, strict=True)),
        )

    def checkpoint_targets(self):
        # transformers' `sinks` are `attention_sink_bias` in the released checkpoint (and in what transformers saves)
        return {re.sub(r"\.self_attn\.sinks$", ".self_attn.attention_sink_bias", name): tensor
                for name, tensor in super().checkpoint_targets().items()}
