"""The narrow interfaces behind which kernels plug in, chosen once at start-up.

- An attention backend stores each step's new KV into the paged cache and attends over it.
- An experts factory builds the routed-experts module of each MoE layer: anything with
  `forward(hidden [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]`. Which experts run where
  (GPU-resident or CPU) is decided by the factory from placement data, not inside the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gpu_layers import reference
from hybrid.config import ModelConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.moe import TorchExperts


class TorchAttentionBackend:
    """Plain-PyTorch paged attention (gpu_layers.reference): the CPU path and the oracle for the kernels."""

    name = "torch"

    def gqa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...],
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        reference.write_kv_cache(k_cache, k, batch.slot_mapping)
        reference.write_kv_cache(v_cache, v, batch.slot_mapping)
        return reference.paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens_cpu, batch.query_lens_cpu, scale, sliding_window
        )

    def mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...],
        w_kv_b: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        v_head_dim: int,
    ) -> torch.Tensor:
        (latent_cache,) = kv_cache
        reference.write_kv_cache(latent_cache, latent.unsqueeze(1), batch.slot_mapping)
        return reference.mla_paged_attention(
            q_nope, q_rope, latent_cache, w_kv_b, batch.block_tables, batch.seq_lens_cpu, batch.query_lens_cpu,
            scale, v_head_dim,
        )


ExpertsFactory = Callable[[int, ModelConfig], nn.Module]  # (layer_idx, config) -> routed-experts module


def default_experts_factory(layer_idx: int, config: ModelConfig) -> nn.Module:
    moe = config.moe
    return TorchExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, moe.expert_proj_names)


@dataclass(frozen=True)
class Backends:
    attention: TorchAttentionBackend = field(default_factory=TorchAttentionBackend)
    make_experts: ExpertsFactory = default_experts_factory
