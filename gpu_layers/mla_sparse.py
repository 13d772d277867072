"""Sparse multi-head latent attention (DSA: DeepSeek-V3.2, GLM-5): each query row attends only to the cached
positions its indexer selected, over the compressed paged cache of `gpu_layers.mla`.

Data flow (N rows, H heads, K selected entries per row; Dn, Dr, Dv, R as in mla.py):
- A row is one query token: a decode sequence's new token (N = B) or one new token of a prefill (N = T). Row n
  belongs to sequence row_seq[n], the row of block_tables that maps its positions to cache pages, and attends to
  the positions selected[n, :] of that sequence (any order, -1 = no token), shared by all its heads. The selection
  already carries the causal mask (the indexer sees only visible positions), so the kernel applies none.
- Weight absorption, as mla_decode: q_latent = q_nope W_UK [H, N, R] (`mla_absorb`'s kernels, as there), then one
  kernel scores a block of heads against the gathered latents, score = (q_latent . c + q_rope . kr) * scale, and
  accumulates o_latent = softmax(score) @ c; out = o_latent W_UV^T [N, H, Dv], written into out. Each selected
  latent is read once per head block; in prefill every token has its own selection, so expanding the latents per
  head, as mla_prefill does for a shared context, would expand K latents per token instead of once.
- Decode and prefill share the kernel: a program per (row, head block, split of the K entries). Small batches
  split the K entries (flash decoding) so that batch 1 still fills the GPU; each split writes a normalised
  partial and its log-sum-exp, merged by mla.py's reduce kernel. With one split (many rows) the kernel writes
  o_latent itself, and prefill needs no [N, H, R] float32 partials. Grids depend on shapes and host ints only:
  CUDA-graph safe.
- A row whose selection is all -1 (a padded slot) yields zeros, never NaN: a tile of -1 entries before the row's
  first selected token keeps the running maximum at -inf, and the exponents are then taken against 0.

Measured on an H100 (bf16, K = 2048, DeepSeek-V3.2's 128 heads, CUDA graph), before mla_absorb's kernels: 50 us
at batch 1, about half of it the two absorption bmms (they read all of W_kv_b, 32 MiB) and 11 us the reduce (then
one split a step, now 8); 80 us at batch 8. Dense mla_decode over the whole context takes 1.3x as long at 8K
tokens and 5x (batch 1) to 21x (batch 8) at 128K.

Entries must be below the sequence's length (the indexer's selection is); they are not checked on the device,
which would need a sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_layers import mla, mla_absorb, mla_cases
from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, num_sms, select
from gpu_layers.mla import (
    LOG2E,
    MAX_SPLITS,
    REDUCE_WARPS,
    TRITON_DTYPES,
    _check_out,
    _require,
    _tile_mask,
    absorb_output,
    absorb_query,
    block_dim,
    check_layer_inputs,
    mla_decode_reduce_kernel,
)


@dataclass(frozen=True)
class SparseConfig:
    block_h: int  # heads per program: they share every latent tile the program gathers
    block_n: int  # selected entries per tile
    num_warps: int
    num_stages: int


# Keyed by capability, then element size (bf16 and fp16: 2, fp32: 4). The tile budget is mla_decode's: scoring
# is as compute-bound (some 240 flops per latent byte at 128 heads), so a program takes 64 heads, and on 99 KiB
# parts (SM120, SM89) that costs 16-entry tiles beside the [64, R] query block; Hopper takes 32-entry tiles.
# The gather adds only the tile's entry indices and page numbers, fetched ahead. Hopper runs three stages: two
# spilled at first (before the look-ahead) and are no faster on an H100 now; its [64, 16] tiles ran 5-20% slower.
# fp32 takes the smallest tiles.
SPARSE_CONFIGS = {
    89: {2: SparseConfig(64, 16, 8, 2), 4: SparseConfig(16, 16, 8, 1)},
    90: {2: SparseConfig(64, 32, 8, 3), 4: SparseConfig(16, 16, 8, 1)},
    120: {2: SparseConfig(64, 16, 8, 2), 4: SparseConfig(16, 16, 8, 1)},
}
# At batch 1 (K = 2048, DeepSeek-V3.2 on an H100) 32 splits of two tiles beat 64 of one (52 us against 54 with the
# bmms): the reduce, which then walked the splits one by one, took 11 us at 32 splits already (it now loads 8 a
# step; both measured before that).
MIN_SPLIT_TILES = 2


@triton.jit
def mla_sparse_kernel(
    q_latent, q_rope, cache, block_tables, row_seq, selected, o_latent, o_part, lse_part,
    qk_scale, num_heads, page_size, num_selected,
    stride_ql_n, stride_ql_h, stride_qr_n, stride_qr_h, stride_bt, stride_sel, stride_ol_n, stride_ol_h,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: row n, heads [h0, h0 + BLOCK_H), one contiguous split of the row's K selected entries. With
    one split it writes the normalised o_latent [H, N, R] rows; else the split's normalised partial o_part
    [N, H, S, R] and base-2 log-sum-exp lse_part [N, H, S] (-inf where the split selected nothing)."""
    n = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split, num_splits = tl.program_id(2), tl.num_programs(2)
    is_head = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)

    seq_table = block_tables + tl.load(row_seq + n) * stride_bt
    # Splits start on tile boundaries so only the selection's last tile is partial.
    split_len = tl.cdiv(tl.cdiv(num_selected, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, num_selected)

    # Prefill rows can number tens of thousands: head offsets in [H, N, R] are 64-bit.
    q_lat = tl.load(q_latent + n * stride_ql_n + heads[:, None].to(tl.int64) * stride_ql_h + offs_r[None, :],
                    mask=_tile_mask(is_head, offs_r, R, BLOCK_R), other=0.0)
    q_rp = tl.load(q_rope + n.to(tl.int64) * stride_qr_n + heads[:, None] * stride_qr_h + offs_dr[None, :],
                   mask=_tile_mask(is_head, offs_dr, DR, BLOCK_DR), other=0.0)
    q_lat_t = tl.trans(q_lat)
    q_rp_t = tl.trans(q_rp)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # The latents' addresses hang on two loads (entry -> page number): those are fetched a tile (page) and two
    # tiles (entry) ahead, so each tile's gather waits on nothing loaded in the same iteration.
    sel_row = selected + n.to(tl.int64) * stride_sel
    offs_n = tl.arange(0, BLOCK_N)
    pos = tl.load(sel_row + start + offs_n, mask=start + offs_n < end, other=-1)
    page = tl.load(seq_table + pos // page_size, mask=pos >= 0, other=0)
    pos_next = tl.load(sel_row + start + BLOCK_N + offs_n, mask=start + BLOCK_N + offs_n < end, other=-1)
    for tile in range(start, end, BLOCK_N):
        is_valid = pos >= 0
        # Entry offsets are multiples of R + DR (the cache is contiguous): aligned vector loads, as in mla_decode.
        slot = (page.to(tl.int64) * page_size + pos % page_size) * (R + DR)
        c = tl.load(cache + slot[:, None] + offs_r[None, :], mask=_tile_mask(is_valid, offs_r, R, BLOCK_R),
                    other=0.0)
        kr = tl.load(cache + slot[:, None] + R + offs_dr[None, :], mask=_tile_mask(is_valid, offs_dr, DR, BLOCK_DR),
                     other=0.0)
        page_next = tl.load(seq_table + pos_next // page_size, mask=pos_next >= 0, other=0)
        after = tile + 2 * BLOCK_N + offs_n
        pos_after = tl.load(sel_row + after, mask=after < end, other=-1)
        # Tokens on the M axis, as in mla_decode: the latent tile is the A operand here and the B operand below,
        # both read untransposed from one shared-memory copy.
        scores = tl.dot(c, q_lat_t, input_precision="ieee")  # [BLOCK_N, BLOCK_H]
        scores = tl.dot(kr, q_rp_t, scores, input_precision="ieee")
        scores = tl.where(is_valid[:, None], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        # -1 entries may come first (any order): until a selected one, m stays -inf and exponents are against 0,
        # so alpha and p are 0 rather than exp2(-inf + inf) = NaN.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = tl.dot(tl.trans(p).to(c.dtype), c, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
        pos, page, pos_next = pos_next, page_next, pos_after

    is_empty = l_i == 0.0
    l_safe = tl.where(is_empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    out_mask = _tile_mask(is_head, offs_r, R, BLOCK_R)
    if num_splits == 1:
        dest = o_latent + n * stride_ol_n + heads[:, None].to(tl.int64) * stride_ol_h + offs_r[None, :]
        tl.store(dest, o.to(o_latent.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(l_safe))
        row = (n * num_heads + heads).to(tl.int64) * num_splits + split
        tl.store(o_part + row[:, None] * R + offs_r[None, :], o, mask=out_mask)
        tl.store(lse_part + row, lse, mask=is_head)


# ---------------------------------------------------------------------------------------------------- launcher


def default_num_splits(num_rows: int, num_head_blocks: int, num_selected: int, block_n: int, num_sms: int) -> int:
    """Splits per (row, head block) so the grid covers the GPU about once (one block fits an SM), none shorter
    than MIN_SPLIT_TILES tiles; 1 once the rows alone fill it. From host ints only (CUDA-graph safe)."""
    wanted = max(1, num_sms // max(1, num_rows * num_head_blocks))
    useful = max(1, triton.cdiv(num_selected, MIN_SPLIT_TILES * block_n))
    return min(wanted, useful, MAX_SPLITS)


def _check_selection(row_seq: torch.Tensor, selected: torch.Tensor, num_rows: int, device: torch.device) -> None:
    _require(row_seq.dim() == 1 and row_seq.shape[0] == num_rows and row_seq.dtype == torch.int32,
             f"row_seq must be [{num_rows}] int32 (one sequence per query row), got {tuple(row_seq.shape)} "
             f"{row_seq.dtype}")
    _require(selected.dim() == 2 and selected.shape[0] == num_rows and selected.dtype == torch.int32,
             f"selected must be [{num_rows}, K] int32 (one row per query row), got {tuple(selected.shape)} "
             f"{selected.dtype}")
    for name, t in (("row_seq", row_seq), ("selected", selected)):
        _require(t.device == device, f"{name} must be on {device}, got {t.device}")
    _require(selected.shape[1] <= 1 or selected.stride(1) == 1, "selected must be contiguous in its last dim")


def mla_sparse(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    v_head_dim: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query rows q_nope [N, H, Dn], q_rope [N, H, Dr], row n of sequence row_seq[n] (its block_tables row),
    attending to the positions selected[n] [K] int32 of that sequence (-1: none) -> [N, H, Dv], by weight
    absorption over the latent cache. No host syncs: CUDA-graph safe."""
    num_heads, nope_dim, rank = check_layer_inputs(q_nope, q_rope, latent_cache, w_kv_b, block_tables, v_head_dim)
    num_rows, rope_dim, device = q_nope.shape[0], q_rope.shape[2], q_nope.device
    _check_selection(row_seq, selected, num_rows, device)
    out = _check_out(out, (num_rows, num_heads, v_head_dim), q_nope)
    num_selected = selected.shape[1]
    if num_rows == 0:
        return out
    if num_selected == 0:
        return out.zero_()
    cfg = select(SPARSE_CONFIGS, capability_of(device))[q_nope.element_size()]
    num_head_blocks = triton.cdiv(num_heads, cfg.block_h)
    if num_splits is None:
        num_splits = default_num_splits(num_rows, num_head_blocks, num_selected, cfg.block_n, num_sms(device))
    _require(1 <= num_splits <= MAX_SPLITS, f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")

    use_kernels = mla_absorb.is_supported(w_kv_b, q_nope, out)
    q_latent = absorb_query(q_nope, w_kv_b, nope_dim, v_head_dim, use_kernels)  # [H, N, R]
    o_latent = torch.empty_like(q_latent)  # [H, N, R], the layout the output absorption reads
    # One split writes o_latent itself; the partials' pointers are then unused (but typed as the gate compiled).
    partial_shape = (num_rows, num_heads, num_splits) if num_splits > 1 else (0, 0, 0)
    o_part = torch.empty(*partial_shape, rank, dtype=torch.float32, device=device)
    lse_part = torch.empty(partial_shape, dtype=torch.float32, device=device)
    mla_sparse_kernel[(num_rows, num_head_blocks, num_splits)](
        q_latent, q_rope, latent_cache, block_tables, row_seq, selected, o_latent, o_part, lse_part,
        scale * LOG2E, num_heads, latent_cache.shape[1], num_selected,
        q_latent.stride(1), q_latent.stride(0), q_rope.stride(0), q_rope.stride(1), block_tables.stride(0),
        selected.stride(0), o_latent.stride(1), o_latent.stride(0),
        R=rank, DR=rope_dim, BLOCK_R=block_dim(rank), BLOCK_DR=block_dim(rope_dim), BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        mla_decode_reduce_kernel[(num_rows, num_heads)](
            o_part, lse_part, o_latent, num_heads, num_splits, o_latent.stride(1), o_latent.stride(0),
            R=rank, BLOCK_R=block_dim(rank), num_warps=REDUCE_WARPS,
        )
    return absorb_output(o_latent, w_kv_b, nope_dim, v_head_dim, out, use_kernels)


# ---------------------------------------------------------------------------------------------------- gate, bench

DEEPSEEK_V3_2 = dict(num_heads=128, nope_dim=128, rope_dim=64, v_head_dim=128, rank=512)
GLM_5 = dict(num_heads=64, nope_dim=192, rope_dim=64, v_head_dim=256, rank=512)
GATED_MODELS = {"deepseek-v3.2": DEEPSEEK_V3_2, "glm-5": GLM_5}
INDEX_TOPK = 2048  # both models' index_topk


def _sparse_signature(dtype: str) -> dict[str, str]:
    sig = {name: f"*{dtype}" for name in ("q_latent", "q_rope", "cache")}
    sig.update(block_tables="*i32", row_seq="*i32", selected="*i32", o_latent=f"*{dtype}", o_part="*fp32",
               lse_part="*fp32", qk_scale="fp32")
    for name in ("num_heads", "page_size", "num_selected", "stride_ql_n", "stride_ql_h", "stride_qr_n",
                 "stride_qr_h", "stride_bt", "stride_sel", "stride_ol_n", "stride_ol_h"):
        sig[name] = "i32"
    return sig | {name: "constexpr" for name in ("R", "DR", "BLOCK_R", "BLOCK_DR", "BLOCK_H", "BLOCK_N")}


def gate_cases() -> list[GateCase]:
    """The kernel for each capability's config of each dtype, and mla.py's reduce it launches, at the gated
    models' R and Dr (which DeepSeek-V3.2 and GLM-5 share: the kernel never sees Dn or Dv)."""
    cases = []
    dims = {(d["rank"], d["rope_dim"]) for d in GATED_MODELS.values()}
    for capability in CAPABILITIES:
        for torch_dtype, dtype in TRITON_DTYPES.items():
            cfg = select(SPARSE_CONFIGS, capability)[torch_dtype.itemsize]
            for rank, rope in sorted(dims):
                constexprs = dict(R=rank, DR=rope, BLOCK_R=block_dim(rank), BLOCK_DR=block_dim(rope),
                                  BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n)
                where = f"R={rank} DR={rope}"
                cases += [
                    GateCase(mla_sparse_kernel, _sparse_signature(dtype), constexprs, capability,
                             f"mla_sparse {dtype} {where} {cfg}", cfg.num_warps, cfg.num_stages),
                    GateCase(mla_decode_reduce_kernel, mla_cases.reduce_signature(dtype),
                             dict(R=rank, BLOCK_R=block_dim(rank)), capability,
                             f"mla_sparse reduce {dtype} {where}", REDUCE_WARPS, 1),
                ]
    return cases


def bench_cases() -> list[tuple]:
    """Decode at batch {1, 8} x context {8K, 32K, 128K}, K = 2048 distinct random positions per row, at
    DeepSeek-V3.2's dims (128 heads) and GLM-5's (64 heads), bf16, pages of 64. Bytes: the selected latents
    (K * (R + Dr) per row), q, out and the absorption weight W_UK / W_UV (the larger share at batch 1); flops:
    scores, p @ c and both absorptions. Baseline: dense mla_decode over the whole context."""
    device, dtype, page_size = torch.device("cuda"), torch.bfloat16, 64
    batches, contexts = (1, 8), (8192, 32768, 131072)
    rank, rope = DEEPSEEK_V3_2["rank"], DEEPSEEK_V3_2["rope_dim"]  # GLM-5's too: one cache serves both
    num_pages = max(batches) * max(contexts) // page_size
    cache = torch.randn(num_pages, page_size, 1, rank + rope, device=device, dtype=dtype)
    cases = []
    for model, dims in GATED_MODELS.items():
        h, dn, dv = dims["num_heads"], dims["nope_dim"], dims["v_head_dim"]
        w_kv_b = torch.randn(h * (dn + dv), rank, device=device, dtype=dtype) / math.sqrt(rank)
        for batch in batches:
            for context in contexts:
                cases.append(_bench_case(model, dims, cache, w_kv_b, batch, context))
    return cases


def _bench_case(model: str, dims: dict, cache: torch.Tensor, w_kv_b: torch.Tensor, batch: int, context: int):
    device, dtype, page_size = cache.device, cache.dtype, cache.shape[1]
    h, dn, dr, dv, r = (dims[k] for k in ("num_heads", "nope_dim", "rope_dim", "v_head_dim", "rank"))
    tables = torch.randperm(cache.shape[0], device=device)[: batch * context // page_size].view(batch, -1).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    row_seq = torch.arange(batch, dtype=torch.int32, device=device)
    selected = torch.rand(batch, context, device=device).topk(INDEX_TOPK, dim=1).indices.int()
    q_nope = torch.randn(batch, h, dn, device=device, dtype=dtype)
    q_rope = torch.randn(batch, h, dr, device=device, dtype=dtype)
    out = torch.empty(batch, h, dv, device=device, dtype=dtype)
    dense_out = torch.empty_like(out)

    def run():
        mla_sparse(q_nope, q_rope, cache, w_kv_b, tables, row_seq, selected, 0.1, dv, out=out)

    def dense():
        mla.mla_decode(q_nope, q_rope, cache, w_kv_b, tables, seq_lens, 0.1, dv, out=dense_out)

    size = cache.element_size()
    moved = (batch * INDEX_TOPK * (r + dr) + w_kv_b.numel() + batch * h * (dn + dr + dv)) * size
    flops = 2 * batch * h * (INDEX_TOPK * (2 * r + dr) + dn * r + r * dv)
    return f"mla_sparse {model} B={batch} ctx={context} K={INDEX_TOPK}", run, moved, flops, dense
