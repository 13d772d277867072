"""Decode kernels for MXFP4 and NVFP4 experts (`cpu_experts.formats`): e2m1 weights decoded in registers, bf16
activations, float32 accumulation. Same work split as `cpu_experts.kernels_vnni` (gate/up over (routed expert, row),
down over the output column h, each routed expert's rows streamed once per call).

Numerics (the contract of the float formats): every matmul input (the token's hidden row; act = silu(gate) * up
before down) is rounded to bf16; the result equals a float32 reference on the dequantized stored weights with
those activations, up to float32 summation order. NVFP4's tensor scale multiplies each row's dot once, at the end.

One 16-byte chunk of a weight row (32 columns, in `kernels_fp4_ir`'s LLVM IR) decodes with two table lookups: each
nibble to 2 * its e2m1 value ({0, 1, 2, 3, 4, 6, 8, 12} and their negatives, exact) as a float32 (AVX-512 `vpermps`
on the bytes widened to int32 lanes) or as an int8 widened after (`pshufb`), multiplied with the activations split
into even and odd columns (`split_bf16`), so the low nibbles meet x_even and the high ones x_odd, both contiguous. A
chunk is one MXFP4 group or two NVFP4 groups; its 16 products are scaled by a vector of the groups' scales (halved,
for the doubled codes) taken from 256-entry tables indexed by the scale byte. E8M0's scale 2^(s - 128) is applied as
two normal factors 2^floor((s - 128) / 2) and 2^ceil((s - 128) / 2), never as the subnormal 2^-128 or 2^-127: exact
wherever the result is a normal float, and unaffected by a flush-to-zero mode that some library may have set. On
AVX-512 the lookup yields value * scale directly (`kernels_fp4_ir.scaled_tables`: the exact dequantized weights), so
the scale multiply disappears; E8M0 bytes 0 and 1, whose tables would hold subnormals, keep the factors.
`pshufb` is SSSE3, present on every x86-64 CPU with AVX2; elsewhere the nibbles decode arithmetically in generic IR
(`decode_mode`). Gate and up rows run in one call, down four rows a call, over ranges of work items
(`gate_up_rows_*`, `down_rows_*`). Vector widths are LLVM's choice for the host (two ymm or one zmm a chunk):
nothing here can raise an illegal instruction.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic

from cpu_experts import formats
from cpu_experts.kernels import activation, round_bf16
from cpu_experts.kernels_fp4_ir import E2M1_TWICE, FOUR_ROWS, ONE_ROW, TWO_ROWS, _fp4_codegen, _signature

# error_model="numpy": no ZeroDivisionError paths for `//` and `%`, whose raising exits kept numba from pruning the
# reference-count updates of every array argument (atomics, on lines every thread shares: more than a short row).
BODY = dict(fastmath=True, nogil=True, cache=True, error_model="numpy")
FLAGS = dict(BODY, parallel=True)
MX_GROUP, NV_GROUP = 32, 16
SERIAL_ROWS = 8  # activation rows below which rounding them is not worth waking the thread pool
GATE_UP_ROWS = 16  # (expert, row) items of gate/up a work item owns
DOWN_ROWS = 16  # output columns a work item of the down projection owns (its rows run four a call)

I32 = ir.IntType(32)
E2M1_TWICE_F32 = np.array(E2M1_TWICE, dtype=np.float32)  # the prefill's dequantizer's copy


# Per scale byte, the factors that scale the doubled codes: MXFP4 two, whose product is the E8M0 scale halved,
# 2^(s - 128), both normal floats (255, NaN, gives NaN); NVFP4 one, the e4m3 scale halved (2^-10 at least: normal).

def _mx_factors() -> np.ndarray:
    exponent = np.arange(256) - 128
    low = np.floor(exponent / 2)
    table = np.stack([np.exp2(low), np.exp2(exponent - low)], axis=1).astype(np.float32)
    table[255] = np.nan
    return table


def _nv_factors() -> np.ndarray:
    return (formats.e4m3_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)) / 2).numpy()


MX_FACTORS = _mx_factors()  # [256, 2]
NV_FACTORS = _nv_factors()  # [256]




# ---- row dot products ------------------------------------------------------------------------------------------
# Rows are named by indices (w[e, n] . x[t]), never sliced out, and each is one piece of IR: a slice (a new array)
# or a call that passes arrays costs reference-count updates (atomics, on lines every thread shares), which measured
# more than the whole of a short row.

@intrinsic
def dot_mxfp4(typingctx, w, s, e, n, table, x_even, x_odd, t):
    """MXFP4 row w[e, n] (packed uint8 [E, N, ceil(K / 2)], E8M0 scale bits s [E, N, ceil(K / 32)]) . x[t] (split
    by `split_bf16`: x_even / x_odd [T, >= ceil(K / 2)]); `table`: MX_FACTORS."""
    return _signature(1)(w, s, e, n, table, x_even, x_odd, t), _fp4_codegen(ONE_ROW, True)


@intrinsic
def dot2_mxfp4(typingctx, w0, s0, w1, s1, e, n, table, x_even, x_odd, t):
    """(w0[e, n] . x[t], w1[e, n] . x[t]) in one pass over x: a token's gate and up rows."""
    return _signature(2)(w0, s0, w1, s1, e, n, table, x_even, x_odd, t), _fp4_codegen(TWO_ROWS, True)


