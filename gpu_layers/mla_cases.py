"""The gate and benchmark cases of gpu_layers.mla (read through its gate_cases and bench_cases): every kernel at
each gated model's dims and each capability's config, and decode/prefill timings at DeepSeek-V3's and
GLM-4.7-Flash's dims."""

from __future__ import annotations

import math

import torch
import triton

from gpu_layers.capability import CAPABILITIES, GateCase, select
from gpu_layers.mla import (
    DECODE_CONFIGS,
    REDUCE_WARPS,
    TRITON_DTYPES,
    block_dim,
    mla_decode,
    mla_decode_kernel,
    mla_decode_reduce_kernel,
    mla_prefill,
    mla_prefill_kernel,
    prefill_config,
)

DEEPSEEK_V3 = dict(num_heads=128, nope_dim=128, rope_dim=64, v_head_dim=128, rank=512)  # and Kimi-K2
GLM_4_7_FLASH = dict(num_heads=20, nope_dim=192, rope_dim=64, v_head_dim=256, rank=512)
GATED_MODELS = {"deepseek-v3": DEEPSEEK_V3, "glm-4.7-flash": GLM_4_7_FLASH}


def _decode_signature(dtype: str) -> dict[str, str]:
    sig = {name: f"*{dtype}" for name in ("q_latent", "q_rope", "cache")}
    sig.update(block_tables="*i32", seq_lens="*i32", o_part="*fp32", lse_part="*fp32", qk_scale="fp32")
    for name in ("num_heads", "page_size", "stride_ql_b", "stride_ql_h", "stride_qr_b", "stride_qr_h", "stride_bt"):
        sig[name] = "i32"
    return sig | {name: "constexpr" for name in ("R", "DR", "BLOCK_R", "BLOCK_DR", "BLOCK_H", "BLOCK_N")}


def reduce_signature(dtype: str) -> dict[str, str]:
    return dict(o_part="*fp32", lse_part="*fp32", out=f"*{dtype}", num_heads="i32", num_splits="i32",
                stride_out_b="i32", stride_out_h="i32", R="constexpr", BLOCK_R="constexpr")


def _prefill_signature(dtype: str) -> dict[str, str]:
    sig = {name: f"*{dtype}" for name in ("q_nope", "q_rope", "kv", "latents", "out")}
    sig.update(query_start_loc="*i32", seq_lens="*i32", context_start="*i32", qk_scale="fp32", num_heads="i32")
    for name in ("stride_qn_t", "stride_qn_h", "stride_qr_t", "stride_qr_h", "stride_o_t", "stride_o_h"):
        sig[name] = "i32"
    constexprs = ("DN", "DR", "DV", "R", "BLOCK_DN", "BLOCK_DR", "BLOCK_DV", "BLOCK_M", "BLOCK_N")
    return sig | {name: "constexpr" for name in constexprs}


def _decode_gate_cases(capability: int, dtype: str, size: int, dims: dict) -> list[GateCase]:
    dec = select(DECODE_CONFIGS, capability)[size]
    rank, rope = dims["rank"], dims["rope_dim"]
    where = f"R={rank} DR={rope}"
    return [
        GateCase(mla_decode_kernel, _decode_signature(dtype),
                 dict(R=rank, DR=rope, BLOCK_R=block_dim(rank), BLOCK_DR=block_dim(rope), BLOCK_H=dec.block_h,
                      BLOCK_N=dec.block_n), capability, f"mla_decode {dtype} {where} {dec}", dec.num_warps,
                 dec.num_stages),
        GateCase(mla_decode_reduce_kernel, reduce_signature(dtype), dict(R=rank, BLOCK_R=block_dim(rank)),
                 capability, f"mla_decode_reduce {dtype} {where}", REDUCE_WARPS, 1),
    ]


def _prefill_gate_case(capability: int, dtype: str, size: int, dims: dict, model: str) -> GateCase:
    dn, dr, dv = dims["nope_dim"], dims["rope_dim"], dims["v_head_dim"]
    pre = prefill_config(capability, dn, dv, size)
    return GateCase(
        mla_prefill_kernel, _prefill_signature(dtype),
        dict(DN=dn, DR=dr, DV=dv, R=dims["rank"], BLOCK_DN=block_dim(dn), BLOCK_DR=block_dim(dr),
             BLOCK_DV=block_dim(dv), BLOCK_M=pre.block_m, BLOCK_N=pre.block_n),
        capability, f"mla_prefill {dtype} {model} {pre}", pre.num_warps, pre.num_stages)


