"""The decoder-only MoE causal LM that every family file specialises.

Layout and names follow the HuggingFace checkpoints (`model.embed_tokens`, `model.layers.N.self_attn`,
`model.layers.N.mlp` or `block_sparse_moe`, `model.norm`, `lm_head`), so loading is a copy. A family file
supplies `parse_config` and, where its checkpoint names differ, the class attributes below (a wrapper's prefix,
such as Kimi-K2.5's `language_model.`, is mapped by the checkpoint reader: `checkpoint_prefixes`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import parallel
from hybrid.config import ModelConfig, RawConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.attention import GQAAttention
from hybrid.layers.backends import Backends
from hybrid.layers.delta_net import GatedDeltaNet
from hybrid.layers.mla import MLAAttention, SharedSelection
from hybrid.layers.mlp import GatedMLP
from hybrid.layers.moe import ExpertDeferral, SparseMoE
from hybrid.layers.norm import OffsetRMSNorm, RMSNorm
from hybrid.layers.ops import DenseOps
from hybrid.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """`mixer_name`: the token mixer's attribute, `self_attn` (attention) or `linear_attn` (a Gated DeltaNet)."""

    def __init__(self, attn: nn.Module, ff: nn.Module, ff_name: str, hidden_size: int, eps: float, ops: DenseOps,
                 mixer_name: str = "self_attn", norm_cls: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, attn)
        self.ff_name = ff_name
        setattr(self, ff_name, ff)
        self.input_layernorm = norm_cls(hidden_size, eps, ops)
        self.post_attention_layernorm = norm_cls(hidden_size, eps, ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(block output, residual stream) of the layer before (residual None at the first layer) -> this layer's.
        The residual adds happen inside the next norm (`RMSNorm.forward` with a residual: one fused kernel)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        hidden = getattr(self, self.mixer_name)(normed, batch)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return getattr(self, self.ff_name)(normed), residual


class VocabEmbedding(nn.Module):
    """Tensor parallel: the embedding rows of this rank's vocabulary shard (`parallel.shard_range`, padded to equal
    shards); ids outside it give zero rows, and the all-reduce of the ranks' rows is every token's embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: parallel.TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, self.end = parallel.shard_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // tp.size), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_local = (input_ids >= self.start) & (input_ids < self.end)
        rows = F.embedding(torch.where(is_local, input_ids - self.start, 0), self.weight)  # [T, H]
        return parallel.all_reduce(rows.masked_fill_(~is_local.unsqueeze(1), 0), self.tp)


class MoECausalLM(nn.Module):
    ff_name = "mlp"  # attribute of the feed-forward block in each decoder layer
    shared_expert_name = "shared_experts"
    # Checkpoint tensors that are not part of inference: multi-token-prediction layers past num_layers are
    # matched by `extra_layer_pattern`, stale rotary caches by the second pattern.
    ignored_tensor_patterns: tuple[str, ...] = (r".*\.rotary_emb\.inv_freq$",)
    has_mtp_layers = False
    # whether some routed experts may stay on the device beside the CPU operator's (`gpu_experts`)
    has_resident_experts = True
    # (published, model) name prefixes where the published checkpoint nests the model under another name (the
    # checkpoint reader maps them: `hybrid.checkpoint`); names below are the model's.
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, backends: Backends | None = None):
        super().__init__()
        backends = backends or Backends()
        self.config = config
        moe_layers = config.moe_layer_indices
        self.deferral = ExpertDeferral(backends.defer_experts) if backends.defer_experts and moe_layers else None
        self._last_moe_layer = moe_layers[-1] if moe_layers else -1
        # DSA: the selection GLM-5.2's shared layers take from the full indexer layer before them
        self.shared_selection = SharedSelection() if any(
            spec.attention.indexer is not None for spec in config.layers) else None
        # tensor parallel (`hybrid.parallel`): the layers split themselves; embeddings and lm_head by vocabulary
        self.tp = tp = parallel.current()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if tp.size == 1 else \
            VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        rotaries: dict = {}  # one RotaryEmbedding per distinct RoPE: layers of one kind share its tables
        for spec in config.layers:
            rotaries.setdefault(spec.rope, RotaryEmbedding(spec.rope, backends.ops))
        norm_cls = OffsetRMSNorm if config.has_offset_norms else RMSNorm
        self.model.layers = nn.ModuleList(
            DecoderLayer(
                self._make_mixer(i, rotaries[config.layers[i].rope], backends),
                self._make_ff(i, backends),
                self.ff_name,
                config.hidden_size,
                config.rms_norm_eps,
                backends.ops,
                "linear_attn" if config.layers[i].is_recurrent else "self_attn",
                norm_cls,
            )
            for i in range(config.num_layers)
        )
        self.model.norm = norm_cls(config.hidden_size, config.rms_norm_eps, backends.ops)
        self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.weight.shape[0], bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def parse_config(cls, raw: RawConfig, checkpoint_dir=None) -> ModelConfig:
        raise NotImplementedError

    def _make_mixer(self, layer_idx: int, rotary: RotaryEmbedding, backends: Backends) -> nn.Module:
        cfg = self.config
        spec = cfg.layers[layer_idx]
        if spec.linear is not None:
            return GatedDeltaNet(spec.linear, cfg.hidden_size, backends.attention)
        if spec.attention.kind == "mla":
            return MLAAttention(spec.attention, cfg.hidden_size, rotary, backends.attention, self.shared_selection)
        return GQAAttention(spec.attention, cfg.hidden_size, cfg.rms_norm_eps, rotary, backends.attention,
                            OffsetRMSNorm if cfg.has_offset_norms else RMSNorm)

    def _make_ff(self, layer_idx: int, backends: Backends) -> nn.Module:
        cfg = self.config
        if not cfg.moe_layers[layer_idx]:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, backends.ops)
        experts = backends.make_experts(layer_idx, cfg)
        # deferral hands CPU experts to the next layer's time on the GPU; a layer without a CPU part keeps its own
        is_deferring = (self.deferral is not None and layer_idx != self._last_moe_layer
                        and getattr(experts, "has_cpu_part", False))
        return SparseMoE(cfg.hidden_size, cfg.moe, experts, self.shared_expert_name, backends.ops, self.deferral,
                         is_deferring=is_deferring)

    # --- checkpoint contract (used by hybrid.loader) ---

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor its values are copied into."""
        return checkpoint_targets_of(self)

    def tp_shards(self) -> dict[str, parallel.Shard]:
        vocab = parallel.vocab(self.config.vocab_size)
        return {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}

    def routed_expert_name(self, layer: int, expert: int, role: str) -> str:
        """Checkpoint name of routed expert `expert`'s projection `role` (gate, up or down) in layer `layer`."""
        proj = self.config.moe.expert_proj_names[("gate", "up", "down").index(role)]
        return f"model.layers.{layer}.{self.ff_name}.experts.{expert}.{proj}.weight"

    def optional_tensor_names(self) -> set[str]:
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def is_ignored_tensor(self, name: str) -> bool:
        if any(re.match(p, name) for p in self.ignored_tensor_patterns):
            return True
        match = re.match(r"model\.layers\.(\d+)\.", name)
        return bool(self.has_mtp_layers and match and int(match.group(1)) >= self.config.num_layers)

    # --- running ---

    def attention_layers(self) -> list[nn.Module]:
        """The layers with a paged KV cache (not the recurrent ones: `state_layers`)."""
        return [layer.self_attn for layer in self.model.layers if layer.mixer_name == "self_attn"]

    def state_layers(self) -> list[nn.Module]:
        """The recurrent layers (Gated DeltaNet), each with per-sequence state slots."""
        return [layer.linear_attn for layer in self.model.layers if layer.mixer_name == "linear_attn"]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, H]."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, batch)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] (tensor parallel: every rank's vocabulary shard gathered)."""
        return parallel.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size, self.tp)


