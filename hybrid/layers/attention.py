"""Grouped-query attention (Qwen, Mixtral, GLM, MiniMax, gpt-oss, MiMo): optional q/k/v bias, QK RMSNorm per head or
over the whole projection (`AttentionConfig.qk_norm`), partial rotary, sliding window, attention sinks, a V head dim
of its own (`v_head_dim`) and a V scale (`value_scale`). The paged KV cache is bound by the runner (`kv_cache`,
`cache_group`), the math lives in the backend.

With the kernels' ops (`DenseOps.is_fused_gate_up`), `fuse_qkv` (called once after loading) puts q, k and v in one
[q + k + v, H] weight (and bias) that the three Linear weights then view, so one GEMV makes all three (the
checkpoint names still address them; no memory is added). Projections that keep quantized weights
(`QuantizedLinear`, placed by the loader) stay three GEMMs, as do the PyTorch ops (the CPU path, bit for bit the
reference's three products). With the Triton attention backend the per-head QK norms, the rotary and the KV-cache
write then run as one kernel too (`gqa_prepare`, `gpu_layers.qk_rope_cache`)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import parallel
from hybrid.config import AttentionConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.norm import RMSNorm
from hybrid.layers.rotary import RotaryEmbedding


class GQAAttention(nn.Module):
    def __init__(self, cfg: AttentionConfig, hidden_size: int, eps: float, rotary: RotaryEmbedding, backend,
                 norm_cls: type[RMSNorm] = RMSNorm):
        super().__init__()
        # tensor parallel: this rank's heads (KV heads replicated where there are fewer than ranks), `tp_shards`
        self.tp = tp = parallel.current()
        self.full_cfg = cfg
        if tp.size > 1:  # a whole-projection qk_norm is refused before: `parallel.check_tensor_parallel`
            parallel.check_divisible("num_attention_heads", cfg.num_heads, tp)
            parallel.check_kv_heads(cfg.num_kv_heads, tp)
            cfg = replace(cfg, num_heads=cfg.num_heads // tp.size,
                          num_kv_heads=parallel.local_heads(cfg.num_kv_heads, tp))
        self.cfg = cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_out = 2 * q_size if cfg.has_output_gate else q_size
        self.q_proj = nn.Linear(hidden_size, q_out, bias=cfg.has_qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_size, bias=cfg.has_qkv_bias)
        self.v_proj = nn.Linear(hidden_size, cfg.num_kv_heads * cfg.v_head_dim, bias=cfg.has_qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, hidden_size, bias=cfg.has_o_bias)
        if cfg.qk_norm != "none":
            is_whole = cfg.qk_norm == "whole"
            self.q_norm = norm_cls(q_size if is_whole else cfg.head_dim, eps, rotary.ops)
            self.k_norm = norm_cls(kv_size if is_whole else cfg.head_dim, eps, rotary.ops)
        if cfg.has_sinks:
            self.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        self.rotary = rotary
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        self.cache_group = 0  # which cache group's pages hold this layer's KV (bound with the cache)
        self.qkv_weight: torch.Tensor | None = None  # [q + k + v, H] once fused (`fuse_qkv`)
        self.qkv_bias: torch.Tensor | None = None

    def tp_shards(self) -> dict[str, parallel.Shard]:
        """q by heads, k and v by KV heads (replicated below one per rank), o_proj row-parallel, its bias once."""
        cfg, kv = self.cfg, parallel.heads(self.full_cfg.num_kv_heads)
        shards = {"q_proj.weight": parallel.COLUMN, "k_proj.weight": kv, "v_proj.weight": kv,
                  "o_proj.weight": parallel.ROW}
        if cfg.has_qkv_bias:
            shards |= {"q_proj.bias": parallel.COLUMN, "k_proj.bias": kv, "v_proj.bias": kv}
        if cfg.has_o_bias:
            shards["o_proj.bias"] = parallel.ONCE
        if cfg.has_sinks:
            shards["sinks"] = parallel.COLUMN
        return shards

    def fuse_qkv(self) -> None:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        is_plain = all(type(p) is nn.Linear for p in projs) and len({p.weight.dtype for p in projs}) == 1
        if not self.rotary.ops.is_fused_gate_up or self.qkv_weight is not None or not is_plain:
            return
        sizes = [p.weight.shape[0] for p in projs]
        fused = torch.cat([p.weight.data for p in projs])  # [q + k + v, H]
        for p, view in zip(projs, fused.split(sizes), strict=True):
            p.weight.data = view
        if self.cfg.has_qkv_bias:
            bias = torch.cat([p.bias.data for p in projs])
            for p, view in zip(projs, bias.split(sizes), strict=True):
                p.bias.data = view
            self.qkv_bias = bias
        self.qkv_weight = fused

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, q_out], k [T, Hkv * D], v [T, Hkv * Dv] (views of one product once fused)."""
        if self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, q + k + v]
        return qkv.split([self.q_proj.weight.shape[0], self.k_proj.weight.shape[0], self.v_proj.weight.shape[0]],
                         dim=-1)

    def prepares_in_one_kernel(self, dtype: torch.dtype) -> bool:
        """Per-head QK norm (plain RMSNorm) or none, rotary and the cache write as one kernel: where the backend
        has it (`gqa_prepare`) for these dims; the other norms keep their own kernels."""
        cfg = self.cfg
        if not hasattr(self.backend, "gqa_prepare") or cfg.qk_norm not in ("per_head", "none"):
            return False
        if cfg.qk_norm == "per_head" and not (type(self.q_norm) is RMSNorm and type(self.k_norm) is RMSNorm):
            return False
        return self.backend.supports_gqa_prepare(cfg.head_dim, cfg.v_head_dim, self.rotary.rope.rotary_dim, dtype)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per-slot shapes of this layer's cache tensors: K as [kv_heads, head_dim], V as [kv_heads, v_head_dim]."""
        return ((self.cfg.num_kv_heads, self.cfg.head_dim), (self.cfg.num_kv_heads, self.cfg.v_head_dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg, num_tokens = self.cfg, x.shape[0]
        q, k, v = self._project(x)  # [T, Hq * D] ([T, Hq * 2D] with the gate), [T, Hkv * D], [T, Hkv * Dv]
        gate = None
        if cfg.has_output_gate:  # per head [q | gate]
            q, gate = q.view(num_tokens, cfg.num_heads, 2 * cfg.head_dim).split(cfg.head_dim, dim=-1)
            q, gate = q.reshape(num_tokens, -1), gate.reshape(num_tokens, -1)
        if cfg.qk_norm == "whole":  # one RMS over all heads: must come before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.v_head_dim)
        if cfg.value_scale != 1.0:  # where MiMo's reference scales V: before the cache, so it is stored rounded
            v = v * cfg.value_scale
        # the kernels take float32 sinks; a bf16 checkpoint's values widen exactly
        sinks = self.sinks.float() if cfg.has_sinks else None
        group_batch = batch.for_group(self.cache_group)
        if self.prepares_in_one_kernel(q.dtype):
            is_normed = cfg.qk_norm == "per_head"
            q = self.backend.gqa_prepare(q, k, v, self.q_norm.weight if is_normed else None,
                                         self.k_norm.weight if is_normed else None,
                                         self.q_norm.eps if is_normed else 0.0, self.rotary, self.kv_cache,
                                         group_batch)
            out = self.backend.gqa_cached(q, self.kv_cache, group_batch, cfg.scale, cfg.sliding_window, sinks)
        else:
            if cfg.qk_norm == "per_head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(batch.positions, q, k)
            out = self.backend.gqa(q, k, v, self.kv_cache, group_batch, cfg.scale, cfg.sliding_window, sinks)
        out = out.reshape(num_tokens, cfg.num_heads * cfg.v_head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return parallel.all_reduce(self.o_proj(out), self.tp)  # the heads' partial sums: one all-reduce
