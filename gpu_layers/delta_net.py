"""Gated DeltaNet kernels (Qwen3-Next, Qwen3.5): causal depthwise conv1d, prefill and recurrent decode of
the gated delta rule, over per-sequence states in pools indexed by slot.

Data flow:
  state_pool [num_slots, Hv, Dk, Dv] float32     the delta-rule state S of each sequence slot
  conv_pool [num_slots, C, K - 1] (model dtype)  the last K - 1 conv inputs of each slot
  state_slots [B] int32, has_initial_state [B] bool: sequence b's slot, and whether it resumes (else zeros)
  prefill tokens are packed [T, ...], sequence b owning cu_seqlens[b]:cu_seqlens[b + 1] (int32 [B + 1])
  conv:   x [T, C] -> silu(bias + sum_j w[:, j] x[t - K + 1 + j]) [T, C]; the slot keeps the last K - 1 inputs
  delta:  q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] float32 -> o [T, Hv, Dv]; v head h reads k head h // G
The math, and the plain-PyTorch oracle, is gpu_layers.delta_net_reference: q and k are always L2-normalised in the
kernels (every GDN model we serve asks for it; doing it here saves a pass over q and k), then q is scaled.

Why it is built this way:
- Our own Triton kernels, not fla-core's: fla is not a dependency, and its kernels are autotuned over many configs
  and split into several launches with intermediate tensors, each of which the SM120 gate would have to cover;
  these few fixed configs are all the runtime can select, and all of them are in the gate.
- Prefill is chunked (64 tokens, the WY / UT form; gpu_layers.delta_net_chunked): a parallel launch over every
  (chunk, v head) builds the chunk's W, U and causal q.k matrix, then one program per (sequence, v head, BLOCK_V
  columns of S) walks the sequence chunk by chunk with its slice of S in registers. The token-sequential kernel
  (the decode step in a loop) stays as the benchmark's baseline and for float32 at Dk = 128, where no chunked
  config fits the gate.
- Decode is one token per (row, v head, BLOCK_V columns): read the state slice, update, write it back. Grids come
  from shapes only and a slot < 0 marks a padding row (output zero, state untouched), so it is CUDA-graph safe.
- The conv state is written by a second launch: the first tile of a sequence reads the old state, and programs of
  one launch are not ordered, so the new state cannot be written in the same kernel.
- Everything inside is float32 (inputs widened on load), so bf16 and fp32 inputs differ only in rounding; but the
  chunked prefill's dots take bf16 operands for bf16 inputs (the state rounded to bf16 as an operand).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_layers import delta_net_chunked
from gpu_layers.capability import GateCase, capability_of, select

SUPPORTED_DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
SUPPORTED_HEAD_DIMS = (64, 128)  # Dk and Dv; Qwen3-Next / Qwen3.5 use 128
SUPPORTED_KERNEL_SIZES = (4,)  # conv taps
L2NORM_EPS = tl.constexpr(1e-6)

# Keyed by (Dv, bytes per element). Prefill: (BLOCK_V, num_warps, num_stages); decode: (BLOCK_V, num_warps).
# BLOCK_V = 32: a [128, 32] float32 slice is 32 registers a thread at 4 warps, and B * Hv * Dv / 32 programs fill
# the GPU at decode batch 8+.
_PREFILL = {(64, 2): (32, 4, 1), (128, 2): (32, 4, 1), (64, 4): (32, 4, 1), (128, 4): (32, 4, 1)}
PREFILL_CONFIGS = {89: _PREFILL, 90: _PREFILL, 120: _PREFILL}
_DECODE = {(64, 2): (32, 4), (128, 2): (32, 4), (64, 4): (32, 4), (128, 4): (32, 4)}
DECODE_CONFIGS = {89: _DECODE, 90: _DECODE, 120: _DECODE}
# Conv: (BLOCK_T, BLOCK_C, num_warps) of the prefill, BLOCK_C of the state write and decode (4 warps).
CONV_CONFIGS = {89: (16, 128, 4, 256), 90: (16, 128, 4, 256), 120: (16, 128, 4, 256)}


@triton.jit
def _l2norm(x, AXIS: tl.constexpr):
    return x * tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) + L2NORM_EPS)


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


# ----------------------------------------------------------------------------------------------- conv1d


@triton.jit
def causal_conv1d_prefill_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, cu_seqlens_ptr, conv_pool_ptr, state_slots_ptr, has_initial_state_ptr,
    num_channels, stride_xt, stride_ot, stride_cs,
    KERNEL_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (token tile, sequence, channel block). Inputs before the sequence come from its old conv state."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    first = start + tile * BLOCK_T
    if first >= end:  # the grid is sized for the longest sequence
        return
    tokens = first + tl.arange(0, BLOCK_T)
    t_mask = tokens < end
    chans = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = chans < num_channels
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_initial = tl.load(has_initial_state_ptr + seq) != 0

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KERNEL_SIZE):
        pos = tokens - (KERNEL_SIZE - 1 - j)
        in_seq = pos >= start
        x = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_xt + chans[None, :],
                    mask=(t_mask & in_seq)[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        column = KERNEL_SIZE - 1 + pos - start  # the old state's column of a position before the sequence
        old = tl.load(conv_pool_ptr + slot * stride_cs + chans[None, :] * (KERNEL_SIZE - 1) + column[:, None],
                      mask=(t_mask & ~in_seq & has_initial)[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + chans * KERNEL_SIZE + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += (x + old) * weight[None, :]
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + chans[None, :],
             _silu(acc).to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def causal_conv1d_state_kernel(
    x_ptr, cu_seqlens_ptr, conv_pool_ptr, state_slots_ptr, has_initial_state_ptr, num_channels, stride_xt, stride_cs,
    KERNEL_SIZE: tl.constexpr, STATE_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (sequence, channel block): the slot's new state, the last K - 1 inputs (older state columns where
    the sequence is shorter; those are read before anything is written, and only from later columns)."""
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = chans < num_channels
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_initial = tl.load(has_initial_state_ptr + seq) != 0
    cols = tl.arange(0, STATE_PAD)
    col_mask = cols < KERNEL_SIZE - 1
    pos = end - (KERNEL_SIZE - 1) + cols
    in_seq = pos >= start
    state_rows = conv_pool_ptr + slot * stride_cs + chans[:, None] * (KERNEL_SIZE - 1)
    x = tl.load(x_ptr + pos.to(tl.int64)[None, :] * stride_xt + chans[:, None],
                mask=c_mask[:, None] & (col_mask & in_seq)[None, :], other=0.0)
    old = tl.load(state_rows + (KERNEL_SIZE - 1 + pos - start)[None, :],
                  mask=c_mask[:, None] & (col_mask & ~in_seq & has_initial)[None, :], other=0.0)
    new = x.to(conv_pool_ptr.dtype.element_ty) + old
    tl.store(state_rows + cols[None, :], new, mask=c_mask[:, None] & col_mask[None, :])