def checkpoint_targets_of(root: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Checkpoint name -> destination tensor for the parameters and buffers of `root` (named under `prefix`);
    modules with their own `checkpoint_targets` (stacked experts, quantized Linears) map the names under them.
    Tensor parallel: a parameter that its module's `tp_shards` splits is a `parallel.ShardTarget`."""
    targets: dict[str, torch.Tensor] = {}
    stacked: set[str] = set()
    shards: dict[str, tuple[parallel.Shard, parallel.TensorParallel]] = {}
    for module_name, module in root.named_modules(prefix=prefix.rstrip(".")):
        tp = getattr(module, "tp", parallel.SINGLE)
        if hasattr(module, "tp_shards") and tp.size > 1:
            shards.update({f"{module_name}.{name}" if module_name else name: (shard, tp)
                           for name, shard in module.tp_shards().items()})
        if hasattr(module, "checkpoint_targets") and module is not root:
            for suffix, tensor in module.checkpoint_targets():
                targets[f"{module_name}.{suffix}"] = tensor
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            stacked.update(f"{module_name}.{n}" for n, _ in own)
    for name, tensor in root.state_dict(prefix=prefix, keep_vars=True).items():
        if name in shards:
            targets[name] = parallel.ShardTarget(tensor.data, *shards[name])
        elif name not in stacked:
            targets[name] = tensor.data
    return targets
