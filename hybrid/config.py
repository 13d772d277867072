"""Model configuration: one frozen dataclass per concern, parsed once from a checkpoint's config.json.

Each architecture family parses the HF config into a `ModelConfig` (see `hybrid.models`); the helpers here
read the keys every family shares, accept both the transformers-4 (`rope_scaling`, `rope_theta`) and the
transformers-5 (`rope_parameters`) spellings, and turn every problem into a one-line `ConfigError` that names
the file and the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid import compressed_tensors
from hybrid.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # leading dims of each head that rotate (partial rotary rotates fewer than head_dim)
    is_interleaved: bool  # pairs (x0, x1), (x2, x3)... (DeepSeek) instead of halves (x_i, x_{i+d/2}) (NeoX)
    scaling_type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer in front of an MLA layer (DeepSeek-V3.2, GLM-5): it scores
    every visible cached token with a small multi-head ReLU attention and the layer attends only to the best
    `topk` (`gpu_layers.dsa_reference` has the math). Its key (head_dim) is cached per token beside the latent."""

    num_heads: int
    head_dim: int
    topk: int
    # RoPE on the first qk_rope_head_dim dims of q and k: pairs (GLM-5) or halves (DeepSeek-V3.2), each as its
    # reference does; the frequencies are the layer's
    is_rope_interleaved: bool
    # GLM-5.2's "shared" layers reuse the previous full indexer layer's selection: no weights, no key cache
    is_shared: bool = False