@triton.jit
def causal_conv1d_decode_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, conv_pool_ptr, state_slots_ptr, num_channels, stride_xb, stride_ob,
    stride_cs,
    KERNEL_SIZE: tl.constexpr, STATE_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (row, channel block): one token through the conv, the state rolled left by one."""
    row = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = chans < num_channels
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    out_ptrs = out_ptr + row * stride_ob + chans
    if slot < 0:  # a padding row of a captured batch
        tl.store(out_ptrs, tl.zeros([BLOCK_C], dtype=out_ptr.dtype.element_ty), mask=c_mask)
        return
    cols = tl.arange(0, STATE_PAD)
    col_mask = cols < KERNEL_SIZE - 1
    mask2 = c_mask[:, None] & col_mask[None, :]
    state_rows = conv_pool_ptr + slot * stride_cs + chans[:, None] * (KERNEL_SIZE - 1)
    state = tl.load(state_rows + cols[None, :], mask=mask2, other=0.0)
    x = tl.load(x_ptr + row * stride_xb + chans, mask=c_mask, other=0.0)
    weight_rows = weight_ptr + chans[:, None] * KERNEL_SIZE
    acc = tl.sum(state.to(tl.float32) * tl.load(weight_rows + cols[None, :], mask=mask2, other=0.0).to(tl.float32), 1)
    acc += x.to(tl.float32) * tl.load(weight_ptr + chans * KERNEL_SIZE + KERNEL_SIZE - 1, mask=c_mask,
                                      other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, _silu(acc).to(out_ptr.dtype.element_ty), mask=c_mask)
    shifted = tl.load(state_rows + cols[None, :] + 1, mask=c_mask[:, None] & (cols < KERNEL_SIZE - 2)[None, :],
                      other=0.0)
    new = tl.where((cols == KERNEL_SIZE - 2)[None, :], x[:, None], shifted)
    tl.store(state_rows + cols[None, :], new, mask=mask2)


# ----------------------------------------------------------------------------------------------- delta rule


@triton.jit
def _delta_step(state, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, q_row, k_row, v_row, g_row, o_row, offs_k,
                offs_v, scale):
    """One token of one v head on a [Dk, BLOCK_V] state slice: decay, delta update, read-out; returns the state."""
    q = _l2norm(tl.load(q_ptr + q_row + offs_k).to(tl.float32), 0) * scale
    k = _l2norm(tl.load(k_ptr + k_row + offs_k).to(tl.float32), 0)
    v = tl.load(v_ptr + v_row + offs_v).to(tl.float32)
    state = state * tl.exp(tl.load(g_ptr + g_row))
    delta = (v - tl.sum(state * k[:, None], 0)) * tl.load(beta_ptr + g_row)
    state += k[:, None] * delta[None, :]
    tl.store(out_ptr + o_row + offs_v, tl.sum(state * q[:, None], 0).to(out_ptr.dtype.element_ty))
    return state


@triton.jit
def gated_delta_rule_prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, cu_seqlens_ptr, state_pool_ptr, state_slots_ptr,
    has_initial_state_ptr, scale, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh, stride_ss,
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (sequence, v head, BLOCK_V columns of the state): the whole sequence, token by token, the state
    slice in registers from the slot's (or zeros) to the final one written back."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    k_head = head // group
    offs_k = tl.arange(0, K_DIM)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    state_ptrs = (state_pool_ptr + slot * stride_ss + head * (K_DIM * V_DIM) + offs_k[:, None] * V_DIM
                  + offs_v[None, :])
    state = tl.zeros([K_DIM, BLOCK_V], dtype=tl.float32)
    if tl.load(has_initial_state_ptr + seq) != 0:
        state = tl.load(state_ptrs)
    for t64 in range(start.to(tl.int64), end):  # int64 offsets: T * row stride can pass 2^31
        state = _delta_step(state, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                            t64 * stride_qt + k_head * stride_qh, t64 * stride_kt + k_head * stride_kh,
                            t64 * stride_vt + head * stride_vh, t64 * stride_gt + head,
                            t64 * stride_ot + head * stride_oh, offs_k, offs_v, scale)
    tl.store(state_ptrs, state)


@triton.jit
def gated_delta_rule_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_pool_ptr, state_slots_ptr, scale, group,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_ob, stride_oh, stride_ss,
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (row, v head, BLOCK_V columns of the state): one recurrent step."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    out_ptrs = out_ptr + row * stride_ob + head * stride_oh + offs_v
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    if slot < 0:  # a padding row of a captured batch
        tl.store(out_ptrs, tl.zeros([BLOCK_V], dtype=out_ptr.dtype.element_ty))
        return
    k_head = head // group
    offs_k = tl.arange(0, K_DIM)
    state_ptrs = (state_pool_ptr + slot * stride_ss + head * (K_DIM * V_DIM) + offs_k[:, None] * V_DIM
                  + offs_v[None, :])
    state = _delta_step(tl.load(state_ptrs), q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                        row * stride_qb + k_head * stride_qh, row * stride_kb + k_head * stride_kh,
                        row * stride_vb + head * stride_vh, row * stride_gb + head, row * stride_ob + head * stride_oh,
                        offs_k, offs_v, scale)
    tl.store(state_ptrs, state)


# ----------------------------------------------------------------------------------------------- host side


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def prefill_config(capability: int, v_head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_V, num_warps, num_stages) of the prefill kernel."""
    return select(PREFILL_CONFIGS, capability)[(v_head_dim, dtype.itemsize)]


