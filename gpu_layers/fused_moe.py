"""Fused MoE for the routed experts that live on the GPU: bf16/fp16 weights, or FP8 e4m3 weights with
per-output-channel or 128x128 block scales (DeepSeek-V3's native layout).

Data flow (T tokens, H hidden, I intermediate, E local experts, K top-k, P = T*K (token, slot) pairs):
  hidden [T, H], w_gate_up [E, 2I, H] (gate = rows [0, I), up = rows [I, 2I)), w_down [E, H, I],
  topk_ids [T, K] (-1: computed elsewhere, contributes nothing), topk_weights [T, K] float32
  1. moe_align (count, offsets and scatter kernels, no host sync): pairs grouped by expert, each expert's run
     padded to BLOCK_M rows -> sorted_pair_ids [R] (P marks a padding row) and block_expert_ids [R / BLOCK_M]
     (-1: unused block). R = P + min(E, P) * (BLOCK_M - 1), rounded up to BLOCK_M, is a bound known from
     shapes alone, so no grid depends on the routing and the whole call can be captured in a CUDA graph.
  2. moe_gate_up_kernel: per row block, act [R, I] = silu(x @ gate^T) * (x @ up^T). The gate and up tiles of
     the same output columns are multiplied in one program, so the unactivated [R, 2I] is never written.
     `Activation` picks the GLU at compile time: silu, or gpt-oss's swiglu_oai (clamped, up + 1); an optional
     float32 bias [E, 2I] is added to both accumulators first.
  3. moe_down_kernel: y [P, H] = routing weight * (act @ down^T + optional float32 bias [E, H]), written at the
     pair's own row. Without biases the kernels load nothing more than the silu-only ones did (HAS_BIAS).
  4. moe_sum_kernel: out [T, H] = sum over k of y[t*K + k] where topk_ids[t, k] is a local expert.
  Steps 3-4 make the result deterministic (no float atomics): each pair's row is written once and the K rows
  of a token are summed in slot order. The extra y traffic is P*H*2 bytes, small against the weights read.

FP8: activations are quantized to e4m3 inside the GEMMs as they are loaded: per token (per-channel weights;
the row scales come from one torch amax) or per token per 128-column group (block weights, as DeepSeek does;
the group is exactly one BLOCK_K=128 tile, so the kernel computes its scale from the tile itself). The MMA is
fp8 x fp8 with float32 accumulation (SM89, SM90 and SM120 all have it); block scales multiply each K block's
partial product, per-channel scales the finished accumulator (on Hopper the sum moves into float32 every 128
products, as DeepSeek-V3 does). Quantizing inside the GEMM costs no launch and no buffer, which suits decode; at
prefill sizes every N tile re-quantizes its A tile, and on an H200 the FP8 path is then slower than bf16 (Qwen3
experts, T=2048: 1.16 ms vs 0.59 ms): quantizing act once in kernel 1's epilogue is the next step there.
Ids outside [0, E) are treated like -1, so a bad id can never read outside the weight table (the reference
raises on them instead).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_layers.capability import GateCase, capability_of, select
from gpu_layers.fused_moe_reference import (  # noqa: F401 (the reference and FP8 helpers are part of this API)
    ACTIVATIONS,
    FP8_BLOCK,
    SILU,
    SWIGLU_OAI,
    Activation,
    dequantize_fp8_weights,
    fake_quantize_activations,
    fp8_scale,
    fused_moe_reference,
    quantize_fp8_weights,
)
from gpu_layers.fused_moe_reference import FP8_MAX as _FP8_MAX
from gpu_layers.fused_moe_reference import MIN_AMAX as _MIN_AMAX

FP8_MAX = tl.constexpr(_FP8_MAX)  # largest finite float8_e4m3fn
MIN_AMAX = tl.constexpr(_MIN_AMAX)  # floor of an absmax, so an all-zero row gets a finite scale
NO_QUANT, FP8_CHANNEL, FP8_BLOCKWISE = 0, 1, 2  # the kernels' QUANT constexpr


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# CONFIGS[capability][(regime, weights)] = (gate_up tiles, down tiles). "decode": few rows per expert, so
# BLOCK_M is the MMA minimum and the kernels are weight-bandwidth bound; "prefill": many rows per expert.
# FP8 uses BLOCK_K = 128: one activation quantization group, one weight scale block, 128-byte rows.
# SM89/SM120 have 99 KiB of shared memory: num_stages * (A tile + gate and up tiles) stays under it (the A tile
# of FP8 is loaded as bf16, 2 bytes). Hopper has 227 KiB and wgmma, which wants BLOCK_M = 64 per warpgroup.
_SMALL_SMEM = {
    ("decode", "16bit"): (Tiles(16, 64, 64, 4, 5), Tiles(16, 64, 64, 4, 5)),
    ("decode", "fp8"): (Tiles(16, 64, 128, 4, 5), Tiles(16, 64, 128, 4, 5)),
    ("prefill", "16bit"): (Tiles(64, 64, 64, 4, 4), Tiles(64, 128, 64, 4, 4)),
    ("prefill", "fp8"): (Tiles(64, 32, 128, 4, 3), Tiles(64, 64, 128, 4, 3)),
}
CONFIGS = {
    89: _SMALL_SMEM,
    90: {
        ("decode", "16bit"): (Tiles(16, 64, 128, 4, 4), Tiles(16, 64, 128, 4, 4)),
        ("decode", "fp8"): (Tiles(16, 64, 128, 4, 5), Tiles(16, 64, 128, 4, 5)),
        ("prefill", "16bit"): (Tiles(128, 128, 64, 8, 3), Tiles(128, 128, 64, 8, 3)),
        ("prefill", "fp8"): (Tiles(128, 64, 128, 8, 3), Tiles(128, 128, 128, 8, 3)),
    },
    120: _SMALL_SMEM,
}
SUM_BLOCK_H = {89: 1024, 90: 1024, 120: 1024}
ALIGN_BLOCK = {89: 256, 90: 256, 120: 256}  # pairs per program of the count and scatter kernels
ALIGN_TILE = 64  # moe_offsets_kernel's tile: 64 blocks x 64 experts of comparisons
DECODE_ROWS_PER_EXPERT = 16  # average pairs per expert up to which the decode tiles are used


@triton.jit
def _quantize(a, row_scale):
    """a [M, N] float32 * (1 / row_scale [M]) -> float8 e4m3, rounded to nearest even and saturated. One exact
    reciprocal per row and a multiply per element: cheap in registers, and bit-for-bit what torch computes."""
    inverse = tl.math.div_rn(1.0, row_scale)
    return tl.clamp(a * inverse[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _group_scale(a):
    """Per-row scale of one 128-column group a [M, 128] float32: absmax / 448."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(a), axis=1), MIN_AMAX), FP8_MAX)