def gate() -> list[GateCase]:
    """Every kernel at each gated model's dims (DeepSeek-V3 / Kimi-K2, GLM-4.7-Flash), for each capability's config
    of each dtype. Decode sees only R and Dr, which the models share: one decode compile serves both."""
    cases = []
    for capability in CAPABILITIES:
        for torch_dtype, dtype in TRITON_DTYPES.items():
            size = torch_dtype.itemsize
            decode_dims = {(d["rank"], d["rope_dim"]): d for d in GATED_MODELS.values()}
            for dims in decode_dims.values():
                cases += _decode_gate_cases(capability, dtype, size, dims)
            cases += [_prefill_gate_case(capability, dtype, size, dims, model) for model, dims in GATED_MODELS.items()]
    return cases


def _random_layer(num_heads, nope_dim, rope_dim, v_head_dim, rank, num_pages, page_size, device, dtype):
    """A random latent cache and kv_b weight at a typical scale (normalised latents, ~1/sqrt(R) weights)."""
    cache = torch.randn(num_pages, page_size, 1, rank + rope_dim, device=device, dtype=dtype)
    w_kv_b = torch.randn(num_heads * (nope_dim + v_head_dim), rank, device=device, dtype=dtype) / math.sqrt(rank)
    return cache, w_kv_b


def bench() -> list[tuple[str, object, int, int]]:
    """DeepSeek-V3 (128 heads on one GPU) decode at batch {1, 8, 32} x context {1K, 8K, 32K}, and prefill, at its
    dims and at GLM-4.7-Flash's (Dn 192, padded in the kernel). Decode bytes: the latents read
    (B * context * (R + Dr)) plus W_UK and W_UV; flops: scores, p @ c and both bmms."""
    device, dtype, page_size = torch.device("cuda"), torch.bfloat16, 64
    h, dn, dr, dv, r = (DEEPSEEK_V3[k] for k in ("num_heads", "nope_dim", "rope_dim", "v_head_dim", "rank"))
    max_tokens = 32 * 32768
    cache, w_kv_b = _random_layer(h, dn, dr, dv, r, max_tokens // page_size, page_size, device, dtype)
    weight_bytes = w_kv_b.numel() * w_kv_b.element_size()
    cases = []
    for batch in (1, 8, 32):
        for context in (1024, 8192, 32768):
            pages_per_seq = context // page_size
            tables = torch.randperm(cache.shape[0], device=device)[: batch * pages_per_seq].view(batch, -1).int()
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q_nope = torch.randn(batch, h, dn, device=device, dtype=dtype)
            q_rope = torch.randn(batch, h, dr, device=device, dtype=dtype)
            out = torch.empty(batch, h, dv, device=device, dtype=dtype)

            def run(q_nope=q_nope, q_rope=q_rope, tables=tables, seq_lens=seq_lens, out=out):
                mla_decode(q_nope, q_rope, cache, w_kv_b, tables, seq_lens, 0.1, dv, out=out)

            latent_bytes = batch * context * (r + dr) * cache.element_size()
            flops = 2 * batch * h * (context * (2 * r + dr) + dn * r + r * dv)
            cases.append((f"mla_decode B={batch} ctx={context}", run, latent_bytes + weight_bytes, flops))
    glm = GLM_4_7_FLASH
    glm_layer = _random_layer(*(glm[k] for k in ("num_heads", "nope_dim", "rope_dim", "v_head_dim", "rank")),
                              cache.shape[0], page_size, device, dtype)
    for prefix, new in ((0, 4096), (8192, 2048)):
        cases.append(_prefill_case(cache, w_kv_b, prefix, new, page_size, DEEPSEEK_V3, ""))
        cases.append(_prefill_case(*glm_layer, prefix, new, page_size, glm, " glm-4.7-flash"))
    return cases


def _prefill_case(cache, w_kv_b, prefix: int, new: int, page_size: int, dims: dict, model: str):
    device, dtype = cache.device, cache.dtype
    h, dn, dr, dv, r = (dims[k] for k in ("num_heads", "nope_dim", "rope_dim", "v_head_dim", "rank"))
    context = prefix + new
    tables = torch.arange(triton.cdiv(context, page_size), device=device, dtype=torch.int32)[None]
    seq_lens = torch.tensor([context], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, new], dtype=torch.int32, device=device)
    q_nope = torch.randn(new, h, dn, device=device, dtype=dtype)
    q_rope = torch.randn(new, h, dr, device=device, dtype=dtype)
    out = torch.empty(new, h, dv, device=device, dtype=dtype)

    def run():
        mla_prefill(q_nope, q_rope, cache, w_kv_b, tables, seq_lens, query_start_loc, new, 0.1, dv, out=out,
                    num_context_tokens=context)

    visible = new * prefix + new * (new + 1) // 2  # (query, key) pairs under the causal mask
    flops = 2 * context * r * h * (dn + dv) + 2 * h * visible * (dn + dr + dv)
    size = cache.element_size()
    moved = (context * (r + dr) + w_kv_b.numel() + 2 * context * h * (dn + dv) + new * h * (dn + dr + dv)) * size
    return f"mla_prefill{model} prefix={prefix} new={new}", run, moved, flops