def decode_config(capability: int, v_head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the decode kernel."""
    return select(DECODE_CONFIGS, capability)[(v_head_dim, dtype.itemsize)]


def conv_config(capability: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) of the conv prefill, and BLOCK_C of the state write and decode."""
    return select(CONV_CONFIGS, capability)


def _check_device(x: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _check(t.device == x.device, f"{name} is on {t.device}, the inputs on {x.device}")


def _check_slots(state_slots, num_seqs: int, has_initial_state=None, cu_seqlens=None) -> None:
    _check(state_slots.dtype == torch.int32 and tuple(state_slots.shape) == (num_seqs,) and
           state_slots.is_contiguous(), f"state_slots must be contiguous int32 [{num_seqs}], got "
           f"{state_slots.dtype} {tuple(state_slots.shape)}")
    if has_initial_state is not None:
        _check(has_initial_state.dtype == torch.bool and tuple(has_initial_state.shape) == (num_seqs,) and
               has_initial_state.is_contiguous(), f"has_initial_state must be contiguous bool [{num_seqs}], got "
               f"{has_initial_state.dtype} {tuple(has_initial_state.shape)}")
    if cu_seqlens is not None:
        _check(cu_seqlens.dtype == torch.int32 and tuple(cu_seqlens.shape) == (num_seqs + 1,) and
               cu_seqlens.is_contiguous(), f"cu_seqlens must be contiguous int32 [{num_seqs + 1}], got "
               f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


def _check_conv(x, weight, bias, conv_pool) -> tuple[int, int]:
    """Checks the conv's tensors; returns (channels, kernel size)."""
    _check(x.dim() == 2 and x.stride(1) == 1, f"x must be [tokens, channels] with contiguous rows, got shape "
           f"{tuple(x.shape)} strides {x.stride()}")
    _check(x.dtype in SUPPORTED_DTYPES, f"x must be bf16 or fp32, got {x.dtype}")
    num_channels = x.shape[1]
    _check(weight.dim() == 2 and weight.shape[0] == num_channels and weight.is_contiguous(),
           f"weight must be contiguous [{num_channels}, kernel], got {tuple(weight.shape)}")
    kernel_size = weight.shape[1]
    _check(kernel_size in SUPPORTED_KERNEL_SIZES, f"conv kernel size {kernel_size} is not one of "
           f"{SUPPORTED_KERNEL_SIZES}")
    _check(bias is None or (tuple(bias.shape) == (num_channels,) and bias.is_contiguous()),
           f"bias must be None or contiguous [{num_channels}]")
    _check(conv_pool.dim() == 3 and tuple(conv_pool.shape[1:]) == (num_channels, kernel_size - 1) and
           conv_pool.stride(2) == 1 and conv_pool.stride(1) == kernel_size - 1,
           f"conv_pool must be [slots, {num_channels}, {kernel_size - 1}] contiguous per slot, got shape "
           f"{tuple(conv_pool.shape)} strides {conv_pool.stride()}")
    _check(conv_pool.dtype == x.dtype, f"conv_pool dtype {conv_pool.dtype} differs from x's {x.dtype}")
    _check_device(x, weight=weight, conv_pool=conv_pool, **({} if bias is None else {"bias": bias}))
    return num_channels, kernel_size


def _output(out, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return like.new_empty(shape)
    _check(tuple(out.shape) == shape and out.dtype == like.dtype and out.device == like.device and
           out.stride(-1) == 1, f"out must be {shape} {like.dtype} on {like.device} with contiguous rows, got "
           f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def causal_conv1d_prefill(x, weight, bias, cu_seqlens, conv_pool, state_slots, has_initial_state,
                          max_seqlen: int | None = None, out=None) -> torch.Tensor:
    """x [T, C] packed sequences -> silu(causal depthwise conv) [T, C]; sequence b resumes from
    conv_pool[state_slots[b]] if has_initial_state[b] (else zeros) and leaves its last K - 1 inputs there.
    `max_seqlen` bounds the sequence lengths (read from cu_seqlens, a host sync, when None).
    Reference: gpu_layers.delta_net_reference.causal_conv1d_prefill."""
    num_channels, kernel_size = _check_conv(x, weight, bias, conv_pool)
    num_seqs = state_slots.shape[0]
    _check_slots(state_slots, num_seqs, has_initial_state, cu_seqlens)
    _check_device(x, cu_seqlens=cu_seqlens, state_slots=state_slots, has_initial_state=has_initial_state)
    out = _output(out, tuple(x.shape), x)
    if num_seqs == 0 or x.shape[0] == 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_t, block_c, num_warps, state_block_c = conv_config(capability_of(x.device))
    bias_arg = weight if bias is None else bias  # unread without HAS_BIAS; keeps a pointer argument
    grid = (triton.cdiv(max(max_seqlen, 1), block_t), num_seqs, triton.cdiv(num_channels, block_c))
    causal_conv1d_prefill_kernel[grid](
        x, weight, bias_arg, out, cu_seqlens, conv_pool, state_slots, has_initial_state,
        num_channels, x.stride(0), out.stride(0), conv_pool.stride(0),
        KERNEL_SIZE=kernel_size, HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=num_warps,
    )
    causal_conv1d_state_kernel[(num_seqs, triton.cdiv(num_channels, state_block_c))](
        x, cu_seqlens, conv_pool, state_slots, has_initial_state, num_channels, x.stride(0), conv_pool.stride(0),
        KERNEL_SIZE=kernel_size, STATE_PAD=triton.next_power_of_2(kernel_size - 1), BLOCK_C=state_block_c,
        num_warps=4,
    )
    return out


def causal_conv1d_decode(x, weight, bias, conv_pool, state_slots, out=None) -> torch.Tensor:
    """One token per row: x [B, C] -> [B, C], rolling each row's conv state; a slot < 0 is a padding row (output
    zero, no state touched). No host syncs. Reference: gpu_layers.delta_net_reference.causal_conv1d_decode."""
    num_channels, kernel_size = _check_conv(x, weight, bias, conv_pool)
    num_rows = x.shape[0]
    _check_slots(state_slots, num_rows)
    _check_device(x, state_slots=state_slots)
    out = _output(out, tuple(x.shape), x)
    if num_rows == 0:
        return out
    block_c = conv_config(capability_of(x.device))[3]
    causal_conv1d_decode_kernel[(num_rows, triton.cdiv(num_channels, block_c))](
        x, weight, weight if bias is None else bias, out, conv_pool, state_slots, num_channels, x.stride(0),
        out.stride(0), conv_pool.stride(0),
        KERNEL_SIZE=kernel_size, STATE_PAD=triton.next_power_of_2(kernel_size - 1), HAS_BIAS=bias is not None,
        BLOCK_C=block_c, num_warps=4,
    )
    return out


def _check_delta(q, k, v, g, beta, state_pool) -> int:
    """Checks the delta rule's tensors; returns the GQA group Hv / Hk."""
    _check(q.dim() == 3 and k.shape == q.shape, f"q and k must be [tokens, k heads, Dk] alike, got "
           f"{tuple(q.shape)} and {tuple(k.shape)}")
    _check(v.dim() == 3 and v.shape[0] == q.shape[0], f"v must be [{q.shape[0]}, v heads, Dv], got {tuple(v.shape)}")
    _check(q.dtype in SUPPORTED_DTYPES, f"q must be bf16 or fp32, got {q.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    num_k_heads, k_head_dim = q.shape[1:]
    num_v_heads, v_head_dim = v.shape[1:]
    _check(k_head_dim in SUPPORTED_HEAD_DIMS and v_head_dim in SUPPORTED_HEAD_DIMS,
           f"head dims Dk {k_head_dim}, Dv {v_head_dim} must be in {SUPPORTED_HEAD_DIMS}")
    _check(num_v_heads % num_k_heads == 0, f"v heads {num_v_heads} are not a multiple of k heads {num_k_heads}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.stride(2) == 1, f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    for name, t in (("g", g), ("beta", beta)):
        _check(t.dtype == torch.float32 and tuple(t.shape) == (q.shape[0], num_v_heads) and t.stride(1) == 1,
               f"{name} must be float32 [{q.shape[0]}, {num_v_heads}] with contiguous rows, got {t.dtype} "
               f"{tuple(t.shape)}")
    _check(g.stride(0) == beta.stride(0), f"g and beta row strides differ: {g.stride(0)} and {beta.stride(0)}")
    shape = (num_v_heads, k_head_dim, v_head_dim)
    _check(state_pool.dim() == 4 and tuple(state_pool.shape[1:]) == shape and state_pool.dtype == torch.float32 and
           state_pool[0].is_contiguous(), f"state_pool must be float32 [slots, {', '.join(map(str, shape))}] "
           f"contiguous per slot, got {state_pool.dtype} {tuple(state_pool.shape)}")
    _check_device(q, k=k, v=v, g=g, beta=beta, state_pool=state_pool)
    return num_v_heads // num_k_heads


def _check_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state, out):
    """Checks a prefill's tensors; returns (GQA group, out)."""
    group = _check_delta(q, k, v, g, beta, state_pool)
    _check_slots(state_slots, state_slots.shape[0], has_initial_state, cu_seqlens)
    _check_device(q, cu_seqlens=cu_seqlens, state_slots=state_slots, has_initial_state=has_initial_state)
    return group, _output(out, tuple(v.shape), v)


def gated_delta_rule_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state,
                             scale: float, out=None) -> torch.Tensor:
    """Gated delta rule over packed sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] float32
    -> o [T, Hv, Dv]; sequence b resumes from state_pool[state_slots[b]] if has_initial_state[b] (else zeros) and
    leaves its final state there. q and k are L2-normalised here. Chunked (gpu_layers.delta_net_chunked: two
    launches and a workspace of T * Hv * (Dk + Dv + 64) elements); no host syncs. Reference:
    gpu_layers.delta_net_reference.gated_delta_rule_prefill."""
    group, out = _check_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state, out)
    capability = capability_of(q.device)
    if delta_net_chunked.chunk_configs(capability, q.shape[2], v.shape[2], q.dtype) is None:
        return gated_delta_rule_prefill_sequential(q, k, v, g, beta, cu_seqlens, state_pool, state_slots,
                                                   has_initial_state, scale, out)
    if state_slots.shape[0] > 0:
        delta_net_chunked.chunked_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state,
                                          scale, out, group, capability)
    return out


def gated_delta_rule_prefill_sequential(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state,
                                        scale: float, out=None) -> torch.Tensor:
    """gated_delta_rule_prefill token by token (one launch, no workspace): the chunked kernels' baseline in
    `hybrid-bench kernels`, and the prefill where they have no config (float32 at Dk = 128)."""
    group, out = _check_prefill(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state, out)
    num_seqs = state_slots.shape[0]
    num_v_heads, v_head_dim = v.shape[1:]
    if num_seqs == 0:
        return out
    block_v, num_warps, num_stages = prefill_config(capability_of(q.device), v_head_dim, q.dtype)
    gated_delta_rule_prefill_kernel[(num_seqs, num_v_heads, v_head_dim // block_v)](
        q, k, v, g, beta, out, cu_seqlens, state_pool, state_slots, has_initial_state, scale, group,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        out.stride(0), out.stride(1), state_pool.stride(0),
        K_DIM=q.shape[2], V_DIM=v_head_dim, BLOCK_V=block_v, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def gated_delta_rule_decode(q, k, v, g, beta, state_pool, state_slots, scale: float, out=None) -> torch.Tensor:
    """One recurrent step per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] float32 -> [B, Hv, Dv],
    updating state_pool[state_slots[b]] in place; a slot < 0 is a padding row (output zero, no state touched).
    No host syncs, grid from shapes only (CUDA-graph safe). Reference:
    gpu_layers.delta_net_reference.gated_delta_rule_decode."""
    group = _check_delta(q, k, v, g, beta, state_pool)
    num_rows = q.shape[0]
    _check_slots(state_slots, num_rows)
    _check_device(q, state_slots=state_slots)
    num_v_heads, v_head_dim = v.shape[1:]
    out = _output(out, tuple(v.shape), v)
    if num_rows == 0:
        return out
    block_v, num_warps = decode_config(capability_of(q.device), v_head_dim, q.dtype)
    gated_delta_rule_decode_kernel[(num_rows, num_v_heads, v_head_dim // block_v)](
        q, k, v, g, beta, out, state_pool, state_slots, scale, group,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        out.stride(0), out.stride(1), state_pool.stride(0),
        K_DIM=q.shape[2], V_DIM=v_head_dim, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out


# ----------------------------------------------------------------------------------------------- gate, bench


def gate_cases() -> list[GateCase]:
    """Every config the launchers can select (gpu_layers.delta_net_cases)."""
    from gpu_layers import delta_net_cases

    return delta_net_cases.gate()


def bench_cases() -> list[tuple]:
    """Qwen3-Next-like heads (gpu_layers.delta_net_cases)."""
    from gpu_layers import delta_net_cases

    return delta_net_cases.bench()