@intrinsic
def dot_nvfp4(typingctx, w, s, e, n, table, x_even, x_odd, t):
    """NVFP4 row w[e, n] (e4m3 scale bits s [E, N, ceil(K / 16)]) . x[t], before the tensor scale; `table`:
    NV_FACTORS."""
    return _signature(1)(w, s, e, n, table, x_even, x_odd, t), _fp4_codegen(ONE_ROW, False)


@intrinsic
def dot2_nvfp4(typingctx, w0, s0, w1, s1, e, n, table, x_even, x_odd, t):
    """`dot2_mxfp4` for NVFP4 rows."""
    return _signature(2)(w0, s0, w1, s1, e, n, table, x_even, x_odd, t), _fp4_codegen(TWO_ROWS, False)


@intrinsic
def dot4_mxfp4(typingctx, w, s, e, n, table, x_even, x_odd, t):
    """(w[e, n + k] . x[t] for k < 4) in one pass over x: four rows of down."""
    return _signature(4)(w, s, e, n, table, x_even, x_odd, t), _fp4_codegen(FOUR_ROWS, True)


@intrinsic
def dot4_nvfp4(typingctx, w, s, e, n, table, x_even, x_odd, t):
    """`dot4_mxfp4` for NVFP4 rows."""
    return _signature(4)(w, s, e, n, table, x_even, x_odd, t), _fp4_codegen(FOUR_ROWS, False)


# ---- activations -----------------------------------------------------------------------------------------------

