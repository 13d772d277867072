"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5) on the GPU: per query row, every visible cached token's index
score, and the positions of the `k` best. Semantics are `gpu_layers.dsa_reference` (the tests' oracle):

    score[n, j] = sum_h w[n, h] * relu(scale * q[n, h] . k_j)    for j < row_limit[n], -inf from there on

Data flow (N rows, Hi indexer heads, Di = 128, L = max_context):
- `index_scores_kernel`, one program per (row, tile of BLOCK_N keys): the row's q [Hi, Di] against the key tile
  gathered through the block table, one tl.dot (fp32 accumulation), relu, the weighted sum over heads. Tiles at or
  past the row's limit return at once (the grid is sized from the host int L, max_model_len in a captured decode).
  Run from `index_topk`, it also adds the tile's coarse histogram (below) into the row's [256] counts and skips
  the -inf stores, which nothing reads.
- `select_topk`: a radix select. Each score's order-preserving key (signed int32, for negatives the low 31 bits
  flipped) is first binned coarsely by the top byte of the same key of the score rounded to float16 (sign, the
  5 exponent bits, 2 mantissa bits: bins a quarter of an octave wide, monotone in the score). From the row's
  coarse histogram every program finds the bin holding the k-th largest score; `topk_gather_kernel`, one program
  per tile, writes the positions of the bins above it straight to the output (slots from one atomic counter per
  row) and the threshold bin's positions to a scratch list (typically a few hundred to a few thousand). Then
  `topk_refine_kernel`, one program per row, refines only those candidates: four 8-bit histogram passes over
  their 32-bit keys, most significant first, narrow to the k-th largest key exactly, and a compaction pass
  writes the candidates above it and the first of those equal to it (tl.cumsum offsets). The first BLOCK_R
  candidates stay in registers across the passes; more are re-read from the scratch list.
  `select_topk` on given scores builds the coarse histogram with `topk_histogram_kernel` first.
- `index_topk` runs the three kernels on chunks of rows sized so the float32 scores and int32 candidates stay
  under a budget (256 MiB): a prefill chunk of 8192 rows at 128K context would take 8 GiB otherwise.

Rows with at most k visible tokens select them all (positions 0..limit-1, then -1). Ties: exact as a set where the
k-th and (k+1)-th largest scores differ; otherwise the boundary's equal scores are taken in the scratch list's
order, which the atomics make run-dependent. -0.0 orders below +0.0. Every launch's grid comes from shapes and
host ints and nothing reads the device on the host: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, select

NUM_BINS = 256  # the coarse and the refining histograms alike: one 8-bit digit
_NUM_BINS = tl.constexpr(NUM_BINS)
COUNTS_STRIDE = NUM_BINS + 4  # a row's coarse histogram, its two list counters (16-byte aligned rows)
_COUNTS_STRIDE = tl.constexpr(COUNTS_STRIDE)
MAX_HEADS = 64  # DeepSeek-V3.2; GLM-5 has 32
MAX_HEAD_DIM = 128
SCORE_BUDGET_BYTES = 256 << 20  # index_topk's scores + candidates per chunk of rows

TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class ScoresConfig:
    block_n: int  # keys per program
    block_k: int  # head-dim slice per tl.dot
    num_warps: int


@dataclass(frozen=True)
class SelectConfig:
    block_g: int  # scores per program of the histogram and gather kernels
    gather_warps: int
    block_r: int  # candidates per refining step; the first block stays in registers
    refine_warps: int


