"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over the compressed paged cache: decode and prefill.

Data flow (B sequences, T new tokens, H heads, L context tokens; Dn = qk_nope_head_dim, Dr = qk_rope_head_dim,
Dv = v_head_dim, R = kv_lora_rank):
- latent_cache [num_blocks, page_size, 1, R + Dr] holds, per token, the normalised kv latent c (R) followed by
  the rotated rope key kr (Dr), shared by all heads. w_kv_b [H * (Dn + Dv), R] is kv_b_proj.weight: per head Dn
  rows W_UK (c -> k_nope) then Dv rows W_UV (c -> v).
- Decode, `mla_decode` (one new token per sequence, q [B, H, *]): weight absorption. Since
  q_nope . (W_UK c) = (q_nope W_UK) . c, the query is moved into latent space once, q_latent [H, B, R]
  (`mla_absorb.absorb_query`), and the kernel scores every head against the latents directly:
  score = (q_latent . c + q_rope . kr) * scale, o_latent = softmax(score) @ c [H, B, R]; then
  out = o_latent W_UV^T [B, H, Dv] (`mla_absorb.absorb_output`, straight into out; torch.bmm and a copy where
  those kernels do not take the tensors: a non-contiguous weight, a strided last dim). The cache is read once
  per step (R + Dr values per token) for a block of heads at a time instead of being expanded per head; with 128
  heads that makes decode about as compute-bound as memory-bound (some 240 flops per byte read).
  The context is split over `num_splits` programs per (sequence, head block) so that small batches still fill the
  GPU (flash decoding); each split writes a normalised partial and its log-sum-exp, and a reduce kernel merges
  them. Grids depend on shapes and host ints only, so decode can be captured in a CUDA graph.
- Prefill, `mla_prefill` (q [T, H, *], sequences concatenated as in ForwardBatch): many queries per context token,
  so expansion is cheaper than absorption: the context latents of all sequences are gathered to [L, R + Dr] and
  expanded with one matmul to k_nope [L, H, Dn] and v [L, H, Dv]; then a causal flash-attention kernel runs each
  sequence's new tokens against its whole context (prefix + itself). The q.k dot is split into the nope part (Dn)
  and the rope part (Dr, the key shared by all heads), since Dn + Dr (192 for DeepSeek-V3) need not be a power
  of two.

