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
  On the engine's device (`expert_placement="device"`) they run through `gpu_layers.fused_moe` (activation
  `swiglu_oai`, both biases) where the Triton kernels run in bf16/fp16, else through the PyTorch loop below; with
  the CPU operator (`expert_placement="cpu"`, or a converted directory) through the layer's `RoutedExperts`, whose
  expert files carry the activation (`SWIGLU_OAI`) and the biases, read from the checkpoint by
  `hybrid.fused_experts` (published MXFP4 as stored, bf16 quantized), as `hybrid-convert` reads them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from cpu_experts.expert_file import SWIGLU_OAI
from hybrid import parallel
from hybrid.config import LayerSpec, ModelConfig, MoEConfig, RawConfig, common_fields, gqa_attention, parse_rope
from hybrid.layers.backends import Backends, default_experts_factory, triton_experts_factory
from hybrid.layers.moe import Router
from hybrid.layers.ops import TORCH_OPS, DenseOps
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


def restack_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """One expert's checkpoint gate_up [H, 2I] (gate and up interleaved along 2I) -> the fused-MoE kernel's
    [2I, H]: gate rows, then up rows. A new tensor."""
    return torch.cat((gate_up[:, 0::2].T, gate_up[:, 1::2].T))


class GptOssExperts(nn.Module):
    """All of a layer's routed experts, loaded in the checkpoint's fused layout. With the Triton ops in bf16/fp16
    (`hybrid.layers.backends.uses_gemm_kernels`), `fuse_gate_up` (called once after loading) rewrites the weights
    into the fused-MoE kernel's layout in their own storage: `w_gate_up` [E, 2I, H] (gate rows, then up rows) and
    `w_down` [E, H, I]. `down_proj` stays a view of `w_down` in its checkpoint shape; `gate_up_proj` becomes the
    view [E, H, I, 2] of `w_gate_up` (its `flatten(2)` is the checkpoint's [E, H, 2I]), since the interleaved
    layout is no strided view of the stacked one. Otherwise the experts run in the PyTorch loop of `forward`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: DenseOps = TORCH_OPS):
        super().__init__()
        self.tp = parallel.current()  # tensor parallel: every expert's slice of the intermediate dimension
        if self.tp.size > 1:
            parallel.check_divisible("intermediate_size", intermediate_size, self.tp)
            intermediate_size //= self.tp.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.ops = ops
        self.w_gate_up: torch.Tensor | None = None  # the kernel's layout, once fused
        self.w_down: torch.Tensor | None = None
        self.w_gate_up_bias: torch.Tensor | None = None  # float32 [E, 2I], gate then up
        self.w_down_bias: torch.Tensor | None = None  # float32 [E, H]
        self.kernel_activation = None  # gpu_layers.fused_moe.Activation, once fused

    def tp_shards(self) -> dict[str, parallel.Shard]:
        """Gate and up interleaved along 2I: a rank's contiguous columns are its gate/up pairs; the down bias once."""
        return {"gate_up_proj": parallel.Shard("split", 2), "gate_up_proj_bias": parallel.Shard("split", 1),
                "down_proj": parallel.Shard("split", 1), "down_proj_bias": parallel.ONCE}

    @property
    def is_graph_safe(self) -> bool:
        """A CUDA graph can capture the fused kernel, not the PyTorch loop (it picks the experts on the host)."""
        return self.w_gate_up is not None

    def fuse_gate_up(self) -> None:
        dtype = self.gate_up_proj.dtype
        if self.w_gate_up is not None or not self.ops.is_fused_gate_up or dtype not in (torch.bfloat16, torch.float16):
            return
        from gpu_layers.fused_moe import Activation

        num_experts, hidden_size, two_i = self.gate_up_proj.shape
        # Expert by expert in place: a 120b layer's experts are GBs, so only one expert's copy is ever added
        gate_up = self.gate_up_proj.data.contiguous()
        w_gate_up = gate_up.view(num_experts, two_i, hidden_size)
        down = self.down_proj.data.contiguous()
        w_down = down.view(num_experts, hidden_size, two_i // 2)
        for e in range(num_experts):
            w_gate_up[e].copy_(restack_gate_up(gate_up[e]))  # the source is copied before its storage is written
            w_down[e].copy_(down[e].T.clone())
        self.gate_up_proj.data = w_gate_up.view(num_experts, 2, two_i // 2, hidden_size).permute(0, 3, 2, 1)
        self.down_proj.data = w_down.transpose(1, 2)
        bias = self.gate_up_proj_bias.data
        self.w_gate_up_bias = torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).float().contiguous()
        self.w_down_bias = self.down_proj_bias.data.float().contiguous()
        self.kernel_activation = Activation("swiglu_oai", alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)
        self.w_gate_up, self.w_down = w_gate_up, w_down

    @staticmethod
    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] with gate and up interleaved -> [N, I]."""
        gate = gate_up[..., ::2].clamp(max=SWIGLU_LIMIT)
        up = gate_up[..., 1::2].clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.w_gate_up is not None:
            from gpu_layers.fused_moe import fused_moe

            return fused_moe(hidden, self.w_gate_up, self.w_down, topk_ids, topk_weights.float().contiguous(),
                             activation=self.kernel_activation, w_gate_up_bias=self.w_gate_up_bias,
                             w_down_bias=self.w_down_bias)
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
        self.experts = experts or GptOssExperts(moe.num_experts, hidden_size, moe.intermediate_size, ops)
        self.tp = parallel.current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.router(x)
        return parallel.all_reduce(self.experts(x, topk_ids, topk_weights), self.tp)  # the ranks' partial sums


class GptOssForCausalLM(MoECausalLM):
    expert_activation = SWIGLU_OAI  # the CPU experts' (`hybrid.direct_experts`, `convert`)
    has_expert_bias = True
    is_cpu_experts = False  # set by `_make_ff` when the layers' experts are `CpuExperts`
    # every expert on the CPU operator, or all on the device (`GptOssExperts`: fused MoE with the clamped SwiGLU and
    # the biases): GPU-resident experts beside the CPU operator's are `RoutedExperts` slots, which hold gate/up/down
    # weights only and compute SiLU without biases (their reference and their fused-MoE call), are loaded from
    # per-expert or [E, 2I, H] tensors (not gpt-oss's interleaved [E, H, 2I] MXFP4 blocks), and hot experts copy no
    # biases into them. The streamed prefill (`hybrid.streaming`) does take the activation and biases.
    has_resident_experts = False

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
        self.is_cpu_experts = True
        return GptOssMLP(self.config.hidden_size, self.config.moe, backends.ops, experts)

    def fused_experts_prefix(self, layer: int) -> str:
        """Where layer `layer`'s fused expert tensors live (`hybrid.direct_experts`)."""
        return f"model.layers.{layer}.mlp.experts"

    def is_ignored_tensor(self, name: str) -> bool:
        # CPU experts: the expert tensors go to the operator (`hybrid.direct_experts`), not to parameters
        return super().is_ignored_tensor(name) or (".mlp.experts." in name and self.is_cpu_experts)
