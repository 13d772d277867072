"""The chunked prefill of the gated delta rule (`gpu_layers.delta_net.gated_delta_rule_prefill` runs it): the WY / UT
form, chunks of C = 64 tokens, as flash-linear-attention's chunk_gated_delta_rule computes it (our own kernels).

Per sequence, v head and chunk (each sequence's chunks start at its first token; its last one may be partial), with
gamma_t = g_1 + ... + g_t the chunk-local cumulative log gate, k_t and q_t L2-normalised (q times scale), S0 the
state [Dk, Dv] at the chunk's start:
  A   = strictly-lower(beta_t exp(gamma_t - gamma_s) k_t . k_s)                  [C, C]
  T   = (I + A)^-1;  W = T diag(beta exp(gamma)) K [C, Dk];  U = T diag(beta) V [C, Dv]
  V'  = U - W S0                       the chunk's delta-rule updates beta_t (v_t - S_{t-1}^T k_t), all at once
  O   = diag(exp(gamma)) Q S0 + Aqk V',  Aqk = causal(exp(gamma_t - gamma_s) q_t . k_s) (diagonal included)
  S_C = exp(gamma_C) S0 + K^T diag(exp(gamma_C - gamma)) V'
(Unrolling S_t = exp(g_t) S_{t-1} + k_t u_t^T over the chunk gives u = beta (v - exp(gamma) S0^T k) - A u, i.e.
(I + A) u = diag(beta) V - diag(beta exp(gamma)) K S0, which is the V' line; O and S_C follow from S_t.)

Two launches, with a workspace between them:
- prepare, one program per (chunk, v head), every chunk at once: gamma; the raw Gram matrices K K^T and Q K^T
  (BLOCK_K columns at a time) scaled by the norms into A and Aqk; T through a float32 scratch [T, Hv, C] (A is
  stored, read back in 16 x 16 blocks, overwritten by T: a barrier between each, as every thread reads what others
  wrote); then W and U as T with scaled columns times raw K and V. Aqk, W and U go to a workspace
  [T, Hv, Dk + Dv + C] in the input dtype (W | U | Aqk per token), gamma, scale/|q| and 1/|k| to a float32
  [3, T, Hv], so the state pass also multiplies raw q and k and scales rows. T's diagonal blocks come by doubling
  (M <- M - M E M, which only ever forms blocks of the true inverse, unlike the power series
  (I + A)^-1 = sum (-A)^n whose terms grow like (1 + |a|)^n), the others by block substitution
  T_ij = -T_ii sum_m A_im T_mj; all in exact float32 dots (small: 16^3 each).
- state pass, one program per (sequence, v head, BLOCK_V columns of S), chunk after chunk with its slice of S in
  float32 registers: V', O, S_C as above, from the slot's state (or zeros) to the final one written back.
  bf16 inputs take bf16 tensor-core dots (S rounded to bf16 as their operand); fp32 inputs exact ("ieee") dots.
The one-kernel form (T inside the state pass) spilled on every target; split, each kernel fits the gate at 8 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk: 4 blocks of SUB in the prepare kernel (written out by hand below)
SUB = tl.constexpr(16)  # the smallest tl.dot side
L2NORM_EPS = tl.constexpr(1e-6)  # as gpu_layers.delta_net's
BLOCK_SEQS = tl.constexpr(128)  # sequences scanned at a time to find a chunk's sequence

# Keyed by (Dk, Dv, bytes per element): (prepare's BLOCK_K, num_warps, num_stages) and the state pass's (BLOCK_V,
# num_warps, num_stages). 8 warps: at 4 the [C, C] float32 tiles of the prepare kernel and the [C, Dk] operands of
# the state pass spill. None: no chunked config fits the gate (float32 at Dk = 128: the state pass's exact dots
# hold [C, 128] float32 operands whole); gpu_layers.delta_net then runs the token-sequential kernel.
_BF16 = ((32, 8, 1), (16, 8, 1))
_CONFIGS = {(64, 64, 2): _BF16, (64, 128, 2): _BF16, (128, 64, 2): _BF16, (128, 128, 2): _BF16,
            (64, 64, 4): _BF16, (64, 128, 4): _BF16, (128, 64, 4): None, (128, 128, 4): None}
_CONFIGS_SM89 = {**_CONFIGS, (128, 64, 2): ((16, 8, 1), (16, 8, 1))}  # BLOCK_K 32 spills there
# Hopper's wgmma state pass spills at Dk = 128 in every tiling tried (BLOCK_V 16-64, 4-8 warps, 1-2 stages: 144 to
# 1916 B); until it is restructured, the token-sequential kernel runs there.
_CONFIGS_SM90 = {**_CONFIGS_SM89, (128, 64, 2): None, (128, 128, 2): None}
CONFIGS = {89: _CONFIGS_SM89, 90: _CONFIGS_SM90, 120: _CONFIGS}

# ----------------------------------------------------------------------------------------------- prepare


@triton.jit
def _load_rows(ptr, rows, mask, stride_t, cols):
    """[rows, cols] of a [T, ...] tensor (ptr already at the head), zeros past the chunk."""
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, rows, mask, stride_t, cols, x):
    tl.store(ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=mask[:, None])


@triton.jit
def _diagonal_inverse(a, eye, e2, e4, e8):
    """(I + a)^-1 of a strictly lower [SUB, SUB] block by doubling: M holds the inverses of the diagonal blocks of
    size b; M - M E M, E the entries of `a` in the blocks just below them (masks e_b), gives those of size 2b. For
    b = 1, M = I: the first step is I - E_1, E_1 the first subdiagonal."""
    r = tl.arange(0, SUB)[:, None]
    c = tl.arange(0, SUB)[None, :]
    m = eye - tl.where((r == c + 1) & (c % 2 == 0), a, 0.0)
    for level in tl.static_range(3):  # b = 2, 4, 8
        e = e2 if level == 0 else (e4 if level == 1 else e8)
        m = m - tl.dot(tl.dot(m, tl.where(e, a, 0.0), input_precision="ieee"), m, input_precision="ieee")
    return m


@triton.jit
def _solve(a_ptr, start, end, stride_t):
    """Overwrites A [4 SUB, 4 SUB] (strictly lower, float32, rows from `start`) with T = (I + A)^-1, block by
    block: the diagonal blocks by doubling, the others by T_ij = -T_ii sum_{j <= m < i} A_im T_mj. A's upper
    blocks are zeros, and so are T's. (Written out: each call of a helper costs the interpreter dearly.)"""
    r = tl.arange(0, SUB)[:, None]
    c = tl.arange(0, SUB)[None, :]
    eye = tl.where(r == c, 1.0, 0.0)
    e2 = (r // 2 == c // 2 + 1) & (c // 2 % 2 == 0)
    e4 = (r // 4 == c // 4 + 1) & (c // 4 % 2 == 0)
    e8 = (r // 8 == c // 8 + 1) & (c // 8 % 2 == 0)
    p0 = a_ptr + (start + r).to(tl.int64) * stride_t + c  # block (0, 0); block (i, j) at p_i + j SUB
    p1 = p0 + SUB * stride_t
    p2 = p1 + SUB * stride_t
    p3 = p2 + SUB * stride_t
    m0, m1, m2, m3 = start + r < end, start + SUB + r < end, start + 2 * SUB + r < end, start + 3 * SUB + r < end
    t00 = _diagonal_inverse(tl.load(p0, mask=m0, other=0.0), eye, e2, e4, e8)
    t11 = _diagonal_inverse(tl.load(p1 + SUB, mask=m1, other=0.0), eye, e2, e4, e8)
    t22 = _diagonal_inverse(tl.load(p2 + 2 * SUB, mask=m2, other=0.0), eye, e2, e4, e8)
    t33 = _diagonal_inverse(tl.load(p3 + 3 * SUB, mask=m3, other=0.0), eye, e2, e4, e8)
    a10 = tl.load(p1, mask=m1, other=0.0)
    a20 = tl.load(p2, mask=m2, other=0.0)
    a21 = tl.load(p2 + SUB, mask=m2, other=0.0)
    a30 = tl.load(p3, mask=m3, other=0.0)
    a31 = tl.load(p3 + SUB, mask=m3, other=0.0)
    a32 = tl.load(p3 + 2 * SUB, mask=m3, other=0.0)
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision="ieee"), input_precision="ieee")
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision="ieee"), input_precision="ieee")
    t20 = tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee")
    t20 = -tl.dot(t22, t20, input_precision="ieee")
    t31 = tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee")
    t31 = -tl.dot(t33, t31, input_precision="ieee")
    t30 = tl.dot(a30, t00, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
    t30 += tl.dot(a32, t20, input_precision="ieee")
    t30 = -tl.dot(t33, t30, input_precision="ieee")
    tl.debug_barrier()  # every thread has read A before any overwrites it
    tl.store(p0, t00, mask=m0)
    tl.store(p1, t10, mask=m1)
    tl.store(p1 + SUB, t11, mask=m1)
    tl.store(p2, t20, mask=m2)
    tl.store(p2 + SUB, t21, mask=m2)
    tl.store(p2 + 2 * SUB, t22, mask=m2)
    tl.store(p3, t30, mask=m3)
    tl.store(p3 + SUB, t31, mask=m3)
    tl.store(p3 + 2 * SUB, t32, mask=m3)
    tl.store(p3 + 3 * SUB, t33, mask=m3)


@triton.jit
def _chunk_of(chunk, cu_seqlens_ptr, chunk_offsets_ptr, num_seqs):
    """(sequence, first token, end) of global chunk `chunk`; sequence == num_seqs past the last chunk.
    chunk_offsets[b] is the number of chunks of sequences before b."""
    seq = num_seqs * 0
    for base in range(0, num_seqs, BLOCK_SEQS):
        offs = base + 1 + tl.arange(0, BLOCK_SEQS)
        firsts = tl.load(chunk_offsets_ptr + offs, mask=offs <= num_seqs, other=2147483647)
        seq += tl.sum((firsts <= chunk).to(tl.int32), 0)
    safe = tl.minimum(seq, num_seqs - 1)
    start = tl.load(cu_seqlens_ptr + safe) + (chunk - tl.load(chunk_offsets_ptr + safe)) * 4 * SUB
    end = tl.minimum(tl.load(cu_seqlens_ptr + safe + 1), start + 4 * SUB)
    return seq, start, end


@triton.jit
def _gram(q_ptr, k_ptr, rows, mask, stride_qt, stride_kt, K_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
          DOT_PRECISION: tl.constexpr):
    """Raw K K^T and Q K^T [C, C] and the squared norms of k and q, over BLOCK_K columns at a time."""
    kk = tl.zeros([4 * SUB, 4 * SUB], dtype=tl.float32)
    qk = tl.zeros([4 * SUB, 4 * SUB], dtype=tl.float32)
    k_sq = tl.zeros([4 * SUB], dtype=tl.float32)
    q_sq = tl.zeros([4 * SUB], dtype=tl.float32)
    for col in range(0, K_DIM, BLOCK_K):  # a loop, not unrolled: one block of q and k live at a time
        cols = col + tl.arange(0, BLOCK_K)
        k = _load_rows(k_ptr, rows, mask, stride_kt, cols)
        q = _load_rows(q_ptr, rows, mask, stride_qt, cols)
        kk = tl.dot(k, tl.trans(k), kk, input_precision=DOT_PRECISION)
        qk = tl.dot(q, tl.trans(k), qk, input_precision=DOT_PRECISION)
        k_sq += tl.sum(k.to(tl.float32) * k.to(tl.float32), 1)
        q_sq += tl.sum(q.to(tl.float32) * q.to(tl.float32), 1)
    return kk, qk, k_sq, q_sq


@triton.jit
def _t_times(t, x_ptr, out_ptr, rows, mask, stride_xt, stride_ot, DIM: tl.constexpr, BLOCK: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """out[rows] = t @ x[rows], BLOCK columns at a time (t [C, C] already column-scaled, in x's dtype)."""
    for col in range(0, DIM, BLOCK):
        cols = col + tl.arange(0, BLOCK)
        x = _load_rows(x_ptr, rows, mask, stride_xt, cols)
        _store_rows(out_ptr, rows, mask, stride_ot, cols, tl.dot(t, x, input_precision=DOT_PRECISION))


@triton.jit
def gated_delta_rule_chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, work_ptr, gates_ptr, scratch_ptr, cu_seqlens_ptr, chunk_offsets_ptr,
    num_seqs, num_v_heads, scale, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_wt, stride_wh, stride_gates_t,
    stride_gates_plane, stride_st, stride_sh,
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (chunk, v head), v heads fastest (those of one k head share its keys in L2): the chunk's gates,
    Aqk, then A through the float32 scratch [T, Hv, C] into T, then W and U. Raw q and k go into the dots; their
    norms scale the results (A = diag(beta / |k|) K K^T diag(1 / |k|) ...)."""
    head = tl.program_id(0) % num_v_heads
    seq, start, end = _chunk_of(tl.program_id(0) // num_v_heads, cu_seqlens_ptr, chunk_offsets_ptr, num_seqs)
    if seq >= num_seqs:  # the grid is sized for the most chunks the batch can have
        return
    q_ptr += (head // group) * stride_qh
    k_ptr += (head // group) * stride_kh
    w_ptr = work_ptr + head * stride_wh
    scratch_ptr += head * stride_sh
    offs_c = tl.arange(0, 4 * SUB)
    rows = start + offs_c
    mask = rows < end
    g = tl.load(g_ptr + head + rows.to(tl.int64) * stride_gt, mask=mask, other=0.0)
    beta = tl.load(beta_ptr + head + rows.to(tl.int64) * stride_gt, mask=mask, other=0.0)
    gamma = tl.cumsum(g, 0)
    kk, qk, k_sq, q_sq = _gram(q_ptr, k_ptr, rows, mask, stride_qt, stride_kt, K_DIM, BLOCK_K, DOT_PRECISION)
    k_factor = tl.rsqrt(k_sq + L2NORM_EPS)
    q_factor = tl.rsqrt(q_sq + L2NORM_EPS) * scale
    gates = gates_ptr + head + rows.to(tl.int64) * stride_gates_t
    tl.store(gates, gamma, mask=mask)
    tl.store(gates + stride_gates_plane, q_factor, mask=mask)
    tl.store(gates + 2 * stride_gates_plane, k_factor, mask=mask)

    causal = offs_c[:, None] >= offs_c[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    decay = decay * k_factor[None, :]
    aqk = qk * q_factor[:, None] * decay
    _store_rows(w_ptr + K_DIM + V_DIM, rows, mask, stride_wt, offs_c, aqk)
    a = tl.where(offs_c[:, None] > offs_c[None, :], kk * (beta * k_factor)[:, None] * decay, 0.0)
    _store_rows(scratch_ptr, rows, mask, stride_st, offs_c, a)
    tl.debug_barrier()  # A is read back by other threads, in blocks
    _solve(scratch_ptr, start, end, stride_st)
    tl.debug_barrier()
    t = _load_rows(scratch_ptr, rows, mask, stride_st, offs_c)
    # W = T diag(beta exp(gamma) / |k|) K, U = T diag(beta) V: the diagonals scale T's columns.
    dtype = w_ptr.dtype.element_ty
    t_w = (t * (beta * tl.exp(gamma) * k_factor)[None, :]).to(dtype)
    _t_times(t_w, k_ptr, w_ptr, rows, mask, stride_kt, stride_wt, K_DIM, BLOCK_K, DOT_PRECISION)
    t_u = (t * beta[None, :]).to(dtype)
    _t_times(t_u, v_ptr + head * stride_vh, w_ptr + K_DIM, rows, mask, stride_vt, stride_wt, V_DIM, BLOCK_K,
             DOT_PRECISION)


# ----------------------------------------------------------------------------------------------- state pass


@triton.jit
def gated_delta_rule_chunk_state_kernel(
    q_ptr, k_ptr, work_ptr, gates_ptr, out_ptr, cu_seqlens_ptr, state_pool_ptr, state_slots_ptr,
    has_initial_state_ptr, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_wt, stride_wh, stride_gates_t, stride_gates_plane, stride_ot,
    stride_oh, stride_ss,
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (sequence, v head, BLOCK_V columns of S): the sequence's chunks in order, S [Dk, BLOCK_V] in
    registers from the slot's (or zeros) to the final one written back."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    offs_c = tl.arange(0, 4 * SUB)
    offs_k = tl.arange(0, K_DIM)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    q_ptr += (head // group) * stride_qh
    k_ptr += (head // group) * stride_kh
    w_ptr = work_ptr + head * stride_wh
    u_ptr = w_ptr + K_DIM + offs_v
    a_ptr = w_ptr + K_DIM + V_DIM
    gates_ptr += head
    out_ptr += head * stride_oh + offs_v
    state_ptrs = (state_pool_ptr + slot * stride_ss + head * (K_DIM * V_DIM) + offs_k[:, None] * V_DIM
                  + offs_v[None, :])
    state = tl.zeros([K_DIM, BLOCK_V], dtype=tl.float32)
    if tl.load(has_initial_state_ptr + seq) != 0:
        state = tl.load(state_ptrs)
    dtype = work_ptr.dtype.element_ty
    causal = offs_c[:, None] >= offs_c[None, :]
    for first in range(start, end, 4 * SUB):
        rows = first + offs_c
        mask = rows < end
        gates = gates_ptr + rows.to(tl.int64) * stride_gates_t
        gamma = tl.load(gates, mask=mask, other=0.0)
        q_factor = tl.load(gates + stride_gates_plane, mask=mask, other=0.0)
        k_factor = tl.load(gates + 2 * stride_gates_plane, mask=mask, other=0.0)
        gamma_last = tl.load(gates_ptr + (tl.minimum(first + 4 * SUB, end) - 1).to(tl.int64) * stride_gates_t)
        row = rows.to(tl.int64)[:, None]
        row_mask = mask[:, None]
        w = tl.load(w_ptr + row * stride_wt + offs_k[None, :], mask=row_mask, other=0.0)
        u = tl.load(u_ptr + row * stride_wt, mask=row_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_wt + offs_c[None, :], mask=row_mask, other=0.0)
        a = tl.where(causal, a, 0.0).to(dtype)
        q = tl.load(q_ptr + row * stride_qt + offs_k[None, :], mask=row_mask, other=0.0)
        k = tl.load(k_ptr + row * stride_kt + offs_k[None, :], mask=row_mask, other=0.0)
        s_in = state.to(dtype)
        v_new = u - tl.dot(w, s_in, input_precision=DOT_PRECISION)  # [C, BLOCK_V]
        o = tl.dot(q, s_in, input_precision=DOT_PRECISION) * (q_factor * tl.exp(gamma))[:, None]
        o = tl.dot(a, v_new.to(dtype), o, input_precision=DOT_PRECISION)
        tl.store(out_ptr + row * stride_ot, o.to(out_ptr.dtype.element_ty), mask=row_mask)
        v_new = v_new * (k_factor * tl.exp(gamma_last - gamma))[:, None]
        state = state * tl.exp(gamma_last) + tl.dot(tl.trans(k), v_new.to(dtype), input_precision=DOT_PRECISION)
    tl.store(state_ptrs, state)


# ----------------------------------------------------------------------------------------------- host side


def chunk_configs(capability: int, k_head_dim: int, v_head_dim: int, dtype: torch.dtype):
    """((BLOCK_K, num_warps, num_stages) of the prepare kernel, (BLOCK_V, num_warps, num_stages) of the state pass),
    or None where the token-sequential kernel runs instead."""
    from gpu_layers.capability import select

    return select(CONFIGS, capability)[(k_head_dim, v_head_dim, dtype.itemsize)]


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 operands read it: exact fp32 dots


def chunked_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state, scale: float, out,
                    group: int, capability: int, prepare_cfg: tuple[int, int, int] | None = None,
                    state_cfg: tuple[int, int, int] | None = None) -> None:
    """The two launches over tensors gpu_layers.delta_net.gated_delta_rule_prefill has checked. `prepare_cfg` and
    `state_cfg` replace the tables' configs (tuning runs on a device; the runtime passes neither)."""
    num_tokens, num_v_heads, v_head_dim = v.shape
    k_head_dim = q.shape[2]
    num_seqs = state_slots.shape[0]
    # W | U | Aqk per (token, v head); gamma, scale/|q|, 1/|k| per (token, v head).
    work = v.new_empty(num_tokens, num_v_heads, k_head_dim + v_head_dim + CHUNK)
    gates = torch.empty(3, num_tokens, num_v_heads, dtype=torch.float32, device=v.device)
    scratch = torch.empty(num_tokens, num_v_heads, CHUNK, dtype=torch.float32, device=v.device)  # A, then T
    chunks = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor")
    chunk_offsets = torch.zeros(num_seqs + 1, dtype=torch.int32, device=v.device)
    torch.cumsum(chunks, 0, dtype=torch.int32, out=chunk_offsets[1:])
    precision = dot_precision(q.dtype)
    configs = chunk_configs(capability, k_head_dim, v_head_dim, q.dtype) or (None, None)
    block_k, num_warps, num_stages = prepare_cfg or configs[0]
    max_chunks = num_tokens // CHUNK + num_seqs  # sum of ceil(L_b / C) <= sum (L_b // C + 1)
    gated_delta_rule_chunk_prepare_kernel[(max_chunks * num_v_heads,)](
        q, k, v, g, beta, work, gates, scratch, cu_seqlens, chunk_offsets, num_seqs, num_v_heads, scale, group,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        work.stride(0), work.stride(1), gates.stride(1), gates.stride(0), scratch.stride(0), scratch.stride(1),
        K_DIM=k_head_dim, V_DIM=v_head_dim, BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=num_warps,
        num_stages=num_stages,
    )
    block_v, num_warps, num_stages = state_cfg or configs[1]
    gated_delta_rule_chunk_state_kernel[(num_seqs, num_v_heads, v_head_dim // block_v)](
        q, k, work, gates, out, cu_seqlens, state_pool, state_slots, has_initial_state, group,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), work.stride(0), work.stride(1), gates.stride(1),
        gates.stride(0), out.stride(0), out.stride(1), state_pool.stride(0),
        K_DIM=k_head_dim, V_DIM=v_head_dim, BLOCK_V=block_v, DOT_PRECISION=precision, num_warps=num_warps,
        num_stages=num_stages,
    )


def gate_cases() -> list:
    """Every config the launcher can select (gpu_layers.delta_net_cases)."""
    from gpu_layers import delta_net_cases

    return delta_net_cases.gate_chunked()
