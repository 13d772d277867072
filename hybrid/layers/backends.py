"""The narrow interfaces behind which kernels plug in, chosen once at start-up (`Backends.for_device`).

- An attention backend stores each step's new KV into the paged cache and attends over it: plain PyTorch
  (`TorchAttentionBackend`, the CPU path and the oracle) or the Triton kernels of `gpu_layers`
  (`TritonAttentionBackend`, on CUDA, where the model's head shapes are ones the kernels take).
- The dense operations (norms, rotary, activation, routers) are one `DenseOps` table (`hybrid.layers.ops`).
- `keep_quantized`: with the Triton ops in bf16/fp16, dense Linear weights stored quantized (FP8, W4A16) stay so
  and run through `gpu_layers.linear` (the loader places `hybrid.layers.quantized_linear.QuantizedLinear`s).
- An experts factory builds the routed-experts module of each MoE layer (`hybrid.routed_experts.RoutedExperts`:
  `submit(hidden [T, H], topk_ids [T, K], topk_weights [T, K])`, `collect(like) -> [T, H]`). Which experts run
  where (GPU-resident or CPU) is decided by the factory from placement data, once, not inside the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gpu_layers import dsa_reference, reference
from hybrid.config import AttentionConfig, LinearAttentionConfig, ModelConfig
from hybrid.forward_batch import ForwardBatch
from hybrid.layers.delta_net import torch_causal_conv1d, torch_gated_delta_rule
from hybrid.layers.ops import TORCH_OPS, DenseOps, dense_ops_for
from hybrid.routed_experts import device_experts_factory


class _TorchGatedDeltaNet:
    """The Gated DeltaNet's conv and delta rule over per-sequence state slots, in plain PyTorch (one token at a time
    in float32, `hybrid.layers.delta_net`); every backend has them until the Triton ones plug in."""

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                      batch: ForwardBatch) -> torch.Tensor:
        """x [T, C], weight [C, K], conv_pool [num_slots, C, K - 1] -> silu(causal depthwise conv) [T, C]."""
        return torch_causal_conv1d(x, weight, conv_pool, batch)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q, k [T, Hk, Dk] (L2-normalised here; each k head serves Hv / Hk consecutive v heads), v [T, Hv, Dv],
        g (log decay), beta [T, Hv] float32; state_pool float32 [num_slots, Hv, Dk, Dv], read (where
        `batch.has_initial_state`) and written at `batch.state_slots` -> [T, Hv, Dv]."""
        return torch_gated_delta_rule(q, k, v, g, beta, state_pool, batch)


class TorchAttentionBackend(_TorchGatedDeltaNet):
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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] (Dv may differ from D: MiMo) -> [T, Hq, Dv]. `sinks`: float32
        [Hq] logits, one more per head in each softmax denominator (gpt-oss), or None."""
        k_cache, v_cache = kv_cache
        reference.write_kv_cache(k_cache, k, batch.slot_mapping)
        reference.write_kv_cache(v_cache, v, batch.slot_mapping)
        return reference.paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens_cpu, batch.query_lens_cpu, scale, sliding_window,
            sinks,
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
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`selected` [T, topk] int32: each token attends to these positions only (DSA), None: to all."""
        (latent_cache,) = kv_cache
        reference.write_kv_cache(latent_cache, latent.unsqueeze(1), batch.slot_mapping)
        return reference.mla_paged_attention(
            q_nope, q_rope, latent_cache, w_kv_b, batch.block_tables, batch.seq_lens_cpu, batch.query_lens_cpu,
            scale, v_head_dim, selected,
        )

    def dsa_select(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                   batch: ForwardBatch, scale: float, topk: int) -> torch.Tensor | None:
        """DSA's indexer: caches k [T, Di], then scores q [T, Hi, Di] with head weights [T, Hi] (float32) against
        each token's visible keys -> [T, topk] int32 positions, -1 padded (`gpu_layers.dsa_reference`); None when
        every sequence of the step fits in topk (the selection would be every visible token: dense attention)."""
        reference.write_kv_cache(index_cache, k.unsqueeze(1), batch.slot_mapping)
        max_context = max(batch.seq_lens_cpu)
        if max_context <= topk:
            return None
        row_seq, row_limit = batch.token_rows()
        scores = dsa_reference.index_scores(q, weights, index_cache, batch.block_tables, row_seq, row_limit, scale,
                                            max_context)
        return dsa_reference.select_topk(scores, row_limit, topk)


def _zero_fresh_slots(pool: torch.Tensor, batch: ForwardBatch) -> None:
    """The decode kernels always resume: a one-token step that starts a sequence (a one-token prompt) zeroes its
    slot first (eager steps only: the runner replays graphs for resuming rows alone)."""
    fresh = [slot for slot, resumes in zip(batch.state_slots_cpu, batch.has_initial_state_cpu, strict=True)
             if not resumes and slot >= 0]
    if fresh:
        pool[fresh] = 0