@triton.jit
def moe_gate_up_kernel(
    hidden, w, w_scale, a_scale, bias, act, sorted_pair_ids, block_expert_ids,
    num_pairs, top_k, hidden_size, inter, stride_ht, stride_we, stride_wn, stride_se, stride_sn,
    QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act[rows, cols] = glu(x @ gate^T + b_gate, x @ up^T + b_up) for one block of one expert's rows (`Activation`:
    ACTIVATION 0 silu(gate) * up, 1 gpt-oss's clamped (up + 1) * gate * sigmoid(ALPHA * gate); bias [E, 2I] float32,
    read only when HAS_BIAS)."""
    tl.static_assert(QUANT != 2 or BLOCK_K == 128)
    # Sizes and row strides are multiples of 16 (the launcher checks). Written as x // 16 * 16 the compiler can
    # prove it in every compile, not only in launches it specializes, so the loads are 16-byte vectors and
    # software-pipelined in the gate's compile exactly as on the device.
    stride_ht, stride_wn, stride_we = stride_ht // 16 * 16, stride_wn // 16 * 16, stride_we // 16 * 16
    hidden_size, inter = hidden_size // 16 * 16, inter // 16 * 16
    pid_m = tl.program_id(0)  # fastest: consecutive programs share the expert's weight tile in L2
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hidden + tokens[:, None] * stride_ht + offs_k[None, :]
    gate_ptrs = w + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + inter * stride_wn
    scales = w_scale + expert * stride_se
    if QUANT == 1:
        row_scale = tl.load(a_scale + tokens, mask=row_ok, other=1.0)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = offs_k < hidden_size - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b_gate = tl.load(gate_ptrs, mask=b_mask, other=0.0)
        b_up = tl.load(up_ptrs, mask=b_mask, other=0.0)
        if QUANT == 0:
            acc_gate = tl.dot(a, b_gate, acc_gate)
            acc_up = tl.dot(a, b_up, acc_up)
        elif QUANT == 1:
            # Hopper's fp8 wgmma adds in reduced precision unless told to move the sum into float32 every
            # BLOCK_K (the block-scale path does so anyway, one dot per K block): DeepSeek-V3's 128-wide promotion.
            a = _quantize(a.to(tl.float32), row_scale)
            acc_gate = tl.dot(a, b_gate, acc_gate, max_num_imprecise_acc=BLOCK_K)
            acc_up = tl.dot(a, b_up, acc_up, max_num_imprecise_acc=BLOCK_K)
        else:
            group_scale = _group_scale(a.to(tl.float32))
            a = _quantize(a.to(tl.float32), group_scale)
            s_gate = tl.load(scales + (cols // 128) * stride_sn + k0 // 128, mask=col_ok, other=0.0)
            s_up = tl.load(scales + ((cols + inter) // 128) * stride_sn + k0 // 128, mask=col_ok, other=0.0)
            acc_gate += tl.dot(a, b_gate) * (group_scale[:, None] * s_gate[None, :])
            acc_up += tl.dot(a, b_up) * (group_scale[:, None] * s_up[None, :])
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if QUANT == 1:  # per-channel: the scales are constant along K, applied once
        s_gate = tl.load(scales + cols * stride_sn, mask=col_ok, other=0.0)
        s_up = tl.load(scales + (cols + inter) * stride_sn, mask=col_ok, other=0.0)
        acc_gate *= row_scale[:, None] * s_gate[None, :]
        acc_up *= row_scale[:, None] * s_up[None, :]
    if HAS_BIAS:
        expert_bias = bias + expert * 2 * inter + cols
        acc_gate += tl.load(expert_bias, mask=col_ok, other=0.0)[None, :]
        acc_up += tl.load(expert_bias + inter, mask=col_ok, other=0.0)[None, :]
    if ACTIVATION == 0:
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:
        # selects rather than minimum/clamp: with those, SM90's FP8 block-scale prefill tiles (at 255 registers
        # already) spilled
        gate = tl.where(acc_gate < LIMIT, acc_gate, LIMIT)
        up = tl.where(acc_up < LIMIT, acc_up, LIMIT)
        up = tl.where(up > -LIMIT, up, -LIMIT)
        h = (up + 1.0) * gate * tl.sigmoid(gate * ALPHA)
    act_ptrs = act + rows[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(act_ptrs, h.to(act.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def moe_down_kernel(
    act, w, w_scale, a_scale, bias, topk_weights, y, sorted_pair_ids, block_expert_ids,
    num_pairs, hidden_size, inter, stride_we, stride_wn, stride_se, stride_sn,
    QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[pairs, cols] = routing weight * (act @ down^T + b_down) for one block of one expert's rows (bias [E, H]
    float32, read only when HAS_BIAS)."""
    tl.static_assert(QUANT != 2 or BLOCK_K == 128)
    stride_wn, stride_we = stride_wn // 16 * 16, stride_we // 16 * 16  # multiples of 16: see moe_gate_up_kernel
    hidden_size, inter = hidden_size // 16 * 16, inter // 16 * 16
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ids + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids + rows)
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act + rows[:, None].to(tl.int64) * inter + offs_k[None, :]
    b_ptrs = w + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    scales = w_scale + expert * stride_se
    if QUANT == 1:
        row_scale = tl.load(a_scale + rows, mask=row_ok, other=1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if QUANT == 0:
            acc = tl.dot(a, b, acc)
        elif QUANT == 1:
            acc = tl.dot(_quantize(a.to(tl.float32), row_scale), b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            group_scale = _group_scale(a.to(tl.float32))
            s = tl.load(scales + (cols // 128) * stride_sn + k0 // 128, mask=col_ok, other=0.0)
            acc += tl.dot(_quantize(a.to(tl.float32), group_scale), b) * (group_scale[:, None] * s[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if QUANT == 1:
        s = tl.load(scales + cols * stride_sn, mask=col_ok, other=0.0)
        acc *= row_scale[:, None] * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + expert * hidden_size + cols, mask=col_ok, other=0.0)[None, :]
    routing = tl.load(topk_weights + pairs, mask=row_ok, other=0.0)
    acc *= routing[:, None]
    y_ptrs = y + pairs[:, None].to(tl.int64) * hidden_size + cols[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_sum_kernel(y, topk_ids, out, hidden_size, top_k, num_experts, stride_ot, BLOCK_H: tl.constexpr):
    """out[t, cols] = sum over local slots k of y[t*K + k, cols], in slot order, in float32."""
    hidden_size, stride_ot = hidden_size // 16 * 16, stride_ot // 16 * 16  # see moe_gate_up_kernel
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, top_k):
        pair = token * top_k + k
        expert = tl.load(topk_ids + pair)
        is_local = (expert >= 0) & (expert < num_experts)
        acc += tl.load(y + pair * hidden_size + cols, mask=col_ok & is_local, other=0.0).to(tl.float32)
    tl.store(out + token * stride_ot + cols, acc.to(out.dtype.element_ty), mask=col_ok)


@triton.jit
def moe_count_kernel(topk_ids, counts, num_pairs, num_experts, BLOCK: tl.constexpr):
    """counts[e] += the number of pairs routed to local expert e (counts starts zeroed)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(topk_ids + offs, mask=offs < num_pairs, other=-1)
    is_local = (ids >= 0) & (ids < num_experts)
    tl.atomic_add(counts + tl.where(is_local, ids, 0), 1, mask=is_local)


@triton.jit
def moe_offsets_kernel(
    counts, cursor, block_expert_ids, sorted_pair_ids, num_experts, num_pairs, num_rows,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: each expert's first padded row (cursor), the expert of each row block (-1 past the last run),
    and every row marked as padding (num_pairs) before moe_scatter_kernel places the pairs."""
    carry = 0
    for e0 in range(0, num_experts, BLOCK):
        experts = e0 + tl.arange(0, BLOCK)
        is_expert = experts < num_experts
        padded = (tl.load(counts + experts, mask=is_expert, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = carry + tl.cumsum(padded, 0)
        tl.store(cursor + experts, ends - padded, mask=is_expert)
        tl.store(counts + experts, ends, mask=is_expert)  # counts now holds each run's end
        carry += tl.sum(padded, 0)
    tl.debug_barrier()  # the ends written above are read back by every thread below
    for b0 in range(0, num_rows // BLOCK_M, BLOCK):
        blocks = b0 + tl.arange(0, BLOCK)
        num_before = tl.zeros([BLOCK], dtype=tl.int32)  # runs that end at or before the block's first row
        for e0 in range(0, num_experts, BLOCK):
            experts = e0 + tl.arange(0, BLOCK)
            ends = tl.load(counts + experts, mask=experts < num_experts, other=2**31 - 1)
            num_before += tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        expert = tl.where(num_before < num_experts, num_before, -1)
        tl.store(block_expert_ids + blocks, expert, mask=blocks < num_rows // BLOCK_M)
    for r0 in range(0, num_rows, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        tl.store(sorted_pair_ids + rows, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=rows < num_rows)


@triton.jit
def moe_scatter_kernel(topk_ids, cursor, sorted_pair_ids, num_pairs, num_experts, BLOCK: tl.constexpr):
    """Each local pair takes the next free row of its expert's run."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(topk_ids + offs, mask=offs < num_pairs, other=-1)
    is_local = (ids >= 0) & (ids < num_experts)
    rows = tl.atomic_add(cursor + tl.where(is_local, ids, 0), 1, mask=is_local)
    tl.store(sorted_pair_ids + rows, offs, mask=is_local)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, capability: int = 120):
    """topk_ids [T, K] int32 -> sorted_pair_ids [R] int32 (pair t*K + k, or P on padding rows) and
    block_expert_ids [R / block_m] int32 (-1: unused block). No host sync: R depends on shapes only.

    Pairs take rows by atomic increments, so their order inside an expert's run varies from call to call; the
    result does not, since each row's products are independent of its neighbours and y is indexed by pair."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32, got {topk_ids.dtype} strides {topk_ids.stride()}")
    num_pairs = topk_ids.numel()
    num_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_rows = triton.cdiv(num_rows, block_m) * block_m
    device = topk_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pair_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    block = select(ALIGN_BLOCK, capability)
    grid = (triton.cdiv(num_pairs, block),)
    moe_count_kernel[grid](topk_ids, counts, num_pairs, num_experts, BLOCK=block)
    moe_offsets_kernel[(1,)](counts, cursor, block_experts, sorted_pair_ids, num_experts, num_pairs, num_rows,
                             BLOCK_M=block_m, BLOCK=ALIGN_TILE)
    moe_scatter_kernel[grid](topk_ids, cursor, sorted_pair_ids, num_pairs, num_experts, BLOCK=block)
    return sorted_pair_ids, block_experts


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
    capability: int | None = None,
    activation: Activation = SILU,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] = sum_k topk_weights[t, k] * (down(activation(gate x + b_gate, up x + b_up)) + b_down) of expert
    topk_ids[t, k] (module docstring). Biases are float32, w_gate_up_bias [E, 2I] in w_gate_up's row order (gate
    then up), w_down_bias [E, H]; the routing weight multiplies the down bias too, as gpt-oss does.
    `capability` picks another config table (tests, benchmarks); by default the device's."""
    quant = _check_inputs(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale,
                          block_shape, out)
    _check_biases(hidden, w_gate_up, w_down, w_gate_up_bias, w_down_bias, activation)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    out = torch.empty_like(hidden) if out is None else out
    if num_tokens == 0:
        return out
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    cc = capability if capability is not None else capability_of(hidden.device)
    regime = "decode" if num_pairs <= DECODE_ROWS_PER_EXPERT * num_experts else "prefill"
    gate_up_tiles, down_tiles = select(CONFIGS, cc)[(regime, "16bit" if quant == NO_QUANT else "fp8")]
    ids = topk_ids.to(torch.int32).contiguous()  # no copy when it already is
    sorted_pair_ids, block_experts = moe_align(ids, num_experts, gate_up_tiles.block_m, cc)
    num_rows = sorted_pair_ids.numel()
    dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=hidden.device)  # stands for unused scale arguments
    gu_scale = w_gate_up_scale if w_gate_up_scale is not None else dummy
    d_scale = w_down_scale if w_down_scale is not None else dummy
    gu_bias = w_gate_up_bias if w_gate_up_bias is not None else dummy
    d_bias = w_down_bias if w_down_bias is not None else dummy

    act = torch.empty(num_rows, inter, dtype=hidden.dtype, device=hidden.device)
    row_scale = _row_scale(hidden) if quant == FP8_CHANNEL else dummy
    grid = (num_rows // gate_up_tiles.block_m, triton.cdiv(inter, gate_up_tiles.block_n))
    moe_gate_up_kernel[grid](
        hidden, w_gate_up, gu_scale, row_scale, gu_bias, act, sorted_pair_ids, block_experts,
        num_pairs, top_k, hidden_size, inter, hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        gu_scale.stride(0), gu_scale.stride(1), HAS_BIAS=w_gate_up_bias is not None, **activation.constexprs(),
        **_launch_args(gate_up_tiles, quant),
    )
    y = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    row_scale = _row_scale(act) if quant == FP8_CHANNEL else dummy
    grid = (num_rows // down_tiles.block_m, triton.cdiv(hidden_size, down_tiles.block_n))
    moe_down_kernel[grid](
        act, w_down, d_scale, row_scale, d_bias, topk_weights, y, sorted_pair_ids, block_experts,
        num_pairs, hidden_size, inter, w_down.stride(0), w_down.stride(1), d_scale.stride(0), d_scale.stride(1),
        HAS_BIAS=w_down_bias is not None, **_launch_args(down_tiles, quant),
    )
    block_h = select(SUM_BLOCK_H, cc)
    moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        y, ids, out, hidden_size, top_k, num_experts, out.stride(0), BLOCK_H=block_h,
    )
    return out


def _launch_args(tiles: Tiles, quant: int) -> dict:
    return dict(QUANT=quant, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _row_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-row FP8 scale absmax / 448 in float32 (the per-token activation scale of per-channel weights)."""
    return fp8_scale(x.abs().amax(dim=-1))


def _check_inputs(hidden, w_gate_up, w_down, topk_ids, topk_weights, w_gate_up_scale, w_down_scale, block_shape,
                  out):
    """Raises ValueError naming the first bad argument; returns the QUANT mode."""
    if hidden.dim() != 2 or hidden.dtype not in (torch.bfloat16, torch.float16) or hidden.stride(1) != 1:
        raise ValueError(f"hidden must be [T, H] bf16/fp16 with unit column stride, got {tuple(hidden.shape)} "
                         f"{hidden.dtype} strides {hidden.stride()}")
    num_tokens, hidden_size = hidden.shape
    if hidden_size % 16 or hidden.stride(0) % 16:
        raise ValueError(f"hidden's size and row stride must be multiples of 16, got {hidden_size}, {hidden.stride(0)}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != hidden_size:
        raise ValueError(f"w_gate_up must be [E, 2I, H={hidden_size}], got {tuple(w_gate_up.shape)}")
    num_experts, two_i, _ = w_gate_up.shape
    if two_i % 32:
        raise ValueError(f"w_gate_up's 2I must be a multiple of 32 (I of 16), got {two_i}")
    if tuple(w_down.shape) != (num_experts, hidden_size, two_i // 2):
        raise ValueError(f"w_down must be [E, H, I] = {(num_experts, hidden_size, two_i // 2)}, "
                         f"got {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T={num_tokens}, K] int32/int64, got {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous float32 {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    named = {"w_gate_up": w_gate_up, "w_down": w_down, "topk_ids": topk_ids, "topk_weights": topk_weights,
             "w_gate_up_scale": w_gate_up_scale, "w_down_scale": w_down_scale}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device}, hidden on {hidden.device}")
    for name in ("w_gate_up", "w_down"):
        if not named[name].is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out is not None and (out.shape != hidden.shape or out.dtype != hidden.dtype or out.device != hidden.device
                            or out.stride(1) != 1 or out.stride(0) % 16):
        raise ValueError(f"out must be like hidden {tuple(hidden.shape)} {hidden.dtype} {hidden.device} (row stride "
                         f"a multiple of 16), got {tuple(out.shape)} {out.dtype} {out.device} {out.stride()}")
    if w_gate_up.dtype != w_down.dtype:
        raise ValueError(f"w_gate_up is {w_gate_up.dtype} but w_down is {w_down.dtype}")
    if w_gate_up.dtype != torch.float8_e4m3fn:
        if w_gate_up.dtype != hidden.dtype:
            raise ValueError(f"w_gate_up must be {hidden.dtype} like hidden (or float8_e4m3fn), got {w_gate_up.dtype}")
        if w_gate_up_scale is not None or w_down_scale is not None or block_shape is not None:
            raise ValueError("w_gate_up_scale, w_down_scale and block_shape are only for float8_e4m3fn weights")
        return NO_QUANT
    if hidden.dtype != torch.bfloat16:
        raise ValueError(f"hidden must be bfloat16 with float8_e4m3fn weights, got {hidden.dtype}")
    if block_shape is not None and tuple(block_shape) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"block_shape must be None (per-channel scales) or (128, 128), got {block_shape}")
    for name, weight, scale in (("w_gate_up_scale", w_gate_up, w_gate_up_scale),
                                ("w_down_scale", w_down, w_down_scale)):
        expected = _scale_shape(weight.shape, block_shape)
        if scale is None or tuple(scale.shape) != expected or scale.dtype != torch.float32 \
                or not scale.is_contiguous():
            got = None if scale is None else (tuple(scale.shape), scale.dtype)
            raise ValueError(f"{name} must be contiguous float32 {expected}, got {got}")
    return FP8_BLOCKWISE if block_shape is not None else FP8_CHANNEL


def _check_biases(hidden, w_gate_up, w_down, w_gate_up_bias, w_down_bias, activation):
    """Raises ValueError naming a bias that is not contiguous float32 of its shape on hidden's device."""
    if not isinstance(activation, Activation):
        raise ValueError(f"activation must be a fused_moe.Activation, got {activation!r}")
    num_experts, two_i, hidden_size = w_gate_up.shape
    for name, bias, shape in (("w_gate_up_bias", w_gate_up_bias, (num_experts, two_i)),
                              ("w_down_bias", w_down_bias, (num_experts, hidden_size))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != torch.float32
                                 or not bias.is_contiguous() or bias.device != hidden.device):
            raise ValueError(f"{name} must be contiguous float32 {shape} on {hidden.device}, got "
                             f"{tuple(bias.shape)} {bias.dtype} {bias.device}")


def _scale_shape(weight_shape, block_shape) -> tuple[int, int, int]:
    num_experts, rows, cols = weight_shape
    if block_shape is None:
        return (num_experts, rows, 1)
    return (num_experts, triton.cdiv(rows, block_shape[0]), triton.cdiv(cols, block_shape[1]))


def gate_cases() -> list[GateCase]:
    """Every config the launchers can select (gpu_layers.fused_moe_cases)."""
    from gpu_layers import fused_moe_cases

    return fused_moe_cases.gate()


def bench_cases() -> list[tuple]:
    """The module's benchmark cases (gpu_layers.fused_moe_cases)."""
    from gpu_layers import fused_moe_cases

    return fused_moe_cases.bench()
