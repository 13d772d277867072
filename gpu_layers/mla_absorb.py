"""MLA weight absorption as two Triton kernels: the query into latent space before the attention kernel, the
latent output back to v after it (used by `mla.mla_decode` and `mla_sparse.mla_sparse`).

Data flow (B query rows, H heads; Dn = qk_nope_head_dim, Dv = v_head_dim, R = kv_lora_rank): w_kv_b is
kv_b_proj.weight [H * (Dn + Dv), R] (or its [H, Dn + Dv, R] view, contiguous): per head Dn rows W_UK then Dv rows
W_UV.
- `absorb_query`: q_nope [B, H, Dn] -> q_latent [H, B, R], q_latent[h, b] = q_nope[b, h] @ W_UK[h].
- `absorb_output`: o_latent [H, B, R] -> out [B, H, Dv], out[b, h] = o_latent[h, b] @ W_UV[h]^T, stored straight
  into the caller's out (any row strides), so no transposing copy follows.
Both accumulate in float32 and round once to the inputs' dtype (bf16, fp16 or fp32): what cuBLAS's bmm does, up
to summation order.

Why not torch.bmm: at decode (B = 1..a few dozen) a batched GEMM with M = B is latency-bound; the two read all of
w_kv_b (32 MiB at DeepSeek-V3.2's dims), about 8 us at an H200's 4 TB/s, but took some 20 us with the output's
transposing copy. Here one program owns one head and a block of output columns (R for the query, Dv for the
output) and a block of BLOCK_B rows; it walks the reduction dim (Dn, resp. R) in BLOCK_K chunks with tl.dot, so
its weight tile streams from memory once, pipelined, and rows are the dot's M (padded to 16, tl.dot's smallest;
the idle rows cost tensor-core time that a memory-bound kernel has to spare). The row block is the grid's fastest
axis: row blocks of one weight tile run side by side and share its fetch through L2. Decode batches up to 16 take
16-row blocks (the weight is read once); larger ones (prefill rows in `mla_sparse`) take 64, so the weight is
re-read from L2 once per 64 rows.

Tiles are fixed by the config; the dims (constexpr, so weight addresses are known aligned) only set loop counts
and masks, and any size >= 1 is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select

TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ROW_BLOCKS = (16, 64)  # BLOCK_B: decode batches up to 16 in one row block, more rows 64 at a time


@dataclass(frozen=True)
class AbsorbConfig:
    block_k: int  # reduction chunk (Dn for the query, R for the output)
    block_n: int  # output columns a program owns (of R for the query, of Dv for the output)
    num_warps: int
    num_stages: int


# Keyed by capability, then element size. Chosen by offline compiles (no spill, a few KiB of shared memory) and
# the grid size at the gated dims: 1024 programs at DeepSeek-V3.2's (128 heads x 8 column blocks) and 512 (query)
# / 1024 (output) at GLM-5's, each streaming 16-24 KiB of weight. Timed on the H200 with the bf16 configs
# (docs/benchmarks.md): 1.02-1.12x the torch.bmm path they replaced.
QUERY_CONFIGS = {
    89: {2: AbsorbConfig(64, 64, 4, 2), 4: AbsorbConfig(32, 64, 4, 2)},
    90: {2: AbsorbConfig(64, 64, 4, 3), 4: AbsorbConfig(32, 64, 4, 2)},
    120: {2: AbsorbConfig(64, 64, 4, 2), 4: AbsorbConfig(32, 64, 4, 2)},
}
OUTPUT_CONFIGS = {
    89: {2: AbsorbConfig(128, 16, 4, 2), 4: AbsorbConfig(64, 16, 4, 2)},
    90: {2: AbsorbConfig(128, 16, 4, 3), 4: AbsorbConfig(64, 16, 4, 2)},
    120: {2: AbsorbConfig(128, 16, 4, 2), 4: AbsorbConfig(64, 16, 4, 2)},
}


@triton.jit
def absorb_query_kernel(
    q_nope, w, q_latent, num_rows,
    stride_q_b, stride_q_h, stride_ql_h, stride_ql_b,
    DN: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: rows [b0, b0 + BLOCK_B), latent columns [r0, r0 + BLOCK_N) of head h.
    q_latent[h, b, r] = sum_d q_nope[b, h, d] * w[h, d, r], w [H, DN + DV, R] contiguous."""
    h = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_row = rows < num_rows
    is_col = cols < R
    q_rows = q_nope + rows.to(tl.int64)[:, None] * stride_q_b + h * stride_q_h
    w_head = w + h * ((DN + DV) * R)
    acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for k in range(0, DN, BLOCK_K):
        d = k + offs_k
        if DN % BLOCK_K == 0:
            is_d = offs_k < BLOCK_K  # all true: no mask beyond the rows' and columns'
        else:
            is_d = d < DN
        q = tl.load(q_rows + d[None, :], mask=is_row[:, None] & is_d[None, :], other=0.0)
        wt = tl.load(w_head + d[:, None] * R + cols[None, :], mask=is_d[:, None] & is_col[None, :], other=0.0)
        acc = tl.dot(q, wt, acc, input_precision="ieee")
    dest = q_latent + h * stride_ql_h + rows.to(tl.int64)[:, None] * stride_ql_b + cols[None, :]
    tl.store(dest, acc.to(q_latent.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


@triton.jit
def absorb_output_kernel(
    o_latent, w, out, num_rows,
    stride_ol_h, stride_ol_b, stride_o_b, stride_o_h,
    DN: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: rows [b0, b0 + BLOCK_B), v columns [v0, v0 + BLOCK_N) of head h.
    out[b, h, v] = sum_r o_latent[h, b, r] * w[h, DN + v, r], w [H, DN + DV, R] contiguous."""
    h = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    is_row = rows < num_rows
    is_col = cols < DV
    o_rows = o_latent + h * stride_ol_h + rows.to(tl.int64)[:, None] * stride_ol_b
    w_uv = w + h * ((DN + DV) * R) + DN * R
    acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for k in range(0, R, BLOCK_K):
        r = k + offs_k
        if R % BLOCK_K == 0:
            is_r = offs_k < BLOCK_K
        else:
            is_r = r < R
        o = tl.load(o_rows + r[None, :], mask=is_row[:, None] & is_r[None, :], other=0.0)
        # W_UV^T's [BLOCK_K, BLOCK_N] tile, read along R (contiguous in memory): the dot's B operand.
        wt = tl.load(w_uv + cols[None, :] * R + r[:, None], mask=is_r[:, None] & is_col[None, :], other=0.0)
        acc = tl.dot(o, wt, acc, input_precision="ieee")
    dest = out + rows.to(tl.int64)[:, None] * stride_o_b + h * stride_o_h + cols[None, :]
    tl.store(dest, acc.to(out.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


# ---------------------------------------------------------------------------------------------------- launchers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def row_block(num_rows: int) -> int:
    """BLOCK_B for num_rows rows: the smallest of ROW_BLOCKS that holds them, else the largest."""
    return next((block for block in ROW_BLOCKS if num_rows <= block), ROW_BLOCKS[-1])


def _weight_heads(w_kv_b: torch.Tensor, num_heads: int, like: torch.Tensor) -> torch.Tensor:
    """w_kv_b [H * (Dn + Dv), R] or [H, Dn + Dv, R], checked -> its [H, Dn + Dv, R] view."""
    _require(w_kv_b.dim() in (2, 3), f"w_kv_b must be [H * (Dn + Dv), R] or [H, Dn + Dv, R], got "
             f"{tuple(w_kv_b.shape)}")
    _require(w_kv_b.dtype == like.dtype, f"w_kv_b must be {like.dtype} like the activations, got {w_kv_b.dtype}")
    _require(w_kv_b.device == like.device, f"w_kv_b must be on {like.device}, got {w_kv_b.device}")
    _require(w_kv_b.is_contiguous(), "w_kv_b must be contiguous")
    rows = w_kv_b.shape[0] * (w_kv_b.shape[1] if w_kv_b.dim() == 3 else 1)
    _require(num_heads >= 1 and rows % num_heads == 0,
             f"w_kv_b's {rows} rows do not split into {num_heads} heads")
    return w_kv_b.view(num_heads, rows // num_heads, w_kv_b.shape[-1])


def is_supported(w_kv_b: torch.Tensor, *activations: torch.Tensor) -> bool:
    """Whether the kernels take this weight and these tensors as given: a contiguous bf16/fp16/fp32 weight of the
    activations' dtype, activations contiguous in their last dim. Callers keep torch.bmm otherwise."""
    return (w_kv_b.dtype in TRITON_DTYPES and w_kv_b.is_contiguous()
            and all(t.dtype == w_kv_b.dtype and t.stride(-1) == 1 for t in activations))


def _checked_out(out: torch.Tensor | None, shape: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
    """`out` (allocated contiguous if None) checked to be `shape` in like's dtype and device with unit last stride."""
    if out is None:
        return like.new_empty(shape)
    _require(tuple(out.shape) == shape and out.dtype == like.dtype and out.device == like.device
             and (out.numel() == 0 or out.stride(2) == 1),
             f"out must be {list(shape)} {like.dtype} on {like.device} with unit last stride, got "
             f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def absorb_query(q_nope: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [B, H, Dn] (unit last stride), w_kv_b [H * (Dn + Dv), R] -> q_latent [H, B, R] (out: unit last
    stride; allocated contiguous if None) in q_nope's dtype. No host syncs."""
    _require(q_nope.dim() == 3, f"q_nope must be [rows, heads, nope_dim], got {tuple(q_nope.shape)}")
    _require(q_nope.dtype in TRITON_DTYPES, f"q_nope must be bf16, fp16 or fp32, got {q_nope.dtype}")
    _require(q_nope.stride(2) == 1, "q_nope must be contiguous in its last dim")
    num_rows, num_heads, dn = q_nope.shape
    _require(dn == nope_dim and nope_dim >= 1, f"q_nope's last dim must be nope_dim={nope_dim}, got {dn}")
    w = _weight_heads(w_kv_b, num_heads, q_nope)
    dv, rank = w.shape[1] - nope_dim, w.shape[2]
    _require(dv >= 1 and rank >= 1, f"w_kv_b must have more than nope_dim={nope_dim} rows a head and a rank >= 1, "
             f"got {tuple(w.shape)} as [H, Dn + Dv, R]")
    out = _checked_out(out, (num_heads, num_rows, rank), q_nope)
    if num_rows == 0:
        return out
    cfg = select(QUERY_CONFIGS, capability_of(q_nope.device))[q_nope.element_size()]
    block_b = row_block(num_rows)
    grid = (triton.cdiv(num_rows, block_b), triton.cdiv(rank, cfg.block_n), num_heads)
    absorb_query_kernel[grid](
        q_nope, w, out, num_rows, q_nope.stride(0), q_nope.stride(1), out.stride(0), out.stride(1),
        DN=nope_dim, DV=dv, R=rank, BLOCK_B=block_b, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def absorb_output(o_latent: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int, v_head_dim: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """o_latent [H, B, R] (unit last stride), w_kv_b [H * (Dn + Dv), R] -> out [B, H, Dv] in o_latent's dtype,
    written in place with out's own row strides (unit last stride; allocated contiguous if None). No host syncs."""
    _require(o_latent.dim() == 3, f"o_latent must be [heads, rows, rank], got {tuple(o_latent.shape)}")
    _require(o_latent.dtype in TRITON_DTYPES, f"o_latent must be bf16, fp16 or fp32, got {o_latent.dtype}")
    _require(o_latent.stride(2) == 1, "o_latent must be contiguous in its last dim")
    num_heads, num_rows, rank = o_latent.shape
    w = _weight_heads(w_kv_b, num_heads, o_latent)
    _require(nope_dim >= 0 and v_head_dim >= 1 and w.shape[1:] == (nope_dim + v_head_dim, rank),
             f"w_kv_b must be [{num_heads} * ({nope_dim} + {v_head_dim}), {rank}] for nope_dim={nope_dim}, "
             f"v_head_dim={v_head_dim} and o_latent's rank, got {tuple(w_kv_b.shape)}")
    out = _checked_out(out, (num_rows, num_heads, v_head_dim), o_latent)
    if num_rows == 0:
        return out
    cfg = select(OUTPUT_CONFIGS, capability_of(o_latent.device))[o_latent.element_size()]
    block_b = row_block(num_rows)
    grid = (triton.cdiv(num_rows, block_b), triton.cdiv(v_head_dim, cfg.block_n), num_heads)
    absorb_output_kernel[grid](
        o_latent, w, out, num_rows, o_latent.stride(0), o_latent.stride(1), out.stride(0), out.stride(1),
        DN=nope_dim, DV=v_head_dim, R=rank, BLOCK_B=block_b, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------------- references


def absorb_query_reference(q_nope: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """The same in PyTorch: the bmm in float32, rounded once to q_nope's dtype -> [H, B, R]."""
    num_heads = q_nope.shape[1]
    w = w_kv_b.reshape(num_heads, -1, w_kv_b.shape[-1])  # [H, Dn + Dv, R]
    return torch.bmm(q_nope.transpose(0, 1).float(), w[:, :nope_dim].float()).to(q_nope.dtype)


def absorb_output_reference(o_latent: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int,
                            v_head_dim: int) -> torch.Tensor:
    """The same in PyTorch: the bmm in float32, rounded once to o_latent's dtype -> [B, H, Dv]."""
    num_heads = o_latent.shape[0]
    w = w_kv_b.reshape(num_heads, -1, w_kv_b.shape[-1])  # [H, Dn + Dv, R]
    w_uv = w[:, nope_dim:nope_dim + v_head_dim].float()
    return torch.bmm(o_latent.float(), w_uv.transpose(1, 2)).transpose(0, 1).to(o_latent.dtype)


# ---------------------------------------------------------------------------------------------------- gate

DEEPSEEK_V3_2 = dict(nope_dim=128, v_head_dim=128, rank=512)  # and DeepSeek-V3, Kimi-K2
GLM_5 = dict(nope_dim=192, v_head_dim=256, rank=512)
GATED_MODELS = {"deepseek-v3.2": DEEPSEEK_V3_2, "glm-5": GLM_5}


def _signature(kernel, dtype: str) -> dict[str, str]:
    first, strides = (("q_nope", "w", "q_latent"), ("stride_q_b", "stride_q_h", "stride_ql_h", "stride_ql_b")) \
        if kernel is absorb_query_kernel else \
        (("o_latent", "w", "out"), ("stride_ol_h", "stride_ol_b", "stride_o_b", "stride_o_h"))
    sig = {name: f"*{dtype}" for name in first}
    sig["num_rows"] = "i32"
    sig.update({name: "i32" for name in strides})
    return sig | {name: "constexpr" for name in ("DN", "DV", "R", "BLOCK_B", "BLOCK_K", "BLOCK_N")}


def gate_cases() -> list[GateCase]:
    """Both kernels for each capability's config of each dtype, at both row blocks and both gated models' dims."""
    cases = []
    for capability in CAPABILITIES:
        for torch_dtype, dtype in TRITON_DTYPES.items():
            for kernel, table in ((absorb_query_kernel, QUERY_CONFIGS), (absorb_output_kernel, OUTPUT_CONFIGS)):
                cfg = select(table, capability)[torch_dtype.itemsize]
                for model, dims in GATED_MODELS.items():
                    for block_b in ROW_BLOCKS:
                        constexprs = dict(DN=dims["nope_dim"], DV=dims["v_head_dim"], R=dims["rank"],
                                          BLOCK_B=block_b, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n)
                        cases.append(GateCase(kernel, _signature(kernel, dtype), constexprs, capability,
                                              f"{kernel.__name__} {dtype} {model} BLOCK_B={block_b} {cfg}",
                                              cfg.num_warps, cfg.num_stages))
    return cases


# ---------------------------------------------------------------------------------------------------- bench

def bench_cases() -> list[tuple]:
    """Each absorption at DeepSeek-V3.2's dims (128 heads) and GLM-5's (64 heads), bf16, batch 1 and 8, against
    the torch.bmm it replaced (the output's with its transposing copy into out). Bytes: the weight half read
    (W_UK or W_UV, the bulk), the rows in and out; flops: the products."""
    device, dtype, cases = torch.device("cuda"), torch.bfloat16, []
    for model, dims in GATED_MODELS.items():
        h = {"deepseek-v3.2": 128, "glm-5": 64}[model]
        dn, dv, r = dims["nope_dim"], dims["v_head_dim"], dims["rank"]
        w = torch.randn(h * (dn + dv), r, device=device, dtype=dtype) / r**0.5
        w_heads = w.view(h, dn + dv, r)
        for batch in (1, 8):
            q = torch.randn(batch, h, dn, device=device, dtype=dtype)
            o = torch.randn(h, batch, r, device=device, dtype=dtype)
            q_latent = torch.empty(h, batch, r, device=device, dtype=dtype)
            out = torch.empty(batch, h, dv, device=device, dtype=dtype)
            size = w.element_size()
            cases.append((
                f"absorb_query {model} B={batch}",
                lambda q=q, w=w, q_latent=q_latent, dn=dn: absorb_query(q, w, dn, out=q_latent),
                (h * dn * r + batch * h * (dn + r)) * size, 2 * batch * h * dn * r,
                lambda q=q, w_heads=w_heads, q_latent=q_latent, dn=dn: torch.bmm(
                    q.transpose(0, 1), w_heads[:, :dn], out=q_latent)))
            cases.append((
                f"absorb_output {model} B={batch}",
                lambda o=o, w=w, out=out, dn=dn, dv=dv: absorb_output(o, w, dn, dv, out=out),
                (h * dv * r + batch * h * (r + dv)) * size, 2 * batch * h * dv * r,
                lambda o=o, w_heads=w_heads, out=out, dn=dn: out.copy_(torch.bmm(
                    o, w_heads[:, dn:].transpose(1, 2)).transpose(0, 1))))
    return cases
