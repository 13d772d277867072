"""The Triton kernels of gpu_layers.attention (paged GQA decode, its split-K combine, causal prefill/extend); the
module docstring there says how they are built and why, its launchers check their inputs and choose configs."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # sinks are natural-log logits; the kernels' scores are in base 2
GROUP_PAD = tl.constexpr(16)  # the M side of the decode dot: tensor-core dots need at least 16 rows

@triton.jit
def _load_kv_tile(cache_ptr, block_table_row, offs_n, n_mask, kv_head, page_shift, stride_p, stride_s, stride_h,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """[BLOCK_N, D_PAD] rows of one KV head at positions offs_n, gathered through the block table."""
    pages = tl.load(block_table_row + (offs_n >> page_shift), mask=n_mask, other=0)
    slots = offs_n & ((1 << page_shift) - 1)
    # Row offsets are multiples of 16 elements (the launchers check the strides), so the compiler emits 16-byte
    # loads and cp.async copies; without the hint the offline gate would compile a different, scalar kernel.
    rows = tl.multiple_of(pages.to(tl.int64) * stride_p + slots * stride_s + kv_head * stride_h, [16])
    offs_d = tl.arange(0, D_PAD)
    mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _softmax_step(q, k, v, score_mask, acc, m_i, l_i, scale_log2, DOT_PRECISION: tl.constexpr):
    """One online-softmax update of (acc, running max, running sum) with a K/V tile; masked scores count as -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
    scale_log2, sliding_window, group, num_splits, page_shift,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    QK_DIM: tl.constexpr, QK_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (b, kv head, split): the G query heads of one KV head over one partition of sequence b's context.
    Writes partials [B, Hq, S, Dv] (acc, not normalised), [B, Hq, S] (max, base 2) and [B, Hq, S] (sum)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * group

    # The visible keys [first, seq_len) in whole tiles, dealt out evenly to the splits.
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if sliding_window > 0:
        first = tl.maximum(seq_len - sliding_window, 0)
    first_tile = first // BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N) - first_tile, num_splits)
    lo = (first_tile + split * tiles_per_split) * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * group + rows
    row_mask = rows < group
    offs_qk = tl.arange(0, QK_PAD)
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_qk[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & (offs_qk[None, :] < QK_DIM), other=0.0)

    acc = tl.zeros([GROUP_PAD, V_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < hi) & (offs_n >= first)
        k = _load_kv_tile(k_cache_ptr, block_table_row, offs_n, n_mask, kv_head, page_shift,
                          stride_kp, stride_ks, stride_kh, QK_DIM, QK_PAD)
        v = _load_kv_tile(v_cache_ptr, block_table_row, offs_n, n_mask, kv_head, page_shift,
                          stride_vp, stride_vs, stride_vh, V_DIM, V_PAD)
        acc, m_i, l_i = _softmax_step(q, k, v, n_mask[None, :], acc, m_i, l_i, scale_log2, DOT_PRECISION)

    partial = (seq * num_q_heads + heads) * num_splits + split  # [GROUP_PAD] index into [B, Hq, S]
    tl.store(partial_max_ptr + partial, m_i, mask=row_mask)
    tl.store(partial_sum_ptr + partial, l_i, mask=row_mask)
    offs_v = tl.arange(0, V_PAD)
    acc_ptrs = partial_acc_ptr + partial[:, None] * V_DIM + offs_v[None, :]
    tl.store(acc_ptrs, acc, mask=row_mask[:, None] & (offs_v[None, :] < V_DIM))


@triton.jit
def paged_decode_reduce_kernel(
    partial_acc_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Program (b, q head): combines the S partials of one head into out[b, head] (online over SPLIT_BLOCK).
    HEAD_DIM is the value head dim. A sink enters here, once, as one more partial (max s_h, sum 1, acc 0), so the
    result does not depend on the number of splits."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * num_splits
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM

    acc = tl.zeros([D_PAD], dtype=tl.float32)
    m_run = float("-inf")
    l_run = 0.0
    if HAS_SINKS:
        m_run = tl.load(sinks_ptr + head) * _LOG2E  # the sink logit, in the partials' base 2
        l_run = 1.0
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        offs_s = s0 + tl.arange(0, SPLIT_BLOCK)
        s_mask = offs_s < num_splits
        part_max = tl.load(partial_max_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
        part_sum = tl.load(partial_sum_ptr + base + offs_s, mask=s_mask, other=0.0)
        acc_ptrs = partial_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
        part_acc = tl.load(acc_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(part_max, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty partials have max -inf and weight 0
        alpha = tl.exp2(m_run - m_safe)
        weight = tl.exp2(part_max - m_safe)
        l_run = l_run * alpha + tl.sum(weight * part_sum, 0)
        acc = acc * alpha + tl.sum(weight[:, None] * part_acc, 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, kv_head, lo, hi, floor, pos, lower,
                  scale_log2, page_shift, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  QK_DIM: tl.constexpr, QK_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, IS_MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Keys [lo, hi) in BLOCK_N tiles. IS_MASKED applies the causal/window mask per (row, key); the unmasked
    loop covers keys that every row of the tile sees, and skips that work. Keys below `floor` (before every row's
    window) are not loaded: their pages may have gone back to the pool (`hybrid.block_manager.NULL_PAGE`)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < hi) & (offs_n >= floor)
        k = _load_kv_tile(k_cache_ptr, block_table_row, offs_n, n_mask, kv_head, page_shift,
                          stride_kp, stride_ks, stride_kh, QK_DIM, QK_PAD)
        v = _load_kv_tile(v_cache_ptr, block_table_row, offs_n, n_mask, kv_head, page_shift,
                          stride_vp, stride_vs, stride_vh, V_DIM, V_PAD)
        if IS_MASKED:
            score_mask = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] > lower[:, None])
        else:
            score_mask = True
        acc, m_i, l_i = _softmax_step(q, k, v, score_mask, acc, m_i, l_i, scale_log2, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    scale_log2, sliding_window, group, page_shift,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    QK_DIM: tl.constexpr, QK_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Program (query tile, b, kv head): BLOCK_M rows = BLOCK_M // G consecutive new tokens of sequence b times
    the G query heads of one KV head, attending causally over b's whole paged context."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tokens_per_tile = BLOCK_M // group
    first_token = tile * tokens_per_tile
    if first_token >= q_len:  # the grid is sized for the longest query of the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // group
    heads = kv_head * group + rows % group
    # Rows past tokens_per_tile * G (when G does not divide BLOCK_M) would alias the next tile's first token.
    row_mask = (rows < tokens_per_tile * group) & (tokens < q_len)
    pos = seq_len - q_len + tokens  # absolute position of each row's token
    lower = tl.where(sliding_window > 0, pos - sliding_window, -1)  # keys must be > lower
    offs_qk = tl.arange(0, QK_PAD)
    q_rows = tl.multiple_of((q_start + tokens).to(tl.int64) * stride_qt + heads * stride_qh, [16])
    q = tl.load(q_ptr + q_rows[:, None] + offs_qk[None, :], mask=row_mask[:, None] & (offs_qk[None, :] < QK_DIM),
                other=0.0)

    # Keys [lo, mid) are visible to every row (no mask needed); [mid, hi) holds the causal diagonal and the
    # window's edge. A window makes every tile masked (rare: Mixtral-like models).
    first_pos = seq_len - q_len + first_token
    hi = seq_len - q_len + tl.minimum(first_token + tokens_per_tile, q_len)
    lo = 0
    floor = 0
    mid = (first_pos + 1) // BLOCK_N * BLOCK_N
    if sliding_window > 0:
        floor = tl.maximum(first_pos - sliding_window + 1, 0)
        lo = floor // BLOCK_N * BLOCK_N
        mid = lo

    acc = tl.zeros([BLOCK_M, V_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink is a key of logit s_h and value 0: the running state starts from it
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    acc, m_i, l_i = _prefill_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, kv_head, lo, mid,
                                  floor, pos, lower, scale_log2, page_shift, stride_kp, stride_ks, stride_kh,
                                  stride_vp, stride_vs, stride_vh, QK_DIM, QK_PAD, V_DIM, V_PAD, BLOCK_N, False,
                                  DOT_PRECISION)
    acc, m_i, l_i = _prefill_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, kv_head, mid, hi,
                                  floor, pos, lower, scale_log2, page_shift, stride_kp, stride_ks, stride_kh,
                                  stride_vp, stride_vs, stride_vh, QK_DIM, QK_PAD, V_DIM, V_PAD, BLOCK_N, True,
                                  DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = tl.multiple_of((q_start + tokens).to(tl.int64) * stride_ot + heads * stride_oh, [16])
    offs_v = tl.arange(0, V_PAD)
    tl.store(out_ptr + o_rows[:, None] + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (offs_v[None, :] < V_DIM))


def gate_cases() -> list:
    """Every config the launchers of gpu_layers.attention can select (gpu_layers.attention_cases)."""
    from gpu_layers import attention_cases

    return attention_cases.gate()
