"""Qwen3-Next (`Qwen3NextForCausalLM`), Qwen3.5/3.6-MoE (`Qwen3_5MoeForConditionalGeneration`, the released
checkpoints, and the text-only `Qwen3_5MoeForCausalLM`) and the dense Qwen3.5 (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5ForCausalLM`: the same layers with one gated MLP each, no routed experts), as transformers'
`modeling_qwen3_next`, `modeling_qwen3_5_moe` and `modeling_qwen3_5` compute them.

- Layers are `linear_attention` (a Gated DeltaNet, `hybrid.layers.delta_net`, with a per-sequence state slot)
  except every `full_attention_interval`-th (4), or as `layer_types` lists them. Qwen3-Next projects the GDN input
  with `in_proj_qkvz` / `in_proj_ba` (grouped per k-head), Qwen3.5 with `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
  `in_proj_a`.
- Full attention is gated: q_proj emits each head's query and a gate, and the output is multiplied by
  sigmoid(gate) before o_proj; per-head q/k norms; NeoX RoPE on the first `partial_rotary_factor` (0.25) of the
  head. Qwen3.5's interleaved MRoPE has equal position ids for text, which is this 1-D RoPE.
- Every RMSNorm scales by (1 + w) in float32 (`OffsetRMSNorm`), except the GDN output norm (`GatedRMSNorm`, w).
- MoE: Qwen2-MoE routing (softmax, top-k; Qwen3.5 always renormalises) plus a shared expert scaled by
  sigmoid(`shared_expert_gate`). Experts are stored per expert (what transformers writes) or fused as 3-D tensors
  (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]: the released Qwen3.5), found in the checkpoint's
  names; on the engine's device the fused ones load into the per-expert parameters
  (`hybrid.layers.moe.FusedExpertsTarget`), on the CPU operator they are read expert by expert and quantized at load
  (`hybrid.direct_experts`). Block-FP8 releases store the experts per expert with `weight_scale_inv` (Qwen's FP8
  checkpoints) or fused with `*_scale_inv` blocks per expert (transformers' FP8 experts): kept as stored on the CPU
  operator, dequantized at load on the device.
- Multi-token-prediction weights (`mtp.*`) and Qwen3.5's vision tower (`model.visual.*`) are not loaded.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from hybrid.config import (
    LayerSpec,
    LinearAttentionConfig,
    ModelConfig,
    MoEConfig,
    RawConfig,
    common_fields,
    gqa_attention,
    parse_rope,
    wrapped_text_config,
)
from hybrid.errors import HybridError
from hybrid.layers.backends import Backends
from hybrid.models.base import MoECausalLM
from hybrid.models.qwen_moe import _qwen_moe, _qwen_moe_layers
from hybrid.safetensors_io import read_header

log = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"
DEFAULT_FULL_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY = 0.25
FUSED_EXPERT_SUFFIX = ".mlp.experts.gate_up_proj"
RELEASED_PREFIXES = (("model.language_model.", "model."),)  # the released Qwen3.5's text weights


def parse_layer_types(raw: RawConfig, num_layers: int) -> tuple[str, ...]:
    """`layer_types` as written, else full attention every `full_attention_interval`-th layer."""
    if not raw.has("layer_types"):
        interval = raw.int("full_attention_interval", DEFAULT_FULL_INTERVAL)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    types = raw.get("layer_types")
    if not isinstance(types, list) or len(types) != num_layers:
        raise raw.error(f"'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({repr(t) for t in types if t not in (LINEAR, FULL)})
    if unknown:
        raise raw.error(f"layer_types {', '.join(unknown)} are not supported; supported: {LINEAR}, {FULL}")
    return tuple(types)


def parse_linear(raw: RawConfig, projection: str) -> LinearAttentionConfig:
    cfg = LinearAttentionConfig(
        num_k_heads=raw.int("linear_num_key_heads", 16),
        num_v_heads=raw.int("linear_num_value_heads", 32),
        head_k_dim=raw.int("linear_key_head_dim", 128),
        head_v_dim=raw.int("linear_value_head_dim", 128),
        conv_kernel=raw.int("linear_conv_kernel_dim", 4, minimum=2),
        projection=projection,
        eps=raw.float("rms_norm_eps", 1e-6),
    )
    if cfg.num_v_heads % cfg.num_k_heads:
        raise raw.error(f"linear_num_value_heads {cfg.num_v_heads} is not a multiple of linear_num_key_heads "
                        f"{cfg.num_k_heads}")
    return cfg


def has_fused_experts(checkpoint_dir: Path | None) -> bool:
    """Whether the checkpoint stores its main layers' experts fused (`model.[language_model.]layers.N.mlp.experts.
    gate_up_proj`): read from the shard index, else the single file's header. The MTP layer's (`mtp.*`, fused in
    Qwen3.6) do not count: they say nothing about the main layers' storage."""
    if checkpoint_dir is None:
        return False
    index = checkpoint_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = json.loads(index.read_text()).get("weight_map", {})
        else:
            names = {}
            for file in sorted(checkpoint_dir.glob("*.safetensors")):
                names.update(dict.fromkeys(read_header(file)[0]))
    except (OSError, ValueError, HybridError):
        return False  # the loader reports an unreadable checkpoint with its file name
    return any(name.startswith("model.") and name.endswith(FUSED_EXPERT_SUFFIX) for name in names)


class Qwen3NextForCausalLM(MoECausalLM):
    shared_expert_name = "shared_expert"
    ignored_tensor_patterns = (*MoECausalLM.ignored_tensor_patterns, r"mtp\.")
    gdn_projection = "qkvz_ba"

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        num_layers = raw.int("num_hidden_layers")
        layer_types = parse_layer_types(raw, num_layers)
        has_bias = raw.bool("attention_bias", False)
        attention = replace(gqa_attention(raw, has_qkv_bias=has_bias, qk_norm="per_head", sliding_window=None),
                            has_o_bias=has_bias, has_output_gate=True)
        rope = parse_rope(raw, attention.head_dim, is_interleaved=False, default_partial=DEFAULT_PARTIAL_ROTARY)
        linear = parse_linear(raw, cls.gdn_projection)
        moe_layers = cls._moe_layers(raw)
        return ModelConfig(
            **common_fields(raw, checkpoint_dir),
            attention=attention,
            rope=rope,
            moe=cls._moe(raw, checkpoint_dir) if any(moe_layers) else None,
            moe_layers=moe_layers,
            layer_specs=tuple(LayerSpec(attention, rope, "moe" if is_moe else "dense",
                                        linear if kind == LINEAR else None)
                              for kind, is_moe in zip(layer_types, moe_layers, strict=True)),
            has_offset_norms=True,
        )

    @classmethod
    def _moe_layers(cls, raw: RawConfig) -> tuple[bool, ...]:
        return _qwen_moe_layers(raw)

    @classmethod
    def _moe(cls, raw: RawConfig, checkpoint_dir: Path | None) -> MoEConfig:
        shared = raw.int("shared_expert_intermediate_size", 0, minimum=0)
        return replace(_qwen_moe(raw), norm_topk_prob=cls._norm_topk_prob(raw), shared_intermediate_size=shared,
                       has_shared_gate=shared > 0, has_fused_storage=has_fused_experts(checkpoint_dir))

    @classmethod
    def _norm_topk_prob(cls, raw: RawConfig) -> bool:
        return raw.bool("norm_topk_prob", True)

    def _make_ff(self, layer_idx: int, backends: Backends):
        ff = super()._make_ff(layer_idx, backends)
        experts = getattr(ff, "experts", None)
        # the fused tensors fill the GPU-resident experts' slots; the CPU operator reads them itself
        # (`hybrid.direct_experts`), so a layer without GPU slots names no target for them
        if experts is not None and self.config.moe.has_fused_storage and experts.gpu_expert_ids:
            experts.has_fused_storage = True
        return ff


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """The text-only Qwen3.5-MoE (`model.*`, `lm_head.*`): every layer MoE, the router always renormalises."""

    ignored_tensor_patterns = (*MoECausalLM.ignored_tensor_patterns, r"mtp\.", r"model\.visual\.")
    gdn_projection = "qkv_z_b_a"

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        # no dense layers, so no intermediate_size of their own: the experts' stands in
        if not raw.has("intermediate_size"):
            raw = RawConfig(dict(raw.data, intermediate_size=raw.int("moe_intermediate_size")), raw.source)
        return super().parse_config(raw, checkpoint_dir)

    @classmethod
    def _moe_layers(cls, raw: RawConfig) -> tuple[bool, ...]:
        return (True,) * raw.int("num_hidden_layers")

    @classmethod
    def _norm_topk_prob(cls, raw: RawConfig) -> bool:
        return True


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The released Qwen3.5/3.6-MoE: text weights under `model.language_model.*`, served as text only."""

    checkpoint_prefixes = RELEASED_PREFIXES

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        return parse_released(super().parse_config, raw, checkpoint_dir)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """The dense Qwen3.5, text only (`model.*`, `lm_head.*`): Qwen3.5-MoE's Gated DeltaNet and gated attention
    layers with one gated MLP (`mlp.gate_proj` / `up_proj` / `down_proj`, `intermediate_size`) on every layer and no
    routed experts, so nothing is placed on the CPU operator."""

    ignored_tensor_patterns = Qwen3_5MoeForCausalLM.ignored_tensor_patterns
    gdn_projection = "qkv_z_b_a"

    @classmethod
    def _moe_layers(cls, raw: RawConfig) -> tuple[bool, ...]:
        return (False,) * raw.int("num_hidden_layers")


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The released dense Qwen3.5 (Qwen3.5-27B and the smaller ones): text weights under `model.language_model.*`,
    served as text only."""

    checkpoint_prefixes = RELEASED_PREFIXES

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        return parse_released(super().parse_config, raw, checkpoint_dir)


def parse_released(parse_text, raw: RawConfig, checkpoint_dir: Path | None) -> ModelConfig:
    """A released Qwen3.5 config.json: its `text_config` parsed by `parse_text` (the text-only class's parser); the
    vision tower it describes is not loaded, which a log line says."""
    text = wrapped_text_config(raw, "the text model's settings, as Qwen3.5 publishes them")
    config = parse_text(text, checkpoint_dir)
    if raw.has("vision_config"):
        log.warning("%s: the Qwen3.5 vision tower (model.visual.*) is not loaded: image and video inputs are not "
                    "supported, text only", raw.source)
    return config
