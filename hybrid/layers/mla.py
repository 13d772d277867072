"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2). The cache holds one compressed entry per token:
the normalised kv latent (kv_lora_rank) followed by the rotated shared rope key (qk_rope_head_dim).

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an `Indexer` beside the attention picks each query token's top-k
visible positions and the attention reads only those. Its key is cached per token in a second cache part of the
layer's pages (same cache group, so prefix caching and preemption cover it). GLM-5.2's "shared" layers have no
indexer: they take the selection the previous full layer made in the same step (`SharedSelection`). While every
sequence of a step fits in top-k, the selection is every visible token and the layers run dense attention (the
backends return no selection then), which is what the sparse attention would compute.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import parallel
from hybrid.config import AttentionConfig, IndexerConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.norm import RMSNorm
from hybrid.layers.quantized_linear import MatrixLinear
from hybrid.layers.rotary import RotaryEmbedding

# The DeepSeek checkpoints' low-rank norms use a fixed epsilon, not the model's rms_norm_eps.
LORA_NORM_EPS = 1e-6


class SharedSelection:
    """The last full indexer layer's selection in this step ([T, topk] int32 positions, or None: dense), which
    GLM-5.2's shared layers reuse. One per model; layers run in order, so it always holds this step's."""

    def __init__(self):
        self.selected: torch.Tensor | None = None


class Indexer(nn.Module):
    """The lightning indexer; parameter names as published (`self_attn.indexer.wq_b`, `wk`, `k_norm`,
    `weights_proj`)."""

    def __init__(self, cfg: IndexerConfig, hidden_size: int, q_lora_rank: int, rotary: RotaryEmbedding, backend):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=LORA_NORM_EPS)
        # float32 math as in the references (transformers keeps this projection in float32)
        self.weights_proj = nn.Linear(hidden_size, cfg.num_heads, bias=False)
        # the layer's frequencies with the indexer's own pairing (GLM-5 interleaved, DeepSeek-V3.2 halves)
        self.rotary = RotaryEmbedding(replace(rotary.rope, is_interleaved=cfg.is_rope_interleaved), rotary.ops)
        self.backend = backend

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, index_cache: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor | None:
        """x [T, H] (the attention's input), q_resid [T, q_lora_rank] -> [T, topk] int32 positions (-1 padded), or
        None where every sequence of the step fits in topk (dense attention). Caches the step's keys either way."""
        cfg, num_tokens = self.cfg, x.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, Hi, Di]
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # [T, 1, Di]
        # rope on the first qk_rope_head_dim dims (the main attention's rope part is its last dims)
        q, k = self.rotary(batch.positions, q, k)
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * cfg.num_heads**-0.5  # [T, Hi]
        return self.backend.dsa_select(q, k[:, 0], weights, index_cache, batch, cfg.head_dim**-0.5, cfg.topk)


class MLAAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, hidden_size: int, rotary: RotaryEmbedding, backend,
                 shared_selection: SharedSelection | None = None):
        super().__init__()
        # tensor parallel: this rank's heads (q, kv_b and o_proj split by heads, `tp_shards`); the latent, its
        # projection and cache, and the DSA indexer are every rank's
        self.tp = tp = parallel.current()
        if tp.size > 1:
            parallel.check_divisible("num_attention_heads", cfg.num_heads, tp)
            cfg = replace(cfg, num_heads=cfg.num_heads // tp.size)
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
        indexer = cfg.indexer
        self.has_indexer = indexer is not None and not indexer.is_shared
        if self.has_indexer:
            self.indexer = Indexer(indexer, hidden_size, cfg.q_lora_rank, rotary, backend)
        if indexer is not None and shared_selection is None:
            raise ValueError("a DSA layer needs the model's SharedSelection")
        self.shared_selection = shared_selection

    def tp_shards(self) -> dict[str, parallel.Shard]:
        shards = {"q_proj.weight" if self.cfg.q_lora_rank is None else "q_b_proj.weight": parallel.COLUMN,
                  "kv_b_proj.weight": parallel.COLUMN, "o_proj.weight": parallel.ROW}
        if self.cfg.has_o_bias:
            shards["o_proj.bias"] = parallel.ONCE
        return shards

    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        latent = (1, self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim)
        return (latent, (1, self.cfg.indexer.head_dim)) if self.has_indexer else (latent,)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg, num_tokens = self.cfg, x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, H, Dn + Dr]
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rotary(batch.positions, q_rope, k_rope.unsqueeze(1))  # k_rope: [T, 1, Dr]
        entry = torch.cat((latent, k_rope[:, 0]), dim=-1)  # [T, R + Dr]
        batch = batch.for_group(self.cache_group)
        selected = None
        if self.has_indexer:
            selected = self.shared_selection.selected = self.indexer(x, q_resid, self.kv_cache[1], batch)
        elif self.shared_selection is not None:
            selected = self.shared_selection.selected
        out = self.backend.mla(q_nope, q_rope, entry, self.kv_cache[:1], self.kv_b_proj.weight, batch, cfg.scale,
                               cfg.v_head_dim, selected)
        out = self.o_proj(out.reshape(num_tokens, cfg.num_heads * cfg.v_head_dim))
        return parallel.all_reduce(out, self.tp)  # the heads' partial sums: one all-reduce