@njit(**BODY)
def split_bf16_row(x, x_even, x_odd):
    """x float32 [K] rounded to bf16 -> x_even / x_odd [ceil(K / 2)] (columns 2b and 2b + 1; x_odd zero past an
    odd K): the weights' low nibbles meet x_even, their high nibbles x_odd."""
    cols = x.shape[0]
    for b in range(cols // 2):
        x_even[b] = round_bf16(x[2 * b])
        x_odd[b] = round_bf16(x[2 * b + 1])
    if cols % 2:
        x_even[cols // 2] = round_bf16(x[cols - 1])
        x_odd[cols // 2] = np.float32(0.0)


@njit(**FLAGS)
def split_bf16(x, x_even, x_odd):
    """`split_bf16_row` for every row of x float32 [T, K]."""
    if x.shape[0] < SERIAL_ROWS:
        for t in range(x.shape[0]):
            split_bf16_row(x[t], x_even[t], x_odd[t])
    else:
        for t in prange(x.shape[0]):
            split_bf16_row(x[t], x_even[t], x_odd[t])


@njit(**BODY)
def act_bf16(g, v, epilogue, e, i):
    """act = silu(g) * v (or the epilogue's activation of expert e's row i), rounded to bf16 (down's input)."""
    return round_bf16(activation(g, v, epilogue, e, i, False))


@njit(**BODY)
def _store_act(act_even, act_odd, p, i, rows, value):
    if i % 2:
        act_odd[p, i // 2] = value
    else:
        act_even[p, i // 2] = value
        if i == rows - 1:  # an odd partition's last column: the high nibble of its byte meets zero
            act_odd[p, i // 2] = np.float32(0.0)


# ---- loop bodies (shared with a decode pool) and one partition in one call ---------------------------------------
# Plain functions (no allocation, nogil-safe), so a pool of threads can split the same items and compute the same
# sums as the parallel loops here. act is stored split, as the down rows read it: act_even[p, i // 2] (even i),
# act_odd (odd i; zero past an odd partition's last column), [P, >= ceil(Ip / 2)].

@njit(**BODY, inline="always")
def gate_up_rows_mxfp4(lo, hi, experts, offsets, pair_token, gate, gate_s, up, up_s, x_even, x_odd, epilogue,
                       act_even, act_odd):
    """Work items lo..hi, item r = (routed expert u, row i) = divmod(r, I): act[p, i] = activation(gate . x_t,
    up . x_t) (`kernels.activation`: silu(g) * v or the layer's epilogue), bf16, for u's pairs p. The intrinsics
    are called here directly (a numba-level helper per row cost its array copies' reference counts)."""
    rows = gate.shape[1]
    r = lo
    while r < hi:
        u = r // rows
        first = r - u * rows
        last = min(rows, first + hi - r)
        e = experts[u]
        for i in range(first, last):
            for p in range(offsets[u], offsets[u + 1]):
                g, v = dot2_mxfp4(gate, gate_s, up, up_s, e, i, MX_FACTORS, x_even, x_odd, pair_token[p])
                _store_act(act_even, act_odd, p, i, rows, act_bf16(g, v, epilogue, e, i))
        r += last - first


@njit(**BODY, inline="always")
def gate_up_rows_nvfp4(lo, hi, experts, offsets, pair_token, gate, gate_s, gate_ts, up, up_s, up_ts, x_even, x_odd,
                       epilogue, act_even, act_odd):
    """`gate_up_rows_mxfp4` for NVFP4 (`gate_ts` / `up_ts` [E]: the tensor scales)."""
    rows = gate.shape[1]
    r = lo
    while r < hi:
        u = r // rows
        first = r - u * rows
        last = min(rows, first + hi - r)
        e = experts[u]
        for i in range(first, last):
            for p in range(offsets[u], offsets[u + 1]):
                g, v = dot2_nvfp4(gate, gate_s, up, up_s, e, i, NV_FACTORS, x_even, x_odd, pair_token[p])
                _store_act(act_even, act_odd, p, i, rows, act_bf16(g * gate_ts[e], v * up_ts[e], epilogue, e, i))
        r += last - first


@njit(**BODY, inline="always")
def down_rows_mxfp4(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, act_even, act_odd, out):
    """Output columns lo..hi: out[t, h] += w * (down[e, h] . act_p) over every routed expert e and its pairs p, four
    rows of down a call (one pass over act_p for four weight rows)."""
    four_end = lo + (hi - lo) // 4 * 4
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t, weight = pair_token[p], pair_weight[p]
            for h in range(lo, four_end, 4):
                d0, d1, d2, d3 = dot4_mxfp4(down, down_s, e, h, MX_FACTORS, act_even, act_odd, p)
                out[t, h] += weight * d0
                out[t, h + 1] += weight * d1
                out[t, h + 2] += weight * d2
                out[t, h + 3] += weight * d3
            for h in range(four_end, hi):
                out[t, h] += weight * dot_mxfp4(down, down_s, e, h, MX_FACTORS, act_even, act_odd, p)


@njit(**BODY, inline="always")
def down_rows_nvfp4(lo, hi, experts, offsets, pair_token, pair_weight, down, down_s, down_ts, act_even, act_odd,
                    out):
    """`down_rows_mxfp4` for NVFP4."""
    four_end = lo + (hi - lo) // 4 * 4
    for u in range(experts.shape[0]):
        e = experts[u]
        for p in range(offsets[u], offsets[u + 1]):
            t, weight, ts = pair_token[p], pair_weight[p], down_ts[e]
            for h in range(lo, four_end, 4):
                d0, d1, d2, d3 = dot4_nvfp4(down, down_s, e, h, NV_FACTORS, act_even, act_odd, p)
                out[t, h] += weight * (d0 * ts)
                out[t, h + 1] += weight * (d1 * ts)
                out[t, h + 2] += weight * (d2 * ts)
                out[t, h + 3] += weight * (d3 * ts)
            for h in range(four_end, hi):
                out[t, h] += weight * (dot_nvfp4(down, down_s, e, h, NV_FACTORS, act_even, act_odd, p) * ts)


# One partition in one call (the dispatch of a numba call with a dozen arrays costs microseconds). The scratch
# arrays are made here and passed to the parallel loops as arguments: arrays a function allocates itself cost
# reference-count updates at every call that passes them, here every work item.

@njit(**BODY)
def decode_mxfp4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, epilogue, out):
    """out[T, H] += this partition's MXFP4 experts on x float32 [T, H]."""
    x_even = np.empty((x.shape[0], gate.shape[2]), dtype=np.float32)  # gate rows: ceil(H / 2) bytes
    x_odd = np.empty_like(x_even)
    split_bf16(x, x_even, x_odd)
    act_even = np.empty((pair_token.shape[0], down.shape[2]), dtype=np.float32)  # down rows: ceil(Ip / 2) bytes
    act_odd = np.empty_like(act_even)
    _loops_mxfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, x_even, x_odd,
                 epilogue, act_even, act_odd, out)


@njit(**FLAGS)
def _loops_mxfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, up, up_s, down, down_s, x_even, x_odd,
                 epilogue, act_even, act_odd, out):
    num_items = experts.shape[0] * gate.shape[1]
    for c in prange(-(-num_items // GATE_UP_ROWS)):
        gate_up_rows_mxfp4(c * GATE_UP_ROWS, min(c * GATE_UP_ROWS + GATE_UP_ROWS, num_items), experts, offsets,
                           pair_token, gate, gate_s, up, up_s, x_even, x_odd, epilogue, act_even, act_odd)
    num_hidden = down.shape[1]
    for c in prange(-(-num_hidden // DOWN_ROWS)):
        down_rows_mxfp4(c * DOWN_ROWS, min(c * DOWN_ROWS + DOWN_ROWS, num_hidden), experts, offsets, pair_token,
                        pair_weight, down, down_s, act_even, act_odd, out)


@njit(**BODY)
def decode_nvfp4(x, experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, epilogue, out):
    """`decode_mxfp4` for NVFP4 (`*_ts` [E]: each projection's tensor scale)."""
    x_even = np.empty((x.shape[0], gate.shape[2]), dtype=np.float32)
    x_odd = np.empty_like(x_even)
    split_bf16(x, x_even, x_odd)
    act_even = np.empty((pair_token.shape[0], down.shape[2]), dtype=np.float32)
    act_odd = np.empty_like(act_even)
    _loops_nvfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, x_even, x_odd, epilogue, act_even, act_odd, out)


@njit(**FLAGS)
def _loops_nvfp4(experts, offsets, pair_token, pair_weight, gate, gate_s, gate_ts, up, up_s, up_ts, down, down_s,
                 down_ts, x_even, x_odd, epilogue, act_even, act_odd, out):
    num_items = experts.shape[0] * gate.shape[1]
    for c in prange(-(-num_items // GATE_UP_ROWS)):
        gate_up_rows_nvfp4(c * GATE_UP_ROWS, min(c * GATE_UP_ROWS + GATE_UP_ROWS, num_items), experts, offsets,
                           pair_token, gate, gate_s, gate_ts, up, up_s, up_ts, x_even, x_odd, epilogue, act_even,
                           act_odd)
    num_hidden = down.shape[1]
    for c in prange(-(-num_hidden // DOWN_ROWS)):
        down_rows_nvfp4(c * DOWN_ROWS, min(c * DOWN_ROWS + DOWN_ROWS, num_hidden), experts, offsets, pair_token,
                        pair_weight, down, down_s, down_ts, act_even, act_odd, out)


# ---- the operator's entry: one partition -------------------------------------------------------------------------

def decode_partition_mxfp4(x, routing, part, spec, epilogue, out) -> None:
    """out += one partition's experts on x float32 [T, H], for `routing` (`operator.Routing`); `spec` (the layer's
    ExpertLayerSpec) is unused: the FP4 formats fix their groups."""
    r = routing
    decode_mxfp4(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales, part.up,
                 part.up_scales, part.down, part.down_scales, epilogue, out)


def decode_partition_nvfp4(x, routing, part, spec, epilogue, out) -> None:
    r = routing
    decode_nvfp4(x, r.experts, r.offsets, r.pair_token, r.pair_weight, part.gate, part.gate_scales,
                 part.gate_tensor_scale, part.up, part.up_scales, part.up_tensor_scale, part.down, part.down_scales,
                 part.down_tensor_scale, epilogue, out)


# ---- prefill: whole projections dequantized ----------------------------------------------------------------------

@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def dequantize_fp4(packed, scales, is_mx, tensor_scale, out):
    """packed uint8 [N, ceil(K / 2)] with MXFP4 (`is_mx`) or NVFP4 scale bits [N, G] -> out float32 [N, K]: the
    reference's values (`formats.dequantize_mxfp4` / `dequantize_nvfp4`, NVFP4 times `tensor_scale` last), exact.
    Not fastmath, so each value is (code * first factor) * second factor, in that order (E8M0: never their
    subnormal product)."""
    cols = out.shape[1]
    group_bytes = (MX_GROUP if is_mx else NV_GROUP) // 2
    whole = cols // 2  # bytes with both columns inside the row
    for n in prange(packed.shape[0]):
        for g in range(scales.shape[1]):
            a, b = _factors(scales[n, g], is_mx, tensor_scale)
            for j in range(g * group_bytes, min((g + 1) * group_bytes, whole)):
                byte = packed[n, j]
                out[n, 2 * j] = E2M1_TWICE_F32[byte & 15] * a * b
                out[n, 2 * j + 1] = E2M1_TWICE_F32[byte >> 4] * a * b
        if cols % 2:
            a, b = _factors(scales[n, scales.shape[1] - 1], is_mx, tensor_scale)
            out[n, cols - 1] = E2M1_TWICE_F32[packed[n, whole] & 15] * a * b


@njit(nogil=True, cache=True)
def _factors(scale, is_mx, tensor_scale):
    if is_mx:
        return MX_FACTORS[scale, 0], MX_FACTORS[scale, 1]
    return NV_FACTORS[scale], tensor_scale
