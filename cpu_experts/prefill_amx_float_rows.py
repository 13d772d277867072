"""The first AMX-BF16 kernels of `cpu_experts.prefill_amx_float` (whole rows converted per task), kept beside
the ones the launcher runs (`prefill_amx_float_chunked`) for A/B timing on the device (`kernels()`).

Per task (gate/up: an expert's 16 gate and 16 up rows; down: 32 rows of H of an expert) the rows are converted to
bf16 whole (`_convert_rows`: 32 x 7168 bf16 = 448 KiB for DeepSeek-V3's gate/up) into a per-thread scratch,
their group scales into `row_scales`, then the tiles run over the scratch group by group, each group's C tiles
stored and added to float32 accumulators by a scalar loop (`_scale_add`). Numerics: `prefill_amx_float`'s.
"""

from __future__ import annotations

import types as pytypes

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from cpu_experts.kernels import scale_value
from cpu_experts.prefill_amx import (
    TILE_BYTES,
    TILE_ROWS,
    _no_tile_begin,
    _no_tile_end,
    _ptr,
    _tile_begin,
    _tile_end,
    _tiles_codegen,
)
from cpu_experts.prefill_amx_float import (
    F32,
    FLAGS,
    FP4_BLOCK,
    FP8,
    I8,
    I32,
    MX_HALF,
    MX_SCALE,
    MXFP4,
    NV_HALF,
    NVFP4,
    STEP,
    _act_epilogue,
    _down_epilogue,
    _fp8_step,
    _mx_foldable,
    _splat,
    _store_bf16,
    _task_groups,
)

# ---- tiles -------------------------------------------------------------------------------------------------------