# Keyed by capability, then the cache's element size. One tile per program, no loop to pipeline: occupancy hides
# the gather latency. fp32 (CPU-parity dtype, FMA dots) slices the head dim by 32 and takes 8 warps: whole
# 128-wide rows, or 4 warps at 64 heads, spill or come within a few registers of it.
SCORES_CONFIGS = {
    89: {2: ScoresConfig(64, 128, 4), 4: ScoresConfig(64, 32, 8)},
    90: {2: ScoresConfig(64, 128, 4), 4: ScoresConfig(64, 32, 8)},
    120: {2: ScoresConfig(64, 128, 4), 4: ScoresConfig(64, 32, 8)},
}
SELECT_CONFIGS = {
    89: SelectConfig(2048, 8, 4096, 16),
    90: SelectConfig(2048, 8, 4096, 16),
    120: SelectConfig(2048, 8, 4096, 16),
}


@triton.jit
def _coarse_bin(score):
    """0..255, non-decreasing in the score: the top byte of the order-preserving key of its float16 rounding."""
    bits = score.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    key = tl.where(bits < 0, bits ^ 0x7FFF, bits)  # signed order is the float order
    return (key + 32768) >> 8


@triton.jit
def _sortable_key(score):
    """int32 whose signed order is the float order of the score (-0.0 just below +0.0)."""
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _add_histogram(counts_row, values, mask):
    counts = tl.histogram(values, _NUM_BINS, mask=mask)
    # A tile's scores fall in few bins: atomics only where it has any.
    tl.atomic_add(counts_row + tl.arange(0, _NUM_BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def index_scores_kernel(
    q, weights, cache, block_tables, row_seq, row_limit, scores, counts,
    scale, max_context, page_size, min_selecting, stride_q_n, stride_q_h, stride_w_n, stride_bt,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, FOR_SELECT: tl.constexpr,
):
    """One program: row n, keys [start, start + BLOCK_N). FOR_SELECT: also the tile's coarse histogram into
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
            _add_histogram(counts + n * _COUNTS_STRIDE, _coarse_bin(tile), is_visible)
    else:
        tl.store(row_scores + pos, tile, mask=pos < max_context)


@triton.jit
def topk_histogram_kernel(scores, counts, row_limit, stride_s, max_context, k, BLOCK_G: tl.constexpr):
    """One program: the coarse histogram of row n's visible scores [start, start + BLOCK_G) into counts[n]."""
    n = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_G
    limit = tl.minimum(tl.load(row_limit + n), max_context)
    if start >= limit or limit <= k:
        return
    pos = start + tl.arange(0, BLOCK_G)
    is_visible = pos < limit
    values = tl.load(scores + n.to(tl.int64) * stride_s + pos, mask=is_visible, other=0.0)
    _add_histogram(counts + n * _COUNTS_STRIDE, _coarse_bin(values), is_visible)


@triton.jit
def _threshold_bin(counts_row, k):
    """From a row's coarse histogram: the bin holding its k-th largest score, and how many scores lie above it."""
    bins = tl.arange(0, _NUM_BINS)
    counts = tl.load(counts_row + bins)
    at_or_above = tl.cumsum(counts, 0, reverse=True)
    threshold = tl.max(tl.where(at_or_above >= k, bins, -1), 0)
    above = tl.sum(tl.where(bins > threshold, counts, 0), 0)
    size = tl.sum(tl.where(bins == threshold, counts, 0), 0)
    return threshold, above, size


@triton.jit
def topk_gather_kernel(scores, counts, out, candidates, row_limit, stride_s, max_context, k,
                       BLOCK_G: tl.constexpr):
    """One program: scores [start, start + BLOCK_G) of row n (one with more than k visible). Positions in bins
    above the threshold bin go to out[n] (slots from the row's counter), the threshold bin's to candidates[n]
    (slots from its counter)."""
    n = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_G
    limit = tl.minimum(tl.load(row_limit + n), max_context)
    if start >= limit or limit <= k:
        return
    counts_row = counts + n * _COUNTS_STRIDE
    threshold, _, _ = _threshold_bin(counts_row, k)
    pos = start + tl.arange(0, BLOCK_G)
    is_visible = pos < limit
    values = tl.load(scores + n.to(tl.int64) * stride_s + pos, mask=is_visible, other=0.0)
    bins = _coarse_bin(values)
    is_above = (is_visible & (bins > threshold)).to(tl.int32)
    is_candidate = (is_visible & (bins == threshold)).to(tl.int32)
    # Slots are bounded (fewer than k above, at most L candidates) so that no inconsistency writes past a row.
    slot = tl.atomic_add(counts_row + _NUM_BINS, tl.sum(is_above, 0), sem="relaxed") + tl.cumsum(is_above, 0) - 1
    tl.store(out + n.to(tl.int64) * k + slot, pos, mask=(is_above != 0) & (slot < k))
    slot = tl.atomic_add(counts_row + _NUM_BINS + 1, tl.sum(is_candidate, 0), sem="relaxed")
    slot += tl.cumsum(is_candidate, 0) - 1
    tl.store(candidates + n.to(tl.int64) * max_context + slot, pos, mask=(is_candidate != 0) & (slot < max_context))


@triton.jit
def _digit_counts(keys, is_valid, prefix, SHIFT: tl.constexpr):
    """The histogram of the 8-bit digit at SHIFT of the keys that match `prefix` above it. Digits are those of the
    unsigned key (the signed key with its sign bit flipped), so digit order is key order."""
    if SHIFT == 24:
        digits = ((keys >> 24) & 0xFF) ^ 0x80
        is_match = is_valid
    else:
        digits = (keys >> SHIFT) & 0xFF
        is_match = is_valid & ((keys >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
    return tl.histogram(digits, _NUM_BINS, mask=is_match)


@triton.jit
def _load_candidates(scores_row, candidates_row, start, size, BLOCK_R: tl.constexpr):
    idx = start + tl.arange(0, BLOCK_R)
    is_valid = idx < size
    pos = tl.load(candidates_row + idx, mask=is_valid, other=0)
    keys = _sortable_key(tl.load(scores_row + pos, mask=is_valid, other=0.0))
    return pos, keys, is_valid


@triton.jit
def _compact(out_row, capacity, pos, keys, is_valid, threshold, num_equal_wanted, num_written, num_equal_seen):
    """Writes the positions whose key is above the threshold, and those equal to it while fewer than
    num_equal_wanted were taken, at out_row[num_written:capacity]. Returns the updated counts."""
    is_equal = (is_valid & (keys == threshold)).to(tl.int32)
    equal_rank = num_equal_seen + tl.cumsum(is_equal, 0) - 1
    is_taken = ((is_valid & (keys > threshold)) | ((is_equal != 0) & (equal_rank < num_equal_wanted))).to(tl.int32)
    slot = num_written + tl.cumsum(is_taken, 0) - 1
    # The counts fill the row exactly; the bound keeps any inconsistency from writing into the next row.
    tl.store(out_row + slot, pos, mask=(is_taken != 0) & (slot < capacity))
    return num_written + tl.sum(is_taken, 0), num_equal_seen + tl.sum(is_equal, 0)


@triton.jit
def topk_refine_kernel(scores, counts, out, candidates, row_limit, stride_s, max_context, k,
                       BLOCK_R: tl.constexpr):
    """One program per row. A row with at most k visible: out[n] = 0..limit-1, then -1. Otherwise the threshold
    bin's candidates are narrowed to the (k - above)-th largest key, and those selected fill out[n][above:]."""
    n = tl.program_id(0)
    limit = tl.minimum(tl.load(row_limit + n), max_context)
    out_row = out + n.to(tl.int64) * k
    if limit <= k:
        for start in range(0, k, BLOCK_R):
            idx = start + tl.arange(0, BLOCK_R)
            tl.store(out_row + idx, tl.where(idx < limit, idx, -1), mask=idx < k)
        return
    _bin, above, size = _threshold_bin(counts + n * _COUNTS_STRIDE, k)
    wanted = k - above  # 1..size: the threshold bin holds the k-th largest
    scores_row = scores + n.to(tl.int64) * stride_s
    candidates_row = candidates + n.to(tl.int64) * max_context
    first_pos, first_keys, first_valid = _load_candidates(scores_row, candidates_row, 0, size, BLOCK_R)
    threshold = 0
    for digit_index in tl.static_range(4):  # digits at bits 24, 16, 8, 0
        digit_counts = _digit_counts(first_keys, first_valid, threshold, 24 - 8 * digit_index)
        for start in range(BLOCK_R, size, BLOCK_R):
            _pos, keys, is_valid = _load_candidates(scores_row, candidates_row, start, size, BLOCK_R)
            digit_counts += _digit_counts(keys, is_valid, threshold, 24 - 8 * digit_index)
        digits = tl.arange(0, _NUM_BINS)
        at_or_above = tl.cumsum(digit_counts, 0, reverse=True)
        digit = tl.max(tl.where(at_or_above >= wanted, digits, -1), 0)
        wanted -= tl.sum(tl.where(digits > digit, digit_counts, 0), 0)
        # The key's top byte is signed: the unsigned digit less 128 (no int32 overflow in the shift).
        if digit_index == 0:
            threshold = (digit - 128) * (1 << 24)
        else:
            threshold += digit * (1 << (24 - 8 * digit_index))
    # `threshold` is the exact key of the wanted-th largest candidate; `wanted` of the candidates equal to it are
    # needed besides all that are greater.
    out_tail = out_row + above
    num_written, num_equal_seen = _compact(out_tail, k - above, first_pos, first_keys, first_valid, threshold,
                                           wanted, 0, 0)
    for start in range(BLOCK_R, size, BLOCK_R):
        pos, keys, is_valid = _load_candidates(scores_row, candidates_row, start, size, BLOCK_R)
        num_written, num_equal_seen = _compact(out_tail, k - above, pos, keys, is_valid, threshold, wanted,
                                               num_written, num_equal_seen)


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


def _select_buffers(num_rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [rows, COUNTS_STRIDE] int32 zeroed per use, candidates [rows, width] int32)."""
    counts = torch.empty(num_rows, COUNTS_STRIDE, dtype=torch.int32, device=device)
    return counts, torch.empty(num_rows, width, dtype=torch.int32, device=device)


def _launch_select(scores, row_limit, k, out, counts, candidates, has_histogram: bool) -> None:
    """The gather and refine kernels over scores [rows, L] (stride of a row: L); the coarse histogram first
    unless the scores kernel made it."""
    num_rows, width = scores.shape
    cfg = select(SELECT_CONFIGS, capability_of(scores.device))
    tiles = (num_rows, triton.cdiv(width, cfg.block_g))
    if not has_histogram:
        topk_histogram_kernel[tiles](scores, counts, row_limit, width, width, k, BLOCK_G=cfg.block_g,
                                     num_warps=cfg.gather_warps)
    topk_gather_kernel[tiles](scores, counts, out, candidates, row_limit, width, width, k, BLOCK_G=cfg.block_g,
                              num_warps=cfg.gather_warps)
    topk_refine_kernel[(num_rows,)](scores, counts, out, candidates, row_limit, width, width, k,
                                    BLOCK_R=cfg.block_r, num_warps=cfg.refine_warps)


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
    the positions of each row's k largest visible scores in no order, -1 padded; a row with at most k visible
    selects them all (dsa_reference.select_topk). No host syncs."""
    _require(scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous(),
             f"scores must be a contiguous [rows, L] float32, got {tuple(scores.shape)} {scores.dtype}")
    _require(k >= 1, f"k must be >= 1, got {k}")
    num_rows, width = scores.shape
    _check_rows("row_limit", row_limit, num_rows, scores.device)
    out = _check_out_topk(out, num_rows, k, scores.device)
    if num_rows == 0 or width == 0:
        return out.fill_(-1)
    counts, candidates = _select_buffers(num_rows, width, scores.device)
    counts.zero_()
    _launch_select(scores, row_limit, k, out, counts, candidates, has_histogram=False)
    return out


def rows_per_chunk(num_rows: int, max_context: int, budget_bytes: int) -> int:
    """Rows whose float32 scores and int32 candidates (8 bytes a position) fit the budget; at least one."""
    return max(1, min(num_rows, budget_bytes // (8 * max_context)))


def index_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
               row_seq: torch.Tensor, row_limit: torch.Tensor, scale: float, max_context: int, k: int,
               out: torch.Tensor | None = None, budget_bytes: int = SCORE_BUDGET_BYTES) -> torch.Tensor:
    """The indexer end to end (index_scores's arguments, then k) -> int32 [N, k]: select_topk of the scores,
    without the -inf stores, the coarse histogram made by the scores kernel. Rows run in chunks whose workspace
    stays under budget_bytes (one chunk for a decode batch). No host syncs: CUDA-graph capturable."""
    _check_scores_inputs(q, weights, index_cache, block_tables, row_seq, row_limit, max_context)
    _require(k >= 1, f"k must be >= 1, got {k}")
    num_rows = q.shape[0]
    out = _check_out_topk(out, num_rows, k, q.device)
    if num_rows == 0:
        return out
    chunk = rows_per_chunk(num_rows, max_context, budget_bytes)
    scores = torch.empty(chunk, max_context, dtype=torch.float32, device=q.device)
    counts, candidates = _select_buffers(chunk, max_context, q.device)
    for first in range(0, num_rows, chunk):
        rows = slice(first, min(first + chunk, num_rows))
        num = rows.stop - first
        counts[:num].zero_()
        _launch_scores(q[rows], weights[rows], index_cache, block_tables, row_seq[rows], row_limit[rows], scale,
                       max_context, scores[:num], counts, k)
        _launch_select(scores[:num], row_limit[rows], k, out[rows], counts, candidates, has_histogram=True)
    return out


# ---------------------------------------------------------------------------------------------------- gate, bench

GATED_HEADS = {"deepseek-v3.2": (64, 128), "glm-5": (32, 128)}  # (indexer heads, head dim)


def _scores_signature(dtype: str) -> dict[str, str]:
    sig = dict(q=f"*{dtype}", weights="*fp32", cache=f"*{dtype}", block_tables="*i32", row_seq="*i32",
               row_limit="*i32", scores="*fp32", counts="*i32", scale="fp32")
    for name in ("max_context", "page_size", "min_selecting", "stride_q_n", "stride_q_h", "stride_w_n", "stride_bt"):
        sig[name] = "i32"
    constexprs = ("H", "D", "BLOCK_H", "BLOCK_D", "BLOCK_K", "BLOCK_N", "FOR_SELECT")
    return sig | {name: "constexpr" for name in constexprs}


def _select_gate_cases(capability: int) -> list[GateCase]:
    cfg = select(SELECT_CONFIGS, capability)
    common = dict(row_limit="*i32", stride_s="i32", max_context="i32", k="i32")
    gather = dict(scores="*fp32", counts="*i32", out="*i32", candidates="*i32") | common
    return [
        GateCase(topk_histogram_kernel, dict(scores="*fp32", counts="*i32") | common | {"BLOCK_G": "constexpr"},
                 dict(BLOCK_G=cfg.block_g), capability, f"topk_histogram {cfg}", cfg.gather_warps, 1),
        GateCase(topk_gather_kernel, gather | {"BLOCK_G": "constexpr"}, dict(BLOCK_G=cfg.block_g), capability,
                 f"topk_gather {cfg}", cfg.gather_warps, 1),
        GateCase(topk_refine_kernel, gather | {"BLOCK_R": "constexpr"}, dict(BLOCK_R=cfg.block_r), capability,
                 f"topk_refine {cfg}", cfg.refine_warps, 1),
    ]


def gate_cases() -> list[GateCase]:
    """The scores kernel at V3.2's and GLM-5's heads, each dtype's config, plain and for selection; the selection
    kernels (float32 scores whatever the cache's dtype), for each capability."""
    cases = []
    for capability in CAPABILITIES:
        for torch_dtype, dtype in TRITON_DTYPES.items():
            cfg = select(SCORES_CONFIGS, capability)[torch_dtype.itemsize]
            for model, (num_heads, head_dim) in GATED_HEADS.items():
                for for_select in (False, True):
                    constexprs = dict(H=num_heads, D=head_dim, BLOCK_H=head_block(num_heads),
                                      BLOCK_D=head_block(head_dim), BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
                                      FOR_SELECT=for_select)
                    label = f"index_scores {dtype} {model}{' for select' if for_select else ''} {cfg}"
                    cases.append(GateCase(index_scores_kernel, _scores_signature(dtype), constexprs, capability,
                                          label, cfg.num_warps, 1))
        cases += _select_gate_cases(capability)
    return cases


def _bench_problem(batch: int, context: int, num_heads: int, cache) -> dict:
    """Decode rows of `batch` sequences of `context` tokens over shuffled pages of the shared cache."""
    device, page_size, head_dim = cache.device, cache.shape[1], cache.shape[3]
    pages = context // page_size
    tables = torch.randperm(cache.shape[0], device=device)[: batch * pages].view(batch, pages).int()
    return dict(q=torch.randn(batch, num_heads, head_dim, device=device, dtype=cache.dtype),
                weights=torch.randn(batch, num_heads, device=device) * num_heads**-0.5, index_cache=cache,
                block_tables=tables, row_seq=torch.arange(batch, dtype=torch.int32, device=device),
                row_limit=torch.full((batch,), context, dtype=torch.int32, device=device),
                scale=head_dim**-0.5, max_context=context)


def bench_cases() -> list[tuple]:
    """Decode rows (batch 1 at 8K, 32K, 128K; batch 8 at 32K), V3.2's 64 heads and GLM-5's 32, bf16 keys in
    pages of 64, k = 2048: the scores alone (keys read + scores written), the selection alone on those scores
    (scores read; baseline torch.topk) and the whole indexer (baseline: index_scores then torch.topk)."""
    device, page_size, head_dim, k = torch.device("cuda"), 64, 128, 2048
    shapes = ((1, 8192), (1, 32768), (1, 131072), (8, 32768))
    cache = torch.randn(max(b * c for b, c in shapes) // page_size, page_size, 1, head_dim, device=device,
                        dtype=torch.bfloat16)
    cases = []
    for batch, context in shapes:
        where = f"B={batch} ctx={context}"
        key_bytes, score_bytes = batch * context * head_dim * 2, batch * context * 4
        for model, (num_heads, _) in GATED_HEADS.items():
            p = _bench_problem(batch, context, num_heads, cache)
            scores = torch.empty(batch, context, device=device)
            out = torch.empty(batch, k, dtype=torch.int32, device=device)
            flops = 2 * batch * context * num_heads * head_dim

            def run_scores(p=p, scores=scores):
                index_scores(**p, out=scores)

            def run_topk(p=p, out=out):
                index_topk(**p, k=k, out=out)

            def run_baseline(p=p, scores=scores):
                index_scores(**p, out=scores)
                torch.topk(scores, k, dim=-1)

            cases.append((f"dsa.index_scores {model} {where}", run_scores, key_bytes + score_bytes, flops))
            cases.append((f"dsa.index_topk {model} {where}", run_topk, key_bytes + 2 * score_bytes, flops,
                          run_baseline))
        run_scores()
        limits = p["row_limit"]
        cases.append((f"dsa.select_topk {where}", lambda s=scores, r=limits, o=out: select_topk(s, r, k, out=o),
                      score_bytes, 0, lambda s=scores: torch.topk(s, k, dim=-1)))
    return cases
