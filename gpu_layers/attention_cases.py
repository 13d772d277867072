"""The gate and benchmark cases of gpu_layers.attention (read through attention_kernels.gate_cases and
attention.bench_cases): every kernel config the launchers can select, and paged decode against PyTorch SDPA over a
contiguous copy of the same KV plus paged prefill."""

from __future__ import annotations

import functools

import torch
import triton

from gpu_layers.attention import (
    DECODE_CONFIGS,
    REDUCE_CONFIG,
    SPLIT_BLOCK,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    _dims,
    _dot_precision,
    _padded,
    decode_config,
    head_dim_pairs,
    paged_decode_attention,
    paged_decode_kernel,
    paged_decode_reduce_kernel,
    paged_prefill_attention,
    paged_prefill_kernel,
    prefill_config,
)
from gpu_layers.capability import GateCase


def _gate_case(kernel, dtype_name: str, constexprs: dict, capability: int, label: str, num_warps: int,
               num_stages: int) -> GateCase:
    """Argument types follow the naming: *_ptr are pointers (int32 metadata, fp32 partials and sinks, else the data
    dtype), scale_log2 is fp32, other plain arguments are i32."""

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"):
            return "*i32"
        if name.startswith("partial_") or name == "sinks_ptr":
            return "*fp32"
        if name.endswith("_ptr"):
            return f"*{dtype_name}"
        return "fp32" if name == "scale_log2" else "i32"

    signature = {name: arg_type(name) for name in kernel.arg_names}
    return GateCase(kernel, signature, constexprs, capability, label, num_warps, num_stages)


def gate() -> list[GateCase]:
    """Every (kernel, dtype, head dims, sinks) config each capability's table can select. The GQA group, page size
    and sliding window are runtime ints, so they add no variants; the split kernel never reads the sinks."""
    cases = []
    for capability in DECODE_CONFIGS:
        for dtype, name in SUPPORTED_DTYPES.items():
            for head_dim, v_head_dim in head_dim_pairs():
                dims, tag = _dims(head_dim, v_head_dim), _dims_label(head_dim, v_head_dim)
                precision = {"DOT_PRECISION": _dot_precision(dtype)}
                block_n, num_warps, num_stages = decode_config(capability, head_dim, dtype, v_head_dim)
                cases.append(_gate_case(paged_decode_kernel, name, {**dims, **precision, "BLOCK_N": block_n},
                                        capability, f"paged_decode {name} {tag} BLOCK_N={block_n}",
                                        num_warps, num_stages))
                block_m, block_n, num_warps, num_stages = prefill_config(capability, head_dim, dtype, v_head_dim)
                for has_sinks in (False, True):
                    sink_tag = " sinks" if has_sinks else ""
                    reduce = {"HEAD_DIM": v_head_dim, "D_PAD": _padded(v_head_dim), "SPLIT_BLOCK": SPLIT_BLOCK,
                              "HAS_SINKS": has_sinks}
                    if head_dim == v_head_dim or v_head_dim not in SUPPORTED_HEAD_DIMS:  # else a symmetric pair's
                        cases.append(_gate_case(paged_decode_reduce_kernel, name, reduce, capability,
                                                f"paged_decode_reduce {name} Dv={v_head_dim}{sink_tag}",
                                                *REDUCE_CONFIG))
                    prefill = {**dims, **precision, "BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_SINKS": has_sinks}
                    cases.append(_gate_case(paged_prefill_kernel, name, prefill, capability,
                                            f"paged_prefill {name} {tag} BLOCK_M={block_m} BLOCK_N={block_n}"
                                            f"{sink_tag}", num_warps, num_stages))
    return cases


def _dims_label(head_dim: int, v_head_dim: int) -> str:
    return f"D={head_dim}" if head_dim == v_head_dim else f"Dqk={head_dim} Dv={v_head_dim}"


def sdpa_decode_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """What a simple engine does: q [B, Hq, D] over contiguous k, v [B, Hkv, L, D] -> [B, Hq, D]."""
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _bench_tables(num_seqs: int, context: int, page_size: int, num_pages: int, device) -> torch.Tensor:
    """Random (scattered) pages for num_seqs sequences of `context` tokens, out of a pool of num_pages."""
    pages_per_seq = triton.cdiv(context, page_size)
    pages = torch.randperm(num_pages, device=device)[: num_seqs * pages_per_seq]
    return pages.view(num_seqs, pages_per_seq).to(torch.int32)


def bench() -> list[tuple]:
    """Qwen3-30B-A3B-like heads (Hq 32, Hkv 4, D 128, bf16, pages of 16). Decode cases count the KV bytes read
    (plus q and out); each comes with the SDPA baseline over a contiguous copy of the same KV (made at its first
    call). Prefill cases count the causal flops."""
    device = torch.device("cuda")
    num_q_heads, num_kv_heads, head_dim, page_size = 32, 4, 128, 16
    scale = head_dim**-0.5
    batches, contexts = (1, 8, 32, 64), (1024, 8192, 32768)
    cache_shape = (max(batches) * max(contexts) // page_size, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, dtype=torch.bfloat16, device=device) for _ in range(2))
    cases = []
    for num_seqs in batches:
        for context in contexts:
            tables = _bench_tables(num_seqs, context, page_size, k_cache.shape[0], device)
            seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
            q = torch.randn(num_seqs, num_q_heads, head_dim, dtype=torch.bfloat16, device=device)
            out = torch.empty_like(q)
            num_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * 2 + 2 * q.numel() * 2
            flops = 4 * num_seqs * num_q_heads * context * head_dim
            run = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                                    max_seq_len=context)
            cases.append((f"attention.paged_decode B={num_seqs} L={context}", run, num_bytes, flops))
            cases.append((f"attention.sdpa_decode B={num_seqs} L={context}",
                          _sdpa_case(q, k_cache, v_cache, tables, context, scale), num_bytes, flops))
    for num_seqs, new, prefix in ((1, 2048, 0), (4, 512, 7680)):
        cases.append(_prefill_case(num_seqs, new, prefix, num_q_heads, k_cache, v_cache, scale))
    return cases


def _sdpa_case(q, k_cache, v_cache, tables, context: int, scale: float):
    copies = []

    def run():
        if not copies:  # [B, Hkv, L, D]: each sequence's pages laid out contiguously
            for cache in (k_cache, v_cache):
                pages = cache[tables.long()]  # [B, pages, P, Hkv, D]
                copies.append(pages.flatten(1, 2)[:, :context].transpose(1, 2).contiguous())
        return sdpa_decode_baseline(q, copies[0], copies[1], scale)

    return run


def _prefill_case(num_seqs: int, new: int, prefix: int, num_q_heads: int, k_cache, v_cache, scale: float):
    device = k_cache.device
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    context = prefix + new
    tables = _bench_tables(num_seqs, context, page_size, k_cache.shape[0], device)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, (num_seqs + 1) * new, new, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs * new, num_q_heads, head_dim, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    visible_keys = num_seqs * (new * prefix + new * (new + 1) // 2)  # summed over the new tokens
    flops = 4 * num_q_heads * head_dim * visible_keys
    num_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * 2 + 2 * q.numel() * 2
    run = functools.partial(paged_prefill_attention, q, k_cache, v_cache, tables, seq_lens, query_start_loc, new,
                            scale, out=out)
    return f"attention.paged_prefill B={num_seqs} new={new} prefix={prefix}", run, num_bytes, flops