@intrinsic
def _bf16_tiles1(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """c[0:256] = A0 . B0, c[256:512] = A1 . B0 over num_k steps of 32 bf16 columns (float32 c)."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(1, op="tdpbf16ps")


@intrinsic
def _bf16_tiles2(typingctx, a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c):
    """`_bf16_tiles1` and c[512:768] = A0 . B1, c[768:1024] = A1 . B1."""
    return types.void(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c), _tiles_codegen(2, op="tdpbf16ps")


@njit(fastmath=True, cache=True)
def _bf16_block(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, num_b, c):
    """The micro-kernel (`prefill_amx._tiles_codegen`) with `tdpbf16ps` over num_b (1 or 2) column tiles."""
    if num_b == 2:
        _bf16_tiles2(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)
    else:
        _bf16_tiles1(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, c)


@njit(cache=True)
def _bf16_block_reference(a0, a0_off, a1, a1_off, lda, b, b_off, b_step, num_k, num_b, c):
    """`_bf16_block` in plain numba, element by element (uint16 arrays of bf16 bits, byte offsets): its oracle on
    CPUs without AMX-BF16."""
    fa0, fa1, fb = a0.ravel(), a1.ravel(), b.ravel()
    for t in range(num_b):
        for r in range(TILE_ROWS):
            row0, row1 = (a0_off + r * lda) // 2, (a1_off + r * lda) // 2
            for col in range(TILE_ROWS):
                s0, s1 = np.float32(0.0), np.float32(0.0)
                for kc in range(num_k):
                    b_tile = (b_off + kc * b_step + t * TILE_ROWS * TILE_BYTES) // 2
                    for k in range(STEP):  # B row k // 2 holds columns k & ~1, k | 1 of each token (a pair)
                        bv = scale_value(fb[b_tile + (k // 2) * STEP + col * 2 + k % 2])
                        s0 += scale_value(fa0[row0 + kc * STEP + k]) * bv
                        s1 += scale_value(fa1[row1 + kc * STEP + k]) * bv
                c[t * 512 + r * TILE_ROWS + col] = s0
                c[t * 512 + 256 + r * TILE_ROWS + col] = s1



@intrinsic
def _fp8_to_bf16(typingctx, src, src_off, dst, dst_off, num_steps):
    """dst (bytes from dst_off) = bf16 bits of the num_steps * 32 e4m3 codes at src (bytes from src_off), exact:
    the e4m3 bits become a float16's (value / 256, subnormals included: `kernels_fp8`'s decoding), widened and
    times 256."""
    def codegen(context, builder, sig, args):
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        dst_p = _ptr(context, builder, sig.args[2], args[2], args[3])
        with cgutils.for_range(builder, args[4]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, STEP))
            _store_bf16(builder, _fp8_step(builder, builder.gep(src_p, [at])), dst_p, builder.add(at, at))
        return context.get_dummy_value()
    return types.void(src, src_off, dst, dst_off, num_steps), codegen



def _doubled_e2m1(builder, codes):
    """<32 x i8> e2m1 codes 0..15 -> <32 x float> twice their values (m = code & 7: m for m < 2, else
    (2 + (m & 1)) << ((m >> 1) - 1); bit 3 the sign)."""
    v32i = ir.VectorType(I32, STEP)
    code = builder.zext(codes, v32i)

    def splat(v):
        return _splat(builder, v32i, v)
    m = builder.and_(code, splat(7))
    normal = builder.shl(builder.or_(builder.and_(m, splat(1)), splat(2)), builder.sub(builder.lshr(m, splat(1)),
                                                                                          splat(1)))
    magnitude = builder.select(builder.icmp_unsigned("<", m, splat(2)), m, normal)
    signed = builder.select(builder.icmp_unsigned(">=", code, splat(8)), builder.sub(splat(0), magnitude), magnitude)
    return builder.sitofp(signed, ir.VectorType(F32, STEP))


@intrinsic
def _fp4_to_bf16(typingctx, src, src_off, dst, dst_off, factors, num_steps):
    """dst (bytes from dst_off) = bf16 bits of 2 * e2m1 value x factors[j // 16] for the num_steps * 32 columns j
    packed at src (bytes from src_off; even column in the low nibble), in column order; exact where the products
    are normal bf16 (the callers' factors see to it)."""
    def codegen(context, builder, sig, args):
        src_p = _ptr(context, builder, sig.args[0], args[0], args[1])
        dst_p = _ptr(context, builder, sig.args[2], args[2], args[3])
        fac_p = builder.bitcast(context.make_array(sig.args[4])(context, builder, args[4]).data, F32.as_pointer())
        with cgutils.for_range(builder, args[5]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, STEP // 2))
            first = builder.add(loop.index, loop.index)
            pair = [builder.load(builder.gep(fac_p, [builder.add(first, ir.Constant(first.type, j))]))
                    for j in range(2)]
            values = _fp4_step(builder, builder.gep(src_p, [at]), pair)
            _store_bf16(builder, values, dst_p, builder.mul(at, ir.Constant(at.type, 4)))
        return context.get_dummy_value()
    return types.void(src, src_off, dst, dst_off, factors, num_steps), codegen


def _fp4_step(builder, src, pair):
    """<32 x float>: twice the e2m1 values of the 32 columns packed at src (i8*, 16 bytes) times pair[0] (columns
    0-15) and pair[1] (16-31), floats (`_fp4_to_bf16`)."""
    v16b = ir.VectorType(I8, STEP // 2)
    interleave = ir.Constant(ir.VectorType(I32, STEP), [j // 2 + (j % 2) * 16 for j in range(STEP)])
    halves = ir.Constant(ir.VectorType(I32, STEP), [j // FP4_BLOCK for j in range(STEP)])
    packed = builder.load(builder.bitcast(src, v16b.as_pointer()), align=1)
    low = builder.and_(packed, _splat(builder, v16b, 15))
    high = builder.lshr(packed, _splat(builder, v16b, 4))
    doubled = _doubled_e2m1(builder, builder.shuffle_vector(low, high, interleave))
    factors = ir.Constant(ir.VectorType(F32, 2), None)
    for j in range(2):
        factors = builder.insert_element(factors, pair[j], ir.Constant(I32, j))
    return builder.fmul(doubled, builder.shuffle_vector(factors, factors, halves))



@njit(fastmath=True, cache=True)
def _fp4_factors(s, e, n, fmt, is_folded, out):
    """out[b]: the factor of the doubled codes of columns 16 b .. 16 b + 15 of row n of expert e."""
    for b in range(out.shape[0]):
        if fmt == NVFP4:
            out[b] = NV_HALF[np.int64(s[e, n, b])]
        elif is_folded:
            out[b] = MX_HALF[np.int64(s[e, n, b // 2])]
        else:
            out[b] = np.float32(0.5)


@njit(fastmath=True, cache=True)
def _convert_rows(fmt, w, s, ts, e, r0, num_rows, cols, is_folded, a, a_row0, rs, num_gs, factors):
    """Rows r0 .. r0 + num_rows of expert e (`cols` columns) -> bf16 rows a_row0 .. of `a` (uint16, row length
    cols); rs[(a_row0 + r) * num_gs + g] = the scale of their group g's sums."""
    num_bytes = w.shape[2]
    for r in range(num_rows):
        n = r0 + r
        src, dst, at = (e * w.shape[1] + n) * num_bytes, (a_row0 + r) * cols * 2, (a_row0 + r) * num_gs
        if fmt == FP8:
            _fp8_to_bf16(w, src, a, dst, cols // STEP)
            for g in range(num_gs):
                rs[at + g] = np.float32(s[e, n, g])
            continue
        _fp4_factors(s, e, n, fmt, is_folded, factors[:cols // FP4_BLOCK])
        _fp4_to_bf16(w, src, a, dst, factors, cols // STEP)
        if fmt == NVFP4:
            rs[at] = ts[e]
        elif is_folded:
            rs[at] = np.float32(1.0)
        else:
            for g in range(num_gs):
                rs[at + g] = MX_SCALE[np.int64(s[e, n, g])]


@njit(fastmath=True, cache=True)
def _scale_add(c, acc, num_b, rs, num_gs, g):
    """acc += C with each tile row times its group-g scale: tiles alternate A0 (rows 0-15 of rs), A1 (16-31)."""
    for t in range(2 * num_b):
        base = t * TILE_ROWS * TILE_ROWS
        for r in range(TILE_ROWS):
            s = rs[(r + (t % 2) * TILE_ROWS) * num_gs + g]
            at = base + r * TILE_ROWS
            for col in range(TILE_ROWS):
                acc[at + col] += c[at + col] * s



# ---- kernels -----------------------------------------------------------------------------------------------------
# The tile calls sit in the kernels' own bodies, not in helpers: `replace_tiles` swaps the kernels' globals only.

@njit(**FLAGS)
def gate_up_bf16(cfg, fmt, gate, gate_s, gate_ts, up, up_s, up_ts, group, experts, offsets, col_offsets, x_v,
                 scratch, row_scales, factors, epilogue, act):
    """act[p, i] = bf16(silu(gate[e, i] . x) * (up[e, i] . x)) (uint16 bits) for every pair p of expert e; tasks
    are (expert, 16 rows of I); per thread, `scratch` holds the task's gate and up rows in bf16, `row_scales` their
    group scales, `factors` a row's FP4 factors."""
    rows, hidden = gate.shape[1], gate.shape[2] * (1 if fmt == FP8 else 2)
    num_rb = rows // TILE_ROWS
    for task in prange(experts.shape[0] * num_rb):
        u, rb = task // num_rb, task % num_rb
        e, p0, m, r0 = experts[u], offsets[u], offsets[u + 1] - offsets[u], rb * TILE_ROWS
        num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
        tid = numba.get_thread_id()
        a, rs, fb = scratch[tid], row_scales[tid], factors[tid]
        is_folded = fmt == NVFP4 or (fmt == MXFP4 and _mx_foldable(gate_s, e, r0, TILE_ROWS)
                                     and _mx_foldable(up_s, e, r0, TILE_ROWS))
        size, num_gs = _task_groups(fmt, group, hidden, is_folded)
        _convert_rows(fmt, gate, gate_s, gate_ts, e, r0, TILE_ROWS, hidden, is_folded, a, 0, rs, num_gs, fb)
        _convert_rows(fmt, up, up_s, up_ts, e, r0, TILE_ROWS, hidden, is_folded, a, TILE_ROWS, rs, num_gs, fb)
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        acc = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        b_step = num_ct * TILE_ROWS * TILE_BYTES
        _tile_begin(cfg)
        for ct in range(0, num_ct, 2):
            num_b = min(2, num_ct - ct)
            b_off = 2 * hidden * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
            acc[:] = 0
            for g in range(num_gs):
                k0 = g * size
                num_k = min(size, hidden - k0) // STEP
                _bf16_block(a, 2 * k0, a, 2 * (TILE_ROWS * hidden + k0), 2 * hidden, x_v, b_off + k0 // STEP * b_step,
                            b_step, num_k, num_b, c)
                _scale_add(c, acc, num_b, rs, num_gs, g)
            _act_epilogue(acc, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, e, r0, epilogue, act)
        _tile_end()


@njit(**FLAGS)
def down_bf16(cfg, fmt, down, down_s, down_ts, group, experts, offsets, pair_token, pair_weight, col_offsets, a_v,
              task_rows, scratch, row_scales, factors, out):
    """out[t, h] += w * (down[e, h] . act) for every pair; tasks own `task_rows` rows of H across all experts (no
    two threads write one element of `out`), converting 32 rows of an expert at a time."""
    hidden, rows = down.shape[1], down.shape[2] * (1 if fmt == FP8 else 2)
    for task in prange(-(-hidden // task_rows)):
        tid = numba.get_thread_id()
        a, rs, fb = scratch[tid], row_scales[tid], factors[tid]
        c = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        acc = np.empty(4 * TILE_ROWS * TILE_ROWS, dtype=np.float32)
        _tile_begin(cfg)
        for u in range(experts.shape[0]):
            e, p0, m = experts[u], offsets[u], offsets[u + 1] - offsets[u]
            num_ct = (col_offsets[u + 1] - col_offsets[u]) // TILE_ROWS
            b_step = num_ct * TILE_ROWS * TILE_BYTES
            for h0 in range(task * task_rows, min(hidden, (task + 1) * task_rows), 2 * TILE_ROWS):
                is_folded = fmt == NVFP4 or (fmt == MXFP4 and _mx_foldable(down_s, e, h0, 2 * TILE_ROWS))
                size, num_gs = _task_groups(fmt, group, rows, is_folded)
                _convert_rows(fmt, down, down_s, down_ts, e, h0, 2 * TILE_ROWS, rows, is_folded, a, 0, rs, num_gs, fb)
                for ct in range(0, num_ct, 2):
                    num_b = min(2, num_ct - ct)
                    b_off = 2 * rows * col_offsets[u] + ct * TILE_ROWS * TILE_BYTES
                    acc[:] = 0
                    for g in range(num_gs):
                        k0 = g * size
                        _bf16_block(a, 2 * k0, a, 2 * (TILE_ROWS * rows + k0), 2 * rows, a_v,
                                    b_off + k0 // STEP * b_step, b_step, min(size, rows - k0) // STEP, num_b, c)
                        _scale_add(c, acc, num_b, rs, num_gs, g)
                    _down_epilogue(acc, min(num_b * TILE_ROWS, m - ct * TILE_ROWS), p0 + ct * TILE_ROWS, h0,
                                   pair_token, pair_weight, out)
        _tile_end()


def kernels():
    """(gate_up_bf16, down_bf16), for `prefill_amx_float.FloatAmxPrefill(..., kernels=...)`."""
    return gate_up_bf16, down_bf16


def replace_tiles(kernel):
    """`kernel` recompiled with the tile instructions replaced by `_bf16_block_reference` (no AMX needed)."""
    env = {**kernel.py_func.__globals__, "_bf16_block": _bf16_block_reference, "_tile_begin": _no_tile_begin,
           "_tile_end": _no_tile_end}
    return njit(parallel=True, fastmath=True)(pytypes.FunctionType(kernel.py_func.__code__, env, kernel.__name__))


def reference_kernels():
    """`kernels()` with the tile instructions replaced by their plain-numba reference: conversion, group scaling
    and epilogues of these kernels, testable on any CPU."""
    return replace_tiles(gate_up_bf16), replace_tiles(down_bf16)
