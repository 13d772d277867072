"""The first build's DSA top-k select, kept as `hybrid-bench kernels`' baseline for `gpu_layers.dsa`'s radix
select (not used by the runtime; remove once docs/benchmarks.md holds both on both score distributions).

Each score is binned coarsely by the top byte of the order-preserving key of its float16 rounding (quarter-octave
bins); from the row's coarse histogram `topk_gather_kernel` writes the positions of the bins above the threshold
bin to the output and the threshold bin's positions to a scratch list; then `topk_refine_kernel`, ONE program per
row, narrows those candidates with four 8-bit histogram passes over their float32 keys and compacts them. Its time
grows with the threshold bin's population, which concentrated scores (many exact zeros, a narrow range) make the
whole row. Ties at the boundary are taken in the scratch list's order, which the atomics make run-dependent.
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


@dataclass(frozen=True)
class RefineSelectConfig:
    block_g: int  # scores per program of the histogram and gather kernels
    gather_warps: int
    block_r: int  # candidates per refining step; the first block stays in registers
    refine_warps: int


CONFIGS = {
    89: RefineSelectConfig(2048, 8, 4096, 16),
    90: RefineSelectConfig(2048, 8, 4096, 16),
    120: RefineSelectConfig(2048, 8, 4096, 16),
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


def select_topk(scores: torch.Tensor, row_limit: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """scores [N, L] float32 contiguous, row_limit [N] int32, out [N, k] int32 -> out: `gpu_layers.dsa.select_topk`'s
    selection (as a set) by the first build's kernels. No host syncs."""
    num_rows, width = scores.shape
    cfg = select(CONFIGS, capability_of(scores.device))
    counts = torch.zeros(num_rows, COUNTS_STRIDE, dtype=torch.int32, device=scores.device)
    candidates = torch.empty(num_rows, width, dtype=torch.int32, device=scores.device)
    tiles = (num_rows, triton.cdiv(width, cfg.block_g))
    topk_histogram_kernel[tiles](scores, counts, row_limit, width, width, k, BLOCK_G=cfg.block_g,
                                 num_warps=cfg.gather_warps)
    topk_gather_kernel[tiles](scores, counts, out, candidates, row_limit, width, width, k, BLOCK_G=cfg.block_g,
                              num_warps=cfg.gather_warps)
    topk_refine_kernel[(num_rows,)](scores, counts, out, candidates, row_limit, width, width, k,
                                    BLOCK_R=cfg.block_r, num_warps=cfg.refine_warps)
    return out


def gate_cases() -> list[GateCase]:
    cases = []
    for capability in CAPABILITIES:
        cfg = select(CONFIGS, capability)
        common = dict(row_limit="*i32", stride_s="i32", max_context="i32", k="i32")
        gather = dict(scores="*fp32", counts="*i32", out="*i32", candidates="*i32") | common
        cases += [
            GateCase(topk_histogram_kernel, dict(scores="*fp32", counts="*i32") | common | {"BLOCK_G": "constexpr"},
                     dict(BLOCK_G=cfg.block_g), capability, f"refine-select histogram {cfg}", cfg.gather_warps, 1),
            GateCase(topk_gather_kernel, gather | {"BLOCK_G": "constexpr"}, dict(BLOCK_G=cfg.block_g), capability,
                     f"refine-select gather {cfg}", cfg.gather_warps, 1),
            GateCase(topk_refine_kernel, gather | {"BLOCK_R": "constexpr"}, dict(BLOCK_R=cfg.block_r), capability,
                     f"refine-select refine {cfg}", cfg.refine_warps, 1),
        ]
    return cases
