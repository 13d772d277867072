"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2). The cache holds one compressed entry per token:
the normalised kv latent (kv_lora_rank) followed by the rotated shared rope key (qk_rope_head_dim)."""

from __future__ import annotations

import torch
from torch import nn

from hybrid.config import AttentionConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.norm import RMSNorm
from hybrid.layers.quantized_linear import MatrixLinear
from hybrid.layers.rotary import RotaryEmbedding

# The DeepSeek checkpoints' low-rank norms use a fixed epsilon, not the model's rms_norm_eps.
LORA_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, hidden_size: int, rotary: RotaryEmbedding, backend):
        super().__init__()
        self.cfg = cfg
        bias = cfg.has_qkv_bias
        q_size = cfg.num_heads * cfg.head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, rotary.ops)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, rotary.ops)
        kv_b_size = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        # its weight goes to the attention kernels as a matrix: always dequantized, never a QuantizedLinear
        self.kv_b_proj = MatrixLinear(cfg.kv_lora_rank, kv_b_size, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, hidden_size, bias=cfg.has_o_bias)
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        self.cache_group = 0  # which cache group's pages hold this layer's KV (bound with the cache)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        return ((1, self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim),)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg, num_tokens = self.cfg, x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, H, Dn + Dr]
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rotary(batch.positions, q_rope, k_rope.unsqueeze(1))  # k_rope: [T, 1, Dr]
        entry = torch.cat((latent, k_rope[:, 0]), dim=-1)  # [T, R + Dr]
        out = self.backend.mla(
            q_nope, q_rope, entry, self.kv_cache, self.kv_b_proj.weight, batch.for_group(self.cache_group), cfg.scale,
            cfg.v_head_dim
        )
        return self.o_proj(out.reshape(num_tokens, cfg.num_heads * cfg.v_head_dim))
