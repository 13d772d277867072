"""W8A8 MoE for int8/int4 experts streamed from the CPU: the CPU experts' numerics contract on the GPU.

The CPU operator's contract (README, "numerics contracts") for int8 and int4 experts: each matmul input row is
rounded to int8 with one absmax scale (`cpu_experts.kernels.quantize_row`: inv = 127 / absmax, code = x * inv
rounded half to even, scale = absmax / 127), the integer sums of each weight scale group are exact, and the groups
add in float32. Here the same, on the codes as the CPU stores them (no dequantized tables):

  1. `quantize_rows_kernel`: hidden [T, H] -> x_q int8 [T, H], x_scale [T]           (bit for bit the CPU's)
  2. `fused_moe.moe_align`: pairs grouped by expert, runs padded to BLOCK_M (shared with fused_moe)
  3. `w8a8_gate_up_kernel`: per group g of H, int32 acc_g = x_q . w_q (tl.dot of int8 gives int32); gate and up
     = sum_g float32(acc_g) * (x_scale * w_scale[g]); + biases; act [R, I] float32 = the layer's GLU
  4. `quantize_rows_kernel` again: act -> a_q int8 [R, I], a_scale [R] (one scale per pair and partition of I,
     as the CPU rounds each partition's act)
  5. `w8a8_down_kernel`: y [P, H] float32 = routing weight * (grouped a_q . down + bias), at the pair's own row
  6. `fused_moe.moe_sum_kernel`: out [T, H] float32 = sum over slots in order (deterministic, no atomics)

int4 weights stay packed (uint8 [E, N, K / 2], the even column in the low nibble, value = nibble - 8) and are
unpacked to int8 in registers. The epilogues are compiled without FMA contraction (enable_fp_fusion=False), so
each float value is the one `w8a8_moe_reference` forms: the outputs equal it bit for bit, and the rounding
of step 1 is the CPU's. Only activation functions (exp) may differ by an ulp from PyTorch's.
A group must hold whole K tiles: BLOCK_K is the config's, or the largest of 32/64 dividing the group.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu_layers.capability import capability_of, select
from gpu_layers.fused_moe import SUM_BLOCK_H, Tiles, moe_align, moe_sum_kernel
from gpu_layers.fused_moe_reference import SILU, Activation
from gpu_layers.w8a8_moe_reference import (  # noqa: F401 (part of this module's API)
    quantize_rows_reference,
    unpack_int4,
    w8a8_moe_reference,
)

# CONFIGS[capability] = (gate_up tiles, down tiles). Registers bound the tiles: each output element has an int32
# and a float32 accumulator, two of each in gate_up, whose 64 x 64 tile spilled on SM120 (255 registers); the
# smaller tiles also fit 99 KiB of shared memory. Hopper takes the same until measured otherwise.
_TILES = (Tiles(64, 32, 128, 4, 3), Tiles(64, 64, 128, 4, 3))  # one BLOCK_M: both walk moe_align's row blocks
CONFIGS = {89: _TILES, 90: _TILES, 120: _TILES}
BLOCK_KS = (32, 64, 128)  # every BLOCK_K a launch can take (`block_k`)
QUANTIZE_BLOCK = 1024  # columns per step of quantize_rows_kernel
NO_FMA = dict(enable_fp_fusion=False)  # every launch: a * b + c rounds twice, as PyTorch's reference does


@triton.jit
def quantize_rows_kernel(x, q, scale, num_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    """One row of x [M, K] -> q int8 (x * (127 / absmax) rounded half to even), scale[row] = absmax / 127."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, num_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    top = tl.max(amax, axis=0)
    inv = tl.where(top > 0, tl.math.div_rn(127.0, tl.where(top > 0, top, 1.0)), 0.0)
    tl.store(scale + row, tl.math.div_rn(top, 127.0))
    for c0 in range(0, num_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        # round half to even: adding 1.5 * 2^23 leaves no fraction bits (|v * inv| <= 127.00002); no FMA (NO_FMA)
        code = (v * inv + 12582912.0) - 12582912.0
        code = tl.minimum(tl.maximum(code, -127.0), 127.0)
        tl.store(q + row * stride_q + cols, code.to(tl.int8), mask=cols < num_cols)


@triton.jit
def _weight_tile(w, row_offsets, col_ok, k0, num_cols, offs_k, IS_INT4: tl.constexpr, BLOCK_K: tl.constexpr):
    """Codes [BLOCK_K, BLOCK_N] int8 of the weight rows at w + row_offsets (BLOCK_N of them, `col_ok` in range),
    columns k0 + offs_k of num_cols; int4 bytes unpacked in registers, the even column (low nibble) first."""
    if IS_INT4:
        half = tl.arange(0, BLOCK_K // 2)
        ok = col_ok[:, None] & (half < (num_cols - k0) // 2)[None, :]
        packed = tl.load(w + row_offsets[:, None] + (k0 // 2 + half)[None, :], mask=ok, other=0x88)  # [N, K/2]
        low = (packed & 0x0F).to(tl.int8) - 8
        high = (packed >> 4).to(tl.int8) - 8
        codes = tl.reshape(tl.join(low, high), [row_offsets.shape[0], BLOCK_K])  # [BLOCK_N, BLOCK_K], interleaved
        return tl.trans(codes)
    ok = (offs_k < num_cols - k0)[:, None] & col_ok[None, :]
    return tl.load(w + row_offsets[None, :] + (k0 + offs_k)[:, None], mask=ok, other=0).to(tl.int8)


@triton.jit
def w8a8_gate_up_kernel(
    x_q, x_scale, gate, gate_scale, up, up_scale, bias, act, sorted_pair_ids, block_expert_ids,
    num_pairs, top_k, hidden_size, inter, group, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
    IS_INT4: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act[rows, cols] float32 = glu(gate, up) of one row block of one expert (module docstring, step 3). gate
    and up share strides (codes [E, I, H] or packed [E, I, H / 2]; scales [E, I, G]); group % BLOCK_K == 0."""
    # multiples of 16 (8 for int4 rows' bytes), written so that every compile can prove it: the loads are then
    # vectors and software-pipelined (as in fused_moe's kernels; without it the gate_up loop was not)
    stride_xt, stride_wn, stride_we = stride_xt // 16 * 16, stride_wn // 8 * 8, stride_we // 8 * 8
    hidden_size, inter = hidden_size // 16 * 16, inter // 16 * 16
    pid_m = tl.program_id(0)
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
    a_rows = x_q + tokens[:, None] * stride_xt
    gate_w = gate + expert * stride_we
    up_w = up + expert * stride_we
    weight_rows = cols.to(tl.int64) * stride_wn
    row_scale = tl.load(x_scale + tokens, mask=row_ok, other=0.0)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    exact_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    exact_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    # one loop over K (so the loads are pipelined); a group's int32 sums move into float32 after its last tile
    for k0 in range(0, hidden_size, BLOCK_K):
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None] & (offs_k < hidden_size - k0)[None, :],
                    other=0)
        exact_gate = tl.dot(a, _weight_tile(gate_w, weight_rows, col_ok, k0, hidden_size, offs_k, IS_INT4, BLOCK_K),
                            exact_gate, out_dtype=tl.int32)
        exact_up = tl.dot(a, _weight_tile(up_w, weight_rows, col_ok, k0, hidden_size, offs_k, IS_INT4, BLOCK_K),
                          exact_up, out_dtype=tl.int32)
        if ((k0 + BLOCK_K) % group == 0) | (k0 + BLOCK_K >= hidden_size):
            scales = expert * stride_se + cols * stride_sn + k0 // group
            s_gate = tl.load(gate_scale + scales, mask=col_ok, other=0.0).to(tl.float32)
            s_up = tl.load(up_scale + scales, mask=col_ok, other=0.0).to(tl.float32)
            acc_gate += exact_gate.to(tl.float32) * (row_scale[:, None] * s_gate[None, :])
            acc_up += exact_up.to(tl.float32) * (row_scale[:, None] * s_up[None, :])
            exact_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            exact_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    if HAS_BIAS:
        expert_bias = bias + expert * 2 * inter + cols
        acc_gate += tl.load(expert_bias, mask=col_ok, other=0.0)[None, :]
        acc_up += tl.load(expert_bias + inter, mask=col_ok, other=0.0)[None, :]
    if ACTIVATION == 0:
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:
        gate_c = tl.where(acc_gate < LIMIT, acc_gate, LIMIT)
        up_c = tl.where(acc_up < LIMIT, acc_up, LIMIT)
        up_c = tl.where(up_c > -LIMIT, up_c, -LIMIT)
        h = (up_c + 1.0) * gate_c * tl.sigmoid(gate_c * ALPHA)
    tl.store(act + rows[:, None].to(tl.int64) * inter + cols[None, :], h, mask=col_ok[None, :])


@triton.jit
def w8a8_down_kernel(
    a_q, a_scale, w, w_scale, bias, topk_weights, y, sorted_pair_ids, block_expert_ids,
    num_pairs, hidden_size, inter, group, stride_we, stride_wn, stride_se, stride_sn,
    IS_INT4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[pairs, cols] float32 = routing weight * (grouped a_q . down + b_down) of one row block of one expert
    (module docstring, step 5); a_q [R, I] int8 in the sorted rows, down codes [E, H, I] or packed [E, H, I / 2]."""
    stride_wn, stride_we = stride_wn // 8 * 8, stride_we // 8 * 8  # see w8a8_gate_up_kernel
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
    a_rows = a_q + rows[:, None].to(tl.int64) * inter
    down_w = w + expert * stride_we
    weight_rows = cols.to(tl.int64) * stride_wn
    row_scale = tl.load(a_scale + rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    exact = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, inter, BLOCK_K):  # as in w8a8_gate_up_kernel
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None] & (offs_k < inter - k0)[None, :], other=0)
        exact = tl.dot(a, _weight_tile(down_w, weight_rows, col_ok, k0, inter, offs_k, IS_INT4, BLOCK_K), exact,
                       out_dtype=tl.int32)
        if ((k0 + BLOCK_K) % group == 0) | (k0 + BLOCK_K >= inter):
            s = tl.load(w_scale + expert * stride_se + cols * stride_sn + k0 // group, mask=col_ok, other=0.0)
            acc += exact.to(tl.float32) * (row_scale[:, None] * s.to(tl.float32)[None, :])
            exact = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    if HAS_BIAS:
        acc += tl.load(bias + expert * hidden_size + cols, mask=col_ok, other=0.0)[None, :]
    routing = tl.load(topk_weights + pairs, mask=row_ok, other=0.0)
    acc *= routing[:, None]
    tl.store(y + pairs[:, None].to(tl.int64) * hidden_size + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def quantize_rows(x: torch.Tensor, q: torch.Tensor | None = None, scale: torch.Tensor | None = None):
    """x [M, K] float32/bf16/fp16 (unit column stride) -> (codes int8 [M, K], scales float32 [M]), bit for bit
    `quantize_rows_reference` (the CPU experts' rounding)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] float32/bf16/fp16 with unit column stride, got {tuple(x.shape)} "
                         f"{x.dtype} strides {x.stride()}")
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device) if q is None else q
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if scale is None else scale
    if q.shape != x.shape or q.dtype != torch.int8 or q.stride(1) != 1 or scale.shape != (x.shape[0],) \
            or scale.dtype != torch.float32:
        raise ValueError(f"q must be int8 {tuple(x.shape)} and scale float32 [{x.shape[0]}], got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(scale.shape)} {scale.dtype}")
    if x.shape[0] and x.shape[1]:
        quantize_rows_kernel[(x.shape[0],)](x, q, scale, x.shape[1], x.stride(0), q.stride(0),
                                            BLOCK=QUANTIZE_BLOCK, **NO_FMA)
    return q, scale


def block_k(tiles: Tiles, group: int, num_cols: int) -> int:
    """The K tile of a launch: the config's for one group a row (masks cover a short last tile), else the largest
    of BLOCK_KS dividing `group` (whole tiles per group)."""
    return tiles.block_k if group >= num_cols else math.gcd(tiles.block_k, group)


def w8a8_moe(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    gate: tuple[torch.Tensor, torch.Tensor],
    up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    group_size: int = 0,
    activation: Activation = SILU,
    w_gate_up_bias: torch.Tensor | None = None,
    w_down_bias: torch.Tensor | None = None,
    capability: int | None = None,
) -> torch.Tensor:
    """float32 [T, H] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x) on int8 rows (module docstring).

    x_q int8 [T, H], x_scale float32 [T]: the hidden rows as `quantize_rows` gives them. gate, up: (codes int8
    [E, I, H] or packed int4 uint8 [E, I, H / 2], scales [E, I, ceil(H / group)]); down: (codes [E, H, I] or
    packed [E, H, I / 2], scales [E, H, ceil(I / group)]); scales float32 (int4: or bfloat16). group_size: the
    weights' scale group along K, 0 for one scale a row (then G = 1). topk_ids [T, K] (-1 or >= E: elsewhere),
    topk_weights [T, K] float32; biases float32 [E, 2I] (gate then up) and [E, H], as `fused_moe` takes them."""
    inter, is_int4 = _check(x_q, x_scale, gate, up, down, topk_ids, topk_weights, group_size)
    _check_bias(x_q, gate[0].shape[0], inter, w_gate_up_bias, w_down_bias, activation)
    num_tokens, hidden_size = x_q.shape
    num_experts = gate[0].shape[0]
    out = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=x_q.device)  # moe_sum writes every row
    if num_tokens == 0:
        return out
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    cc = capability if capability is not None else capability_of(x_q.device)
    gate_up_tiles, down_tiles = select(CONFIGS, cc)
    ids = topk_ids.to(torch.int32).contiguous()
    sorted_pair_ids, block_experts = moe_align(ids, num_experts, gate_up_tiles.block_m, cc)
    num_rows = sorted_pair_ids.numel()
    dummy = torch.empty(1, dtype=torch.float32, device=x_q.device)
    group_h, group_i = group_size or hidden_size, group_size or inter

    act = torch.empty(num_rows, inter, dtype=torch.float32, device=x_q.device)
    grid = (num_rows // gate_up_tiles.block_m, triton.cdiv(inter, gate_up_tiles.block_n))
    w8a8_gate_up_kernel[grid](
        x_q, x_scale, gate[0], gate[1], up[0], up[1], dummy if w_gate_up_bias is None else w_gate_up_bias, act,
        sorted_pair_ids, block_experts, num_pairs, top_k, hidden_size, inter, group_h,
        x_q.stride(0), gate[0].stride(0), gate[0].stride(1), gate[1].stride(0), gate[1].stride(1),
        IS_INT4=is_int4, HAS_BIAS=w_gate_up_bias is not None, **activation.constexprs(),
        **_launch_args(gate_up_tiles, group_h, hidden_size),
    )
    a_q, a_scale = quantize_rows(act)  # rows of unused blocks hold garbage: their codes are never read
    y = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=x_q.device)
    grid = (num_rows // down_tiles.block_m, triton.cdiv(hidden_size, down_tiles.block_n))
    w8a8_down_kernel[grid](
        a_q, a_scale, down[0], down[1], dummy if w_down_bias is None else w_down_bias, topk_weights, y,
        sorted_pair_ids, block_experts, num_pairs, hidden_size, inter, group_i,
        down[0].stride(0), down[0].stride(1), down[1].stride(0), down[1].stride(1),
        IS_INT4=is_int4, HAS_BIAS=w_down_bias is not None, **_launch_args(down_tiles, group_i, inter),
    )
    block_h = select(SUM_BLOCK_H, cc)
    moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        y, ids, out, hidden_size, top_k, num_experts, out.stride(0), BLOCK_H=block_h, **NO_FMA,
    )
    return out


def _launch_args(tiles: Tiles, group: int, num_cols: int) -> dict:
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k(tiles, group, num_cols),
                num_warps=tiles.num_warps, num_stages=tiles.num_stages, **NO_FMA)


def _check(x_q, x_scale, gate, up, down, topk_ids, topk_weights, group_size) -> tuple[int, bool]:
    """Raises ValueError naming the first bad argument; returns (I, whether the weights are packed int4)."""
    if x_q.dim() != 2 or x_q.dtype != torch.int8 or x_q.stride(1) != 1 or x_q.stride(0) % 16 or x_q.shape[1] % 16:
        raise ValueError(f"x_q must be int8 [T, H] (H and the row stride multiples of 16, unit column stride), got "
                         f"{tuple(x_q.shape)} {x_q.dtype} strides {x_q.stride()}")
    num_tokens, hidden_size = x_q.shape
    if x_scale.shape != (num_tokens,) or x_scale.dtype != torch.float32 or not x_scale.is_contiguous():
        raise ValueError(f"x_scale must be contiguous float32 [{num_tokens}], got {tuple(x_scale.shape)} "
                         f"{x_scale.dtype}")
    if group_size < 0 or (group_size and group_size % BLOCK_KS[0]):
        raise ValueError(f"group_size must be 0 (one scale a row) or a multiple of {BLOCK_KS[0]}, got {group_size}")
    is_int4 = gate[0].dtype == torch.uint8
    per_byte = 2 if is_int4 else 1
    if gate[0].dim() != 3 or gate[0].dtype not in (torch.int8, torch.uint8) \
            or gate[0].shape[2] * per_byte != hidden_size:
        raise ValueError(f"gate codes must be int8 [E, I, H={hidden_size}] or packed uint8 [E, I, H / 2], got "
                         f"{tuple(gate[0].shape)} {gate[0].dtype}")
    num_experts, inter = gate[0].shape[:2]
    if inter % 16:
        raise ValueError(f"I must be a multiple of 16, got {inter}")
    gate_up_shape = (num_experts, inter, hidden_size // per_byte)
    shapes = {"gate": gate_up_shape, "up": gate_up_shape, "down": (num_experts, hidden_size, inter // per_byte)}
    scale_dtypes = (torch.float32, torch.bfloat16) if is_int4 else (torch.float32,)
    for name, (codes, scales) in (("gate", gate), ("up", up), ("down", down)):
        num_cols = hidden_size if name != "down" else inter
        scale_shape = (*shapes[name][:2], -(-num_cols // (group_size or num_cols)))
        if tuple(codes.shape) != shapes[name] or codes.dtype != gate[0].dtype or not codes.is_contiguous():
            raise ValueError(f"{name} codes must be contiguous {gate[0].dtype} {shapes[name]}, got "
                             f"{tuple(codes.shape)} {codes.dtype}")
        if tuple(scales.shape) != scale_shape or scales.dtype not in scale_dtypes or not scales.is_contiguous():
            raise ValueError(f"{name} scales must be contiguous {'/'.join(map(str, scale_dtypes))} {scale_shape}, "
                             f"got {tuple(scales.shape)} {scales.dtype}")
        if scales.dtype != gate[1].dtype:
            raise ValueError(f"{name} scales are {scales.dtype}, gate's {gate[1].dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T={num_tokens}, K] int32/int64, got {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous float32 {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    for name, tensor in (("x_scale", x_scale), ("gate", gate[0]), ("up", up[0]), ("down", down[0]),
                         ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tensor.device != x_q.device:
            raise ValueError(f"{name} is on {tensor.device}, x_q on {x_q.device}")
    return inter, is_int4


def _check_bias(x_q, num_experts, inter, w_gate_up_bias, w_down_bias, activation) -> None:
    if not isinstance(activation, Activation):
        raise ValueError(f"activation must be a fused_moe.Activation, got {activation!r}")
    for name, bias, shape in (("w_gate_up_bias", w_gate_up_bias, (num_experts, 2 * inter)),
                              ("w_down_bias", w_down_bias, (num_experts, x_q.shape[1]))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != torch.float32
                                 or not bias.is_contiguous() or bias.device != x_q.device):
            raise ValueError(f"{name} must be contiguous float32 {shape} on {x_q.device}, got "
                             f"{tuple(bias.shape)} {bias.dtype} {bias.device}")


def gate_cases() -> list:
    """Every config the launchers can select (gpu_layers.w8a8_moe_cases)."""
    from gpu_layers import w8a8_moe_cases

    return w8a8_moe_cases.gate()


def bench_cases() -> list[tuple]:
    """Qwen3-30B-A3B's experts in int8 and int4 against bf16 fused_moe (gpu_layers.w8a8_moe_cases)."""
    from gpu_layers import w8a8_moe_cases

    return w8a8_moe_cases.bench()
