"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5) on the GPU: per query row, every visible cached token's index
score, and the positions of the `k` best. Semantics are `gpu_layers.dsa_reference` (the tests' oracle):

    score[n, j] = sum_h w[n, h] * relu(scale * q[n, h] . k_j)    for j < row_limit[n], -inf from there on

Data flow (N rows, Hi indexer heads, Di = 128, L = max_context):
- `index_scores_kernel`, one program per (row, tile of BLOCK_N keys): the row's q [Hi, Di] against the key tile
  gathered through the block table, one tl.dot (fp32 accumulation), relu, the weighted sum over heads. Tiles at or
  past the row's limit return at once (the grid is sized from the host int L, max_model_len in a captured decode).
  Run from `index_topk`, it also makes the select's first radix histogram (below) and skips the -inf stores,
  which nothing reads.
- `select_topk`: a radix select over each score's order-preserving 32-bit key (signed int32; for negatives the
  low 31 bits flipped; -0.0 made +0.0 first, as the reference's == sees them), one 8-bit digit a pass, most
  significant first. Pass p (`topk_pass_kernel`, one program per (row, tile of BLOCK_G scores)) re-reads the row
  and histograms digit p of the keys whose higher digits match the prefix found so far, adding each tile's counts
  to the row's [256] histogram with atomics. Every program of a pass derives the prefix itself from the previous
  pass's histogram (and the state the previous pass stored), so no program waits for another; the row is small
  beside the bandwidth (512 KiB at 128K), so four full passes cost their launches and not their bytes, whatever
  the scores' distribution. Pass 3 also stores, per tile, how many of its keys are above each candidate threshold
  (its above-the-bucket count plus the bucket's counts at or above each last digit). `topk_gather_kernel` then
  knows the exact k-th largest key T and how many keys equal to it are wanted; each program sums the earlier
  tiles' counts at T (its offset) and writes its selected positions in order: the output is sorted by position,
  and ties at T go to the lowest positions. No atomics decide a slot: the selection is deterministic.
- `index_topk` runs the scores and the select on chunks of rows sized so the float32 scores and the per-tile
  counts stay under a budget (256 MiB): a prefill chunk of 8192 rows at 128K context would take 4 GiB otherwise.

Rows with at most k visible tokens select them all (positions 0..limit-1, then -1). Every launch's grid comes from
shapes and host ints and nothing reads the device on the host: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_layers.capability import GateCase, capability_of, select

NUM_BINS = 256  # one 8-bit digit of the 32-bit key per pass
_NUM_BINS = tl.constexpr(NUM_BINS)
NUM_PASSES = 4
_STATE = tl.constexpr(NUM_PASSES * NUM_BINS)  # a row's histograms, then (prefix, wanted) after passes 1, 2, 3
ROW_STRIDE = NUM_PASSES * NUM_BINS + 8  # int32s a row: 4 histograms, 3 states, 16-byte aligned
_ROW_STRIDE = tl.constexpr(ROW_STRIDE)
TILE_STRIDE = NUM_BINS + 4  # int32s a tile of pass 3: at or above each last digit, then above the bucket
_TILE_STRIDE = tl.constexpr(TILE_STRIDE)
MAX_HEADS = 64  # DeepSeek-V3.2; GLM-5 has 32
MAX_HEAD_DIM = 128
SCORE_BUDGET_BYTES = 256 << 20  # index_topk's scores + per-tile counts per chunk of rows

TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class ScoresConfig:
    block_n: int  # keys per program
    block_k: int  # head-dim slice per tl.dot
    num_warps: int


@dataclass(frozen=True)
class SelectConfig:
    block_g: int  # scores per program of the radix passes and the gather (a row's tile)
    num_warps: int
    block_t: int  # earlier tiles' counts summed per step of the gather's offset


# Keyed by capability, then the cache's element size. One tile per program, no loop to pipeline: occupancy hides
# the gather latency. fp32 (CPU-parity dtype, FMA dots) slices the head dim by 32 and takes 8 warps: whole
# 128-wide rows, or 4 warps at 64 heads, spill or come within a few registers of it.
SCORES_CONFIGS = {
    89: {2: ScoresConfig(64, 128, 4), 4: ScoresConfig(64, 32, 8)},
    90: {2: ScoresConfig(64, 128, 4), 4: ScoresConfig(64, 32, 8)},
    120: {2: ScoresConfig(64, 128, 4), 4: ScoresConfig(64, 32, 8)},
}

# Tiles of 1024: 128 programs a row at 128K, about one per SM of an H200 at batch 1.
SELECT_CONFIGS = {
    89: SelectConfig(1024, 4, 128),
    90: SelectConfig(1024, 4, 128),
    120: SelectConfig(1024, 4, 128),
}


@triton.jit
def _sortable_key(score):
    """int32 whose signed order is the float order of the score; -0.0 and +0.0 are one key."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _digit(keys, SHIFT: tl.constexpr):
    """The 8-bit digit at SHIFT of the unsigned key (the signed key with its sign bit flipped): digit order is
    key order."""
    if SHIFT == 24:
        return ((keys >> 24) & 0xFF) ^ 0x80
    return (keys >> SHIFT) & 0xFF


@triton.jit
def _add_counts(histogram, counts):
    # A tile's keys fall in few bins: atomics only where it has any.
    tl.atomic_add(histogram + tl.arange(0, _NUM_BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def index_scores_kernel(
    q, weights, cache, block_tables, row_seq, row_limit, scores, counts,
    scale, max_context, page_size, min_selecting, stride_q_n, stride_q_h, stride_w_n, stride_bt,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, FOR_SELECT: tl.constexpr,
):
    """One program: row n, keys [start, start + BLOCK_N). FOR_SELECT: also the tile's pass-0 radix histogram into
    counts[n] (rows with more than min_selecting visible keys only), and no -inf stores past the limit."""
    n = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
    pos = start + tl.arange(0, BLOCK_N)
    limit = tl.minimum(tl.load(row_limit + n), max_context)
    row_scores = scores + n.to(tl.int64) * max_context
    if start >= limit:
        if not FOR_SELECT:
            tl.store(row_scores + pos, float("-inf"), mask=pos < max_context)
        return
    is_visible = pos < limit
    heads = tl.arange(0, BLOCK_H)
    w = tl.load(weights + n * stride_w_n + heads, mask=heads < H, other=0.0)  # padded heads weigh nothing
    seq = tl.load(row_seq + n)
    page = tl.load(block_tables + seq * stride_bt + pos // page_size, mask=is_visible, other=0).to(tl.int64)
    # The cache is contiguous: entry offsets are multiples of D, known aligned whatever the launch specialises.
    slot = (page * page_size + pos % page_size) * D
    dots = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    # The head dim in BLOCK_K slices: fp32's FMA dots hold whole operand rows in registers, which spill at 128.
    for d0 in tl.static_range(0, BLOCK_D, BLOCK_K):
        offs_d = d0 + tl.arange(0, BLOCK_K)
        q_rows = tl.load(q + n * stride_q_n + heads[:, None] * stride_q_h + offs_d[None, :],
                         mask=(heads[:, None] < H) & (offs_d[None, :] < D), other=0.0)
        keys = tl.load(cache + slot[:, None] + offs_d[None, :], mask=is_visible[:, None] & (offs_d[None, :] < D),
                       other=0.0)
        dots = tl.dot(keys, tl.trans(q_rows), dots, input_precision="ieee")  # [BLOCK_N, BLOCK_H]
    per_head = tl.maximum(dots * scale, 0.0)
    tile = tl.sum(per_head * w[None, :], axis=1)
    tile = tl.where(is_visible, tile, float("-inf"))
    if FOR_SELECT:
        tl.store(row_scores + pos, tile, mask=is_visible)
        if limit > min_selecting:
            counts_row = counts + n * _ROW_STRIDE
            _add_counts(counts_row, tl.histogram(_digit(_sortable_key(tile), 24), _NUM_BINS, mask=is_visible))
    else:
        tl.store(row_scores + pos, tile, mask=pos < max_context)


@triton.jit
def _next_digit(counts_row, prefix, wanted, PASS: tl.constexpr):
    """From pass PASS's histogram of the keys matching `prefix` (digits 0..PASS-1, the rest zero): the digit of
    the wanted-th largest of them. Returns the prefix with that digit, and how many keys matching it are wanted
    (the wanted-th largest less those above its digit)."""
    bins = tl.arange(0, _NUM_BINS)
    counts = tl.load(counts_row + PASS * _NUM_BINS + bins)
    at_or_above = tl.cumsum(counts, 0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= wanted, bins, -1), 0)
    wanted -= tl.sum(tl.where(bins > digit, counts, 0), 0)
    # The key's top byte is signed: the unsigned digit less 128 (no int32 overflow in the shift).
    if PASS == 0:
        prefix = (digit - 128) * (1 << 24)
    else:
        prefix += digit * (1 << (24 - 8 * PASS))
    return prefix, wanted


@triton.jit
def _prefix_before(counts_row, k, PASS: tl.constexpr):
    """(prefix, wanted) over digits 0..PASS-1, from pass PASS-1's histogram and the state pass PASS-1 stored
    (passes from 2 on store theirs; the gather, PASS 4, stores none)."""
    if PASS == 1:
        prefix, wanted = _next_digit(counts_row, 0, k, 0)
    else:
        state = counts_row + _STATE + 2 * (PASS - 2)
        prefix, wanted = _next_digit(counts_row, tl.load(state), tl.load(state + 1), PASS - 1)
    if PASS < 4:
        # Every program of the pass stores the same two values; the next pass reads them.
        state = counts_row + _STATE + 2 * (PASS - 1)
        tl.store(state, prefix)
        tl.store(state + 1, wanted)
    return prefix, wanted


@triton.jit
def topk_pass_kernel(scores, counts, tile_counts, row_limit, stride_s, stride_t, max_context, k,
                     PASS: tl.constexpr, BLOCK_G: tl.constexpr):
    """One program: scores [start, start + BLOCK_G) of row n (one with more than k visible). Histograms digit PASS
    of the keys whose digits 0..PASS-1 are the prefix so far into counts[n]; pass 3 also stores the tile's counts
    at or above each last digit (and above the prefix's 24 bits) in tile_counts[n, tile]."""
    n = tl.program_id(0)
    tile = tl.program_id(1)
    start = tile * BLOCK_G
    limit = tl.minimum(tl.load(row_limit + n), max_context)
    if start >= limit or limit <= k:
        return
    counts_row = counts + n * _ROW_STRIDE
    pos = start + tl.arange(0, BLOCK_G)
    is_visible = pos < limit
    keys = _sortable_key(tl.load(scores + n.to(tl.int64) * stride_s + pos, mask=is_visible, other=0.0))
    SHIFT = 24 - 8 * PASS
    if PASS == 0:
        is_match = is_visible
    else:
        prefix, _ = _prefix_before(counts_row, k, PASS)
        # Arithmetic shifts of both sides: equal high digits, and (pass 3) the order of the prefixes.
        is_match = is_visible & ((keys >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
    digit_counts = tl.histogram(_digit(keys, SHIFT), _NUM_BINS, mask=is_match)
    _add_counts(counts_row + PASS * _NUM_BINS, digit_counts)
    if PASS == 3:
        num_above = tl.sum((is_visible & ((keys >> 8) > (prefix >> 8))).to(tl.int32), 0)
        tile_row = tile_counts + n.to(tl.int64) * stride_t + tile * _TILE_STRIDE
        tl.store(tile_row + tl.arange(0, _NUM_BINS), num_above + tl.cumsum(digit_counts, 0, reverse=True))
        tl.store(tile_row + _NUM_BINS, num_above)


@triton.jit
def topk_gather_kernel(scores, counts, tile_counts, out, row_limit, stride_s, stride_t, max_context, k,
                       BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: positions [start, start + BLOCK_G) of row n. A row with at most k visible: out[n] =
    0..limit-1, then -1. Otherwise the positions whose key is above the k-th largest key T, and those equal to it
    while fewer than the wanted number were taken before them, go to out[n] in position order, from the number
    the earlier tiles select (their pass-3 counts at T's last digit)."""
    n = tl.program_id(0)
    tile = tl.program_id(1)
    start = tile * BLOCK_G
    limit = tl.minimum(tl.load(row_limit + n), max_context)
    out_row = out + n.to(tl.int64) * k
    pos = start + tl.arange(0, BLOCK_G)
    if limit <= k:
        tl.store(out_row + pos, tl.where(pos < limit, pos, -1), mask=pos < k)
        return
    if start >= limit:
        return
    threshold, wanted = _prefix_before(counts + n * _ROW_STRIDE, k, 4)
    last = threshold & 0xFF
    # Earlier tiles: keys at or above T, and above it (column last + 1; 256: above the bucket's 24 bits).
    tile_rows = tile_counts + n.to(tl.int64) * stride_t
    at_or_above = 0
    above = 0
    for first in range(0, tile, BLOCK_T):
        earlier = first + tl.arange(0, BLOCK_T)
        is_earlier = earlier < tile
        at_or_above += tl.sum(tl.load(tile_rows + earlier * _TILE_STRIDE + last, mask=is_earlier, other=0), 0)
        above += tl.sum(tl.load(tile_rows + earlier * _TILE_STRIDE + last + 1, mask=is_earlier, other=0), 0)
    ties_before = at_or_above - above
    is_visible = pos < limit
    keys = _sortable_key(tl.load(scores + n.to(tl.int64) * stride_s + pos, mask=is_visible, other=0.0))
    is_tie = (is_visible & (keys == threshold)).to(tl.int32)
    tie_rank = ties_before + tl.cumsum(is_tie, 0) - 1
    is_taken = ((is_visible & (keys > threshold)) | ((is_tie != 0) & (tie_rank < wanted))).to(tl.int32)
    slot = above + tl.minimum(ties_before, wanted) + tl.cumsum(is_taken, 0) - 1
    # The counts fill the row exactly; the bound keeps any inconsistency from writing into the next row.
    tl.store(out_row + slot, pos, mask=(is_taken != 0) & (slot < k))



# ---------------------------------------------------------------------------------------------------- launchers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def head_block(dim: int) -> int:
    """The in-kernel block of a dim (heads, head dim): the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(dim))


def supports_dims(num_heads: int, head_dim: int) -> bool:
    """Whether the kernels take these indexer dims: padded to no more than the gated 64 heads and 128 dims."""
    return 1 <= num_heads <= MAX_HEADS and 1 <= head_dim <= MAX_HEAD_DIM


def _check_rows(name: str, t: torch.Tensor, num_rows: int, device) -> None:
    _require(t.dim() == 1 and t.shape[0] == num_rows and t.dtype == torch.int32 and t.device == device,
             f"{name} must be [{num_rows}] int32 on {device}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def _check_scores_inputs(q, weights, index_cache, block_tables, row_seq, row_limit, max_context) -> None:
    _require(q.dim() == 3, f"q must be [rows, heads, head_dim], got {tuple(q.shape)}")
    _require(q.dtype in TRITON_DTYPES, f"q must be bf16, fp16 or fp32, got {q.dtype}")
    num_rows, num_heads, head_dim = q.shape
    _require(supports_dims(num_heads, head_dim),
             f"q has {num_heads} heads of {head_dim}: the indexer kernels take 1..{MAX_HEADS} heads of "
             f"1..{MAX_HEAD_DIM}")
    _require(q.stride(2) == 1, "q must be contiguous in its last dim")
    _require(weights.shape == (num_rows, num_heads) and weights.dtype == torch.float32 and weights.stride(1) == 1,
             f"weights must be [{num_rows}, {num_heads}] float32 (heads contiguous), got "
             f"{tuple(weights.shape)} {weights.dtype}")
    _require(index_cache.dim() == 4 and index_cache.shape[2] == 1 and index_cache.shape[3] == head_dim,
             f"index_cache must be [num_blocks, page_size, 1, {head_dim}], got {tuple(index_cache.shape)}")
    _require(index_cache.dtype == q.dtype, f"index_cache must be {q.dtype} like q, got {index_cache.dtype}")
    _require(index_cache.is_contiguous(), "index_cache must be contiguous")
    _require(block_tables.dim() == 2 and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1,
             f"block_tables must be [B, pages] int32, got {tuple(block_tables.shape)} {block_tables.dtype}")
    device = q.device
    for name, t in (("weights", weights), ("index_cache", index_cache), ("block_tables", block_tables)):
        _require(t.device == device, f"{name} must be on {device}, got {t.device}")
    _check_rows("row_seq", row_seq, num_rows, device)
    _check_rows("row_limit", row_limit, num_rows, device)
    capacity = block_tables.shape[1] * index_cache.shape[1]
    _require(1 <= max_context <= capacity,
             f"max_context must be 1..{capacity} (block_tables' pages x page_size), got {max_context}")


def _launch_scores(q, weights, index_cache, block_tables, row_seq, row_limit, scale, max_context, scores, counts,
                   min_selecting: int) -> None:
    """index_scores_kernel over q's rows; counts is None for plain scores (every position written)."""
    num_rows, num_heads, head_dim = q.shape
    cfg = select(SCORES_CONFIGS, capability_of(q.device))[q.element_size()]
    for_select = counts is not None
    index_scores_kernel[(num_rows, triton.cdiv(max_context, cfg.block_n))](
        # Plain scores keep no counts: row_limit stands in for the pointer, never read through it.
        q, weights, index_cache, block_tables, row_seq, row_limit, scores, counts if for_select else row_limit,
        scale, max_context, index_cache.shape[1], min_selecting, q.stride(0), q.stride(1), weights.stride(0),
        block_tables.stride(0),
        H=num_heads, D=head_dim, BLOCK_H=head_block(num_heads), BLOCK_D=head_block(head_dim),
        BLOCK_K=min(cfg.block_k, head_block(head_dim)), BLOCK_N=cfg.block_n,
        FOR_SELECT=for_select, num_warps=cfg.num_warps, num_stages=1,
    )


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
                 row_seq: torch.Tensor, row_limit: torch.Tensor, scale: float, max_context: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hi, Di], weights [N, Hi] float32, index_cache [num_blocks, page_size, 1, Di] (q's dtype),
    block_tables [B, pages] int32, row_seq / row_limit [N] int32 -> float32 scores [N, max_context], -inf from
    row_limit[n] on (dsa_reference.index_scores). No host syncs."""
    _check_scores_inputs(q, weights, index_cache, block_tables, row_seq, row_limit, max_context)
    shape = (q.shape[0], max_context)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    _require(tuple(out.shape) == shape and out.dtype == torch.float32 and out.is_contiguous(),
             f"out must be a contiguous {shape} float32, got {tuple(out.shape)} {out.dtype}")
    if q.shape[0]:
        _launch_scores(q, weights, index_cache, block_tables, row_seq, row_limit, scale, max_context, out, None, 0)
    return out



def _select_buffers(num_rows: int, width: int, block_g: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [rows, ROW_STRIDE] int32, zeroed per use; tile_counts [rows, tiles * TILE_STRIDE] int32, written
    by pass 3 before the gather reads them)."""
    counts = torch.empty(num_rows, ROW_STRIDE, dtype=torch.int32, device=device)
    tile_counts = torch.empty(num_rows, triton.cdiv(width, block_g) * TILE_STRIDE, dtype=torch.int32, device=device)
    return counts, tile_counts


def _launch_select(scores, row_limit, k, out, counts, tile_counts, first_pass: int) -> None:
    """Radix passes first_pass..3 and the gather over scores [rows, L] (stride of a row: L); the scores kernel
    made pass 0 when first_pass is 1."""
    num_rows, width = scores.shape
    cfg = select(SELECT_CONFIGS, capability_of(scores.device))
    args = (row_limit, width, tile_counts.shape[1], width, k)
    for radix_pass in range(first_pass, NUM_PASSES):
        topk_pass_kernel[(num_rows, triton.cdiv(width, cfg.block_g))](
            scores, counts, tile_counts, *args, PASS=radix_pass, BLOCK_G=cfg.block_g, num_warps=cfg.num_warps)
    # Short rows write -1 up to k, which may pass L.
    topk_gather_kernel[(num_rows, triton.cdiv(max(width, k), cfg.block_g))](
        scores, counts, tile_counts, out, *args, BLOCK_G=cfg.block_g, BLOCK_T=cfg.block_t, num_warps=cfg.num_warps)


def _check_out_topk(out, num_rows: int, k: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty(num_rows, k, dtype=torch.int32, device=device)
    _require(tuple(out.shape) == (num_rows, k) and out.dtype == torch.int32 and out.is_contiguous()
             and out.device == device, f"out must be a contiguous ({num_rows}, {k}) int32 on {device}, got "
             f"{tuple(out.shape)} {out.dtype}")
    return out


def select_topk(scores: torch.Tensor, row_limit: torch.Tensor, k: int, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """scores [N, L] float32 (positions from row_limit[n] on are not read), row_limit [N] int32 -> int32 [N, k]:
    the positions of each row's k largest visible scores in increasing order, ties at the k-th largest to the
    lowest positions, -1 padded; a row with at most k visible selects them all (dsa_reference.select_topk,
    exactly). No host syncs."""
    _require(scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous(),
             f"scores must be a contiguous [rows, L] float32, got {tuple(scores.shape)} {scores.dtype}")
    _require(k >= 1, f"k must be >= 1, got {k}")
    num_rows, width = scores.shape
    _check_rows("row_limit", row_limit, num_rows, scores.device)
    out = _check_out_topk(out, num_rows, k, scores.device)
    if num_rows == 0 or width == 0:
        return out.fill_(-1)
    cfg = select(SELECT_CONFIGS, capability_of(scores.device))
    counts, tile_counts = _select_buffers(num_rows, width, cfg.block_g, scores.device)
    counts.zero_()
    _launch_select(scores, row_limit, k, out, counts, tile_counts, first_pass=0)
    return out


def workspace_bytes_per_row(max_context: int, block_g: int) -> int:
    """index_topk's workspace a row: float32 scores, pass 3's per-tile counts, the radix histograms and states."""
    return 4 * (max_context + triton.cdiv(max_context, block_g) * TILE_STRIDE + ROW_STRIDE)


def rows_per_chunk(num_rows: int, row_bytes: int, budget_bytes: int) -> int:
    """Rows whose workspace (row_bytes each) fits the budget; at least one."""
    return max(1, min(num_rows, budget_bytes // row_bytes))


def index_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
               row_seq: torch.Tensor, row_limit: torch.Tensor, scale: float, max_context: int, k: int,
               out: torch.Tensor | None = None, budget_bytes: int = SCORE_BUDGET_BYTES) -> torch.Tensor:
    """The indexer end to end (index_scores's arguments, then k) -> int32 [N, k]: select_topk of the scores,
    without the -inf stores, radix pass 0 made by the scores kernel. Rows run in chunks whose workspace stays
    under budget_bytes (one chunk for a decode batch). No host syncs: CUDA-graph capturable."""
    _check_scores_inputs(q, weights, index_cache, block_tables, row_seq, row_limit, max_context)
    _require(k >= 1, f"k must be >= 1, got {k}")
    num_rows = q.shape[0]
    out = _check_out_topk(out, num_rows, k, q.device)
    if num_rows == 0:
        return out
    cfg = select(SELECT_CONFIGS, capability_of(q.device))
    chunk = rows_per_chunk(num_rows, workspace_bytes_per_row(max_context, cfg.block_g), budget_bytes)
    scores = torch.empty(chunk, max_context, dtype=torch.float32, device=q.device)
    counts, tile_counts = _select_buffers(chunk, max_context, cfg.block_g, q.device)
    for first in range(0, num_rows, chunk):
        rows = slice(first, min(first + chunk, num_rows))
        num = rows.stop - first
        counts[:num].zero_()
        _launch_scores(q[rows], weights[rows], index_cache, block_tables, row_seq[rows], row_limit[rows], scale,
                       max_context, scores[:num], counts, k)
        _launch_select(scores[:num], row_limit[rows], k, out[rows], counts, tile_counts, first_pass=1)
    return out


# ---------------------------------------------------------------------------------------------------- gate, bench

def gate_cases() -> list[GateCase]:
    """The scoring kernel at each gated model's heads and the select's kernels, per capability and dtype
    (gpu_layers.dsa_cases)."""
    from gpu_layers import dsa_cases

    return dsa_cases.gate()


def bench_cases() -> list[tuple]:
    """Scoring, the indexer and the select at DeepSeek-V3.2's and GLM-5's heads (gpu_layers.dsa_cases)."""
    from gpu_layers import dsa_cases

    return dsa_cases.bench()