Dims of any size up to the gated ones (MAX_BLOCK_DIMS) are taken: each is padded inside the kernel to a block of
the next power of two (at least 16, tl.dot's smallest K) with masked loads and stores, never in memory. A dim
that is already a power of two gets no mask on its columns and compiles to the unpadded kernel. DeepSeek-V3 and
Kimi-K2 have Dn = Dv = 128, Dr = 64, R = 512; GLM-4.7-Flash has Dn = 192 (a 256 block, 12.5% more dot work than
needed over Dn + Dr + Dv) and Dv = 256 with the same R and Dr, so its decode is DeepSeek-V3's kernel. Tiles for
SM120/SM89 fit 99 KiB of shared memory: a [BLOCK_N, R] latent tile is 16 KiB in bf16 at BLOCK_N = 16,
double-buffered beside the [64 heads, R] query block; Hopper has 227 KiB and takes wider tiles; prefill at
GLM's 256-wide nope and v blocks takes narrower tiles than at DeepSeek's 128.
Tile addresses are built from constexpr strides (the cache and the expanded kv are contiguous) so the compiler
knows them aligned and pipelines the loads with cp.async whatever the launch specialises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_layers import mla_absorb
from gpu_layers.capability import GateCase, capability_of, num_sms, select

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # enough to fill a GPU with one sequence's two 64-head blocks; more only add partial traffic


@dataclass(frozen=True)
class DecodeConfig:
    block_h: int  # heads per program: they share every latent tile the program loads
    block_n: int  # context tokens per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # queries per program
    block_n: int  # context tokens per tile
    num_warps: int
    num_stages: int


# Keyed by capability, then (decode) by element size; picked by offline compiles (none spills, aligned as at run
# time or not) and, for Hopper and the mma.sync configs, timings on an H200. Decode is compute-bound at 128 heads
# (about 240 flops per latent byte), so a program takes 64 heads: twice the work per shared-memory tile of 32, and
# each latent tile comes from L2 twice instead of four times; on SM120/SM89 that costs 16-token tiles to fit
# 99 KiB (94 KiB, double-buffered). Prefill on SM120 runs [64, 64] tiles (72 KiB; 45% faster on the H200 than
# [128, 32]), which spill on SM89's compiler, so Ada keeps [128, 32]. fp32 (CPU-parity dtype, exact dots) takes
# the smallest tiles to stay in budget.
DECODE_CONFIGS = {
    89: {2: DecodeConfig(64, 16, 8, 2), 4: DecodeConfig(16, 16, 8, 1)},
    90: {2: DecodeConfig(64, 32, 8, 2), 4: DecodeConfig(16, 16, 8, 1)},
    120: {2: DecodeConfig(64, 16, 8, 2), 4: DecodeConfig(16, 16, 8, 1)},
}
# Prefill is keyed by the wider of the padded nope and v blocks as well. GLM-4.7-Flash's 256-wide q, k and v
# tiles (and a [BLOCK_M, 256] accumulator) take smaller tiles than DeepSeek-V3's 128: on 99 KiB parts [64, 32]
# and wider spill at 8 warps, so SM120 keeps 64 queries against 16-key tiles (three stages, 80 KiB) and SM89,
# whose compiler spills that too, [32, 32]; Hopper takes [64, 64] (184 KiB). These were chosen by offline
# compiles alone (no spill, within budget), not yet by timings.
PREFILL_CONFIGS = {
    89: {(128, 2): PrefillConfig(128, 32, 8, 2), (128, 4): PrefillConfig(32, 16, 8, 2),
         (256, 2): PrefillConfig(32, 32, 8, 2), (256, 4): PrefillConfig(16, 16, 8, 2)},
    90: {(128, 2): PrefillConfig(128, 64, 8, 3), (128, 4): PrefillConfig(32, 16, 8, 2),
         (256, 2): PrefillConfig(64, 64, 8, 2), (256, 4): PrefillConfig(16, 16, 8, 2)},
    120: {(128, 2): PrefillConfig(64, 64, 4, 2), (128, 4): PrefillConfig(32, 16, 8, 2),
          (256, 2): PrefillConfig(64, 16, 8, 3), (256, 4): PrefillConfig(16, 16, 8, 2)},
}
PREFILL_HEAD_BLOCKS = (128, 256)
# The largest padded dims that the gated configs were compiled at (DeepSeek-V3's and GLM-4.7-Flash's); smaller
# dims only shrink the tiles.
MAX_BLOCK_DIMS = {"nope_dim": 256, "rope_dim": 64, "v_head_dim": 256, "kv_lora_rank": 512}
REDUCE_WARPS = 4
_MAX_SPLITS = tl.constexpr(MAX_SPLITS)  # the reduce loads a row's log-sum-exps at once
_REDUCE_SPLITS = tl.constexpr(8)  # partials a reduce step loads: [8, R] float32 is 32 registers a thread at 4 warps

TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def _tile_mask(is_row, offs, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The mask of a [rows, BLOCK_D] tile whose columns from D on are padding. An unpadded block (BLOCK_D == D)
    keeps the [rows, 1] row mask alone, so a power-of-two dim compiles to exactly the kernel it had unpadded."""
    if BLOCK_D == D:
        mask = is_row[:, None]
    else:
        mask = is_row[:, None] & (offs[None, :] < D)
    return mask


@triton.jit
def mla_decode_kernel(
    q_latent, q_rope, cache, block_tables, seq_lens, o_part, lse_part,
    qk_scale, num_heads, page_size,
    stride_ql_b, stride_ql_h, stride_qr_b, stride_qr_h, stride_bt,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: sequence b, heads [h0, h0 + BLOCK_H), one contiguous split of the context. Writes the
    split's normalised o_latent [BLOCK_H, R] and base-2 log-sum-exp [BLOCK_H] (-inf for an empty split)."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split, num_splits = tl.program_id(2), tl.num_programs(2)
    is_head = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)

    seq_len = tl.load(seq_lens + b)
    # Splits start on tile boundaries so only the context's last tile is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # Padded columns load as zeros in the queries and the latents alike: they add nothing to a score, and the
    # padded columns of acc stay zero.
    q_lat = tl.load(q_latent + b * stride_ql_b + heads[:, None] * stride_ql_h + offs_r[None, :],
                    mask=_tile_mask(is_head, offs_r, R, BLOCK_R), other=0.0)
    q_rp = tl.load(q_rope + b * stride_qr_b + heads[:, None] * stride_qr_h + offs_dr[None, :],
                   mask=_tile_mask(is_head, offs_dr, DR, BLOCK_DR), other=0.0)
    q_lat_t = tl.trans(q_lat)
    q_rp_t = tl.trans(q_rp)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        is_valid = pos < end
        page = tl.load(block_tables + b * stride_bt + pos // page_size, mask=is_valid, other=0).to(tl.int64)
        # The cache is contiguous: entry offsets are multiples of R + DR, which the compiler sees (aligned, vector
        # loads, cp.async pipelining) whatever the launch specialises.
        slot = (page * page_size + pos % page_size) * (R + DR)
        c = tl.load(cache + slot[:, None] + offs_r[None, :], mask=_tile_mask(is_valid, offs_r, R, BLOCK_R),
                    other=0.0)
        kr = tl.load(cache + slot[:, None] + R + offs_dr[None, :], mask=_tile_mask(is_valid, offs_dr, DR, BLOCK_DR),
                     other=0.0)
        # Scores are computed transposed, tokens on the M axis, so that the latent tile is the A operand here and
        # the B operand below, both read untransposed from one shared-memory copy (a transposed use would be
        # converted through registers: 64+ more per thread at R = 512).
        scores = tl.dot(c, q_lat_t, input_precision="ieee")  # [BLOCK_N, BLOCK_H]
        scores = tl.dot(kr, q_rp_t, scores, input_precision="ieee")
        scores = tl.where(is_valid[:, None], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = tl.dot(tl.trans(p).to(c.dtype), c, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new

    is_empty = l_i == 0.0
    l_safe = tl.where(is_empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(l_safe))
    row = (b * num_heads + heads) * num_splits + split  # o_part [B, H, S, R], lse_part [B, H, S]
    tl.store(o_part + row[:, None].to(tl.int64) * R + offs_r[None, :], o, mask=_tile_mask(is_head, offs_r, R, BLOCK_R))
    tl.store(lse_part + row, lse, mask=is_head)


@triton.jit
def mla_decode_reduce_kernel(
    o_part, lse_part, out, num_heads, num_splits, stride_out_b, stride_out_h,
    R: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program per (sequence, head): merges the splits' partials, weighted by exp2(lse - max lse). The splits
    are read _REDUCE_SPLITS at a time, so the loads of a step are in flight together (one split a step kept one
    load in flight: 32 L2 round trips in a row at batch 1, 11 us of sparse MLA's 45 on an H200)."""
    b, h = tl.program_id(0), tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, _REDUCE_SPLITS)
    first = (b * num_heads + h) * num_splits
    all_splits = tl.arange(0, _MAX_SPLITS)
    lse_max = tl.max(tl.load(lse_part + first + all_splits, mask=all_splits < num_splits, other=float("-inf")), 0)
    # An empty context (a padded batch slot) has every lse at -inf: it yields zeros, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = 0.0
    acc = tl.zeros([BLOCK_R], tl.float32)
    for first_split in range(0, num_splits, _REDUCE_SPLITS):
        splits = first_split + offs_s
        is_split = splits < num_splits
        weight = tl.exp2(tl.load(lse_part + first + splits, mask=is_split, other=float("-inf")) - lse_max)
        parts = o_part + (first + splits).to(tl.int64)[:, None] * R + offs_r[None, :]
        acc += tl.sum(weight[:, None] * tl.load(parts, mask=is_split[:, None] & (offs_r[None, :] < R), other=0.0), 0)
        total += tl.sum(weight, 0)
    merged = acc / tl.maximum(total, 1e-30)
    if BLOCK_R == R:
        tl.store(out + b * stride_out_b + h * stride_out_h + offs_r, merged.to(out.dtype.element_ty))
    else:
        tl.store(out + b * stride_out_b + h * stride_out_h + offs_r, merged.to(out.dtype.element_ty),
                 mask=offs_r < R)


@triton.jit
def mla_prefill_kernel(
    q_nope, q_rope, kv, latents, out, query_start_loc, seq_lens, context_start,
    qk_scale, num_heads,
    stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h, stride_o_t, stride_o_h,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M new tokens of sequence b, head h. Context rows (the sequence's prefix then its new
    tokens) start at row context_start[b] of kv [L, H, DN + DV] (k_nope then v) and latents [L, R + DR] (the rope
    key at column R); both contiguous, their strides built from constexprs so tile loads are known aligned.
    Query i of the sequence sits at position prefix + i."""
    block_m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc + b)
    query_len = tl.load(query_start_loc + b + 1) - q_start
    if block_m * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens + b)
    ctx_row = tl.load(context_start + b).to(tl.int64)
    prefix = seq_len - query_len
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_query = offs_m < query_len
    q_pos = prefix + offs_m
    offs_dn, offs_dr, offs_dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    tokens = (q_start + offs_m).to(tl.int64)

    # Padded columns are zeros in q and k alike (no score change) and in v (acc's padded columns, never stored).
    qn = tl.load(q_nope + tokens[:, None] * stride_qn_t + h * stride_qn_h + offs_dn[None, :],
                 mask=_tile_mask(is_query, offs_dn, DN, BLOCK_DN), other=0.0)
    qr = tl.load(q_rope + tokens[:, None] * stride_qr_t + h * stride_qr_h + offs_dr[None, :],
                 mask=_tile_mask(is_query, offs_dr, DR, BLOCK_DR), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Causal: this block's last query sees up to its own position.
    kv_end = tl.minimum(seq_len, prefix + (block_m + 1) * BLOCK_M)
    for tile in range(0, kv_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        is_key = pos < kv_end
        rows = ctx_row + pos
        kv_rows = kv + (rows[:, None] * num_heads + h) * (DN + DV)
        kn = tl.load(kv_rows + offs_dn[None, :], mask=_tile_mask(is_key, offs_dn, DN, BLOCK_DN), other=0.0)
        kr = tl.load(latents + rows[:, None] * (R + DR) + R + offs_dr[None, :],
                     mask=_tile_mask(is_key, offs_dr, DR, BLOCK_DR), other=0.0)
        scores = tl.dot(qn, tl.trans(kn), input_precision="ieee")
        scores = tl.dot(qr, tl.trans(kr), scores, input_precision="ieee")
        is_visible = is_key[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(is_visible, scores * qk_scale, float("-inf"))
        # Every query sees position 0, in the first tile, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(kv_rows + DN + offs_dv[None, :], mask=_tile_mask(is_key, offs_dv, DV, BLOCK_DV), other=0.0)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(out + tokens[:, None] * stride_o_t + h * stride_o_h + offs_dv[None, :],
             o.to(out.dtype.element_ty), mask=_tile_mask(is_query, offs_dv, DV, BLOCK_DV))


# ---------------------------------------------------------------------------------------------------- launchers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def block_dim(dim: int) -> int:
    """The in-kernel block of a head dim: the next power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(dim))


def supports_dims(nope_dim: int, rope_dim: int, v_head_dim: int, kv_lora_rank: int) -> bool:
    """Whether the kernels take these dims: each padded to no more than the gated MAX_BLOCK_DIMS."""
    dims = {"nope_dim": nope_dim, "rope_dim": rope_dim, "v_head_dim": v_head_dim, "kv_lora_rank": kv_lora_rank}
    return all(dim >= 1 and block_dim(dim) <= MAX_BLOCK_DIMS[name] for name, dim in dims.items())


def prefill_config(capability: int, nope_dim: int, v_head_dim: int, element_size: int) -> PrefillConfig:
    """The prefill tiles for the wider of the padded nope and v blocks."""
    width = max(block_dim(nope_dim), block_dim(v_head_dim))
    head_block = next(b for b in PREFILL_HEAD_BLOCKS if b >= width)
    return select(PREFILL_CONFIGS, capability)[(head_block, element_size)]


def check_layer_inputs(q_nope, q_rope, latent_cache, w_kv_b, block_tables, v_head_dim) -> tuple[int, int, int]:
    """Shape, dtype and device checks of the queries, the cache, the weight and the block tables, shared by every
    launcher here and by `mla_sparse`. Returns (num_heads, nope_dim, rank)."""
    _require(q_nope.dim() == 3, f"q_nope must be [tokens, heads, nope_dim], got {tuple(q_nope.shape)}")
    _require(q_nope.dtype in TRITON_DTYPES, f"q_nope must be bf16, fp16 or fp32, got {q_nope.dtype}")
    num_tokens, num_heads, nope_dim = q_nope.shape
    _require(q_rope.dim() == 3 and q_rope.shape[:2] == q_nope.shape[:2],
             f"q_rope must be [{num_tokens}, {num_heads}, rope_dim], got {tuple(q_rope.shape)}")
    rope_dim = q_rope.shape[2]
    _require(latent_cache.dim() == 4 and latent_cache.shape[2] == 1,
             f"latent_cache must be [num_blocks, page_size, 1, rank + rope_dim], got {tuple(latent_cache.shape)}")
    rank = latent_cache.shape[3] - rope_dim
    _require(w_kv_b.shape == (num_heads * (nope_dim + v_head_dim), rank),
             f"w_kv_b must be [{num_heads * (nope_dim + v_head_dim)}, {rank}], got {tuple(w_kv_b.shape)}")
    dims = {"nope_dim": nope_dim, "rope_dim": rope_dim, "kv_lora_rank": rank, "v_head_dim": v_head_dim}
    for name, dim in dims.items():
        _require(dim >= 1 and block_dim(dim) <= MAX_BLOCK_DIMS[name],
                 f"{name} must be 1..{MAX_BLOCK_DIMS[name]} (the gated sizes), got {dim}")
    for name, t in (("q_rope", q_rope), ("latent_cache", latent_cache), ("w_kv_b", w_kv_b)):
        _require(t.dtype == q_nope.dtype, f"{name} must be {q_nope.dtype} like q_nope, got {t.dtype}")
    for name, t in (("q_rope", q_rope), ("latent_cache", latent_cache), ("w_kv_b", w_kv_b),
                    ("block_tables", block_tables)):
        _require(t.device == q_nope.device, f"{name} must be on {q_nope.device}, got {t.device}")
    _require(q_rope.stride(2) == 1, "q_rope must be contiguous in its last dim")
    _require(latent_cache.is_contiguous(), "latent_cache must be contiguous")
    _require(block_tables.dim() == 2 and block_tables.dtype == torch.int32,
             "block_tables must be [B, max_blocks] int32")
    return num_heads, nope_dim, rank


def _check_common(q_nope, q_rope, latent_cache, w_kv_b, block_tables, seq_lens, v_head_dim) -> tuple[int, int, int]:
    """check_layer_inputs, and seq_lens: the checks shared by decode and prefill."""
    dims = check_layer_inputs(q_nope, q_rope, latent_cache, w_kv_b, block_tables, v_head_dim)
    _require(seq_lens.device == q_nope.device, f"seq_lens must be on {q_nope.device}, got {seq_lens.device}")
    _require(seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.shape[0] == block_tables.shape[0],
             f"seq_lens must be [{block_tables.shape[0]}] int32 like block_tables' rows")
    return dims


def _check_out(out, shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return like.new_empty(shape)
    _require(tuple(out.shape) == tuple(shape) and out.dtype == like.dtype and out.device == like.device,
             f"out must be {tuple(shape)} {like.dtype} on {like.device}, got {tuple(out.shape)} {out.dtype}")
    return out


def default_num_splits(num_seqs: int, num_head_blocks: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Splits per (sequence, head block) so the grid covers the GPU about once (one block fits an SM), but none
    shorter than 4 tiles: from host ints only, so a captured graph replays with any lengths."""
    wanted = max(1, num_sms // max(1, num_seqs * num_head_blocks))
    useful = max(1, triton.cdiv(max_context, 4 * block_n))
    return min(wanted, useful, MAX_SPLITS)


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence, q_nope [B, H, Dn], q_rope [B, H, Dr] (already in the cache, seq_lens counting
    it) -> [B, H, Dv], by weight absorption over the latent cache. No host syncs: CUDA-graph safe."""
    num_heads, nope_dim, rank = _check_common(q_nope, q_rope, latent_cache, w_kv_b, block_tables, seq_lens,
                                              v_head_dim)
    num_seqs, rope_dim = q_nope.shape[0], q_rope.shape[2]
    _require(seq_lens.shape[0] == num_seqs, f"seq_lens must have one entry per sequence ({num_seqs})")
    out = _check_out(out, (num_seqs, num_heads, v_head_dim), q_nope)
    if num_seqs == 0:
        return out
    cfg = select(DECODE_CONFIGS, capability_of(q_nope.device))[q_nope.element_size()]
    num_head_blocks = triton.cdiv(num_heads, cfg.block_h)
    page_size = latent_cache.shape[1]
    if num_splits is None:
        max_context = block_tables.shape[1] * page_size
        num_splits = default_num_splits(num_seqs, num_head_blocks, max_context, cfg.block_n, num_sms(q_nope.device))
    _require(1 <= num_splits <= MAX_SPLITS, f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")

    use_kernels = mla_absorb.is_supported(w_kv_b, q_nope, out)
    q_latent = absorb_query(q_nope, w_kv_b, nope_dim, v_head_dim, use_kernels)  # [H, B, R]
    o_part = torch.empty(num_seqs, num_heads, num_splits, rank, dtype=torch.float32, device=q_nope.device)
    lse_part = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q_nope.device)
    mla_decode_kernel[(num_seqs, num_head_blocks, num_splits)](
        q_latent, q_rope, latent_cache, block_tables, seq_lens, o_part, lse_part,
        scale * LOG2E, num_heads, page_size,
        q_latent.stride(1), q_latent.stride(0), q_rope.stride(0), q_rope.stride(1), block_tables.stride(0),
        R=rank, DR=rope_dim, BLOCK_R=block_dim(rank), BLOCK_DR=block_dim(rope_dim), BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    o_latent = torch.empty_like(q_latent)  # [H, B, R], the layout the output absorption reads
    mla_decode_reduce_kernel[(num_seqs, num_heads)](
        o_part, lse_part, o_latent, num_heads, num_splits, o_latent.stride(1), o_latent.stride(0),
        R=rank, BLOCK_R=block_dim(rank), num_warps=REDUCE_WARPS,
    )
    return absorb_output(o_latent, w_kv_b, nope_dim, v_head_dim, out, use_kernels)


def absorb_query(q_nope: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int, v_head_dim: int,
                 use_kernels: bool) -> torch.Tensor:
    """q_nope [N, H, Dn] -> q_latent = q_nope W_UK per head [H, N, R]: mla_absorb's kernel, or torch.bmm where
    it does not take the tensors as given (a non-contiguous weight, a strided last dim; `mla_absorb.is_supported`)."""
    if use_kernels:
        return mla_absorb.absorb_query(q_nope, w_kv_b, nope_dim)
    w_heads = w_kv_b.reshape(q_nope.shape[1], nope_dim + v_head_dim, w_kv_b.shape[1])  # [H, Dn + Dv, R]
    return torch.bmm(q_nope.transpose(0, 1), w_heads[:, :nope_dim])


def absorb_output(o_latent: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int, v_head_dim: int, out: torch.Tensor,
                  use_kernels: bool) -> torch.Tensor:
    """o_latent [H, N, R] -> out [N, H, Dv] = o_latent W_UV^T per head, written into out: mla_absorb's kernel
    (straight into out's rows), or torch.bmm and a transposing copy where the kernel does not take the tensors."""
    if use_kernels:
        return mla_absorb.absorb_output(o_latent, w_kv_b, nope_dim, v_head_dim, out=out)
    w_heads = w_kv_b.reshape(o_latent.shape[0], nope_dim + v_head_dim, w_kv_b.shape[1])  # [H, Dn + Dv, R]
    return out.copy_(torch.bmm(o_latent, w_heads[:, nope_dim:].transpose(1, 2)).transpose(0, 1))


def gather_latents(
    latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_context_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context entries, concatenated: ([L, R + Dr], context_start [B + 1] int32), L the sum of
    seq_lens. On-device index arithmetic, no host sync."""
    num_seqs, page_size = seq_lens.shape[0], latent_cache.shape[1]
    device = seq_lens.device
    context_start = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    torch.cumsum(seq_lens, 0, dtype=torch.int32, out=context_start[1:])
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), seq_lens.long(),
                                      output_size=num_context_tokens)
    pos = torch.arange(num_context_tokens, device=device) - context_start[seq_ids]
    pages = block_tables[seq_ids, pos // page_size].long()
    latents = latent_cache.view(-1, latent_cache.shape[-1])[pages * page_size + pos % page_size]
    return latents, context_start


def mla_prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    v_head_dim: int,
    out: torch.Tensor | None = None,
    num_context_tokens: int | None = None,
) -> torch.Tensor:
    """New tokens q_nope [T, H, Dn], q_rope [T, H, Dr] of B sequences (query_start_loc [B + 1]; their latents
    already in the cache, seq_lens counting them) -> [T, H, Dv], causal over each sequence's whole context.
    max_query_len bounds every sequence's new tokens. num_context_tokens = sum(seq_lens): pass it from host data
    (ForwardBatch.seq_lens_cpu); when None it is read from the device, a sync."""
    num_heads, nope_dim, rank = _check_common(q_nope, q_rope, latent_cache, w_kv_b, block_tables, seq_lens,
                                              v_head_dim)
    num_tokens, rope_dim, num_seqs = q_nope.shape[0], q_rope.shape[2], seq_lens.shape[0]
    _require(q_nope.stride(2) == 1, "q_nope must be contiguous in its last dim")
    _require(query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
             and query_start_loc.device == q_nope.device, f"query_start_loc must be [{num_seqs + 1}] int32")
    _require(max_query_len >= 0, f"max_query_len must be >= 0, got {max_query_len}")
    out = _check_out(out, (num_tokens, num_heads, v_head_dim), q_nope)
    _require(out.stride(2) == 1, "out must be contiguous in its last dim")
    if num_tokens == 0 or max_query_len == 0:
        return out
    if num_context_tokens is None:
        num_context_tokens = int(seq_lens.sum())
    cfg = prefill_config(capability_of(q_nope.device), nope_dim, v_head_dim, q_nope.element_size())

    latents, context_start = gather_latents(latent_cache, block_tables, seq_lens, num_context_tokens)
    kv = torch.nn.functional.linear(latents[:, :rank], w_kv_b)  # [L, H * (Dn + Dv)]: one matmul expands all heads
    grid = (triton.cdiv(max_query_len, cfg.block_m), num_seqs, num_heads)
    mla_prefill_kernel[grid](
        q_nope, q_rope, kv, latents, out, query_start_loc, seq_lens, context_start,
        scale * LOG2E, num_heads,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        DN=nope_dim, DR=rope_dim, DV=v_head_dim, R=rank, BLOCK_DN=block_dim(nope_dim),
        BLOCK_DR=block_dim(rope_dim), BLOCK_DV=block_dim(v_head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------------- gate, bench

def gate_cases() -> list[GateCase]:
    """Every kernel at each gated model's dims, for each capability's config of each dtype (gpu_layers.mla_cases)."""
    from gpu_layers import mla_cases

    return mla_cases.gate()


def bench_cases() -> list[tuple[str, object, int, int]]:
    """DeepSeek-V3 decode and prefill, GLM-4.7-Flash prefill (gpu_layers.mla_cases)."""
    from gpu_layers import mla_cases

    return mla_cases.bench()