class TritonAttentionBackend(_TorchGatedDeltaNet):
    """The paged-attention kernels of `gpu_layers`: the KV-cache write, then decode (split-K over the context) when
    every sequence of the step has one new token, else prefill/extend (causal over the paged prefix)."""

    name = "triton"

    def __init__(self, has_linear_kernels: bool = False):
        """`has_linear_kernels`: the Gated DeltaNet layers run on `gpu_layers.delta_net` (`supports_linear`)."""
        from gpu_layers import attention, kv_cache, mla

        self.attention, self.kv_cache, self.mla_kernels = attention, kv_cache, mla
        self.has_linear_kernels = has_linear_kernels

    @staticmethod
    def supports(cfg: AttentionConfig, block_size: int) -> bool:
        from gpu_layers import attention, mla

        if block_size & (block_size - 1):
            return False
        if cfg.kind == "mla":
            if cfg.indexer is not None and not cfg.indexer.is_shared:
                from gpu_layers import dsa

                if not dsa.supports_dims(cfg.indexer.num_heads, cfg.indexer.head_dim):
                    return False
            return mla.supports_dims(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        return (attention.supports_head_dims(cfg.head_dim, cfg.v_head_dim)
                and cfg.num_heads // cfg.num_kv_heads <= attention.MAX_GROUP)

    def gqa(self, q, k, v, kv_cache, batch: ForwardBatch, scale: float, sliding_window: int | None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.kv_cache.write_kv_cache(k_cache, k, batch.slot_mapping)
        self.kv_cache.write_kv_cache(v_cache, v, batch.slot_mapping)
        return self.gqa_cached(q, kv_cache, batch, scale, sliding_window, sinks)

    @staticmethod
    def supports_gqa_prepare(head_dim: int, v_head_dim: int, rotary_dim: int, dtype: torch.dtype) -> bool:
        """Whether `gqa_prepare` takes these dims and dtype (`gpu_layers.qk_rope_cache`)."""
        from gpu_layers import qk_rope_cache

        return qk_rope_cache.supports(head_dim, v_head_dim, rotary_dim, dtype)

    def gqa_prepare(self, q, k, v, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                    eps: float, rotary, kv_cache, batch: ForwardBatch) -> torch.Tensor:
        """One kernel for what the layer's QK norms, its rotary and `gqa`'s cache writes do: q, k [T, H, D], v
        [T, Hkv, Dv] (views of the QKV product) -> q normed and rotated [T, Hq, D], with k and v in the cache; then
        `gqa_cached` attends."""
        from gpu_layers import qk_rope_cache

        k_cache, v_cache = kv_cache
        return qk_rope_cache.qk_norm_rope_cache(
            q, k, v, q_norm_weight, k_norm_weight, eps, batch.positions, rotary.inv_freq, rotary.attention_factor,
            rotary.is_interleaved, k_cache, v_cache, batch.slot_mapping)

    def gqa_cached(self, q, kv_cache, batch: ForwardBatch, scale: float, sliding_window: int | None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`gqa` once the step's keys and values are in the cache."""
        k_cache, v_cache = kv_cache
        if max(batch.query_lens_cpu) == 1:
            return self.attention.paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, sliding_window,
                max_seq_len=max(batch.seq_lens_cpu), sinks=sinks)
        return self.attention.paged_prefill_attention(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            max(batch.query_lens_cpu), scale, sliding_window, sinks=sinks)

    @staticmethod
    def supports_linear(cfg: LinearAttentionConfig, dtype: torch.dtype) -> bool:
        """Whether `gpu_layers.delta_net`'s kernels take this Gated DeltaNet layer (else the PyTorch loops run)."""
        from gpu_layers import delta_net

        return (dtype in delta_net.SUPPORTED_DTYPES and cfg.head_k_dim in delta_net.SUPPORTED_HEAD_DIMS
                and cfg.head_v_dim in delta_net.SUPPORTED_HEAD_DIMS
                and cfg.conv_kernel in delta_net.SUPPORTED_KERNEL_SIZES)

    def causal_conv1d(self, x, weight, conv_pool, batch: ForwardBatch) -> torch.Tensor:
        if not self.has_linear_kernels:
            return super().causal_conv1d(x, weight, conv_pool, batch)
        from gpu_layers import delta_net

        if max(batch.query_lens_cpu) == 1:
            _zero_fresh_slots(conv_pool, batch)
            return delta_net.causal_conv1d_decode(x, weight, None, conv_pool, batch.state_slots)
        return delta_net.causal_conv1d_prefill(x, weight, None, batch.query_start_loc, conv_pool, batch.state_slots,
                                               batch.has_initial_state, max_seqlen=max(batch.query_lens_cpu))

    def gated_delta_rule(self, q, k, v, g, beta, state_pool, batch: ForwardBatch) -> torch.Tensor:
        if not self.has_linear_kernels:
            return super().gated_delta_rule(q, k, v, g, beta, state_pool, batch)
        from gpu_layers import delta_net

        scale = q.shape[-1] ** -0.5
        if max(batch.query_lens_cpu) == 1:
            _zero_fresh_slots(state_pool, batch)
            return delta_net.gated_delta_rule_decode(q, k, v, g, beta, state_pool, batch.state_slots, scale)
        return delta_net.gated_delta_rule_prefill(q, k, v, g, beta, batch.query_start_loc, state_pool,
                                                  batch.state_slots, batch.has_initial_state, scale)

    def dsa_select(self, q, k, weights, index_cache, batch: ForwardBatch, scale: float,
                   topk: int) -> torch.Tensor | None:
        from gpu_layers import dsa

        self.kv_cache.write_kv_cache(index_cache, k.unsqueeze(1), batch.slot_mapping)
        # Decode always selects, as a captured decode step must (it is replayed at every length): eager and graph
        # decode run the same kernels. A prefill step within top-k runs dense attention.
        max_context = max(batch.seq_lens_cpu)
        if max_context <= topk and max(batch.query_lens_cpu) > 1:
            return None
        row_seq, row_limit = batch.token_rows()
        return dsa.index_topk(q, weights, index_cache, batch.block_tables, row_seq, row_limit, scale, max_context,
                              topk)

    def mla(self, q_nope, q_rope, latent, kv_cache, w_kv_b, batch: ForwardBatch, scale: float,
            v_head_dim: int, selected: torch.Tensor | None = None) -> torch.Tensor:
        (latent_cache,) = kv_cache
        self.kv_cache.write_kv_cache(latent_cache, latent.unsqueeze(1), batch.slot_mapping)
        if selected is not None:
            from gpu_layers import mla_sparse

            row_seq, _ = batch.token_rows()
            return mla_sparse.mla_sparse(q_nope, q_rope, latent_cache, w_kv_b, batch.block_tables, row_seq, selected,
                                         scale, v_head_dim)
        if max(batch.query_lens_cpu) == 1:
            return self.mla_kernels.mla_decode(q_nope, q_rope, latent_cache, w_kv_b, batch.block_tables,
                                               batch.seq_lens, scale, v_head_dim)
        return self.mla_kernels.mla_prefill(
            q_nope, q_rope, latent_cache, w_kv_b, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            max(batch.query_lens_cpu), scale, v_head_dim, num_context_tokens=sum(batch.seq_lens_cpu))


ExpertsFactory = Callable[[int, ModelConfig], nn.Module]  # (layer_idx, config) -> routed-experts module


def default_experts_factory(layer_idx: int, config: ModelConfig) -> nn.Module:
    """Every routed expert on the engine's device, through the PyTorch reference."""
    return device_experts_factory(layer_idx, config, is_fused=False)


def triton_experts_factory(layer_idx: int, config: ModelConfig) -> nn.Module:
    """Every routed expert on the engine's device, through the fused-MoE kernel."""
    return device_experts_factory(layer_idx, config, is_fused=True)


def uses_gemm_kernels(device: torch.device | str, kernels: str, dtype: torch.dtype) -> bool:
    """Whether the MoE and linear GEMM kernels run: the Triton ops, in the 16-bit dtypes those kernels take."""
    return dense_ops_for(device, kernels) is not TORCH_OPS and dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Backends:
    attention: TorchAttentionBackend | TritonAttentionBackend = field(default_factory=TorchAttentionBackend)
    make_experts: ExpertsFactory = default_experts_factory
    ops: DenseOps = TORCH_OPS
    # Dense Linear layers keep quantized checkpoint weights for the Triton GEMMs (hybrid.layers.quantized_linear)
    keep_quantized: bool = False
    # Expert deferral (`hybrid.layers.moe.ExpertDeferral`): each token's N lowest-weight CPU experts a layer late
    defer_experts: int = 0

    @classmethod
    def for_device(cls, device: torch.device | str, config: ModelConfig, block_size: int, dtype: torch.dtype,
                   kernels: str = "auto", make_experts: ExpertsFactory | None = None,
                   defer_experts: int = 0) -> Backends:
        """`kernels`: "auto" (the Triton kernels on CUDA, PyTorch elsewhere), "triton" or "torch".
        `make_experts` None: the model's own routed experts on `device`, through the fused-MoE kernel where the
        kernels run in bf16/fp16, else the PyTorch reference."""
        ops = dense_ops_for(device, kernels)
        is_triton = ops is not TORCH_OPS
        attention = TorchAttentionBackend()
        if is_triton and all(TritonAttentionBackend.supports(spec.attention, block_size) for spec in config.layers):
            linear = [spec.linear for spec in config.layers if spec.linear is not None]
            attention = TritonAttentionBackend(bool(linear) and all(
                TritonAttentionBackend.supports_linear(cfg, dtype) for cfg in linear))
        is_half_kernels = uses_gemm_kernels(device, kernels, dtype)
        if make_experts is None:
            make_experts = triton_experts_factory if is_half_kernels else default_experts_factory
        return cls(attention=attention, make_experts=make_experts, ops=ops, keep_quantized=is_half_kernels,
                   defer_experts=defer_experts)
