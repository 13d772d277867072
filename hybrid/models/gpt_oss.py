"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b), as transformers' `modeling_gpt_oss` computes it.

- Attention: GQA with q/k/v/o biases, head_dim from the config, NeoX rotary with YaRN (`truncate: false`), a learned
  per-head sink logit in every softmax denominator (`self_attn.sinks`), and per-layer `layer_types`: a
  `sliding_attention` layer sees its last `sliding_window` positions (itself included), a `full_attention` layer
  all. The windowed layers form their own cache group (`hybrid.cache_groups`), which gives back the pages a
  running request's window has left behind.
- MoE in every layer (`mlp.router`, `mlp.experts`): router logits with a bias, top-k on the logits, softmax over
  the k. The experts are stored fused as transformers writes them: `gate_up_proj` [E, H, 2I] with gate and up
  interleaved along 2I, `down_proj` [E, I, H], each with a bias; the activation is
  `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 * g)`, g = `clamp(gate, max=7)`, whatever `hidden_act` says.
  With `expert_placement="device"` they run through the PyTorch reference on the engine's device (the fused-MoE
  kernel does not compute this activation yet); with the CPU operator (`expert_placement="cpu"`, or a converted
  directory) through `CpuExperts`, whose expert files carry the activation (`SWIGLU_OAI`) and the biases, read
  from the checkpoint by `hybrid.native_experts.read_gpt_oss_layer` (published MXFP4 as stored, bf16 quantized).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from cpu_experts.expert_file import SWIGLU_OAI
from hybrid.config import LayerSpec, ModelConfig, MoEConfig, RawConfig, common_fields, gqa_attention, parse_rope
from hybrid.errors import ConfigError
from hybrid.layers.backends import Backends, default_experts_factory, triton_experts_factory
from hybrid.layers.moe import Router
from hybrid.models.base import MoECausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU_ALPHA = SWIGLU_OAI.alpha
SWIGLU_LIMIT = SWIGLU_OAI.limit
DEFAULT_ROPE_THETA = 150000.0  # GptOssConfig.default_theta


def parse_layer_types(raw: RawConfig, num_layers: int) -> tuple[str, ...]:
    """`layer_types` as written, else transformers' default: even layers sliding, odd layers full."""
    if not raw.has("layer_types"):
        return tuple(LAYER_TYPES[i % 2] for i in range(num_layers))
    types = raw.get("layer_types")
    if not isinstance(types, list) or len(types) != num_layers:
        raise raw.error(f"'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise raw.error(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return tuple(types)


class GptOssRouter(Router):
    """Top-k of the biased router logits, softmax over those k (`mlp.router.weight`, `mlp.router.bias`)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ops):
        super().__init__(hidden_size, moe, ops)
        self.bias = nn.Parameter(torch.empty(moe.num_experts))

    def _route(self, x: torch.Tensor, correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top_logits, ids = torch.topk(logits, self.moe.top_k, dim=-1)
        return torch.softmax(top_logits, dim=1, dtype=top_logits.dtype), ids


class GptOssExperts(nn.Module):
    """All of a layer's routed experts in the checkpoint's fused layout, computed in PyTorch."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    @staticmethod
    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] with gate and up interleaved -> [N, I]."""
        gate = gate_up[..., ::2].clamp(max=SWIGLU_LIMIT)
        up = gate_up[..., 1::2].clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in topk_ids.unique().tolist():
            if expert < 0:  # padding
                continue
            tokens, slots = torch.where(topk_ids == expert)
            gate_up = hidden[tokens] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            down = self.activation(gate_up) @ self.down_proj[expert] + self.down_proj_bias[expert]
            out.index_add_(0, tokens, (down * topk_weights[tokens, slots, None]).to(hidden.dtype))
        return out


class GptOssMLP(nn.Module):
    """`experts`: the layer's `RoutedExperts`, all on the CPU operator (reached through the model's CPU hand-off),
    or None for the fused layout's PyTorch reference."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ops, experts: nn.Module | None = None):
        super().__init__()
        self.router = GptOssRouter(hidden_size, moe, ops)
        self.experts = experts or GptOssExperts(moe.num_experts, hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.router(x)
        return self.experts(x, topk_ids, topk_weights)


class GptOssForCausalLM(MoECausalLM):
    expert_activation = SWIGLU_OAI  # the CPU experts' (`hybrid.direct_experts`, `convert`)
    has_expert_bias = True
    is_cpu_experts = False  # set by `_make_ff` when the layers' experts are `CpuExperts`

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        # hidden_act names silu, but the experts use their own clamped activation (module docstring)
        plain = RawConfig({k: v for k, v in raw.data.items() if k != "hidden_act"}, raw.source)
        num_layers = raw.int("num_hidden_layers")
        layer_types = parse_layer_types(raw, num_layers)
        window = raw.int("sliding_window") if "sliding_attention" in layer_types else None
        attention = replace(gqa_attention(raw, has_qkv_bias=raw.bool("attention_bias", True), qk_norm="none",
                                          sliding_window=window),
                            has_o_bias=raw.bool("attention_bias", True), has_sinks=True)
        rope = parse_rope(raw, attention.head_dim, is_interleaved=False, default_theta=DEFAULT_ROPE_THETA)
        full = replace(attention, sliding_window=None)
        return ModelConfig(
            **common_fields(plain, checkpoint_dir),
            attention=attention,
            rope=rope,
            moe=MoEConfig(
                num_experts=raw.int("num_local_experts", raw.get("num_experts")),
                top_k=raw.int("num_experts_per_tok"),
                intermediate_size=raw.int("intermediate_size"),
                scoring="softmax",
                norm_topk_prob=True,
            ),
            moe_layers=(True,) * num_layers,
            layer_specs=tuple(LayerSpec(full if kind == "full_attention" else attention, rope, "moe")
                              for kind in layer_types),
        )

    def _make_ff(self, layer_idx: int, backends: Backends) -> nn.Module:
        if backends.make_experts in (default_experts_factory, triton_experts_factory):
            return GptOssMLP(self.config.hidden_size, self.config.moe, backends.ops)
        experts = backends.make_experts(layer_idx, self.config)
        if not experts.has_cpu_part or experts.gpu_expert_ids:
            raise ConfigError(f"{self.config.architecture}: routed experts run on the CPU operator or all on the "
                              "device; set gpu_experts=0 (--gpu-experts 0) or expert_placement=device")
        self.is_cpu_experts = True
        return GptOssMLP(self.config.hidden_size, self.config.moe, backends.ops, experts)

    def fused_experts_prefix(self, layer: int) -> str:
        """Where layer `layer`'s fused expert tensors live (`hybrid.direct_experts`)."""
        return f"model.layers.{layer}.mlp.experts"

    def is_ignored_tensor(self, name: str) -> bool:
        # CPU experts: the expert tensors go to the operator (`hybrid.direct_experts`), not to parameters
        return super().is_ignored_tensor(name) or (".mlp.experts." in name and self.is_cpu_experts)