@dataclass(frozen=True)
class AttentionConfig:
    kind: str  # "gqa" or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim (MLA: nope + rope)
    v_head_dim: int
    scale: float  # softmax scale, YaRN's mscale already folded in
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    # RMSNorm of q and k before RoPE: "none"; "per_head" over each head's D values (Qwen3, GLM-4.5); "whole" over
    # the whole projection output, all heads' H*D values at once (MiniMax-M2: q_norm weight [H*D]).
    qk_norm: str = "none"
    sliding_window: int | None = None
    # A learned per-head logit in every softmax denominator (`self_attn.sinks` [Hq], gpt-oss), probability dropped
    has_sinks: bool = False
    # V is multiplied by this as it is projected, before it is cached (MiMo-V2-Flash's `attention_value_scale`)
    value_scale: float = 1.0
    # q_proj emits each head's query and an output gate ([q | gate] per head); the output is attn * sigmoid(gate)
    # before o_proj (Qwen3-Next, Qwen3.5)
    has_output_gate: bool = False
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    indexer: IndexerConfig | None = None  # DSA (MLA only): attend to the indexer's top-k tokens, not all of them


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str  # "softmax" or "sigmoid"
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # group-limited routing: pick `topk_group` of `num_groups` groups first
    topk_group: int = 1
    group_score: str = "none"  # "none", "max" (DeepSeek-V2), "top2_sum" (DeepSeek-V3, GLM-4.5)
    has_correction_bias: bool = False  # e_score_correction_bias added for selection only
    # Where the checkpoint keeps that bias: on the router ("gate": `mlp.gate.e_score_correction_bias`, DeepSeek/GLM)
    # or on the MoE block ("block": `block_sparse_moe.e_score_correction_bias`, MiniMax-M2).
    correction_bias_at: str = "gate"
    shared_intermediate_size: int = 0  # 0: no shared expert
    has_shared_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared expert
    router_in_fp32: bool = False  # DeepSeek/GLM compute router logits in float32
    # Checkpoint names of each expert's gate, up and down projections (Mixtral: w1, w3, w2).
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # The checkpoint stores a layer's experts fused as 3-D tensors (`experts.gate_up_proj` [E, 2I, H], gate rows
    # first, and `experts.down_proj` [E, H, I], no `.weight` suffix: the released Qwen3.5) instead of per expert
    has_fused_storage: bool = False


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5): q/k heads of `head_k_dim`, v heads of `head_v_dim` (q and k
    repeated to the v-head count), a causal depthwise conv of `conv_kernel` taps over the q/k/v channels, and a
    float32 recurrent state [num_v_heads, head_k_dim, head_v_dim] per sequence. `projection`: how the checkpoint
    projects the input: "qkvz_ba" (Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped per k-head) or
    "qkv_z_b_a" (Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    projection: str
    eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence shapes of the recurrent state (float32) and of the conv state (model dtype)."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim), (self.conv_dim, self.conv_kernel - 1)


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is, as data the runtime builds the layer and its cache from: its attention (kind,
    heads, KV heads, head dims, sliding window, sinks, biases), the RoPE it applies, and its feed-forward kind."""

    attention: AttentionConfig
    rope: RopeConfig
    mlp: str  # "moe" (routed experts) or "dense" (one gated MLP)
    # A Gated DeltaNet in place of attention (`linear_attn`, with a per-sequence state slot), or None: `attention`
    linear: LinearAttentionConfig | None = None

    @property
    def is_recurrent(self) -> bool:
        return self.linear is not None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention: AttentionConfig
    rope: RopeConfig
    moe: MoEConfig | None  # None: a dense model (no routed experts, every moe_layers entry False)
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or dense MLP (False)
    eos_token_ids: tuple[int, ...] = ()
    fp8_block_size: tuple[int, int] | None = None  # checkpoint stores DeepSeek-style FP8 block-scaled weights
    compressed_tensors: compressed_tensors.Scheme | None = None  # checkpoint stores compressed-tensors weights
    is_modelopt: bool = False  # checkpoint stores NVIDIA ModelOpt NVFP4 weights (`parse_modelopt`)
    # Per-layer specs where layers differ (window, KV heads, head dims, RoPE); empty: every layer has `attention`
    # and `rope`. Read them through `layers`.
    layer_specs: tuple[LayerSpec, ...] = ()
    # Every RMSNorm but the GDN output norm scales by (1 + w), in float32 (Gemma-style, Qwen3-Next, Qwen3.5)
    has_offset_norms: bool = False

    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        """Each decoder layer's spec, in order."""
        if self.layer_specs:
            return self.layer_specs
        return tuple(LayerSpec(self.attention, self.rope, "moe" if is_moe else "dense") for is_moe in self.moe_layers)

    @property
    def has_recurrent_layers(self) -> bool:
        return any(spec.is_recurrent for spec in self.layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]

    @property
    def max_context_length(self) -> int:
        """The longest sequence the model's positions cover, as vLLM derives it: max_position_embeddings; with
        YaRN, original_max_position_embeddings x factor (the config's max_position_embeddings may still name the
        pre-scaling length); with linear scaling, max_position_embeddings x factor."""
        rope = self.rope
        if rope.scaling_type == "yarn" and rope.original_max_position:
            return int(rope.original_max_position * rope.factor)
        if rope.scaling_type == "linear":
            return int(self.max_position_embeddings * rope.factor)
        return self.max_position_embeddings

    def context_limit_source(self) -> str:
        """Where `max_context_length` comes from, in the config's own keys (for error messages)."""
        rope = self.rope
        if rope.scaling_type == "yarn" and rope.original_max_position:
            return f"yarn rope: original_max_position_embeddings {rope.original_max_position} x factor {rope.factor:g}"
        if rope.scaling_type == "linear":
            return f"linear rope: max_position_embeddings {self.max_position_embeddings} x factor {rope.factor:g}"
        return "max_position_embeddings"


DEFAULT_MAX_MODEL_LEN = 4096  # what LLM(...) takes when no max_model_len is given, if the model allows it


def resolve_max_model_len(requested: int | None, config: ModelConfig) -> int:
    """The context length an LLM runs with: `requested`, which must fit the model's positions
    (`ModelConfig.max_context_length`), else min(that limit, DEFAULT_MAX_MODEL_LEN)."""
    limit = config.max_context_length
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if requested > limit:
        raise ConfigError(f"context length {requested} (max_model_len, --context-length) exceeds the model's limit "
                          f"of {limit} tokens ({config.context_limit_source()}); pass at most {limit}")
    return requested


class RawConfig:
    """Typed access to a config.json dict; every failure names the file and the key."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(key, default)
        if value is None:
            raise self.error(f"missing required key '{key}'")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"'{key}' must be an integer >= {minimum}, got {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if value is None:
            raise self.error(f"missing required key '{key}'")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(f"'{key}' must be a finite number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"'{key}' must be true or false, got {value!r}")
        return value


# Keys that a multimodal wrapper's config.json may set for the whole model; where present they win over text_config's
# (transformers reads the wrapper's; `hybrid-convert --gpu-quant` records its quantization there).
WRAPPER_KEYS = ("quantization_config", "tie_word_embeddings", "eos_token_id")


def wrapped_text_config(raw: RawConfig, text_model: str) -> RawConfig:
    """The text model's settings of a multimodal wrapper's config.json (Kimi-K2.5, Qwen3.5), named by the wrapper's
    architecture; `text_model` says what they are, in the error of a config without them."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise raw.error(f"missing 'text_config' ({text_model})")
    data = dict(text, architectures=raw.get("architectures"))
    data.update({key: raw.get(key) for key in WRAPPER_KEYS if raw.has(key)})
    return RawConfig(data, f"{raw.source}: text_config")


def read_config_json(path: str | Path) -> RawConfig:
    """Reads `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{file}: no config.json found; pass a HuggingFace checkpoint directory")
    try:
        content = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(content)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level")
    return RawConfig(data, str(file))


def architecture_of(raw: RawConfig) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise raw.error("missing 'architectures' (a list naming the model class, e.g. ['Qwen3MoeForCausalLM'])")
    return archs[0]


def parse_rope(
    raw: RawConfig, head_dim: int, *, is_interleaved: bool, default_theta: float = 10000.0, default_partial: float = 1.0
) -> RopeConfig:
    """RoPE settings from either spelling; `head_dim` is the per-head size that rotary applies to."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise raw.error(f"rope type '{rope_type}' is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise raw.error(f"partial_rotary_factor {partial} gives an unusable rotary dim {rotary_dim} (head {head_dim})")
    factor = float(params.get("factor") or 1.0)
    original = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and original is None:
        raise raw.error("yarn rope needs 'original_max_position_embeddings' in rope_scaling/rope_parameters")
    if rope_type == "yarn" and params.get("factor") is None:
        factor = raw.float("max_position_embeddings") / original
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rotary_dim,
        is_interleaved=is_interleaved,
        scaling_type=rope_type,
        factor=factor,
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


MODELOPT_FILE = "hf_quant_config.json"
MODELOPT_ALGOS = ("NVFP4",)


def parse_quantization(raw: RawConfig, checkpoint_dir: Path | None = None) -> dict[str, Any]:
    """The checkpoint's weight storage, as ModelConfig fields: DeepSeek-style block FP8 (`quant_method: fp8`, e4m3,
    `weight_block_size`), compressed-tensors (what `hybrid-convert --gpu-quant` and llm-compressor write), NVIDIA
    ModelOpt NVFP4 (`quant_method: modelopt`, or no quantization_config beside an `hf_quant_config.json`) or
    gpt-oss's MXFP4 experts (`quant_method: mxfp4`: the rest is stored unquantized)."""
    quant = raw.get("quantization_config")
    plain = {"fp8_block_size": None, "compressed_tensors": None, "is_modelopt": False}
    if not quant:
        modelopt_file = checkpoint_dir / MODELOPT_FILE if checkpoint_dir is not None else None
        if modelopt_file is None or not modelopt_file.is_file():
            return plain
        return plain | {"is_modelopt": parse_modelopt(_read_json(modelopt_file), str(modelopt_file))}
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        try:
            return plain | {"compressed_tensors": compressed_tensors.parse(quant, raw.source)}
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if method == "modelopt":
        return plain | {"is_modelopt": parse_modelopt(quant, f"{raw.source}: quantization_config")}
    if method == "mxfp4":  # gpt-oss as published: only its fused experts, which `hybrid.fused_experts` reads
        return plain
    if method != "fp8":
        raise raw.error(f"quantization_config.quant_method '{method}' is not supported here; supported: fp8, "
                        "compressed-tensors, modelopt, mxfp4")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise raw.error(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise raw.error(f"quantization_config.fmt '{quant.get('fmt')}' is not supported; supported: e4m3")
    return plain | {"fp8_block_size": (block[0], block[1])}


def parse_modelopt(quant: dict, source: str) -> bool:
    """A ModelOpt quantization description (`hf_quant_config.json`'s, its settings under `quantization`, or
    config.json's `quantization_config`): True for NVFP4 in groups of 16, the one algorithm read."""
    settings = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    algo = settings.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise ConfigError(f"{source}: ModelOpt quant_algo {algo!r} is not supported; supported: "
                          f"{', '.join(MODELOPT_ALGOS)}")
    if settings.get("group_size", 16) != 16:
        raise ConfigError(f"{source}: ModelOpt NVFP4 group_size {settings.get('group_size')} is not supported; "
                          "NVFP4 groups are 16")
    return True


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def parse_eos(raw: RawConfig, checkpoint_dir: Path | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it wins, as in transformers), else config.json."""
    eos = raw.get("eos_token_id")
    if checkpoint_dir is not None and (checkpoint_dir / "generation_config.json").is_file():
        try:
            gen = json.loads((checkpoint_dir / "generation_config.json").read_text())
            eos = gen.get("eos_token_id", eos) if isinstance(gen, dict) else eos
        except (OSError, json.JSONDecodeError):
            pass  # generation_config.json is advisory; config.json's value stands
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def require_silu(raw: RawConfig) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise raw.error(f"hidden_act '{act}' is not supported; supported: silu")


def moe_layer_flags(num_layers: int, is_moe) -> tuple[bool, ...]:
    return tuple(bool(is_moe(i)) for i in range(num_layers))


def common_fields(raw: RawConfig, checkpoint_dir: Path | None) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way."""
    require_silu(raw)
    return dict(
        architecture=architecture_of(raw),
        vocab_size=raw.int("vocab_size"),
        hidden_size=raw.int("hidden_size"),
        num_layers=raw.int("num_hidden_layers"),
        intermediate_size=raw.int("intermediate_size"),
        rms_norm_eps=raw.float("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.int("max_position_embeddings", 4096),
        tie_word_embeddings=raw.bool("tie_word_embeddings", False),
        eos_token_ids=parse_eos(raw, checkpoint_dir),
    ) | parse_quantization(raw, checkpoint_dir)


def gqa_attention(raw: RawConfig, *, has_qkv_bias: bool, qk_norm: str, sliding_window: int | None):
    """AttentionConfig and head_dim for grouped-query attention families."""
    num_heads = raw.int("num_attention_heads")
    num_kv_heads = raw.int("num_key_value_heads", num_heads)
    head_dim = raw.int("head_dim", raw.int("hidden_size") // num_heads)
    if num_heads % num_kv_heads:
        raise raw.error(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    return AttentionConfig(
        kind="gqa",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        scale=head_dim**-0.5,
        has_qkv_bias=has_qkv_bias,
        qk_norm=qk_norm,
        sliding_window=sliding_window,
    )
